"""The switch protocol (docs/protocol.md) between real worker processes and
an aggregator host in switch mode, over UDP: exact under loss, duplication
and reorder, jobs kept apart, silent workers named, bad packets counted,
and a two-level hierarchy."""

from __future__ import annotations

import contextlib
import functools
import socket
import time
import uuid

import numpy as np
import pytest

from aggnet import Client
from aggnet.protocol.wire import job_id_of
from aggnet.emulation.lossy_relay import LossyRelay
from aggnet.errors import AggregationError, NonFiniteError
from aggnet.processes import ServiceProcess
from aggnet.kernels import quant_shift
from aggnet.protocol.limits import MAX_WORKERS
from aggnet.client.switch import query_stats
from aggnet.protocol import wire
from aggnet.protocol.messages import padding_asked
from aggnet.protocol.wire import HEADER_SIZE, DType, Flag, Header, MsgType
from harness.helpers import run_workers, silent_rank_run, worker_context

K = 64


def switch(*extra) -> ServiceProcess:
    return ServiceProcess("udp://127.0.0.1:0", args=["--mode", "switch", "--pool", "512", "--elements", str(K), *extra])


@pytest.fixture
def aggregator():
    svc = switch()
    yield svc
    svc.stop()


def data(rank: int, seed: int, n: int = 20011):
    rng = np.random.default_rng(seed * 100 + rank)
    x = (rng.standard_normal(n) * np.exp(rng.uniform(-6, 6, n))).astype(np.float32)
    y = rng.integers(-(2**31), 2**31, n, dtype=np.int64).astype(np.int32)
    return x, y


def _worker(rank, address, world, job, seed, opts):
    opts = dict(opts)
    member_rank, members = opts.pop("member", (None, None))
    x, y = data(rank, seed)
    with Client(address, job=job, rank=rank, world_size=world, timeout=30, elements=K,
                member_rank=member_rank, members=members, **opts) as c:
        c.allreduce(x).result(120)
        c.allreduce(y).result(120)
        small = np.full(5, rank + 1, np.float32)  # fewer blocks than slots
        c.allreduce(small, op="avg").result(120)
        return x, y, small, c.stats.retransmissions


def run(addresses, world, seed, job=None, **opts):
    job = job or f"sw-{uuid.uuid4().hex[:6]}"
    if isinstance(addresses, str):
        addresses = [addresses] * world
    return run_workers("udp://", world, lambda r, *a: _worker(r, addresses[r], *a), world, job, seed, opts,
                       timeout=180)


def check_exact(results, world, seed):
    inputs = [data(r, seed) for r in range(world)]
    want_y = np.zeros(inputs[0][1].size, np.int64)
    for _, y in inputs:
        want_y += y
    want_y = ((want_y + 2**31) % 2**32 - 2**31).astype(np.int32)
    exact_x = sum(x.astype(np.float64) for x, _ in inputs)
    for x, y, small, _ in results:
        np.testing.assert_array_equal(y, want_y)
        np.testing.assert_array_equal(x, results[0][0])  # every worker holds the same sum
        np.testing.assert_allclose(small, np.full(5, (world + 1) / 2), rtol=1e-6)
    # quantization error bound per block of K: world * half a step
    got = results[0][0].astype(np.float64)
    for b in range(0, exact_x.size, K):
        block = slice(b, b + K)
        e = max(int(np.frexp(np.max(np.abs(x[block])))[1]) for x, _ in inputs)
        step = 2.0 ** -quant_shift(e, world)
        assert np.all(np.abs(got[block] - exact_x[block]) <= world * step / 2 + np.abs(exact_x[block]) * 2**-23)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_lossless_sums_are_exact(aggregator, world):
    check_exact(run(aggregator.address, world, seed=world), world, world)


@pytest.mark.parametrize(
    "impair",
    [{"drop": 0.01}, {"drop": 0.10}, {"duplicate": 0.10}, {"reorder": 0.20}, {"drop": 0.05, "duplicate": 0.05, "reorder": 0.1}],
    ids=["drop1%", "drop10%", "dup10%", "reorder20%", "all"],
)
def test_results_under_impairment_equal_the_lossless_run(aggregator, impair):
    world, seed = 3, 42
    clean = run(aggregator.address, world, seed)
    host, port = aggregator.address[len("udp://"):].rsplit(":", 1)
    with LossyRelay((host, int(port)), world, seed=7, **impair) as relay:
        lossy = run(relay.addresses, world, seed)
        counters = dict(relay.counters)
    for (x0, y0, s0, _), (x1, y1, s1, _) in zip(clean, lossy):
        np.testing.assert_array_equal(x1, x0)
        np.testing.assert_array_equal(y1, y0)
        np.testing.assert_array_equal(s1, s0)
    for kind in impair:
        assert counters[{"drop": "dropped", "duplicate": "duplicated", "reorder": "reordered"}[kind]] > 0
    if "drop" in impair:
        assert sum(r[3] for r in lossy) > 0  # recovered by retransmission
        assert query_stats(aggregator.address)["totals"].get("results_resent", 0) > 0


def test_thirty_two_workers_fill_the_seen_bitmap_and_sum_exactly(aggregator):
    """32 workers use every bit of a slot's seen bitmap, the top one included;
    clients in threads of one process keep the test light on two cores."""
    from concurrent.futures import ThreadPoolExecutor

    world = MAX_WORKERS
    ints = [np.random.default_rng(r).integers(-(2**31), 2**31, 3000, dtype=np.int64).astype(np.int32)
            for r in range(world)]
    want = ((sum(y.astype(np.int64) for y in ints) + 2**31) % 2**32 - 2**31).astype(np.int32)
    floats = [np.arange(3000, dtype=np.float32) * (r + 1) for r in range(world)]

    def worker(rank):
        with Client(aggregator.address, job="bits", rank=rank, world_size=world, elements=K, timeout=30) as c:
            y, x = ints[rank].copy(), floats[rank].copy()
            c.allreduce(y).result(60)
            c.allreduce(x).result(60)
            return y, x

    with ThreadPoolExecutor(world) as pool:
        results = list(pool.map(worker, range(world)))
    for y, x in results:
        np.testing.assert_array_equal(y, want)
        np.testing.assert_array_equal(x, np.arange(3000, dtype=np.float32) * (world * (world + 1) // 2))
    with pytest.raises(ValueError, match="at most 32 workers"):
        Client(aggregator.address, job="too-many", rank=0, world_size=world + 1, elements=K)


def test_two_jobs_use_distinct_pool_slices(aggregator):
    def both(rank):
        job, world, r = ("one", 2, rank) if rank < 2 else ("two", 3, rank - 2)
        return job, _worker(r, aggregator.address, world, job, 9 + world, {})

    results = run_workers("udp://", 5, both, timeout=180)
    check_exact([res for job, res in results if job == "one"], 2, 11)
    check_exact([res for job, res in results if job == "two"], 3, 12)


def test_jobs_get_disjoint_slices_while_both_are_joined(aggregator):
    a = Client(aggregator.address, job="slice-a", rank=0, world_size=2, elements=K, slots=100)
    b = Client(aggregator.address, job="slice-b", rank=0, world_size=2, elements=K, slots=100)
    try:
        jobs = query_stats(aggregator.address)["jobs"]
        ra = range(jobs["slice-a"]["base"], jobs["slice-a"]["base"] + 100)
        rb = range(jobs["slice-b"]["base"], jobs["slice-b"]["base"] + 100)
        assert not set(ra) & set(rb)
    finally:
        a.close()
        b.close()


def _join_and_hang(address, job, ready):
    Client(address, job=job, rank=0, world_size=1, elements=K, slots=256)
    ready.set()
    time.sleep(60)  # killed by the test long before


@contextlib.contextmanager
def _a_killed_job_beside_a_live_one(*serve_args):
    """A switch-mode host whose pool (512) holds a live job and a job whose
    only worker was killed (SIGKILL: no LEAVE); yields (aggregator, the
    live job's client)."""
    import multiprocessing as mp

    agg = switch(*serve_args)
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    dead = ctx.Process(target=_join_and_hang, args=(agg.address, "killed", ready), daemon=True)
    alive = None
    try:
        dead.start()
        assert ready.wait(60), "the worker that is to be killed never joined"
        dead.kill()
        dead.join(10)
        # joined after the killed job, however slowly a loaded machine started
        # it: the live job is never the longer idle of the two
        alive = Client(agg.address, job="alive", rank=0, world_size=1, elements=K, slots=256)
        yield agg, alive
    finally:
        if alive is not None:
            alive.close()
        if dead.is_alive():
            dead.kill()
        agg.stop()


def _next_job_sums_beside(agg, alive) -> dict:
    """A new job takes the freed slice and sums; the live one still does.
    Returns the aggregator's STATS."""
    x = np.arange(1000, dtype=np.int32)
    with Client(agg.address, job="next", rank=0, world_size=1, elements=K, slots=256) as nxt:
        np.testing.assert_array_equal(nxt.allreduce(x.copy()).result(10), x)
        stats = query_stats(agg.address)
    assert set(stats["jobs"]) == {"alive", "next"}
    np.testing.assert_array_equal(alive.allreduce(x.copy()).result(10), x)
    return stats


def test_a_full_pool_takes_back_the_slice_of_a_job_whose_workers_were_killed():
    """Workers that send no heartbeats (heartbeats off here, as for a
    worker of an older aggnet): the pool takes their job's slice back once
    it has been idle ``--reclaim-idle`` seconds and a new job needs it."""
    idle = 4
    with _a_killed_job_beside_a_live_one("--reclaim-idle", str(idle), "--heartbeat-lapse", "0") as (agg, alive):
        # the pool is full: the killed job is not yet idle long enough (a
        # client that joins anyway is closed, so a failure leaks nothing)
        with pytest.raises(AggregationError, match="no room for job 'next'"):
            Client(agg.address, job="next", rank=0, world_size=1, elements=K, slots=256, connect_timeout=5).close()
        # the live job keeps all-reducing while the killed one stays silent
        deadline = time.monotonic() + idle + 1
        x = np.arange(1000, dtype=np.int32)
        while time.monotonic() < deadline:
            np.testing.assert_array_equal(alive.allreduce(x.copy()).result(10), x)
            time.sleep(0.2)
        assert _next_job_sums_beside(agg, alive)["totals"]["jobs_reclaimed"] == 1


def test_a_killed_jobs_slice_is_free_once_its_heartbeats_stop():
    """With heartbeats the killed job's last member is gone within the
    lapse, and its slice with it: a new job needs no idle wait."""
    with _a_killed_job_beside_a_live_one("--reclaim-idle", "300") as (agg, alive):
        t0 = time.monotonic()
        while "killed" in query_stats(agg.address)["jobs"]:
            assert time.monotonic() - t0 < 8, "the killed job kept its slice"
            time.sleep(0.1)
        assert time.monotonic() - t0 < 5
        totals = _next_job_sums_beside(agg, alive)["totals"]
        assert totals["members_disconnected"] == 1 and "jobs_reclaimed" not in totals


def test_a_silent_worker_is_named_by_the_others(aggregator):
    job = f"stall-{uuid.uuid4().hex[:6]}"
    failed = worker_context("udp://").Semaphore(0)
    stall = functools.partial(silent_rank_run, peers_failed=failed, size=1000, elements=K)
    res = run_workers("udp://", 3, stall, aggregator.address, job, timeout=60)
    for text, waited in res[:2]:
        assert "[2] never sent theirs" in text and job in text and "slot" in text, text
        assert waited < 5
    assert res[2] == "idle"


def _nan(rank, address, job):
    x = np.ones(3000, np.float32)
    if rank == 1:
        x[100] = np.inf
    with Client(address, job=job, rank=rank, world_size=2, timeout=10, elements=K) as c:
        try:
            c.allreduce(x).result(30)
        except NonFiniteError as exc:
            first = str(exc)
        y = np.full(10, rank + 1, np.float32)
        c.allreduce(y).result(30)  # the job goes on
        return first, y


def test_nan_stops_every_worker_and_names_the_one_that_had_it(aggregator):
    (m0, y0), (m1, y1) = run_workers("udp://", 2, _nan, aggregator.address, "nan-job", timeout=60)
    assert "rank 1" in m1 and "NaN/Inf" in m1
    assert "another worker reported NaN/Inf" in m0
    np.testing.assert_array_equal(y0, np.full(10, 3, np.float32))


def test_stats_over_a_lossy_path_are_asked_again_until_answered(aggregator):
    """A fifth of the datagrams each way lost: each STATS (and each padding
    round) is asked again after a quarter second, doubling, instead of
    waiting out the whole timeout for an answer that was lost."""
    host, port = aggregator.address[len("udp://"):].rsplit(":", 1)
    with LossyRelay((host, int(port)), 1, drop=0.2, seed=11) as relay:
        t0 = time.monotonic()
        for _ in range(5):
            assert "totals" in query_stats(relay.addresses[0], timeout=5)
        took = time.monotonic() - t0
        dropped = relay.counters["dropped"]
    assert dropped > 0 and took < 15, (dropped, took)


def test_bad_packets_are_dropped_and_counted(aggregator):
    host, port = aggregator.address[len("udp://"):].rsplit(":", 1)
    dest = (host, int(port))
    job = "guarded"
    c = Client(aggregator.address, job=job, rank=0, world_size=2, elements=K)
    good = Header(MsgType.PUSH, job_id=job_id_of(job), index=0, sender=0, dtype=DType.INT32, count=K,
                  world=2, ref=1, flags=Flag.VERSION)
    payload = b"\0" * (4 * K)
    bad_version = bytearray(good.pack() + payload)
    bad_version[2] = 7
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(good.pack() + payload, dest)  # claims rank 0 from another address
            other = Header(MsgType.PUSH, job_id=12345, index=0, sender=0, dtype=DType.INT32, count=K, ref=1)
            s.sendto(other.pack() + payload, dest)  # a job nobody installed
            s.sendto(bytes(bad_version), dest)
            s.sendto(good.pack() + payload[:-4], dest)  # truncated payload
            s.sendto(good.pack()[:30], dest)  # truncated header
            far = Header(MsgType.PUSH, job_id=job_id_of(job), index=100000, sender=0, dtype=DType.INT32, count=K, ref=1)
            s.sendto(far.pack() + payload, dest)  # outside the job's slice
            time.sleep(0.3)
        totals = query_stats(aggregator.address)["totals"]
        assert totals["dropped_not_admitted"] == 1
        assert totals["dropped_unknown_job"] == 1
        assert totals["dropped_version"] == 1
        assert totals["dropped_length"] == 1
        assert totals["dropped_short"] == 1
        assert totals["dropped_index"] == 1
        assert "summed" not in totals  # nothing of it touched a slot
    finally:
        c.close()
    # the aggregator still serves
    check_exact(run(aggregator.address, 2, seed=5), 2, 5)


def _await_totals(address: str, counter: str, at_least: int, timeout: float = 10.0) -> dict:
    """The aggregator's totals once ``counter`` reaches ``at_least``."""
    deadline = time.monotonic() + timeout
    while True:
        totals = query_stats(address)["totals"]
        if totals.get(counter, 0) >= at_least or time.monotonic() > deadline:
            return totals
        time.sleep(0.05)


@pytest.mark.parametrize("io", ["gso", "mmsg", "plain"])
def test_a_datagram_larger_than_any_packet_is_dropped_and_counted_on_every_io_path(io):
    agg = switch("--io", io)
    try:
        host, port = agg.address[len("udp://"):].rsplit(":", 1)
        job = f"big-{uuid.uuid4().hex[:6]}"
        # the largest packets there are (2048 values): a datagram cut to
        # the receive buffer's size would pass for one of the job's
        k = 2048
        with Client(agg.address, job=job, rank=0, world_size=2, elements=k):
            big = Header(MsgType.PUSH, job_id=job_id_of(job), index=0, sender=0, dtype=DType.INT32, count=k,
                         world=2, ref=1, flags=Flag.VERSION)
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.sendto(big.pack() + b"\0" * (4 * k + 800), (host, int(port)))  # more than the largest packet
            totals = _await_totals(agg.address, "dropped_length", 1)
        assert totals.get("dropped_length") == 1, totals
        assert "summed" not in totals
        assert query_stats(agg.address)["io"] == io
    finally:
        agg.stop()


def test_udp_control_answers_are_never_larger_than_an_unsigned_request(aggregator):
    # STATS and HELLO come from anyone, source address forged or not: an
    # answer larger than the request would make the aggregator an amplifier
    host, port = aggregator.address[len("udp://"):].rsplit(":", 1)
    dest = (host, int(port))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(5)
        for t, ok in ((MsgType.HELLO, MsgType.HELLO_OK), (MsgType.STATS, MsgType.STATS_OK)):
            s.sendto(Header(t).pack(), dest)
            data, _ = s.recvfrom(1 << 16)
            assert len(data) <= HEADER_SIZE, (t, len(data))
            needed = padding_asked(wire.unpack_header(data))
            assert needed > HEADER_SIZE
            # padded as asked, the request draws the answer, no larger than it
            padded = Header(t).pack() + bytes(needed + 512 - HEADER_SIZE)
            s.sendto(padded, dest)
            data, _ = s.recvfrom(1 << 16)
            h = wire.unpack_header(data)
            assert h.msg_type == ok and h.count > 0 and len(data) <= len(padded)
    # the client pads by itself
    assert query_stats(aggregator.address)["totals"]["padding_asked"] >= 2


def _hier_run(addresses, seed, job):
    # ranks 0,1 on rack 0 and ranks 2,3 on rack 1: each is member r % 2 of 2
    return run_workers("udp://", 4, lambda r: _worker(r, addresses[r // 2], 4, job, seed, {"member": (r % 2, 2)}),
                       timeout=180)


def test_two_racks_under_a_parent_sum_like_one_aggregator(aggregator):
    parent = switch()
    racks = [switch("--parent", parent.address, "--rack-id", str(i), "--racks", "2") for i in range(2)]
    try:
        res = _hier_run([r.address for r in racks], 21, "hier")
        check_exact(res, 4, 21)
        flat = run(aggregator.address, 4, 21)
        for (x0, y0, _, _), (x1, y1, _, _) in zip(flat, res):
            np.testing.assert_array_equal(x1, x0)
            np.testing.assert_array_equal(y1, y0)
        assert query_stats(parent.address)["totals"]["completed"] > 0
        assert query_stats(racks[0].address)["totals"]["uplink_sent"] > 0
    finally:
        for s in racks + [parent]:
            s.stop()


def test_lost_uplink_packets_are_recovered_through_the_workers(aggregator):
    parent = switch()
    host, port = parent.address[len("udp://"):].rsplit(":", 1)
    with LossyRelay((host, int(port)), 2, drop=0.1, seed=3) as relay:
        racks = [switch("--parent", relay.addresses[i], "--rack-id", str(i), "--racks", "2") for i in range(2)]
        try:
            res = _hier_run([r.address for r in racks], 22, "hier-lossy")
            check_exact(res, 4, 22)
            assert relay.counters["dropped"] > 0
            assert sum(query_stats(r.address)["totals"].get("uplink_resent", 0) for r in racks) > 0
        finally:
            for s in racks:
                s.stop()
    parent.stop()


def _raw_join(sock, dest, name: str, slots: int):
    """One JOIN datagram; the answer's (header, payload)."""
    payload = wire.json_payload({"name": name, "world": 1, "timeout": 5, "slots": slots, "elements": K})
    sock.sendto(Header(MsgType.JOIN, job_id=job_id_of(name), sender=0, world=1).pack_for(payload) + payload, dest)
    while True:
        data, src = sock.recvfrom(1 << 16)
        h = wire.unpack_header(data)
        if h.job_id == job_id_of(name):
            return h, bytes(data[HEADER_SIZE:])


def test_refusals_name_the_real_cause_when_job_rows_or_slots_run_out(aggregator):
    """A JOIN cannot take more than MAX_JOB_SLOTS; once every job row is
    taken (by one-slot jobs, the pool mostly free) the refusal says that,
    not that the pool is full."""
    from aggnet.protocol.limits import MAX_JOB_SLOTS, MAX_JOBS

    host, port = aggregator.address.split("://")[1].rsplit(":", 1)
    dest = (host, int(port))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(5)
        h, payload = _raw_join(s, dest, f"greedy-{uuid.uuid4().hex[:6]}", MAX_JOB_SLOTS + 1)
        assert h.msg_type == MsgType.ERROR and f"gives a job 1..{min(MAX_JOB_SLOTS, 512)}" in wire.parse_error(payload)[1]
        names = [f"row-{i}-{uuid.uuid4().hex[:6]}" for i in range(MAX_JOBS)]
        for name in names:
            h, payload = _raw_join(s, dest, name, 1)
            assert h.msg_type == MsgType.JOIN_OK, wire.parse_error(payload)
        h, payload = _raw_join(s, dest, "one-too-many", 1)
        assert h.msg_type == MsgType.ERROR
        text = wire.parse_error(payload)[1]
        assert f"holds its most jobs ({MAX_JOBS})" in text and "pool" not in text, text
