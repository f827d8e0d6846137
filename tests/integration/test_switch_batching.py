"""The batched switch path: every UDP I/O mode, a sharded aggregator whose
job slices span shards, a window shared by overlapping all-reduces, and
elements/slots agreed at JOIN. Real processes and sockets on loopback."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from aggnet import Client
from aggnet.errors import JobMismatch
from aggnet.processes import ServiceProcess
from aggnet.client.switch import query_stats
from aggnet.transport import mmsg
from aggnet.transport.udp import DatagramSocket

from harness.helpers import run_workers
from test_switch_protocol import check_exact, data


def _job() -> str:
    return f"b-{uuid.uuid4().hex[:6]}"


def switch(*args) -> ServiceProcess:
    return ServiceProcess("udp://127.0.0.1:0", args=["--mode", "switch", *args])


def _sum_worker(rank, address, world, job, seed, opts):
    x, y = data(rank, seed)
    with Client(address, job=job, rank=rank, world_size=world, timeout=30, **opts) as c:
        c.allreduce(x).result(120)
        c.allreduce(y).result(120)
        small = np.full(5, rank + 1, np.float32)
        c.allreduce(small, op="avg").result(120)
        return x, y, small, c.stats.retransmissions, c.io, c.elements, c.slots


def run(address, world, seed, **opts):
    return run_workers("udp://", world, _sum_worker, address, world, _job(), seed, opts, timeout=180)


IO_OK = {"gso": True, "mmsg": mmsg.available(), "plain": True}


@pytest.mark.parametrize("io", ["gso", "mmsg", "plain"])
def test_every_udp_io_mode_sums_exactly(io):
    if not IO_OK[io]:
        pytest.skip(f"{io} I/O is not available on this kernel/libc")
    probe = DatagramSocket(("127.0.0.1", 0), io=io)
    got_io = probe.io
    probe.close()
    if got_io != io:
        pytest.skip(f"this kernel offers no {io} I/O (got {got_io})")
    agg = switch("--io", io, "--pool", "512", "--elements", "64")
    try:
        res = run(agg.address, 3, seed=11, udp_io=io, elements=64)
        check_exact([r[:4] for r in res], 3, 11)
        assert {r[4] for r in res} == {io}
        assert query_stats(agg.address)["io"] == io
    finally:
        agg.stop()


def test_the_same_sums_whatever_the_io_mode():
    """Batching changes how datagrams move, never what they carry."""
    agg = switch("--pool", "512", "--elements", "64")
    try:
        modes = [m for m in ("gso", "mmsg", "plain") if IO_OK[m]]
        results = [run(agg.address, 2, seed=12, udp_io=m, elements=64) for m in modes]
        for other in results[1:]:
            for a, b in zip(results[0], other):
                np.testing.assert_array_equal(a[0], b[0])
                np.testing.assert_array_equal(a[1], b[1])
    finally:
        agg.stop()


def test_a_job_slice_spanning_shards_sums_exactly():
    # pool 256 over 2 shards: 128 slots each; the job's 200 slots span both
    agg = switch("--shards", "2", "--pool", "256", "--elements", "64")
    try:
        res = run(agg.address, 3, seed=13, elements=64, slots=200)
        check_exact([r[:4] for r in res], 3, 13)
        st = query_stats(agg.address)
        assert st["shards"] == 2 and st["shard_slots"] == 128
        summed = [shard.get("summed", 0) for shard in st["per_shard"]]
        assert all(s > 0 for s in summed), f"every shard should have summed its part of the slice: {summed}"
        assert st["totals"].get("dropped_other_shard", 0) == 0
    finally:
        agg.stop()


def test_a_packet_sent_to_the_wrong_shard_is_dropped_and_counted():
    from aggnet.protocol.wire import job_id_of
    from aggnet.protocol.wire import DType, Header, MsgType

    agg = switch("--shards", "2", "--pool", "256", "--elements", "64")
    try:
        job = _job()
        with Client(agg.address, job=job, rank=0, world_size=2, elements=64, slots=200) as c:
            host, port = agg.address[len("udp://"):].rsplit(":", 1)
            s = c.dsock.sock
            # slot 150 lives on shard 1 (port + 1): send it to shard 0
            h = Header(MsgType.PUSH, job_id=job_id_of(job), index=150, sender=0, dtype=DType.INT32, count=64,
                       ref=1, world=2)
            s.sendto(h.pack() + bytes(256), (host, int(port)))
            for _ in range(50):
                st = query_stats(agg.address)
                if st["totals"].get("dropped_other_shard"):
                    break
            assert st["totals"]["dropped_other_shard"] == 1
            assert st["per_shard"][0]["dropped_other_shard"] == 1
    finally:
        agg.stop()


def _overlapping_worker(rank, address, world, job, sizes):
    rng = np.random.default_rng(rank)
    bufs = []
    for i, n in enumerate(sizes):
        if i % 3 == 2:
            bufs.append(rng.integers(-(2**20), 2**20, n).astype(np.int32))
        else:
            bufs.append((rng.integers(-1000, 1000, n) / 8).astype(np.float32))  # exact in the quantized sum
    originals = [b.copy() for b in bufs]
    with Client(address, job=job, rank=rank, world_size=world, timeout=30, elements=64, slots=64) as c:
        futures = [c.allreduce(b) for b in bufs]  # all in flight at once
        for f in futures:
            f.result(120)
    return originals, bufs


def test_overlapping_allreduces_share_the_window_and_stay_exact():
    """Buckets smaller and larger than the window, float and int, submitted
    without waiting: each slot serves them in order on every worker."""
    sizes = [5, 64 * 64 * 3 + 7, 1, 200, 64 * 10, 64 * 64, 3, 5000, 64 * 64 * 2 + 1, 77, 640, 12345]
    agg = switch("--pool", "512", "--elements", "64")
    try:
        res = run_workers("udp://", 3, _overlapping_worker, agg.address, 3, _job(), sizes, timeout=180)
        for i in range(len(sizes)):
            want = sum(res[r][0][i].astype(np.float64) for r in range(3))
            for r in range(3):
                np.testing.assert_array_equal(res[r][1][i].astype(np.float64), want)
    finally:
        agg.stop()


def test_elements_and_slots_are_agreed_at_join():
    agg = switch("--pool", "1024")
    try:
        with Client(agg.address, job=_job(), rank=0, world_size=1) as c:
            assert c.elements == 2048  # the host's default, which loopback's MTU fits
            assert 16 <= c.slots <= 256  # about 1 MiB in flight, a quarter of the pool at most
            x = np.arange(100_000, dtype=np.int32)
            c.allreduce(x).result(30)
            np.testing.assert_array_equal(x, np.arange(100_000))
        job = _job()
        with Client(agg.address, job=job, rank=0, world_size=2, elements=100, slots=40) as a:
            assert (a.elements, a.slots) == (100, 40)
            with Client(agg.address, job=job, rank=1, world_size=2) as b:  # asks nothing: takes the job's
                assert (b.elements, b.slots) == (100, 40)
            with pytest.raises(JobMismatch, match="100 elements per packet"):
                Client(agg.address, job=job, rank=1, world_size=2, elements=64, connect_timeout=5)
    finally:
        agg.stop()


def _tree_worker(rank, addresses, seed, job):
    x, y = data(rank, seed)
    # ranks 0,1 on rack 0 and ranks 2,3 on rack 1
    with Client(addresses[rank // 2], job=job, rank=rank, world_size=4, member_rank=rank % 2, members=2,
                timeout=30, elements=64, slots=200) as c:
        c.allreduce(x).result(120)
        c.allreduce(y).result(120)
        small = np.full(5, rank + 1, np.float32)
        c.allreduce(small, op="avg").result(120)
        return x, y, small, c.stats.retransmissions


def test_sharded_racks_under_a_sharded_parent_sum_exactly():
    """Each rack's slice spans its two shards and the parent's spans its
    own: partials go up from the shard that owns a slot to the parent's
    shard that owns it, and finals come back the same way."""
    parent = switch("--shards", "2", "--pool", "256", "--elements", "64")
    racks = [switch("--shards", "2", "--pool", "256", "--elements", "64", "--parent", parent.address,
                    "--rack-id", str(i), "--racks", "2") for i in range(2)]
    try:
        res = run_workers("udp://", 4, _tree_worker, [r.address for r in racks], 31, _job(), timeout=180)
        check_exact([res[r] for r in range(4)], 4, 31)
        top = query_stats(parent.address)
        assert all(s.get("completed", 0) > 0 for s in top["per_shard"])
        for rack in racks:
            st = query_stats(rack.address)
            assert all(s.get("uplink_sent", 0) > 0 for s in st["per_shard"])
            assert all(s.get("finals", 0) > 0 for s in st["per_shard"])
            assert st["totals"].get("dropped_not_admitted", 0) == 0
    finally:
        for s in racks + [parent]:
            s.stop()


def test_a_join_whose_shard_layout_points_outside_its_ports_is_refused():
    """A member's layout decides where results go: one that would send them
    to another host's address (a port past 65535 spills into the IP) is
    refused, and the aggregator keeps serving."""
    import socket

    from aggnet.protocol import wire
    from aggnet.protocol.wire import job_id_of
    from aggnet.protocol.wire import HEADER_SIZE, Header, MsgType

    agg = switch("--pool", "256", "--elements", "64")
    try:
        host, port = agg.address[len("udp://"):].rsplit(":", 1)
        job = _job()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind(("127.0.0.1", 0))
            s.settimeout(5)
            body = wire.json_payload({"name": job, "slots": 16})
            h = Header(MsgType.JOIN, job_id=job_id_of(job), sender=0, world=2, offset=1 << 40, ref=1)
            s.sendto(h.pack_for(body) + body, (host, int(port)))
            reply, _ = s.recvfrom(65536)
            h = wire.unpack_header(reply)
            assert h.msg_type == MsgType.ERROR
            code, text = wire.parse_error(memoryview(reply)[HEADER_SIZE:])
            assert code == "malformed" and "shard layout" in text
        check_exact([r[:4] for r in run(agg.address, 2, seed=14, elements=64)], 2, 14)
    finally:
        agg.stop()
