"""A shard's state: jobs, their members, and the slots being summed.

A slot is one (round, chunk) of one job: an accumulator, the bitmap of
workers already summed into it, and what every contribution must agree on
(dtype, element count, offset, exponent). Accumulators come from a pool
(:mod:`aggnet.buffers`) so that steady-state aggregation allocates nothing.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

import numpy as np

from aggnet.hosts.parent import Standing
from aggnet.protocol.replay import KeptResults
from aggnet.transport.shm import Segment, SharedBuffer
from aggnet.protocol.wire import DType

#: how many finished (round, chunk) keys a job remembers, so that a late or
#: duplicated contribution is recognized and dropped instead of opening a
#: slot that would never complete
DONE_MEMORY = 8192
#: bytes of replayed results (FINAL pushes) a job keeps for members that
#: have not asked for them yet; the oldest go first past this
FINALS_BYTES = 256 << 20
#: a rack under a root keeps the root's last finals of chunks for a root
#: that restarts (another rack lacks at most those of its open partials,
#: which its workers' windows bound)
KEEP_UP_CHUNKS = 64

#: rounds' shared buffers (SHARE) a job remembers at most: a record goes
#: once its chunks are read, so only failed rounds' linger, oldest first out
SHARED_ROUNDS = DONE_MEMORY
#: shared buffers a job keeps mapped at most, the least recently named
#: unmapped first (a worker names the same few every step)
SHARED_MAPS = 1024

#: accumulator dtype per wire dtype: 16-bit floats are summed in float32
ACC_DTYPE = {
    DType.FLOAT32: np.float32,
    DType.INT32: np.int32,
    DType.FLOAT16: np.float32,
    DType.BFLOAT16: np.float32,
    DType.INT16: np.int16,
}


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
    #: a rack's partial went to the root; the slot waits for the final
    sent_up: bool = False
    #: the one rank that receives the result (a reduce-scatter's chunk), or None: all
    owner: int | None = None


@dataclass(eq=False)
class SharedRound:
    """Where a member's buffer of one round lies in its shared memory
    (its SHARE): what is left to read there and to write back."""

    buffer: "SharedBuffer | None"  #: None: the SHARE was refused (the round's chunks are dropped)
    start: int = 0  #: byte of the segment where the round's buffer begins
    reads_left: int = 0  #: its chunks on this shard not read yet
    writes_left: int = 0  #: results still to write there (0: the member copies them itself)
    multiplier: float = 1.0  #: applied as they are written (an average's 1/N)

    @property
    def done(self) -> bool:
        return self.reads_left <= 0 and self.writes_left <= 0


#: a member heard from this recently is running: another connection's JOIN
#: for its rank is a second run under the same job name, not a restart
LIVE_SECONDS = 5.0


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
    #: (rank, round) -> SharedRound: where that member's buffer of the round lies
    shared: collections.OrderedDict = field(default_factory=collections.OrderedDict)
    #: segment name -> the SharedBuffer mapped from it
    shared_maps: collections.OrderedDict = field(default_factory=collections.OrderedDict)
    #: (round, index, op) -> ERROR payload of slots given up (stall,
    #: mismatch, a member left), for the ranks whose part comes later
    abandoned: collections.OrderedDict = field(default_factory=collections.OrderedDict)
    #: ranks that left while the job went on (a chunk can no longer
    #: complete), and how each went, for the others' errors
    departed: dict = field(default_factory=dict)
    #: messages and bytes of this job (STATS, metrics)
    counters: collections.Counter = field(default_factory=collections.Counter)
    #: a rack under a root: whether the root took the job, and the
    #: members' JOIN_OKs held until it does
    parent: Standing = field(default_factory=Standing)
    #: every member of the job joins here (hosts.parent.whole_here): it
    #: completes at this aggregator even under a root
    whole: bool = False
    #: when a member was last heard from (the shard's job lease)
    last_heard: float = field(default_factory=time.monotonic)
    #: rank -> when that rank's member last sent anything
    member_heard: dict = field(default_factory=dict)
    #: (round, index, op) -> [RESULT header, payload, ranks answered]: a
    #: result a member replayed (it had it from before a restart), kept
    #: for the members that ask for it after
    finals: collections.OrderedDict = field(default_factory=collections.OrderedDict)
    finals_bytes: int = 0
    #: a rack under a root: the root's finals that another rack may still
    #: wait for, replayed to a root that restarted
    kept_up: KeptResults = field(default_factory=lambda: KeptResults(KEEP_UP_CHUNKS))
    #: the root lost the job (it restarted): once it takes the rack back,
    #: the kept finals and the open partials go to it again
    replay_up: bool = False
    #: at a root: members that are racks' shards (a supervisor restarts
    #: them), and those whose connection closed -> when
    racks: set = field(default_factory=set)
    away: dict = field(default_factory=dict)
    #: at a root: (round, index, op) -> (RESULT header, payload) of the last
    #: results, for a rack shard that restarted and asks again for one it
    #: never got (at most its open partials: KEEP_UP_CHUNKS)
    recent: collections.OrderedDict = field(default_factory=collections.OrderedDict)

    def keep_final(self, key, header, payload: bytes, seen: int) -> None:
        self.finals[key] = [header, payload, seen]
        self.finals_bytes += len(payload)
        while self.finals and (self.finals_bytes > FINALS_BYTES or len(self.finals) > DONE_MEMORY):
            self.forget_final(next(iter(self.finals)))

    def forget_final(self, key) -> None:
        _, payload, _ = self.finals.pop(key)
        self.finals_bytes -= len(payload)

    def live_member(self, rank: int, now: float) -> float | None:
        """Seconds since ``rank``'s member was last heard, where that member
        is live: heard within LIVE_SECONDS, or holding a part of a round
        still open. None: it may be replaced (a restarted worker)."""
        quiet = now - self.member_heard.get(rank, -1e9)
        if quiet < LIVE_SECONDS or any(slot.seen >> rank & 1 for slot in self.slots.values()):
            return quiet
        return None

    def remember_shared(self, rank: int, round_: int, record: SharedRound) -> None:
        self.shared[(rank, round_)] = record
        while len(self.shared) > SHARED_ROUNDS:
            self.shared.popitem(last=False)

    def close_shared(self) -> None:
        for buf in self.shared_maps.values():
            buf.close()
        self.shared_maps.clear()
        self.shared.clear()

    def remember_done(self, key) -> None:
        self.done[key] = None
        if len(self.done) > DONE_MEMORY:
            self.done.popitem(last=False)

    def remember_abandoned(self, key, error_payload: bytes) -> None:
        self.abandoned[key] = error_payload
        if len(self.abandoned) > DONE_MEMORY:
            self.abandoned.popitem(last=False)

    def missing(self, seen: int) -> list[int]:
        return [r for r in range(self.world) if not seen >> r & 1]

    def present(self, seen: int) -> list[int]:
        return [r for r in range(self.world) if seen >> r & 1]
