"""Buffers in a worker's own shared memory (``aggnet.shared_array``, a GPU
bucket's staging buffers): over ``shm://`` the worker names the buffer to
each shard once a round and the shard reads its chunks where they lie, so
the worker copies nothing on the way in. Worker processes against a real
shm service with two shards: the sums are the bits the ring-slot path
gives, every chunk is read in place, and a buffer the shard cannot open
fails the round with a line that says why, on a shard that goes on."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import json

import numpy as np
import pytest

import aggnet
from aggnet import Client
from aggnet.protocol import wire
from aggnet.protocol.wire import Header, MsgType
from aggnet.transport import connect, shm
from aggnet.processes import ServiceProcess
from harness.helpers import RunningService, run_workers
from harness.racks import topology_text

N = 10_007  # elements: several 4 KiB chunks and a short last one
CHUNK = 4096


@pytest.fixture(scope="module")
def service():
    svc = RunningService("shm", shards=2)
    yield svc
    svc.stop()


def values(rank: int, dtype, n: int = N) -> np.ndarray:
    rng = np.random.default_rng(11 + rank)
    if np.dtype(dtype) == np.int32:
        return rng.integers(-1 << 20, 1 << 20, n, dtype=np.int32)
    return rng.standard_normal(n).astype(dtype)


def _rounds(rank: int, address: str, job: str, cases: list, shared_ranks: tuple, world: int = 2,
            restore: bool = False, share: bool = True):
    """Each case (dtype, op, codec, offset) all-reduced twice, from a shared
    array at ``offset`` elements into it (on the ranks in
    ``shared_ranks``) or from an ordinary one: (the result's bytes, chunks
    read in place, results written in place). ``address``: a topology's
    text for racks. ``restore``: a failed round puts the buffer back
    (all_or_nothing), which the client does only for results it writes."""
    out = []
    where = {"topology": address} if "[[racks]]" in address else {"address": address}
    with Client(**where, job=job, rank=rank, world_size=world, chunk_bytes=CHUNK, timeout=30,
                all_or_nothing=restore, share_buffers=share) as c:
        for dtype, op, codec, offset in cases:
            if rank in shared_ranks:
                whole = aggnet.shared_array(N + offset + 3, dtype)
                buf = whole[offset:offset + N]
            else:
                buf = np.empty(N, dtype)
            got = []
            for rnd in range(2):
                buf[...] = values(rank + rnd, dtype)
                before = c.stats.chunks_shared, c.stats.results_in_place
                c.allreduce(buf, op=op, codec=codec).result(30)
                got.append((buf.view(np.uint8).copy(), c.stats.chunks_shared - before[0],
                            c.stats.results_in_place - before[1]))
            out.append(got)
    return out


CASES = [(np.float32, "sum", None, 0), (np.float32, "avg", None, 37), (np.int32, "sum", None, 5),
         (np.float16, "sum", None, 1), (np.float32, "sum", "int32", 0)]


def run(service, shared_ranks, restore: bool = False):
    return run_workers(service.address, 2, _rounds, service.address, f"shared-{uuid.uuid4().hex[:8]}", CASES,
                       shared_ranks, 2, restore, timeout=90)


CHUNKS = {case: -(-N * np.dtype(case[0]).itemsize // CHUNK) for case in CASES}


@pytest.mark.parametrize("restore", [False, True], ids=["results-in-place", "results-copied"])
def test_a_shared_buffer_is_read_in_place_and_sums_to_the_bits_the_rings_give(service, restore):
    """Its chunks are read where they lie; its results are written there
    by the shards too, unless the client restores a failed round's buffer
    (then it saves each chunk before it copies the result in itself)."""
    service.mark_counts()
    shared = run(service, (0, 1), restore)
    counts = service.new_counts()
    ringed = run(service, (), restore)
    for rank in range(2):
        for i, case in enumerate(CASES):
            for rnd in range(2):
                bits, read_in_place, written_in_place = shared[rank][i][rnd]
                np.testing.assert_array_equal(bits, ringed[rank][i][rnd][0], err_msg=f"{case} round {rnd}")
                np.testing.assert_array_equal(bits, shared[0][i][rnd][0])
                # as they are on the wire: read in place; the int32 codec
                # quantizes into a staging buffer first, through the rings
                assert read_in_place == (0 if case[2] == "int32" else CHUNKS[case]), case
                assert written_in_place == (0 if restore else read_in_place), case
                assert ringed[rank][i][rnd][1:] == (0, 0)
    # the sums are the sums (and the averages the averages), not only equal to each other
    want = values(0, np.float32) + values(1, np.float32)
    np.testing.assert_allclose(shared[0][0][0][0].view(np.float32), want, rtol=1e-6)
    np.testing.assert_allclose(shared[0][1][0][0].view(np.float32), want / 2, rtol=1e-6)
    in_place = 2 * 2 * sum(CHUNKS[c] for c in CASES if c[2] is None)
    assert counts["shared_pushes"] == in_place
    assert counts["results_in_place"] == (0 if restore else in_place)
    assert counts["shares"] == 2 * 2 * 2 * sum(1 for c in CASES if c[2] is None)  # both shards, each round


def test_one_worker_shared_and_one_not_sum_alike(service):
    mixed = run(service, (1,))
    ringed = run(service, ())
    for i in range(len(CASES)):
        for rnd in range(2):
            np.testing.assert_array_equal(mixed[0][i][rnd][0], ringed[0][i][rnd][0])
            np.testing.assert_array_equal(mixed[1][i][rnd][0], ringed[0][i][rnd][0])
            assert mixed[0][i][rnd][1:] == (0, 0)
            assert mixed[1][i][rnd][2] == mixed[1][i][rnd][1]


def _scratch_copy(rank: int, address: str, job: str):
    """A CUDA buffer's staging copy, as the client makes one (aggnet/client/
    device.py): its own, so nothing in it is restored, whatever
    all_or_nothing says, and the shards write the results there."""
    with Client(address, job=job, rank=rank, world_size=2, chunk_bytes=CHUNK, timeout=30) as c:
        assert c.config.all_or_nothing is None  # the default: restore the caller's buffers
        host = aggnet.shared_array(N)
        host[...] = values(rank, np.float32)
        c.allreduce(host, op="avg", _scratch=True).result(30)
        return host.copy(), c.stats.results_in_place


def test_a_device_buffer_s_staging_copy_takes_its_results_in_place(service):
    out = run_workers(service.address, 2, _scratch_copy, service.address, f"scratch-{uuid.uuid4().hex[:8]}",
                      timeout=60)
    ringed = run(service, ())  # CASES[1]: the same values averaged through the rings, in its first round
    for got, in_place in out:
        np.testing.assert_array_equal(got.view(np.uint8), ringed[0][1][0][0])
        assert in_place == CHUNKS[CASES[0]]


#: unequal shares, each several chunks with a short last one
BOUNDS = [0, 3001, N]
#: how each reduce-scatter is received: (buffer shared, output its own share)
SCATTERS = [(True, True), (True, False), (False, True), (False, False)]


def _scatters(rank: int, address: str, job: str, op: str, restore: bool):
    """Each of SCATTERS once: (the share's bytes, chunks read in place,
    results written in place)."""
    out = []
    mine = slice(BOUNDS[rank], BOUNDS[rank + 1])
    with Client(address, job=job, rank=rank, world_size=2, chunk_bytes=CHUNK, timeout=30,
                all_or_nothing=restore) as c:
        for shared, own in SCATTERS:
            buf = aggnet.shared_array(N, np.float32) if shared else np.empty(N, np.float32)
            buf[...] = values(rank, np.float32)
            share = buf[mine] if own else np.empty(mine.stop - mine.start, np.float32)
            before = c.stats.chunks_shared, c.stats.results_in_place
            c.reduce_scatter(buf, share, BOUNDS, op=op).result(30)
            out.append((share.copy(), c.stats.chunks_shared - before[0], c.stats.results_in_place - before[1]))
            if not own:  # the rest of buf is left as it was
                np.testing.assert_array_equal(buf, values(rank, np.float32))
    return out


@pytest.mark.parametrize("op,restore", [("sum", False), ("avg", False), ("sum", True)],
                         ids=["sum", "avg", "sum-restoring"])
def test_a_reduce_scatter_into_its_own_share_of_a_shared_buffer_takes_it_in_place(service, op, restore):
    """The staged reduce-scatter of aggnet.torch's backend receives its
    share into the staged input's own elements: the shards write the
    share's results there, and only there; every other way of receiving
    it gets the same bits through the rings."""
    service.mark_counts()
    got = run_workers(service.address, 2, _scatters, service.address, f"scatter-{uuid.uuid4().hex[:8]}", op,
                      restore, timeout=90)
    counts = service.new_counts()
    total = sum(values(r, np.float32) for r in range(2))
    if op == "avg":
        total = total * np.float32(0.5)
    chunks = [-(-(e - b) * 4 // CHUNK) for b, e in zip(BOUNDS, BOUNDS[1:])]
    for rank in range(2):
        want = total[BOUNDS[rank]:BOUNDS[rank + 1]]
        first = got[rank][0][0]
        np.testing.assert_allclose(first, want, rtol=1e-6)
        for (shared, own), (share, read_in_place, written) in zip(SCATTERS, got[rank]):
            np.testing.assert_array_equal(share, first, err_msg=f"shared={shared} own share={own}")
            assert read_in_place == (sum(chunks) if shared else 0)
            assert written == (chunks[rank] if shared and own and not restore else 0), (shared, own)
    assert counts["results_in_place"] == (0 if restore else sum(chunks))


def _staged_under_restore(rank: int, address: str, job: str):
    """A tensor through aggnet.torch's stager (in shared memory, as for an
    shm:// service) on a client told to restore failed rounds: the
    stager's buffer is its own, so nothing in it is saved, and the shards
    write the results there all the same."""
    import torch

    from aggnet.torch.staging import Stager

    torch.set_num_threads(1)
    with Client(address, job=job, rank=rank, world_size=2, chunk_bytes=CHUNK, timeout=30,
                all_or_nothing=True) as c:
        stager = Stager(torch.device("cpu"), through_host=True, shared=c.takes_shared)
        t = torch.from_numpy(values(rank, np.float32))
        staged = stager.stage(t, codec=None, op="avg", world=2)
        stager.submit(staged, lambda arr, **o: c.allreduce(arr, op=staged.op, codec=staged.codec, **o)).result(30)
        stager.unstage(staged)
        return t.numpy().copy(), c.stats.results_in_place


def test_a_tensor_staged_by_aggnet_torch_takes_its_results_in_place_even_where_failed_rounds_are_restored(service):
    out = run_workers(service.address, 2, _staged_under_restore, service.address,
                      f"staged-{uuid.uuid4().hex[:8]}", timeout=60)
    ringed = run(service, ())  # CASES[1]: the same values averaged through the rings, in its first round
    for got, in_place in out:
        np.testing.assert_array_equal(got.view(np.uint8), ringed[0][1][0][0])
        assert in_place == CHUNKS[CASES[0]]


def test_share_buffers_off_sends_a_shared_array_through_the_rings(service):
    out = run_workers(service.address, 2, _rounds, service.address, f"unshared-{uuid.uuid4().hex[:8]}", CASES[:2],
                      (0, 1), 2, False, False, timeout=60)
    ringed = run(service, ())
    for rank in range(2):
        for i in range(2):
            np.testing.assert_array_equal(out[rank][i][0][0], ringed[rank][i][0][0])
            assert out[rank][i][0][1:] == (0, 0)


def test_over_a_socket_a_shared_array_is_an_ordinary_buffer():
    svc = RunningService("zmq+ipc", shards=2)
    try:
        out = run_workers(svc.address, 2, _rounds, svc.address, f"shared-ipc-{uuid.uuid4().hex[:8]}", CASES[:1],
                          (0, 1), timeout=60)
    finally:
        svc.stop()
    want = values(0, np.float32) + values(1, np.float32)
    for rank in range(2):
        np.testing.assert_allclose(out[rank][0][0][0].view(np.float32), want, rtol=1e-6)
        assert out[rank][0][0][1:] == (0, 0)


def test_racks_on_shared_memory_under_a_root_read_in_place(tmp_path):
    """A rack aggregator on its workers' host (shm://) under a root: the
    rack reads its workers' buffers in place and sends its partial up."""
    root = ServiceProcess("zmq+tcp://127.0.0.1:0", shards=2)
    racks = []
    try:
        for i in range(2):
            listen = f"shm://{tmp_path}/rack{i}.sock"
            racks.append(ServiceProcess(listen, shards=2, args=["--parent", root.address, "--rack-id", str(i),
                                                                "--racks", "2"]))
        topology = topology_text("service", root.address, [r.address for r in racks], 2, shards=2)
        cases = CASES[:3]
        shared = run_workers("spawn://", 4, _rounds, topology, f"shared-racks-{uuid.uuid4().hex[:8]}", cases,
                             (0, 1, 2, 3), 4, timeout=120)
        ringed = run_workers("spawn://", 4, _rounds, topology, f"ringed-racks-{uuid.uuid4().hex[:8]}", cases,
                             (), 4, timeout=120)
    finally:
        for p in [*racks, root]:
            p.stop()
    for rank in range(4):
        for i, case in enumerate(cases):
            bits, read_in_place, written_in_place = shared[rank][i][0]
            np.testing.assert_array_equal(bits, ringed[rank][i][0][0], err_msg=str(case))
            # the rack reads the chunks there and writes the root's finals there
            assert read_in_place == written_in_place == CHUNKS[case]
    want = sum(values(r, np.float32).astype(np.float64) for r in range(4))
    np.testing.assert_allclose(shared[0][0][0][0].view(np.float32), want, rtol=1e-6, atol=1e-5)


def _unreadable(rank: int, address: str, job: str):
    """Rank 0's buffer is in shared memory whose file is gone (another
    /dev/shm than the aggregator's, or removed by hand)."""
    with Client(address, job=job, rank=rank, world_size=2, chunk_bytes=CHUNK, timeout=4) as c:
        buf = aggnet.shared_array(N) if rank == 0 else np.empty(N, np.float32)
        if rank == 0:
            name = shm.find_shared(buf)[0]
            os.unlink(os.path.join(shm.SHM_DIR, name))
        buf[...] = 1.0
        try:
            c.allreduce(buf).result(30)
        except aggnet.AggnetError as exc:
            return type(exc).__name__, str(exc)
        return "no error"


def test_a_buffer_the_shard_cannot_open_fails_the_round_saying_why(service):
    service.mark_counts()
    out = run_workers(service.address, 2, _unreadable, service.address, f"unreadable-{uuid.uuid4().hex[:8]}",
                      timeout=60)
    kind, text = out[0]
    assert "cannot read rank 0's shared buffer" in text and "/dev/shm" in text, text
    assert "\n" not in text
    assert out[1] != "no error"  # rank 1's part cannot complete without rank 0's
    assert service.alive()
    counts = service.new_counts()
    assert counts["dropped_share_unavailable"] >= 1
    # the shard went on: the next job sums as before
    again = run(service, (0, 1))
    np.testing.assert_allclose(again[0][0][0][0].view(np.float32), values(0, np.float32) + values(1, np.float32),
                               rtol=1e-6)


def test_a_shared_buffer_goes_with_its_last_view_and_a_dead_process_s_are_swept():
    buf = aggnet.shared_array((4, 5), np.int32)
    name = shm.find_shared(buf)[0]
    path = os.path.join(shm.SHM_DIR, name)
    assert os.path.exists(path) and buf.shape == (4, 5) and not buf.any()
    view = buf[1:]
    del buf
    assert os.path.exists(path)  # a view still holds it
    del view
    assert not os.path.exists(path)
    # a worker killed before it could remove its buffer leaves the file;
    # the next process that makes one removes it
    child = subprocess.run([sys.executable, "-c", "import os, aggnet\n"
                            "a = aggnet.shared_array(64)\n"
                            "from aggnet.transport import shm\n"
                            "print(shm.find_shared(a)[0], flush=True)\n"
                            "os._exit(0)"], capture_output=True, text=True, timeout=60)
    left = os.path.join(shm.SHM_DIR, child.stdout.strip())
    assert child.returncode == 0 and os.path.exists(left), child.stderr
    shm.sweep_stale_shared()  # (or another test process's first shared buffer did)
    assert not os.path.exists(left)


def test_malformed_shares_are_refused_and_counted_on_a_shard_that_goes_on(service):
    """A member's SHARE that is not JSON, names no aggnet buffer, starts
    outside it, or a chunk that ends outside it: each refused with an
    ERROR that says why, and counted; a stranger's too. A good one is
    read, and its result written back in place."""
    with connect([service.address]) as conn:
        conn.send(0, Header(MsgType.HELLO).pack())
        shard = json.loads(bytes(conn.recv(5.0).payload))["shards"][0]
    raw = shm.shared_bytes(64)
    name, size, _ = shm.find_shared(raw)
    job = 0x5A5A0000 | os.getpid() & 0xFFFF
    service.mark_counts()
    with connect([shard]) as conn:
        def tell(h, payload=b""):
            conn.send(0, h.pack_for(payload) if payload else h.pack(), payload or None)

        def ask(h, payload=b""):
            tell(h, payload)
            msg = conn.recv(5.0)
            assert msg is not None, f"no answer to {h.msg_type.name}"
            return wire.unpack_header(msg.header), bytes(msg.payload)

        def share(rnd, answered=True, **fields):  # a SHARE is answered only when refused
            body = {"name": name, "bytes": size, "at": 0, "chunks": 1, **fields}
            h = Header(MsgType.SHARE, job_id=job, round=rnd, sender=0, world=1)
            return (ask if answered else tell)(h, json.dumps(body).encode())

        # not a member yet
        h, reply = share(1)
        assert h.msg_type == MsgType.ERROR and "without joining" in wire.parse_error(reply)[1]
        join = json.dumps({"name": f"raw-{job:x}", "shm": {"window": 2, "chunk_bytes": 4096}}).encode()
        assert ask(Header(MsgType.JOIN, job_id=job, sender=0, world=1), join)[0].msg_type == MsgType.JOIN_OK
        h, reply = ask(Header(MsgType.SHARE, job_id=job, round=2, sender=0, world=1), b"{not json")
        assert h.msg_type == MsgType.ERROR and h.round == 2
        for rnd, fields, says in ((3, {"name": "../../etc/passwd"}, "not the name of an aggnet shared buffer"),
                                  (4, {"at": size}, "starts at byte"),
                                  (5, {"bytes": size + 1}, "smaller than")):
            h, reply = share(rnd, **fields)
            assert h.msg_type == MsgType.ERROR and h.round == rnd and says in wire.parse_error(reply)[1], reply
        # a good one: the chunk is read there, and its result written back
        raw.view(np.float32)[:4] = [1.5, 2.5, -3.0, 4.0]
        share(6, answered=False, results=1, multiplier=0.5)
        push = Header(MsgType.PUSH, job_id=job, round=6, index=0, sender=0, world=1, dtype=wire.DType.FLOAT32,
                      count=4, flags=wire.Flag.LITTLE_ENDIAN | wire.Flag.SHM, ref=0, offset=0)
        h, _ = ask(push)
        assert h.msg_type == MsgType.RESULT_IN_PLACE and h.count == 4
        assert list(raw.view(np.float32)[:4]) == [0.75, 1.25, -1.5, 2.0]  # the sum of one, times 0.5
        # a chunk past the buffer's end
        share(7, answered=False)
        push.round, push.offset, push.ref = 7, 15, 1
        h, reply = ask(push)
        assert h.msg_type == MsgType.ERROR and "ends at byte 76" in wire.parse_error(reply)[1], reply
        ask(Header(MsgType.LEAVE, job_id=job, sender=0, world=1))
    assert service.alive()
    counts = service.new_counts()
    for reason, n in (("share_not_joined", 1), ("malformed_json", 1), ("share_unavailable", 2),
                      ("share_bounds", 2)):
        assert counts[f"dropped_{reason}"] == n, (reason, counts)
    assert counts["shared_pushes"] == 1 and counts["results_in_place"] == 1
