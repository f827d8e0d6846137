"""All-reduce through aggregator services over every transport: exact sums,
codecs, concurrent jobs, and every way a run can go wrong."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest

from aggnet import Client
from aggnet.protocol import wire
from aggnet.errors import (
    AggregationTimeout,
    AggregatorUnreachable,
    ClientClosed,
    JobMismatch,
    NonFiniteError,
)
from aggnet.kernels import quant_shift
from aggnet.transport import connect, listen
from harness.helpers import free_port, run_workers, silent_rank_run, worker_context

SIZES = [0, 1, 7, 1000, 4096, 70001]


def float_data(rank: int, n: int, seed: int = 0) -> np.ndarray:
    """Integer-valued floats: every sum of up to 4 of them is exact."""
    rng = np.random.default_rng(1000 * seed + rank)
    return rng.integers(-(2**20), 2**20, n).astype(np.float32)


def int_data(rank: int, n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(5000 + 1000 * seed + rank)
    return rng.integers(-(2**31), 2**31, n, dtype=np.int64).astype(np.int32)


def wrapped_sum(arrays) -> np.ndarray:
    total = np.zeros(arrays[0].shape, np.int64)
    for a in arrays:
        total += a
    return ((total + 2**31) % 2**32 - 2**31).astype(np.int32)


def _exact_worker(rank, address, world, job, chunk_bytes, seed):
    with Client(address, job=job, rank=rank, world_size=world, chunk_bytes=chunk_bytes, timeout=20) as c:
        out = []
        for n in SIZES:
            x = float_data(rank, n, seed)
            y = int_data(rank, n, seed)
            fx, fy = c.allreduce(x), c.allreduce(y)
            assert fx.result(30) is x and fy.result(30) is y
            out.append((x, y))
        return out


def _check_exact(results, world, seed):
    for rank_out in results:
        for n, (x, y) in zip(SIZES, rank_out):
            want_x = sum(float_data(r, n, seed).astype(np.float64) for r in range(world)) if n else np.zeros(0)
            np.testing.assert_array_equal(x, want_x.astype(np.float32))
            want_y = wrapped_sum([int_data(r, n, seed) for r in range(world)]) if n else np.zeros(0, np.int32)
            np.testing.assert_array_equal(y, want_y)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sums_are_exact_on_every_transport(service, world):
    job = f"exact-{uuid.uuid4().hex[:6]}"
    results = run_workers(service.address, world, _exact_worker, service.address, world, job, 4096, world)
    _check_exact(results, world, world)


@pytest.mark.parametrize("kind", ["inproc", "zmq+ipc", "tcp", "shm"])
@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("chunk_bytes", [256, 65536, 1 << 20])
def test_sums_identical_across_chunk_sizes_and_shard_counts(shared_service, kind, shards, chunk_bytes):
    svc = shared_service(kind, shards)
    job = f"grid-{uuid.uuid4().hex[:6]}"
    results = run_workers(svc.address, 3, _exact_worker, svc.address, 3, job, chunk_bytes, 7)
    _check_exact(results, 3, 7)


def _tensor_worker(rank, address, world, job):
    import torch

    n = 4096 * world + 3 * world
    with Client(address, job=job, rank=rank, world_size=world, chunk_bytes=4096, timeout=20) as c:
        flat = torch.arange(n, dtype=torch.float32) * (rank + 1)
        half = torch.full((1000,), rank + 1.0, dtype=torch.bfloat16)
        ints = torch.full((777,), rank - 5, dtype=torch.int32)
        grad = torch.full((10, 10), 2.0, requires_grad=True)  # a parameter: summed outside autograd
        named = np.full(100, rank + 1.0, np.float32)  # codec "float32": the buffer as it is
        futures = [c.allreduce(flat), c.allreduce(half, op="avg"), c.allreduce(ints), c.allreduce(grad),
                   c.allreduce(named, codec="float32")]
        same = [f.result(30) is t for f, t in zip(futures, (flat, half, ints, grad, named))]
        whole = torch.arange(n, dtype=torch.float32)
        share = torch.empty(n // world)
        scattered = c.reduce_scatter(whole, share).result(30)
        return (same, scattered is share, flat.numpy(), half.float().numpy(), ints.numpy(), grad.detach().numpy(),
                named, share.numpy(), grad.grad)


def test_torch_tensors_are_all_reduced_in_place_as_numpy_arrays_are(shared_service):
    """A torch CPU tensor is its own NumPy view: summed where it lies (bfloat16
    included), and its future resolves to the tensor itself."""
    svc, world = shared_service("zmq+ipc"), 2
    results = run_workers(svc.address, world, _tensor_worker, svc.address, world, f"tensors-{uuid.uuid4().hex[:6]}",
                          start_method="spawn")
    n = 4096 * world + 3 * world
    rank_sum = sum(range(1, world + 1))
    for rank, (same, scattered_same, flat, half, ints, grad, named, share, grad_of_grad) in enumerate(results):
        assert same == [True] * 5 and scattered_same
        np.testing.assert_array_equal(flat, np.arange(n, dtype=np.float32) * rank_sum)
        np.testing.assert_array_equal(half, np.full(1000, rank_sum / world, np.float32))
        np.testing.assert_array_equal(ints, np.full(777, sum(r - 5 for r in range(world)), np.int32))
        np.testing.assert_array_equal(grad, np.full((10, 10), 2.0 * world, np.float32))
        np.testing.assert_array_equal(named, np.full(100, rank_sum, np.float32))
        lo = rank * (n // world)
        np.testing.assert_array_equal(share, np.arange(lo, lo + n // world, dtype=np.float32) * world)
        assert grad_of_grad is None


def _codec_worker(rank, address, world, job, codec, op):
    rng = np.random.default_rng(rank)
    x = (rng.standard_normal(50000) * np.exp(rng.uniform(-8, 8, 50000))).astype(np.float32)
    orig = x.copy()
    with Client(address, job=job, rank=rank, world_size=world, chunk_bytes=8192, timeout=20) as c:
        c.allreduce(x, op=op, codec=codec).result(30)
    return orig, x


@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("codec", [None, "int32", "fp16", "bf16"])
def test_codecs_stay_within_their_bounds(service_factory, codec, op):
    svc = service_factory("inproc")
    world = 3
    res = run_workers(svc.address, world, _codec_worker, svc.address, world, f"codec-{codec}-{op}", codec, op)
    inputs = [o for o, _ in res]
    exact = sum(i.astype(np.float64) for i in inputs)
    if op == "avg":
        exact = exact / world
    got = res[0][1]
    for _, other in res[1:]:
        np.testing.assert_array_equal(other, got)  # every worker holds the same result
    err = np.abs(got.astype(np.float64) - exact)
    magnitude = sum(np.abs(i.astype(np.float64)) for i in inputs) / (world if op == "avg" else 1)
    if codec is None:
        # world-1 float32 additions, each off by at most half an ulp of the
        # partial sum, plus the division for avg
        assert np.all(err <= magnitude * (world - 1) * 2**-24 + np.abs(exact) * 2**-23)
    elif codec == "int32":
        # per 2048-element chunk: each worker's rounding is at most half a step
        elems = 8192 // 4
        for start in range(0, exact.size, elems):
            block = slice(start, start + elems)
            e = max(int(np.frexp(np.max(np.abs(i[block])))[1]) for i in inputs)
            step = 2.0 ** -quant_shift(e, world)
            bound = world * 0.5 * step * (1 / world if op == "avg" else 1) + np.abs(exact[block]) * 2**-23
            assert np.all(err[block] <= bound), f"chunk at {start}"
    else:
        mant = 10 if codec == "fp16" else 7
        # each input rounded once (and divided first for avg), the sum rounded once more
        bound = magnitude * 2.0 ** -mant + np.abs(exact) * 2.0 ** -mant + 2.0 ** -24 * world
        finite = np.isfinite(got)
        assert np.all(err[finite] <= bound[finite])
        if codec == "fp16":
            assert np.all(finite[np.abs(exact) < 60000])


def _two_jobs_worker(rank, address):
    job, world, r = ("alpha", 2, rank) if rank < 2 else ("beta", 3, rank - 2)
    with Client(address, job=job, rank=r, world_size=world, chunk_bytes=1024, timeout=20) as c:
        outs = []
        for i in range(5):
            x = float_data(r, 20000, seed=100 * world + i)
            c.allreduce(x).result(30)
            outs.append(x)
    return job, world, outs


@pytest.mark.slow
def test_two_jobs_concurrently_get_independent_exact_results(service):
    results = run_workers(service.address, 5, _two_jobs_worker, service.address)
    for job, world, outs in results:
        for i, x in enumerate(outs):
            want = sum(float_data(r, 20000, seed=100 * world + i) for r in range(world))
            np.testing.assert_array_equal(x, want)
    # every worker closed after its shards echoed its LEAVE
    jobs = {name for s in service.stats()["shards"] for name in s["jobs"]}
    assert not jobs & {"alpha", "beta"}, f"finished jobs are removed once every worker left; still {jobs}"


def test_malformed_messages_are_dropped_counted_and_answered(service):
    job = f"bad-{uuid.uuid4().hex[:6]}"
    from aggnet.protocol.wire import job_id_of

    good = wire.Header(wire.MsgType.PUSH, job_id=job_id_of(job), round=1, index=0, sender=0,
                       dtype=wire.DType.FLOAT32, count=4, flags=wire.Flag.LITTLE_ENDIAN)
    with connect([service.address]) as ctl:
        ctl.send(0, wire.Header(wire.MsgType.HELLO).pack())
        msg = ctl.recv(10)
        shards = wire.parse_json(msg.payload)["shards"]
    bad_magic = bytearray(good.pack())
    bad_magic[0] = 0
    bad_version = bytearray(good.pack())
    bad_version[2] = 99
    truncated = good.pack()[:20]
    garbage = [
        (bytes(bad_magic), b"\0" * 16),
        (bytes(bad_version), b"\0" * 16),
        (truncated, None),
        (good.pack(), b"\0" * 15),  # payload shorter than count says
        (good.pack(), b"\0" * 16),  # well formed, but nobody joined this job
    ]
    # one connection per bad message: a stream transport (UCX) cannot
    # re-frame after a header it cannot read, and drops that connection
    errors = []
    for header, payload in garbage:
        with connect(shards) as raw:
            raw.send(0, header, payload)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                m = raw.recv(0.5)
                if m is not None:
                    h = wire.unpack_header(m.header)
                    assert h.msg_type == wire.MsgType.ERROR
                    errors.append(wire.parse_error(m.payload))
                    break
    # the service keeps serving real workers
    results = run_workers(service.address, 2, _exact_worker, service.address, 2, job, 4096, 3)
    _check_exact(results, 2, 3)
    codes = [c for c, _ in errors]
    if service.kind == "ucx":
        # ucxx does not tell how many bytes a receive got: the truncated
        # header (zero-filled) and the short payload go unseen there, and
        # those messages fail on their job, which nobody joined
        assert codes.count("malformed") == 2 and codes.count("not_joined") == 3, errors
        assert service.new_counts()["dropped_unknown_job"] == 3
        return
    assert any("bad magic" in m for _, m in errors)
    assert any("version 99" in m for _, m in errors)
    assert any("shorter than the 48-byte" in m for _, m in errors)
    assert any("does not match count=4" in m for _, m in errors)
    c = service.new_counts()
    assert c["dropped_malformed_magic"] == 1
    assert c["dropped_malformed_version"] == 1
    assert c["dropped_malformed_short"] == 1
    assert c["dropped_malformed_length"] == 1
    assert c["dropped_unknown_job"] == 1


def test_unreachable_aggregator_fails_fast_with_the_address(tmp_path):
    address = f"zmq+ipc://{tmp_path}/nobody.sock"
    t0 = time.monotonic()
    with pytest.raises(AggregatorUnreachable) as err:
        Client(address, job="lonely", connect_timeout=1.5)
    assert time.monotonic() - t0 < 5
    assert "nobody.sock" in str(err.value) and "aggnet serve --listen" in str(err.value)


@pytest.mark.parametrize("scheme", ["zmq+ipc", "shm"])
def test_a_socket_file_nobody_listens_on_is_reported_at_once(tmp_path, scheme):
    # what a killed service leaves behind: the file, no listener
    import socket

    path = tmp_path / "gone.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()
    t0 = time.monotonic()
    with pytest.raises(AggregatorUnreachable, match="nothing listens on .*gone.sock.*aggnet serve --listen"):
        Client(f"{scheme}://{path}", job="late", connect_timeout=30)
    assert time.monotonic() - t0 < 2


def test_aggregator_that_dies_fails_the_allreduce_within_its_timeout(service_factory):
    svc = service_factory("zmq+ipc")
    c = Client(svc.address, job="orphan", rank=0, world_size=2, timeout=1.5)
    try:
        svc.stop()
        fut = c.allreduce(np.ones(1000, np.float32))
        t0 = time.monotonic()
        with pytest.raises(AggregationTimeout) as err:
            fut.result(timeout=10)
        assert time.monotonic() - t0 < 6
        msg = str(err.value)
        assert "orphan" in msg and svc.address in msg and "no progress" in msg
        # the client keeps its head: the next all-reduce tries to join the
        # service again (it may have been restarted) and says it is gone
        c.config = c.config.replace(connect_timeout=1.0)
        with pytest.raises(AggregatorUnreachable):
            c.allreduce(np.ones(4, np.float32)).result(timeout=10)
    finally:
        c.close()


def test_a_silent_worker_is_named_by_the_others(service):
    job = f"stall-{uuid.uuid4().hex[:6]}"
    failed = worker_context(service.address).Semaphore(0)
    stall = functools.partial(silent_rank_run, peers_failed=failed, size=10000)
    res = run_workers(service.address, 3, stall, service.address, job, timeout=40)
    for text, waited in res[:2]:
        assert "rank(s) [2]" in text and job in text, text
        assert waited < 4.5
    assert res[2] == "idle"


_KILLED_WORKER = """
import os, signal, sys
import numpy as np
from aggnet import Client
c = Client(sys.argv[1], job=sys.argv[2], rank=1, world_size=2, timeout=60)
c.allreduce(np.ones(1000, np.float32)).result(timeout=60)
print("summed", flush=True)
sys.stdin.readline()
os.kill(os.getpid(), signal.SIGKILL)  # no LEAVE, no close: as a crash
"""


@pytest.mark.parametrize("kind", ["zmq+tcp", "tcp", "zmq+ipc", "shm", "udp"])
def test_a_killed_worker_is_reported_to_the_survivor_at_once(shared_service, kind):
    """The service hears the connection close; a host in switch mode
    (udp, two shard ports) hears the worker's heartbeats stop."""
    svc = shared_service(kind)
    job = f"killed-{uuid.uuid4().hex[:6]}"
    other = subprocess.Popen([sys.executable, "-c", _KILLED_WORKER, svc.address, job], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        with Client(svc.address, job=job, rank=0, world_size=2, timeout=60) as c:
            c.allreduce(np.ones(1000, np.float32)).result(timeout=60)
            assert other.stdout.readline().strip() == "summed"
            pending = c.allreduce(np.ones(200_000, np.float32))  # rank 1 will never send its part
            other.stdin.write("go\n")
            other.stdin.flush()
            other.wait(10)
            t0 = time.monotonic()
            with pytest.raises(AggregationTimeout,
                               match="rank 1 of job .* (lost its connection|sent no heartbeat)"):
                pending.result(timeout=60)
            # a closed connection at once; silence within the lapse (3 s)
            assert time.monotonic() - t0 < (5 if kind == "udp" else 2)
    finally:
        if other.poll() is None:
            other.kill()
    assert svc.new_counts()["members_disconnected"] >= 1


def test_a_worker_that_died_before_joining_every_shard_is_reported_in_seconds():
    """Rank 1 joined shard 0 and died before joining shard 1. Shard 0 tells
    rank 0 at once; shard 1 never heard of rank 1, and holds the round's
    buffer-size agreement until its stall timeout. Rank 0 reports what
    shard 0 said after a short grace, not after half its timeout.

    Rank 0 joins first: had shard 0 seen rank 1's connection close before
    rank 0's JOIN, it would have dropped the job with its last member and
    never known rank 1 (a CI run caught that order)."""
    from harness.raw_worker import RawWorker

    from aggnet.client.chunked import HELD_GRACE
    from aggnet.client.stats import query
    from aggnet.processes import ServiceProcess

    with ServiceProcess("zmq+tcp://127.0.0.1:0", shards=2) as svc:
        job = f"half-{uuid.uuid4().hex[:6]}"
        with Client(svc.address, job=job, rank=0, world_size=2, timeout=40, chunk_bytes=4096) as c:
            raw = RawWorker(svc.address, job, rank=1, world=2, timeout=10)
            raw.join(shards=[0])
            raw.close()
            deadline = time.monotonic() + 10
            while query(svc.address)["totals"].get("members_disconnected", 0) < 1:  # shard 0 saw it go
                assert time.monotonic() < deadline, "shard 0 never saw rank 1's connection close"
                time.sleep(0.02)
            t0 = time.monotonic()
            # round 1's buffer-size agreement is shard 1's, which never heard of rank 1
            with pytest.raises(AggregationTimeout, match=r"shard 0 .*rank\(s\) \[1\] left job .* or lost their "
                                                         r"connection"):
                c.allreduce(np.ones(10_000, np.float32)).result(timeout=60)
            took = time.monotonic() - t0
        assert HELD_GRACE <= took < HELD_GRACE + 3, took  # the stall would be 20 s


@pytest.mark.parametrize("kind", ["inproc", "zmq+tcp", "tcp", "shm", "udp"])
def test_a_world_size_mismatch_is_told_to_every_rank_at_once(shared_service, kind):
    """Rank 1 joins with another world size than the job rank 0 registered
    (on the service, and on a host in switch mode over udp://):
    rank 1 is refused, and rank 0, already a member, hears the same verdict
    at once (its all-reduce fails naming both sizes, and so does the next),
    not a timeout that blames a missing rank."""
    svc = shared_service(kind)
    job = f"world-{uuid.uuid4().hex[:6]}"
    with Client(svc.address, job=job, rank=0, world_size=2, timeout=30) as first:
        pending = first.allreduce(np.ones(50_000, np.float32))
        with pytest.raises(JobMismatch, match="registered with world size 2 .* world size 3"):
            Client(svc.address, job=job, rank=1, world_size=3, connect_timeout=10)
        t0 = time.monotonic()
        with pytest.raises(JobMismatch, match="registered with world size 2 .* world size 3"):
            pending.result(timeout=30)
        assert time.monotonic() - t0 < 5, "the verdict comes at once, not after a timeout"
        with pytest.raises(JobMismatch, match="world size 3"):
            first.allreduce(np.ones(10, np.float32)).result(timeout=5)


def _size_worker(rank, address, job):
    with Client(address, job=job, rank=rank, world_size=2, chunk_bytes=4096, timeout=10) as c:
        try:
            c.allreduce(np.ones(1000 * (rank + 1), np.float32)).result(20)
        except JobMismatch as exc:
            return str(exc)
        return "no error"


def test_buffer_size_mismatch_is_reported_to_both_workers(service):
    job = f"size-{uuid.uuid4().hex[:6]}"
    res = run_workers(service.address, 2, _size_worker, service.address, job)
    for text in res:
        assert "same buffers in the same order" in text, text


def _key_worker(rank, address, job, keys):
    with Client(address, job=job, rank=rank, world_size=2, chunk_bytes=4096, timeout=20) as c:
        t0 = time.monotonic()
        try:
            c.allreduce(np.ones(1000, np.float32), key=keys[rank]).result(30)
        except JobMismatch as exc:
            return str(exc), time.monotonic() - t0
        return "no error", time.monotonic() - t0


@pytest.mark.parametrize("keys", [(0, 1), (1, 3), (None, 2)], ids=["other-shards", "same-shard", "none-and-int"])
def test_a_round_under_different_keys_fails_on_both_workers_at_once(service, keys):
    """Keys place a round's chunks on the shards: two workers that give
    the same round different keys each waited at another shard for the
    other until the timeout, or, placed on one shard, had buffers of
    different keys summed. The buffer-size agreement carries the key, so
    both fail at once saying so."""
    job = f"key-{uuid.uuid4().hex[:6]}"
    res = run_workers(service.address, 2, _key_worker, service.address, job, keys)
    for text, took in res:
        assert "another worker otherwise: give each buffer the same key on every worker" in text, text
        assert took < 5, f"the mismatch took {took:.1f}s to be told (the round's timeout is 20 s)"


def test_a_key_that_is_not_an_int_is_refused_in_one_line(service):
    with Client(service.address, job=f"key-{uuid.uuid4().hex[:6]}", rank=0, world_size=1, timeout=10) as c:
        with pytest.raises(TypeError, match=r"key must be an int .* or None; got 'up'"):
            c.allreduce(np.ones(10, np.float32), key="up")
        assert c.allreduce(np.ones(10, np.float32), key=np.int64(3)).result(10)[0] == 1.0


def test_an_io_thread_that_fails_while_admitting_an_all_reduce_fails_it(shared_service, monkeypatch):
    """A fault in the client's I/O thread fails what it held: the
    all-reduce it was admitting (taken off the queue, not yet under way)
    ends with the fault at once, as every later one does, instead of
    never ending. The fault is injected where the I/O thread cuts a buffer
    into chunks."""
    from aggnet.client import chunked

    svc = shared_service("zmq+tcp", 2)
    with Client(svc.address, job=f"io-{uuid.uuid4().hex[:6]}", rank=0, world_size=1, timeout=20) as c:
        assert c.allreduce(np.ones(10, np.float32)).result(10)[0] == 1.0

        def broken(*args, **kwargs):
            raise RuntimeError("cutting the buffer broke")

        monkeypatch.setattr(chunked.chunking, "plan", broken)
        pending = c.allreduce(np.ones(10, np.float32))
        with pytest.raises(RuntimeError, match="cutting the buffer broke"):
            pending.result(timeout=5)
        with pytest.raises(ClientClosed, match="cutting the buffer broke"):
            c.allreduce(np.ones(10, np.float32))


class ScriptedShards:
    """Two shards that speak the protocol but answer a round's chunks with
    the ERRORs a test names, in the order it names, so a client's handling
    of replies that cross between shards is tested without a race."""

    def __init__(self, errors):
        self.errors = errors  # [(chunk index, code, text)], in the order sent
        self.listeners = [listen(f"zmq+tcp://127.0.0.1:{free_port()}") for _ in range(2)]
        self.addresses = [str(lst.address) for lst in self.listeners]
        self.chunks: dict[int, tuple] = {}  # chunk index -> (shard, peer, header)
        self.stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stop:
            for shard, lst in enumerate(self.listeners):
                m = lst.recv(0.02)
                if m is None:
                    continue
                h = wire.unpack_header(m.header)
                if h.msg_type == wire.MsgType.HELLO:
                    payload = wire.json_payload({"shards": self.addresses})
                    lst.send(m.peer, wire.Header(wire.MsgType.HELLO_OK).pack_for(payload), payload)
                elif h.msg_type == wire.MsgType.JOIN:
                    payload = wire.json_payload({})
                    lst.send(m.peer, wire.Header(wire.MsgType.JOIN_OK, job_id=h.job_id).pack_for(payload), payload)
                elif h.msg_type == wire.MsgType.LEAVE:
                    lst.send(m.peer, m.header)
                elif h.msg_type == wire.MsgType.PUSH and h.index == wire.PLAN_INDEX:
                    # the one worker agrees with itself
                    lst.send(m.peer, wire.Header(wire.MsgType.RESULT, job_id=h.job_id, round=h.round,
                                                 index=h.index, dtype=h.dtype, count=h.count,
                                                 flags=h.flags).pack(), bytes(m.payload))
                elif h.msg_type == wire.MsgType.PUSH:
                    self.chunks[h.index] = (shard, m.peer, h)
                    if len(self.chunks) == len(self.errors):
                        for index, code, text in self.errors:
                            where, peer, ch = self.chunks[index]
                            err = wire.Header(wire.MsgType.ERROR, job_id=ch.job_id, round=ch.round, index=index)
                            payload = wire.error_payload(code, text)
                            self.listeners[where].send(peer, err.pack_for(payload), payload)
                            time.sleep(0.3)  # the later error comes clearly later

    def close(self):
        self.stop = True
        self.thread.join(5)
        for lst in self.listeners:
            lst.close()


@pytest.mark.parametrize("later", ["mismatch", "stall"])
def test_a_departure_reported_first_does_not_hide_the_mismatch_behind_it(later):
    """A worker that hears of a mismatch stops and leaves; a shard where it
    had a chunk open may tell the other worker of that departure before the
    mismatch reaches it from another shard. The client waits for its chunks
    in flight and reports the cause: the mismatch."""
    later_code = wire.ErrorCode.JOB_MISMATCH if later == "mismatch" else wire.ErrorCode.STALL
    shards = ScriptedShards([(1, wire.ErrorCode.STALL, "rank 1 left job 'x' while round 1 chunk 1 was open"),
                             (0, later_code, "rank 1 sent 1000 FLOAT32 but ranks [0] sent 500")])
    try:
        with Client(shards.addresses[0], job="x", rank=0, world_size=2, chunk_bytes=4096, timeout=10) as c:
            started = time.monotonic()
            with pytest.raises(JobMismatch if later == "mismatch" else AggregationTimeout) as err:
                c.allreduce(np.ones(2048, np.float32)).result(20)
            took = time.monotonic() - started
        assert ("sent 1000 FLOAT32" if later == "mismatch" else "while round 1 chunk 1 was open") in str(err.value)
        # answered when the last chunk in flight answered, not at a timeout
        assert took < 3, took
    finally:
        shards.close()


def _nan_worker(rank, address, job):
    x = np.ones(5000, np.float32)
    if rank == 1:
        x[1234] = np.nan
        x[4000] = np.inf
    with Client(address, job=job, rank=rank, world_size=2, chunk_bytes=4096, timeout=10) as c:
        try:
            c.allreduce(x, codec="int32").result(20)
        except NonFiniteError as exc:
            first = str(exc)
        else:
            first = "no error"
        # the job carries on after a refused buffer
        y = np.full(100, rank + 1, np.float32)
        c.allreduce(y, codec="int32").result(20)
        return first, y


@pytest.mark.slow
def test_nan_and_inf_are_reported_not_quantized(service):
    job = f"nan-{uuid.uuid4().hex[:6]}"
    (msg0, y0), (msg1, y1) = run_workers(service.address, 2, _nan_worker, service.address, job)
    assert "rank 1" in msg1 and "2 NaN/Inf" in msg1
    assert "another worker reported NaN/Inf" in msg0
    np.testing.assert_array_equal(y0, np.full(100, 3, np.float32))
    np.testing.assert_array_equal(y1, y0)


def _embedded_worker(rank, job):
    with Client(job=job, rank=rank, world_size=2, timeout=20) as c:
        x = np.full(300000, rank + 1, np.float32)
        c.allreduce(x).result(30)
        return float(x.min()), float(x.max()), c.address


def test_embedded_default_needs_no_service(monkeypatch):
    monkeypatch.delenv("AGGNET_ADDRESS", raising=False)
    job = f"embedded-{uuid.uuid4().hex[:6]}"
    res = run_workers("zmq+ipc://embedded", 2, _embedded_worker, job)
    assert [r[:2] for r in res] == [(3.0, 3.0), (3.0, 3.0)]
    address = res[0][2]
    # the aggregator stopped after the job's last member left: nothing
    # listens there any more, and it left no files
    path = address.split("://", 1)[1]
    # (the socket goes when it closes, the lock file a moment after)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and (os.path.exists(path) or os.path.exists(path + ".lock")):
        time.sleep(0.1)
    assert not os.path.exists(path) and not os.path.exists(path + ".lock")
    with pytest.raises(AggregatorUnreachable):
        Client(address, job="late", connect_timeout=1.0)


def test_sigterm_stops_service_and_shards(service_factory):
    svc = service_factory("zmq+tcp", shards=2)
    pids = [s["pid"] for s in svc.stats()["shards"]]
    assert len(pids) == 2
    assert svc.stop() == 0
    for pid in pids:
        for _ in range(50):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"shard process {pid} outlived its service")


def test_bad_settings_fail_with_the_bad_value(service):
    with pytest.raises(ValueError, match="rank must be an integer in \\[0, 2\\), got 2"):
        Client(service.address, rank=2, world_size=2)
    with pytest.raises(ValueError, match=r"chunk_bytes must be between 64 B and 64 MiB .*, got 10"):
        Client(service.address, chunk_bytes=10)
    with Client(service.address, job="settings") as c:
        with pytest.raises(ValueError, match="float32, int32, float16 and bfloat16 buffers, not float64"):
            c.allreduce(np.ones(3))
        with pytest.raises(ValueError, match="C-contiguous"):
            c.allreduce(np.ones((4, 4), np.float32)[:, 1])
        with pytest.raises(ValueError, match="op='avg' needs a floating-point buffer"):
            c.allreduce(np.ones(3, np.int32), op="avg")
        with pytest.raises(ValueError, match="codec must be one of"):
            c.allreduce(np.ones(3, np.float32), codec="int8")
        with pytest.raises(ValueError, match="codec 'float32' sends a float32 buffer as it is; this buffer is int32"):
            c.allreduce(np.ones(3, np.int32), codec="float32")
        with pytest.raises(TypeError, match="allreduce takes a NumPy array, a torch tensor, .*; got list for buf"):
            c.allreduce([1.0, 2.0])
        import torch

        with pytest.raises(TypeError, match="reduce_scatter takes dense tensors; buf is torch.sparse_coo"):
            c.reduce_scatter(torch.eye(4).to_sparse(), torch.empty(4))
        with pytest.raises(TypeError, match="allreduce takes CPU and CUDA tensors; buf is on meta"):
            c.allreduce(torch.empty(4, device="meta"))
        with pytest.raises(ValueError, match="float32, int32, float16 and bfloat16 buffers, not float64"):
            c.allreduce(torch.ones(3, dtype=torch.float64))
        with pytest.raises(ValueError, match="dtype must be one of .* got 'int8'"):
            c.allreduce(np.ones(3, np.float32), dtype="int8")
        # dtype names what travels: float32 quantized to int32, then back
        x = np.full(1000, 0.5, np.float32)
        c.allreduce(x, dtype="int32").result(20)
        np.testing.assert_array_equal(x, np.full(1000, 0.5, np.float32))
