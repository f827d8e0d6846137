"""A shard's state: jobs, their members, and the slots being summed.

A slot is one (round, chunk) of one job: an accumulator, the bitmap of
workers already summed into it, and what every contribution must agree on
(dtype, element count, offset, exponent). Accumulators come from a pool so
that steady-state aggregation allocates nothing.
"""

from __future__ import annotations

import collections
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from aggnet.shm import Segment
from aggnet.wire import DType

#: how many finished (round, chunk) keys a job remembers, so that a late or
#: duplicated contribution is recognized and dropped instead of opening a
#: slot that would never complete
DONE_MEMORY = 8192

#: accumulator dtype per wire dtype: 16-bit floats are summed in float32
ACC_DTYPE = {
    DType.FLOAT32: np.float32,
    DType.INT32: np.int32,
    DType.FLOAT16: np.float32,
    DType.BFLOAT16: np.float32,
    DType.INT16: np.int16,
}


class BufferPool:
    """Reusable byte buffers for accumulators and outgoing results.

    A buffer handed to a zero-copy transport stays referenced by that
    transport until the bytes have left; the pool reuses a buffer only when
    nothing but the pool refers to it any more (CPython's reference count
    says so exactly), so a result is never overwritten while being sent.
    """

    def __init__(self, capacity: int = 0):
        self.capacity = capacity
        self._idle: list[np.ndarray] = []
        self.allocated = 0

    def take(self, nbytes: int) -> np.ndarray:
        if nbytes > self.capacity:
            # chunks grew (a client with a larger chunk size): start over
            self.capacity = nbytes
            self._idle.clear()
        idle = self._idle
        for i in range(len(idle) - 1, -1, -1):
            # references: the list, getrefcount's argument
            if sys.getrefcount(idle[i]) <= 2:
                return idle.pop(i)
        self.allocated += 1
        return np.empty(self.capacity, np.uint8)

    def give(self, buf: np.ndarray) -> None:
        if buf.size == self.capacity and len(self._idle) < 1024:
            self._idle.append(buf)


@dataclass(eq=False)
class Slot:
    key: tuple
    dtype: DType
    count: int
    offset: int
    exponent: int
    op_max: bool
    buf: np.ndarray | None  # pool buffer behind acc (None: acc lives in shared memory)
    acc: np.ndarray
    ref: int = 0  #: the chunk's per-shard sequence number (shared-memory slots)
    first_seen: float = field(default_factory=time.monotonic)
    seen: int = 0  #: bitmap of ranks summed in
    nsum: int = 0
    next_exponent: int = -32768  #: MAX of the senders' next_exponent


@dataclass(eq=False)
class Job:
    job_id: int
    name: str
    world: int
    stall_timeout: float
    members: dict = field(default_factory=dict)  #: rank -> transport peer
    slots: dict = field(default_factory=dict)  #: (round, index, op) -> Slot
    done: collections.OrderedDict = field(default_factory=collections.OrderedDict)
    #: shared-memory rings of the job on this shard, and the ranks using them
    segment: "Segment | None" = None
    shm_members: set = field(default_factory=set)

    def remember_done(self, key) -> None:
        self.done[key] = None
        if len(self.done) > DONE_MEMORY:
            self.done.popitem(last=False)

    def missing(self, seen: int) -> list[int]:
        return [r for r in range(self.world) if not seen >> r & 1]

    def present(self, seen: int) -> list[int]:
        return [r for r in range(self.world) if seen >> r & 1]
