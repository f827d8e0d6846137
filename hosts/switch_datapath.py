"""The switch-mode data path: docs/protocol.md's slot rules over a batch.

One numba call applies the rules to every datagram of a received batch
(GRO-coalesced datagrams split into records by the engine), rewriting each
packet in place into what is to be sent; a second call lays the packets to
send out contiguously per destination so that one GSO send carries a run
of them. The registers and job tables live in shared memory: the shard
processes of one aggregator each run this data path on their own range of
the pool, while the control shard installs jobs into the same tables.

The kernels take the tables as named tuples of arrays (SlotTable, JobTable,
Counters) and count by the protocol's names (limits.Drop, limits.Event),
as the P4 program counts with the constants generated from the same enums.
"""

from __future__ import annotations

import mmap
from collections import namedtuple

import numba
import numpy as np

from aggnet.kernels.cpu import _accumulate_be_i32, _byteswap32
from aggnet.kernels.datagrams import (
    D_INT32, F_UPLINK, F_VERSION, O_COUNT, O_DTYPE, O_EXPONENT, O_FLAGS, O_INDEX, O_JOB, O_MAGIC, O_NEXT_EXPONENT,
    O_NSUM, O_RESERVED, O_REF, O_SENDER, O_TYPE, O_VERSION, O_WORLD, PROBE_COUNT, PROBE_SEEN, PROBE_TAG,
    PROBE_WORLD, T_PROBE, T_PROBE_OK, T_PUSH, T_RESULT, Batch, be16, be32, put16, put_field, s16, shard_delta,
)
from aggnet.protocol.limits import MAX_JOBS, MAX_WORKERS, Drop, Event, drop_counter, event_counter
from aggnet.protocol.wire import HEADER_SIZE, MAGIC, VERSION

# actions the data path asks of the I/O loop
A_DROP, A_MULTICAST, A_UNICAST, A_UPLINK, A_CONTROL = 0, 1, 2, 3, 4

#: a host's counters by index: drops in Drop's order, then events in Event's
COUNTERS = tuple(drop_counter(d) for d in Drop) + tuple(event_counter(e) for e in Event)
_FIRST_EVENT = len(Drop)

#: each slot's registers, per version ([2, pool] arrays): the sum
#: (``values[v, slot, :K]``), the contributions it holds, the bitmap of
#: their senders, the use's tag, its agreed exponent and the largest
#: proposed next exponent
SlotTable = namedtuple("SlotTable", "values count seen tag expo maxexp")
#: the installed jobs, a row each: id, whether the row is in use, slice
#: (base, slots), world, K; the uplink (whether, this rack's id, the
#: parent's address key and shard layout); each member's address key
#: (-1: none) and shard layout ([MAX_JOBS, MAX_WORKERS] arrays)
JobTable = namedtuple("JobTable", "ids used base slots world k uplink rack parent pbase pshard members mbase mshard")
#: one shard's counters, in all and per job row: by Drop and by Event
Counters = namedtuple("Counters", "drops events job_drops job_events")
#: the data path's verdict on each packet of a batch: an action, the job
#: row (-1: none) and the length to send
Verdicts = namedtuple("Verdicts", "action job length")
#: plan_sends' scratch: an entry per copy to send (destination, size,
#: packet) and their order by destination, then the runs it found
#: (destination, segment size, arena offset, bytes)
SendArrays = namedtuple("SendArrays", "ent_dest ent_size ent_pkt order run_dest run_seg run_start run_bytes")

_jit = numba.njit(cache=True, nogil=True, boundscheck=False)
_inline = numba.njit(cache=True, nogil=True, inline="always")


@_inline
def _drop(ctr, j, reason):
    """Count a drop for ``reason`` (against job row ``j`` too, when the
    packet named one); the drop action."""
    ctr.drops[reason] += 1
    if j >= 0:
        ctr.job_drops[j, reason] += 1
    return A_DROP


@_inline
def _count(ctr, j, event):
    """Count ``event`` (against job row ``j`` too, when not -1)."""
    ctr.events[event] += 1
    if j >= 0:
        ctr.job_events[j, event] += 1


# the payload loops are the CPU backend's kernels on whole words, called on
# contiguous slices: LLVM vectorizes them there, not inlined into this loop


@_inline
def _load(p, vals, k):
    _byteswap32(p[HEADER_SIZE:HEADER_SIZE + 4 * k].view(np.uint32), vals[:k].view(np.uint32))


@_inline
def _add(p, vals, k):
    # uint32 addition wraps exactly as a switch's int32
    _accumulate_be_i32(vals[:k].view(np.uint32), p[HEADER_SIZE:HEADER_SIZE + 4 * k].view(np.uint32))


@_inline
def _store(p, vals, k):
    _byteswap32(vals[:k].view(np.uint32), p[HEADER_SIZE:HEADER_SIZE + 4 * k].view(np.uint32))


@_inline
def _as_result(p, vals, k, maxexp, nsum, world):
    """Rewrite the packet into the slot's result."""
    p[O_TYPE] = T_RESULT
    p[O_FLAGS] = p[O_FLAGS] & (F_VERSION | F_UPLINK)
    put16(p, O_SENDER, 0)
    put16(p, O_NEXT_EXPONENT, maxexp)
    put16(p, O_NSUM, nsum)
    put16(p, O_WORLD, world)
    _store(p, vals, k)


@_inline
def _as_partial(p, vals, k, maxexp, rack, world):
    """Rewrite the packet into this rack's partial sum for its parent."""
    p[O_TYPE] = T_PUSH
    p[O_FLAGS] = (p[O_FLAGS] & F_VERSION) | F_UPLINK
    put16(p, O_SENDER, rack)
    put16(p, O_NEXT_EXPONENT, maxexp)
    put16(p, O_NSUM, world)
    put16(p, O_WORLD, world)
    _store(p, vals, k)


@_jit
def process_batch(batch, slots, jobs, shard, ctr, out):
    """Apply docs/protocol.md to the batch's packets, in order: each is
    rewritten in place into what is to be sent, and ``out`` says what to
    do with it. ``shard`` is the (lo, hi) range of pool slots this process
    serves; ``slots``, ``jobs`` and ``ctr`` are its SlotTable, JobTable and
    Counters."""
    for i in range(batch.count):
        o = batch.offsets[i]
        length = batch.lengths[i]
        out.length[i] = length
        _count(ctr, -1, Event.RECEIVED)
        action, j = _packet(batch.arena[o:o + length], batch.sources[i], slots, jobs, shard, ctr)
        out.action[i] = action
        out.job[i] = j


@_inline
def _job_row(jobs, job_id):
    for q in range(jobs.ids.size):
        if jobs.used[q] and jobs.ids[q] == job_id:
            return q
    return -1


@_inline
def _packet(p, src, slots, jobs, shard, ctr):
    """One packet from address key ``src``: (action, job row or -1)."""
    if p.size < HEADER_SIZE:
        return _drop(ctr, -1, Drop.SHORT), -1
    if be16(p, O_MAGIC) != MAGIC:
        return _drop(ctr, -1, Drop.MAGIC), -1
    if p[O_VERSION] != VERSION:
        return _drop(ctr, -1, Drop.VERSION), -1
    mtype = p[O_TYPE]
    if mtype != T_PUSH and mtype != T_RESULT and mtype != T_PROBE:
        return A_CONTROL, -1
    if be32(p, O_RESERVED) != 0:
        return _drop(ctr, -1, Drop.RESERVED), -1
    j = _job_row(jobs, be32(p, O_JOB))
    if j < 0:
        return _drop(ctr, -1, Drop.UNKNOWN_JOB), -1
    index = be32(p, O_INDEX)
    if index >= np.uint32(jobs.slots[j]):
        return _drop(ctr, j, Drop.INDEX), j
    s = jobs.base[j] + np.int64(index)
    if s < shard[0] or s >= shard[1]:
        return _drop(ctr, j, Drop.OTHER_SHARD), j
    if mtype == T_PROBE:
        return _probe(p, slots, jobs, ctr, j, s), j
    k = jobs.k[j]
    if p[O_DTYPE] != D_INT32:
        return _drop(ctr, j, Drop.DTYPE), j
    if be32(p, O_COUNT) != np.uint32(k) or p.size != HEADER_SIZE + 4 * k:
        return _drop(ctr, j, Drop.LENGTH), j
    if mtype == T_RESULT:
        return _final(p, src, slots, jobs, ctr, j, s), j
    return _push(p, src, slots, jobs, ctr, j, s), j


@_inline
def _probe(p, slots, jobs, ctr, j, s):
    """A PROBE of slot ``s``: answered to its sender with the state of the
    version it names (messages.ProbeOk)."""
    if p.size != HEADER_SIZE:
        return _drop(ctr, j, Drop.LENGTH)
    v = np.int64(p[O_FLAGS] & F_VERSION)
    p[O_TYPE] = T_PROBE_OK
    put_field(p, PROBE_COUNT, slots.count[v, s])
    put_field(p, PROBE_SEEN, slots.seen[v, s])
    put_field(p, PROBE_WORLD, jobs.world[j])
    put_field(p, PROBE_TAG, slots.tag[v, s])
    _count(ctr, j, Event.PROBES)
    return A_UNICAST


@_inline
def _final(p, src, slots, jobs, ctr, j, s):
    """A RESULT: only a parent's final sum, arriving at a rack that sent
    its partial up, is taken; it goes to every member."""
    world = jobs.world[j]
    index = be32(p, O_INDEX)
    if (p[O_FLAGS] & F_UPLINK) == 0 or not jobs.uplink[j] or \
            src != jobs.parent[j] + shard_delta(jobs.pbase[j], jobs.pshard[j], index):
        return _drop(ctr, j, Drop.NOT_ADMITTED)
    v = np.int64(p[O_FLAGS] & F_VERSION)
    if slots.tag[v, s] != be32(p, O_REF) or slots.count[v, s] != world:
        return _drop(ctr, j, Drop.FINAL)
    _load(p, slots.values[v, s], jobs.k[j])
    slots.count[v, s] = 0
    slots.maxexp[v, s] = s16(be16(p, O_NEXT_EXPONENT))
    p[O_FLAGS] = p[O_FLAGS] & F_VERSION
    put16(p, O_SENDER, 0)
    put16(p, O_WORLD, world)
    _count(ctr, j, Event.FINALS)
    return A_MULTICAST


@_inline
def _push(p, src, slots, jobs, ctr, j, s):
    """A member's contribution to slot ``s``: summed (and answered when it
    completes the slot), or dropped for a reason."""
    index = be32(p, O_INDEX)
    sender = be16(p, O_SENDER)
    if sender >= jobs.world[j] or jobs.members[j, sender] < 0 or \
            jobs.members[j, sender] + shard_delta(jobs.mbase[j, sender], jobs.mshard[j, sender], index) != src:
        return _drop(ctr, j, Drop.NOT_ADMITTED)
    v = np.int64(p[O_FLAGS] & F_VERSION)
    t = be32(p, O_REF)
    bit = np.uint32(1) << np.uint32(sender)
    d = np.uint32(t - slots.tag[v, s])
    if d >= np.uint32(0x80000000):
        return _drop(ctr, j, Drop.STALE)
    if d == 0 and (slots.seen[v, s] & bit) != 0:
        return _repeat(p, slots, jobs, ctr, j, v, s)
    c = slots.count[v, s]
    nexp = s16(be16(p, O_NEXT_EXPONENT))
    if d != 0:
        if c != 0:
            return _drop(ctr, j, Drop.EARLY)
        _load(p, slots.values[v, s], jobs.k[j])  # the first contribution: overwrite
        slots.tag[v, s] = t
        slots.seen[v, s] = bit
        slots.expo[v, s] = s16(be16(p, O_EXPONENT))
        slots.maxexp[v, s] = nexp
    else:
        if c == 0:
            return _drop(ctr, j, Drop.STALE)
        if s16(be16(p, O_EXPONENT)) != slots.expo[v, s]:
            return _drop(ctr, j, Drop.EXPONENT)
        _add(p, slots.values[v, s], jobs.k[j])
        slots.seen[v, s] |= bit
        if nexp > slots.maxexp[v, s]:
            slots.maxexp[v, s] = nexp
    c += 1
    slots.seen[1 - v, s] &= ~bit  # the sender moved on from the other version
    slots.count[v, s] = c
    _count(ctr, j, Event.SUMMED)
    if c != jobs.world[j]:
        return A_DROP  # summed; the result comes with the last contribution
    return _complete(p, slots, jobs, ctr, j, v, s)


@_inline
def _repeat(p, slots, jobs, ctr, j, v, s):
    """A contribution the slot holds already: its sender lost what came
    of it, or sent it twice."""
    c = slots.count[v, s]
    world = jobs.world[j]
    if c == 0:
        # complete: the sender lost the result; answer it alone
        _as_result(p, slots.values[v, s], jobs.k[j], slots.maxexp[v, s], world, world)
        _count(ctr, j, Event.RESULTS_RESENT)
        return A_UNICAST
    if jobs.uplink[j] and c == world:
        # waiting on the parent: the partial (or the final) was lost
        _as_partial(p, slots.values[v, s], jobs.k[j], slots.maxexp[v, s], jobs.rack[j], world)
        _count(ctr, j, Event.UPLINK_RESENT)
        return A_UPLINK
    return _drop(ctr, j, Drop.DUPLICATE)


@_inline
def _complete(p, slots, jobs, ctr, j, v, s):
    """Every member's contribution is in: the result goes to them all, or
    this rack's partial sum to its parent."""
    world = jobs.world[j]
    if jobs.uplink[j]:
        _as_partial(p, slots.values[v, s], jobs.k[j], slots.maxexp[v, s], jobs.rack[j], world)
        _count(ctr, j, Event.UPLINK_SENT)
        return A_UPLINK
    slots.count[v, s] = 0
    _as_result(p, slots.values[v, s], jobs.k[j], slots.maxexp[v, s], world, world)
    _count(ctr, j, Event.COMPLETED)
    return A_MULTICAST


@_jit
def plan_sends(batch, verdicts, jobs, arr):
    """Group the packets to send into runs (destination, segment size,
    arena offset, bytes) of packets that lie one after another in the
    arena, where the data path rewrote them: a GSO send takes a run as it
    is, and a multicast sends the same run to each member, at the port of
    the member's shard that serves the slot. Nothing is copied. Returns
    the number of runs, in ``arr.run_*``."""
    e = _copies(batch, verdicts, jobs, arr)
    if e == 0:
        return 0
    return _runs(batch, arr, e, _by_destination(arr, e))


@_inline
def _entry(arr, e, dest, size, pkt):
    arr.ent_dest[e], arr.ent_size[e], arr.ent_pkt[e] = dest, size, pkt
    return e + 1


@_jit
def _copies(batch, verdicts, jobs, arr):
    """An entry per copy of a packet to send; returns how many."""
    e = 0
    for i in range(batch.count):
        a = verdicts.action[i]
        if a == A_DROP or a == A_CONTROL:
            continue
        size = verdicts.length[i]
        if a == A_UNICAST:
            e = _entry(arr, e, batch.sources[i], size, i)
            continue
        j = verdicts.job[i]
        index = be32(batch.arena[batch.offsets[i]:batch.offsets[i] + size], O_INDEX)
        if a == A_UPLINK:
            e = _entry(arr, e, jobs.parent[j] + shard_delta(jobs.pbase[j], jobs.pshard[j], index), size, i)
            continue
        for r in range(jobs.members.shape[1]):
            key = jobs.members[j, r]
            if key >= 0:
                e = _entry(arr, e, key + shard_delta(jobs.mbase[j, r], jobs.mshard[j, r], index), size, i)
    return e


@_jit
def _by_destination(arr, e):
    """Order the ``e`` entries by destination with a counting sort (a
    handful of destinations, thousands of packets), keeping arena order
    within one: ``arr.order`` lists them so, each entry's ``ent_dest``
    becomes its destination's number, and ``run_dest`` holds the
    destinations. Returns how many there are."""
    ndest = 0
    for q in range(e):
        d = arr.ent_dest[q]
        found = -1
        for u in range(ndest):
            if arr.run_dest[u] == d:
                found = u
                break
        if found < 0:
            found = ndest
            arr.run_dest[ndest] = d
            arr.run_bytes[ndest] = 0
            ndest += 1
        arr.run_bytes[found] += 1  # entries per destination, for now
        arr.ent_dest[q] = found
    starts = np.empty(ndest + 1, np.int64)
    starts[0] = 0
    for u in range(ndest):
        starts[u + 1] = starts[u] + arr.run_bytes[u]
    fill = starts[:ndest].copy()
    for q in range(e):
        u = arr.ent_dest[q]
        arr.order[fill[u]] = q
        fill[u] += 1
    return ndest


@_jit
def _runs(batch, arr, e, ndest):
    """Merge the ordered entries into runs; returns how many."""
    dests = arr.run_dest[:ndest].copy()
    runs = -1
    for q in range(e):
        x = arr.order[q]
        dest, size = dests[arr.ent_dest[x]], arr.ent_size[x]
        o = batch.offsets[arr.ent_pkt[x]]
        if runs >= 0 and arr.run_dest[runs] == dest and arr.run_seg[runs] == size \
                and arr.run_start[runs] + arr.run_bytes[runs] == o:
            arr.run_bytes[runs] += size
        else:
            runs += 1
            arr.run_dest[runs], arr.run_seg[runs], arr.run_start[runs], arr.run_bytes[runs] = dest, size, o, size
    return runs + 1


def _shared(shape, dtype, fill=0) -> np.ndarray:
    """An array in anonymous shared memory: forked shard processes see the
    same registers (a MAP_SHARED mapping survives fork, pages stay lazy)."""
    dtype = np.dtype(dtype)
    nbytes = max(1, int(np.prod(shape)) * dtype.itemsize)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    arr = np.frombuffer(buf, dtype).reshape(shape)
    if fill:
        arr[...] = fill
    return arr


def batch_of(sock) -> Batch:
    """What a DatagramSocket's last receive holds, as the kernels take it."""
    return Batch(sock.arena, sock.offsets, sock.lengths, sock.sources, sock.count)


class SwitchRegisters:
    """The data path's state: the pool's registers, the job tables and
    per-shard counters, all shared by the shard processes."""

    def __init__(self, pool: int, max_elements: int, shards: int = 1):
        self.pool = pool
        self.max_elements = max_elements
        self.shards = shards
        self.slots = SlotTable(values=_shared((2, pool, max_elements), np.int32), count=_shared((2, pool), np.int32),
                               seen=_shared((2, pool), np.uint32), tag=_shared((2, pool), np.uint32),
                               expo=_shared((2, pool), np.int16), maxexp=_shared((2, pool), np.int16))
        rows, members = MAX_JOBS, (MAX_JOBS, MAX_WORKERS)
        self.jobs = JobTable(
            ids=_shared(rows, np.uint32), used=_shared(rows, np.bool_), base=_shared(rows, np.int64),
            slots=_shared(rows, np.int64), world=_shared(rows, np.int32), k=_shared(rows, np.int64),
            uplink=_shared(rows, np.bool_), rack=_shared(rows, np.int32), parent=_shared(rows, np.int64, -1),
            pbase=_shared(rows, np.int64), pshard=_shared(rows, np.int64), members=_shared(members, np.int64, -1),
            mbase=_shared(members, np.int64), mshard=_shared(members, np.int64))
        #: per shard (and per shard and job row): COUNTERS, drops then events
        self.counters = _shared((shards, len(COUNTERS)), np.int64)
        self.job_counters = _shared((shards, MAX_JOBS, len(COUNTERS)), np.int64)
        self._shard_counters = [
            Counters(self.counters[i, :_FIRST_EVENT], self.counters[i, _FIRST_EVENT:],
                     self.job_counters[i, :, :_FIRST_EVENT], self.job_counters[i, :, _FIRST_EVENT:])
            for i in range(shards)]
        #: pool slots per shard; shard i serves [i * shard_slots, (i + 1) * shard_slots)
        self.shard_slots = -(-pool // shards)

    def shard_range(self, shard: int) -> tuple[int, int]:
        lo = shard * self.shard_slots
        return lo, min(self.pool, lo + self.shard_slots)

    def reset_slice(self, base: int, slots: int) -> None:
        """A new job starts from empty registers."""
        sl = slice(base, base + slots)
        for arr in self.slots:
            arr[:, sl] = 0

    def install(self, row: int, job_id: int, base: int, slots: int, world: int, k: int, *, parent: int = -1,
                rack: int = 0) -> None:
        """Fill job row ``row``: a cleared slice, no members yet, counters
        at 0; an uplink to address key ``parent`` as rack ``rack`` unless
        -1. The data shards see the row once it is complete."""
        t = self.jobs
        t.used[row] = False
        self.reset_slice(base, slots)
        t.ids[row], t.base[row], t.slots[row], t.world[row], t.k[row] = job_id, base, slots, world, k
        t.members[row, :] = -1
        t.mbase[row, :] = 0
        t.mshard[row, :] = 0
        self.job_counters[:, row, :] = 0
        t.uplink[row] = parent >= 0
        t.rack[row] = rack
        t.parent[row] = parent
        t.pbase[row] = t.pshard[row] = 0
        t.used[row] = True  # last: the data shards may look at the row from now on

    def remove(self, row: int) -> None:
        self.jobs.used[row] = False
        self.jobs.members[row, :] = -1

    def set_member(self, row: int, rank: int, key: int, base: int = 0, shard_slots: int = 0) -> None:
        """Member ``rank`` of job row ``row`` sends from address key ``key``
        (a sharded member: from the port of its shard serving the slot)."""
        t = self.jobs
        t.mbase[row, rank], t.mshard[row, rank] = base, shard_slots
        t.members[row, rank] = key  # last: the layout is in place when the data shards see the member

    def remove_member(self, row: int, rank: int) -> None:
        self.jobs.members[row, rank] = -1

    def set_parent_shards(self, row: int, base: int, shard_slots: int) -> None:
        """The parent's shard layout for job row ``row`` (from its JOIN_OK)."""
        self.jobs.pbase[row] = base
        self.jobs.pshard[row] = shard_slots

    def count_drop(self, shard: int, reason: Drop) -> None:
        """A drop outside the data path (a control message at a data shard)."""
        self.counters[shard, reason] += 1

    def job_counter_totals(self, row: int) -> np.ndarray:
        return self.job_counters[:, row].sum(axis=0)

    def shard_counters(self, shard: int) -> Counters:
        """Shard ``shard``'s counters as the data path bumps them (views of
        ``counters`` and ``job_counters``)."""
        return self._shard_counters[shard]

    def run(self, sock, shard: int, verdicts: Verdicts) -> None:
        process_batch(batch_of(sock), self.slots, self.jobs, self.shard_range(shard), self._shard_counters[shard],
                      verdicts)


def verdicts_for(max_datagrams: int) -> Verdicts:
    """Room for the data path's verdicts on a batch of ``max_datagrams``."""
    return Verdicts(np.zeros(max_datagrams, np.int8), np.zeros(max_datagrams, np.int32),
                    np.zeros(max_datagrams, np.int32))


class SendPlan:
    """Preallocated arrays for :func:`plan_sends`."""

    def __init__(self, max_datagrams: int):
        entries = max_datagrams * MAX_WORKERS
        self.arrays = SendArrays(*(np.zeros(entries, np.int64) for _ in SendArrays._fields))

    def plan(self, sock, regs: SwitchRegisters, verdicts: Verdicts) -> int:
        return plan_sends(batch_of(sock), verdicts, regs.jobs, self.arrays)

    def send(self, sock, runs: int) -> None:
        arena = sock.arena
        a = self.arrays
        for r in range(runs):
            start, nbytes = int(a.run_start[r]), int(a.run_bytes[r])
            try:
                sock.send_segments(arena[start:start + nbytes], int(a.run_seg[r]), nbytes, int(a.run_dest[r]))
            except OSError:
                pass  # counted by the socket (send_errors); the protocol's retransmissions cover the loss
