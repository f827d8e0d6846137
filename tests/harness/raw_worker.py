"""A worker that speaks the service protocol one message at a time, over
the real transport, so that a test can make it do what the client never
does by itself: stop half-way through a round, or ask a restarted shard
again for a round it once had. The client and the shards it meets are
the real ones; only this worker's choices are the test's."""

from __future__ import annotations

import json
import time

import numpy as np

from aggnet.protocol import wire
from aggnet.client.chunked import plan_key
from aggnet.protocol.wire import PLAN_VALUES, DType, Flag, Header, MsgType, job_id_of
from aggnet.transport import connect


class RawWorker:
    def __init__(self, address: str, job: str, rank: int, world: int, timeout: float = 5.0):
        self.job, self.job_id, self.rank, self.world, self.timeout = job, job_id_of(job), rank, world, timeout
        with connect([address]) as ctl:
            ctl.send(0, Header(MsgType.HELLO).pack())
            msg = ctl.recv(10.0)
        assert msg is not None, f"no HELLO_OK from {address}"
        self.shards = json.loads(bytes(msg.payload))["shards"]
        self.conn = connect(self.shards)

    def join(self, shards=None) -> None:
        """JOIN every shard (or those given) and wait for each JOIN_OK."""
        shards = range(len(self.shards)) if shards is None else shards
        payload = wire.json_payload({"name": self.job, "world": self.world, "timeout": self.timeout})
        h = Header(MsgType.JOIN, job_id=self.job_id, sender=self.rank, world=self.world)
        for s in shards:
            self.conn.send(s, h.pack_for(payload), payload)
        waiting = set(shards)
        deadline = time.monotonic() + self.timeout
        while waiting and time.monotonic() < deadline:
            msg = self.conn.recv(max(0.0, deadline - time.monotonic()))
            if msg is not None and wire.unpack_header(msg.header).msg_type == MsgType.JOIN_OK:
                waiting.discard(msg.peer)
        assert not waiting, f"rank {self.rank}: shards {sorted(waiting)} did not answer JOIN within {self.timeout}s"

    def plan(self, round_: int, size: int, lag: int = 1, key=None) -> None:
        """This worker's part of round ``round_``'s buffer-size agreement
        for a float32 buffer of ``size`` elements under ``key``."""
        mine = np.array([size >> 31, size & 0x7FFFFFFF, int(DType.FLOAT32), plan_key(key)], np.int32)
        payload = np.concatenate([mine, -mine, np.array([lag], np.int32)])
        assert payload.size == PLAN_VALUES
        h = Header(MsgType.PUSH, job_id=self.job_id, round=round_, index=wire.PLAN_INDEX, sender=self.rank,
                   flags=Flag.OP_MAX | Flag.LITTLE_ENDIAN, dtype=DType.INT32, count=PLAN_VALUES, world=self.world)
        self.conn.send(round_ % len(self.shards), h.pack(), payload)

    def push(self, shard: int, round_: int, index: int, offset: int, values: np.ndarray) -> None:
        """This worker's float32 part of one chunk."""
        values = np.ascontiguousarray(values, np.float32)
        h = Header(MsgType.PUSH, job_id=self.job_id, round=round_, index=index, sender=self.rank,
                   flags=Flag.LITTLE_ENDIAN, dtype=DType.FLOAT32, count=values.size, world=self.world,
                   offset=offset)
        self.conn.send(shard, h.pack(), values)

    def expect(self, msg_type: MsgType, shard: int | None = None, index: int | None = None):
        """The next message of ``msg_type`` (from ``shard``, for chunk
        ``index``): (header, payload bytes); others are skipped."""
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            msg = self.conn.recv(max(0.0, deadline - time.monotonic()))
            if msg is None:
                continue
            h = wire.unpack_header(msg.header)
            if h.msg_type == msg_type and (shard is None or msg.peer == shard) and \
                    (index is None or h.index == index):
                return h, bytes(msg.payload)
        raise AssertionError(f"rank {self.rank}: no {msg_type.name} (shard {shard}, index {index}) within "
                             f"{self.timeout}s")

    def close(self) -> None:
        self.conn.close()
