"""All-reduces that survive an aggregator shard's restart, and buffers that
are all or nothing: real `aggnet serve --restart` processes whose shards
are killed with SIGKILL mid-round, over real sockets."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest

from aggnet import Client, kernels
from aggnet.client.codec import Quantized
from aggnet.client.chunked import KEEP_CHUNKS
from aggnet.client.stats import query
from aggnet.errors import AggregationError, AggregationTimeout
from aggnet.processes import ServiceProcess
from aggnet.protocol.wire import DType, Flag, Header, MsgType
from aggnet.bench.soak import kill_shard
from harness.raw_worker import RawWorker

pytestmark = pytest.mark.timeout(180)

CPU = kernels.load("cpu")


def _job() -> str:
    return f"r-{uuid.uuid4().hex[:8]}"


class OwnerQuantized:
    """A float32 buffer all-reduced with the int32 codec, quantized by its
    owner (as a GPU bucket is on its device), here with the CPU kernels."""

    def __init__(self, client: Client, buf: np.ndarray):
        self.buf, self.world, self.block = buf, client.world_size, client.chunk_bytes // 4
        exps = np.empty(-(-buf.size // self.block), np.int16)
        CPU.block_exponents(buf, self.block, exps)
        self.q = np.empty(buf.size, np.int32)
        self.future = client.allreduce(self.q, codec="int32", _quantized=Quantized(exps, self.quantize))

    def _parts(self, chunks=None):
        for i in range(self.agreed.size) if chunks is None else chunks:
            yield slice(i * self.block, (i + 1) * self.block), kernels.quant_shift(int(self.agreed[i]), self.world)

    def quantize(self, agreed, chunks):
        self.agreed = agreed
        for part, shift in self._parts(chunks):
            CPU.quantize(self.buf[part], shift, self.q[part], False)

    def result(self, timeout: float):
        self.future.result(timeout=timeout)
        for part, shift in self._parts():
            CPU.dequantize(self.q[part], shift, self.buf[part], False)


@pytest.mark.parametrize("codec, scheme", [(None, "zmq+tcp"), ("int32", "zmq+tcp"), ("owner-int32", "zmq+tcp"),
                                           (None, "tcp")])
def test_an_allreduce_in_flight_finishes_on_the_restarted_shard(codec, scheme):
    """Rank 0's round waits for rank 1 when a shard dies: the shard's
    successor takes both ranks back and the same round completes exactly
    (with ``owner-int32`` rank 0 quantizes its buffer itself, as a GPU
    bucket is, once its exponents are agreed). Over tcp:// too: a worker
    dials the successor itself and hears the old connection close."""
    with ServiceProcess(f"{scheme}://127.0.0.1:0", shards=2, args=["--restart"]) as svc:
        job = _job()
        clients = [Client(svc.address, job=job, rank=r, world_size=2, timeout=20, chunk_bytes=64 << 10)
                   for r in range(2)]
        try:
            rng = np.random.default_rng(7)
            inputs = [rng.standard_normal(1 << 18).astype(np.float32) for _ in range(2)]
            bufs = [x.copy() for x in inputs]
            if codec == "owner-int32":
                codec = "int32"
                first = OwnerQuantized(clients[0], bufs[0])
            else:
                first = clients[0].allreduce(bufs[0], codec=codec)
            kill_shard(svc.address, 1)
            assert not (first.future if isinstance(first, OwnerQuantized) else first).done()
            second = clients[1].allreduce(bufs[1], codec=codec)
            first.result(timeout=60)
            second.result(timeout=60)
            # the reference: the same round on a service that nobody killed
            ref_job = _job()
            ref = [Client(svc.address, job=ref_job, rank=r, world_size=2, chunk_bytes=64 << 10) for r in range(2)]
            try:
                expected = [x.copy() for x in inputs]
                for f in [c.allreduce(b, codec=codec) for c, b in zip(ref, expected)]:
                    f.result(timeout=60)
            finally:
                for c in ref:
                    c.close()
            for b, e in zip(bufs, expected):
                np.testing.assert_array_equal(b, e)
            np.testing.assert_array_equal(bufs[0], bufs[1])
            assert all(c.stats.rejoins >= 1 for c in clients), [c.stats.rejoins for c in clients]
            # and the job goes on
            more = [np.full(1000, r + 1, np.float32) for r in range(2)]
            for f in [c.allreduce(b) for c, b in zip(clients, more)]:
                f.result(timeout=60)
            assert all((b == 3).all() for b in more)
        finally:
            for c in clients:
                c.close()
        assert svc.alive()


def test_a_worker_that_finished_a_round_replays_its_result_to_the_restarted_shard():
    """Rank 0 (the client) has round 1's result; rank 1 never got it before
    the shard died. Rank 1 asks the successor for round 1 again and gets
    the very result rank 0 has, from rank 0's replay: the successor never
    saw rank 0's part of that round."""
    with ServiceProcess("zmq+tcp://127.0.0.1:0", shards=1, args=["--restart"]) as svc:
        job = _job()
        client = Client(svc.address, job=job, rank=0, world_size=2, timeout=20)
        raw = RawWorker(svc.address, job, rank=1, world=2, timeout=20)
        try:
            raw.join()
            mine = np.arange(1000, dtype=np.float32) * 0.1
            theirs = np.linspace(-1, 1, 1000, dtype=np.float32)
            buf = mine.copy()
            fut = client.allreduce(buf)
            raw.plan(1, theirs.size)
            raw.push(0, 1, 0, 0, theirs)
            fut.result(timeout=30)
            raw.expect(MsgType.RESULT, index=0)  # it got it, and acts as if it had not
            kill_shard(svc.address, 0)
            raw.join()
            raw.push(0, 1, 0, 0, theirs)
            h, payload = raw.expect(MsgType.RESULT, index=0)
            assert h.round == 1
            np.testing.assert_array_equal(np.frombuffer(payload, np.float32), buf)
            shard = query(svc.address)["shards"][0]["counters"]
            assert shard.get("finals_replayed", 0) >= 1, shard
            assert client.stats.rejoins == 1
        finally:
            raw.close()
            client.close()


def test_a_worker_keeps_only_what_another_may_lack():
    """Results of rounds a later agreement shows every worker finished are
    not kept, nor chunks older than the last few (a worker can lack at most
    a window of a shard's chunks): a shard that restarts after three
    rounds of 40 chunks is sent the last round's agreement and 16 chunks."""
    with ServiceProcess("zmq+tcp://127.0.0.1:0", shards=1, args=["--restart"]) as svc:
        job = _job()
        clients = [Client(svc.address, job=job, rank=r, world_size=2, timeout=20, chunk_bytes=1024)
                   for r in range(2)]
        try:
            for _ in range(3):
                bufs = [np.ones(10_240, np.float32) for _ in range(2)]
                for f in [c.allreduce(b) for c, b in zip(clients, bufs)]:
                    f.result(timeout=30)
            kill_shard(svc.address, 0)
            bufs = [np.ones(10_240, np.float32) for _ in range(2)]
            for f in [c.allreduce(b) for c, b in zip(clients, bufs)]:
                f.result(timeout=30)
            assert all((b == 2).all() for b in bufs)
            counters = query(svc.address)["shards"][0]["counters"]
            replayed = counters.get("finals_replayed", 0) + counters.get("dropped_duplicate_final", 0)
            assert replayed == 2 * (KEEP_CHUNKS + 1), counters
        finally:
            for c in clients:
                c.close()


def test_a_failed_allreduce_leaves_the_buffer_as_given():
    """Half of a round's chunks come back, the other half never can: the
    round fails and the caller's buffer holds its input, not half a sum."""
    with ServiceProcess("zmq+tcp://127.0.0.1:0", shards=2) as svc:
        job = _job()
        client = Client(svc.address, job=job, rank=0, world_size=2, timeout=4, chunk_bytes=4096)
        raw = RawWorker(svc.address, job, rank=1, world=2)
        try:
            raw.join()
            given = np.arange(4096, dtype=np.float32)
            buf = given.copy()
            fut = client.allreduce(buf)
            raw.plan(1, buf.size)
            # round 1 puts chunk c on shard (c + 1) % 2: rank 1 sends shard 0's chunks only
            for index in range(4):
                if (index + 1) % 2 == 0:
                    raw.push(0, 1, index, index * 1024, np.ones(1024, np.float32))
            for index in (1, 3):
                raw.expect(MsgType.RESULT, index=index)  # rank 0 had these written in
            with pytest.raises(AggregationTimeout):
                fut.result(timeout=60)
            np.testing.assert_array_equal(buf, given)
        finally:
            raw.close()
            client.close()


def test_without_resume_a_restart_fails_the_round_naming_the_shard():
    with ServiceProcess("zmq+tcp://127.0.0.1:0", shards=2, args=["--restart"]) as svc:
        job = _job()
        clients = [Client(svc.address, job=job, rank=r, world_size=2, timeout=3, resume=False) for r in range(2)]
        try:
            given = [np.full(400_000, r + 1, np.float32) for r in range(2)]
            bufs = [g.copy() for g in given]
            first = clients[0].allreduce(bufs[0])
            kill_shard(svc.address, 1)
            second = clients[1].allreduce(bufs[1])
            errors = []
            for f in (first, second):
                try:
                    f.result(timeout=30)
                except (AggregationError, AggregationTimeout) as exc:
                    errors.append(str(exc))
            assert len(errors) == 2 and all("shard" in e for e in errors), errors
            for b, g in zip(bufs, given):
                np.testing.assert_array_equal(b, g)
            bufs = [np.full(400_000, r + 1, np.float32) for r in range(2)]
            for f in [c.allreduce(b) for c, b in zip(clients, bufs)]:
                f.result(timeout=60)
            assert all((b == 3).all() for b in bufs)
        finally:
            for c in clients:
                c.close()


def test_a_final_that_disagrees_with_the_open_chunk_is_refused_and_the_shard_goes_on():
    with ServiceProcess("zmq+tcp://127.0.0.1:0", shards=1) as svc:
        job = _job()
        a = RawWorker(svc.address, job, rank=0, world=2)
        b = RawWorker(svc.address, job, rank=1, world=2)
        try:
            a.join()
            b.join()
            a.push(0, 5, 0, 0, np.ones(100, np.float32))
            # two connections: the chunk is open only once the shard has
            # a's PUSH, which may come after b's FINAL if sent at once
            deadline = time.monotonic() + 10
            while query(svc.address)["shards"][0]["counters"].get("pushes", 0) < 1:
                assert time.monotonic() < deadline, "the shard never counted rank 0's PUSH"
                time.sleep(0.02)
            bad = Header(MsgType.PUSH, job_id=b.job_id, round=5, index=0, sender=1,
                         flags=Flag.LITTLE_ENDIAN | Flag.FINAL, dtype=DType.FLOAT32, count=50,
                         world=2)
            b.conn.send(0, bad.pack(), np.zeros(50, np.float32))
            h, _ = a.expect(MsgType.ERROR, index=0)
            assert h.round == 5
            counters = query(svc.address)["shards"][0]["counters"]
            assert counters.get("dropped_mismatch", 0) == 1 and not counters.get("internal_error"), counters
        finally:
            a.close()
            b.close()
