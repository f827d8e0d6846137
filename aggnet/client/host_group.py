"""Workers on one host combine their sparse rows before the network.

Parallax (EuroSys'19) aggregates a machine's sparse gradients locally
before they reach the parameter servers: the rows that several workers of a
host touch then cross the network once, and each server waits for one push
per host instead of one per worker. aggnet does the same: the host's first
worker (local rank 0, the *leader*) takes the rows of the other workers of
its host over a Unix socket, sums them with its own (in local-rank order, so
the bits do not depend on timing) and pushes one round for the host. The
shards answer every worker directly, so a follower only hands its rows over
and then waits for the same answer it would have got by pushing itself.

A group comes from torchrun's environment (``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``: ranks ``node * local_size ..``),
from the worker's arguments, or not at all (``AGGNET_SPARSE_COMBINE=0``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import time
from dataclasses import dataclass

import numpy as np

from aggnet.protocol import sparse_layout
from aggnet.errors import AggregationTimeout, AggregatorUnreachable

log = logging.getLogger("aggnet.sparse")

#: a follower's message: magic, table id, round, local rank, rows
_HEAD = struct.Struct("<4sIIHI")
_MAGIC = b"AGHG"
#: rounds ahead of its own for which a leader keeps followers' rows
MAX_EARLY = 64


@dataclass(frozen=True)
class HostGroup:
    """The workers of one host: host ``node`` of ``nodes``, this worker
    ``local_rank`` of ``local_size``; ranks are numbered host by host, as
    torchrun numbers them."""
    node: int
    nodes: int
    local_rank: int
    local_size: int

    def __post_init__(self):
        if not (0 <= self.node < self.nodes and 0 <= self.local_rank < self.local_size):
            raise ValueError(f"a host group needs 0 <= node < nodes and 0 <= local_rank < local_size, got {self}")

    @property
    def leader(self) -> bool:
        return self.local_rank == 0

    def rank(self) -> int:
        return self.node * self.local_size + self.local_rank

    @classmethod
    def from_env(cls, rank: int, world_size: int) -> "HostGroup | None":
        """The group torchrun describes, or None: one worker per host,
        combining switched off (``AGGNET_SPARSE_COMBINE=0``), or ranks not
        numbered host by host (said in the log)."""
        if os.environ.get("AGGNET_SPARSE_COMBINE", "1").strip().lower() in ("0", "no", "off", "false"):
            return None
        try:
            local_rank = int(os.environ["LOCAL_RANK"])
            local_size = int(os.environ["LOCAL_WORLD_SIZE"])
            node = int(os.environ["GROUP_RANK"])
        except (KeyError, ValueError):
            return None
        if local_size <= 1:
            return None
        if world_size % local_size or node * local_size + local_rank != rank:
            log.info("rank %d: sparse rows are not combined per host: LOCAL_WORLD_SIZE=%d, GROUP_RANK=%d and "
                     "LOCAL_RANK=%d do not number %d workers host by host", rank, local_size, node, local_rank,
                     world_size)
            return None
        return cls(node, world_size // local_size, local_rank, local_size)


def channel_path(service: str, job: str, table: str, node: int) -> str:
    """The Unix socket of a host's leader for one table: one per (service,
    job, table, host), in aggnet's private runtime directory."""
    from aggnet.client.embedded import runtime_dir

    tag = hashlib.sha1(f"{service}\0{job}\0{table}".encode()).hexdigest()[:16]
    return os.path.join(runtime_dir(), f"rows-{tag}-{node}.sock")


class LocalChannel:
    """The followers-to-leader path of one table in one host group. Used
    from the sparse client's one I/O thread only (zmq sockets are not
    thread-safe)."""

    def __init__(self, group: HostGroup, path: str, shape: tuple[int, int], table_id: int,
                 counters: dict | None = None):
        import zmq

        self.group = group
        self.path = path
        self.shape = shape
        self.table_id = table_id
        self._ctx = zmq.Context.instance()
        self._zmq = zmq
        if group.leader:
            self._sock = self._ctx.socket(zmq.PULL)
            self._sock.bind(f"ipc://{path}")
        else:
            self._sock = self._ctx.socket(zmq.PUSH)
            self._sock.setsockopt(zmq.LINGER, 1000)
            self._sock.connect(f"ipc://{path}")
        #: rows that came early: round -> {local rank: (indices, rows)}
        self._early: dict[int, dict[int, tuple[np.ndarray, np.ndarray]]] = {}
        self.counters = counters if counters is not None else {}
        self.bytes_local = 0

    def hand(self, rnd: int, idx: np.ndarray, rows: np.ndarray, timeout: float) -> None:
        """A follower's rows of a round, to its leader."""
        self._sock.setsockopt(self._zmq.SNDTIMEO, max(1, int(timeout * 1000)))
        head = _HEAD.pack(_MAGIC, self.table_id, rnd & 0xFFFFFFFF, self.group.local_rank, idx.size)
        try:
            self._sock.send_multipart([head, np.ascontiguousarray(idx, sparse_layout.INDEX_DTYPE),
                                       np.ascontiguousarray(rows, sparse_layout.ROW_DTYPE)], copy=False)
        except self._zmq.Again:
            raise AggregatorUnreachable(
                f"local rank {self.group.local_rank} of host {self.group.node}: the host's first worker (local rank "
                f"0) took no rows within {timeout:g}s at {self.path}; is it running, with the same job and "
                f"service?") from None
        self.bytes_local += idx.nbytes + rows.nbytes

    def collect(self, rnd: int, timeout: float, what: str) -> list:
        """The leader's wait for every follower's rows of a round: [(indices,
        rows)] in local-rank order. Malformed messages are dropped and
        counted, and so are rows of a round already given up (a follower
        that came too late); rows of a later round wait for their turn."""
        key = rnd & 0xFFFFFFFF
        want = self.group.local_size - 1
        got = self._early.pop(key, {})
        deadline = time.monotonic() + timeout
        while len(got) < want:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [r for r in range(1, self.group.local_size) if r not in got]
                raise AggregationTimeout(
                    f"host {self.group.node}, local rank 0: {what}: local rank(s) {missing} of this host handed "
                    f"no rows within {timeout:g}s; are all {self.group.local_size} workers of the host "
                    f"stepping the table together?")
            if not self._sock.poll(int(min(left, 0.5) * 1000) + 1):
                continue
            parsed = self._parse(self._sock.recv_multipart(copy=False))
            if parsed is None:
                continue
            k, local, idx, rows = parsed
            if k == key:
                slot = got
            elif (k - key) & 0xFFFFFFFF < MAX_EARLY:
                slot = self._early.setdefault(k, {})
            else:
                self._count("late")
                continue
            if local in slot:
                self._count("duplicate")
                continue
            slot[local] = (idx, rows)
            self.bytes_local += idx.nbytes + rows.nbytes
        return [got[r] for r in sorted(got)]

    def _count(self, why: str) -> None:
        self.counters[f"dropped_local_{why}"] = self.counters.get(f"dropped_local_{why}", 0) + 1
        log.debug("host %d leader dropped a local message: %s", self.group.node, why)

    def _parse(self, frames):
        def drop(why: str):
            self._count(why)
            return None

        if len(frames) != 3 or len(frames[0].bytes) != _HEAD.size:
            return drop("malformed")
        magic, table_id, rnd, local, n = _HEAD.unpack(frames[0].bytes)
        if magic != _MAGIC or not 1 <= local < self.group.local_size:
            return drop("malformed")
        if table_id != self.table_id:
            return drop("unknown_table")
        nrows, width = self.shape
        idx_buf, row_buf = frames[1].buffer, frames[2].buffer
        if len(idx_buf) != n * sparse_layout.INDEX_DTYPE.itemsize or len(row_buf) != n * width * 4:
            return drop("width")
        idx = np.frombuffer(idx_buf, sparse_layout.INDEX_DTYPE)
        rows = np.frombuffer(row_buf, sparse_layout.ROW_DTYPE).reshape(n, width)
        if n and (idx.min() < 0 or idx.max() >= nrows or not np.isfinite(rows).all()):
            return drop("rows")
        return rnd, local, idx, rows

    def close(self) -> None:
        self._sock.close(linger=0 if self.group.leader else 1000)
        if self.group.leader:
            try:
                os.unlink(self.path)
            except OSError:
                pass
