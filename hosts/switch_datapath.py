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
from aggnet.kernels.hot import hot
from aggnet.kernels.datagrams import (
    D_INT32, F_UPLINK, F_VERSION, O_COUNT, O_DTYPE, O_EXPONENT, O_FLAGS, O_INDEX, O_JOB, O_MAGIC, O_NEXT_EXPONENT,
    O_NSUM, O_RESERVED, O_REF, O_SENDER, O_TYPE, O_VERSION, O_WORLD, PROBE_COUNT, PROBE_SEEN, PROBE_TAG,
    PROBE_WORLD, T_PROBE, T_PROBE_OK, T_PUSH, T_RESULT, Batch, be16, be32, put16, put_field, s16, shard_delta,
)
from aggnet.protocol.limits import MAX_JOBS, MAX_WORKERS, UPLINK_RESENDER, Drop, Event, drop_counter, event_counter
from aggnet.protocol.wire import HEADER_SIZE, MAGIC, VERSION

# actions the data path asks of the I/O loop
A_DROP, A_MULTICAST, A_UNICAST, A_UPLINK, A_CONTROL = 0, 1, 2, 3, 4

#: a host's counters by index: drops in Drop's order, then events in Event's
COUNTERS = tuple(drop_counter(d) for d in Drop) + tuple(event_counter(e) for e in Event)
_FIRST_EVENT = len(Drop)
#: the counters' indices as plain integers, for the data path's loop
_D_DTYPE = int(Drop.DTYPE)
_D_DUPLICATE = int(Drop.DUPLICATE)
_D_EARLY = int(Drop.EARLY)
_D_EXPONENT = int(Drop.EXPONENT)
_D_FINAL = int(Drop.FINAL)
_D_INDEX = int(Drop.INDEX)
_D_LENGTH = int(Drop.LENGTH)
_D_MAGIC = int(Drop.MAGIC)
_D_NOT_ADMITTED = int(Drop.NOT_ADMITTED)
_D_OTHER_SHARD = int(Drop.OTHER_SHARD)
_D_RESERVED = int(Drop.RESERVED)
_D_SHORT = int(Drop.SHORT)
_D_STALE = int(Drop.STALE)
_D_UNKNOWN_JOB = int(Drop.UNKNOWN_JOB)
_D_VERSION = int(Drop.VERSION)
_E_COMPLETED = int(Event.COMPLETED)
_E_FINALS = int(Event.FINALS)
_E_PROBES = int(Event.PROBES)
_E_RECEIVED = int(Event.RECEIVED)
_E_RESULTS_RESENT = int(Event.RESULTS_RESENT)
_E_SUMMED = int(Event.SUMMED)
_E_UPLINK_RESENT = int(Event.UPLINK_RESENT)
_E_UPLINK_SENT = int(Event.UPLINK_SENT)

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


@_inline
def _admitted(members, mbase, mshard, j, sender, world, index, src):
    """Whether ``src`` is the address (and shard port) ``sender`` of job
    row ``j`` joined from."""
    return sender < world and members[j, sender] >= 0 and \
        members[j, sender] + shard_delta(mbase[j, sender], mshard[j, sender], index) == src


@hot
@_jit
def process_batch(batch, slots, jobs, shard, ctr, out):
    """Apply docs/protocol.md to the batch's packets, in order: each is
    rewritten in place into what is to be sent, and ``out`` says what to
    do with it. ``shard`` is the (lo, hi) range of pool slots this process
    serves; ``slots``, ``jobs`` and ``ctr`` are its SlotTable, JobTable and
    Counters.

    One loop over local arrays, on purpose: the same rules split into
    helpers that take the tables as tuples ran at half the speed (each
    helper re-extracts and reference-counts the arrays it touches), and
    this loop is what bounds a host's packet rate at small K."""
    arena, offsets, lengths, srcs, n = batch
    values, count, seen, tag, expo, maxexp = slots
    job_ids, job_used, job_base, job_slots, job_world, job_k, job_uplink, job_rack, job_parent, job_pbase, \
        job_pshard, members, mbase, mshard = jobs
    shard_lo, shard_hi = shard
    drops, events, job_drops, job_events = ctr
    for i in range(n):
        length = lengths[i]
        o = offsets[i]
        p = arena[o:o + length]
        out.action[i] = A_DROP
        out.job[i] = -1
        out.length[i] = length
        events[_E_RECEIVED] += 1
        if length < HEADER_SIZE:
            drops[_D_SHORT] += 1
            continue
        if be16(p, O_MAGIC) != MAGIC:
            drops[_D_MAGIC] += 1
            continue
        if p[O_VERSION] != VERSION:
            drops[_D_VERSION] += 1
            continue
        mtype = p[O_TYPE]
        if mtype != T_PUSH and mtype != T_RESULT and mtype != T_PROBE:
            out.action[i] = A_CONTROL
            continue
        if be32(p, O_RESERVED) != 0:
            drops[_D_RESERVED] += 1
            continue
        flags = p[O_FLAGS]
        job = be32(p, O_JOB)
        j = -1
        for q in range(job_ids.size):
            if job_used[q] and job_ids[q] == job:
                j = q
                break
        if j < 0:
            drops[_D_UNKNOWN_JOB] += 1
            continue
        out.job[i] = j
        index = be32(p, O_INDEX)
        world = job_world[j]
        k = job_k[j]
        if index >= np.uint32(job_slots[j]):
            drops[_D_INDEX] += 1
            job_drops[j, _D_INDEX] += 1
            continue
        s = job_base[j] + np.int64(index)
        if s < shard_lo or s >= shard_hi:
            drops[_D_OTHER_SHARD] += 1
            job_drops[j, _D_OTHER_SHARD] += 1
            continue
        v = np.int64(flags & F_VERSION)
        t = be32(p, O_REF)
        if mtype == T_PROBE:
            # answered to admitted members only: a slot's state is the job's,
            # and an answer to anyone would reflect spoofed sources
            if not _admitted(members, mbase, mshard, j, be16(p, O_SENDER), world, index, srcs[i]):
                drops[_D_NOT_ADMITTED] += 1
                job_drops[j, _D_NOT_ADMITTED] += 1
                continue
            if length != HEADER_SIZE:
                drops[_D_LENGTH] += 1
                job_drops[j, _D_LENGTH] += 1
                continue
            p[O_TYPE] = T_PROBE_OK
            put_field(p, PROBE_COUNT, count[v, s])
            put_field(p, PROBE_SEEN, seen[v, s])
            put_field(p, PROBE_WORLD, world)
            put_field(p, PROBE_TAG, tag[v, s])
            out.action[i] = A_UNICAST
            events[_E_PROBES] += 1
            job_events[j, _E_PROBES] += 1
            continue
        if p[O_DTYPE] != D_INT32:
            drops[_D_DTYPE] += 1
            job_drops[j, _D_DTYPE] += 1
            continue
        if be32(p, O_COUNT) != np.uint32(k) or length != HEADER_SIZE + 4 * k:
            drops[_D_LENGTH] += 1
            job_drops[j, _D_LENGTH] += 1
            continue
        if mtype == T_RESULT:
            # only a parent's final sum, arriving at a rack that sent its partial up
            if (flags & F_UPLINK) == 0 or not job_uplink[j] or \
                    srcs[i] != job_parent[j] + shard_delta(job_pbase[j], job_pshard[j], index):
                drops[_D_NOT_ADMITTED] += 1
                job_drops[j, _D_NOT_ADMITTED] += 1
                continue
            if tag[v, s] != t or count[v, s] != world:
                drops[_D_FINAL] += 1
                job_drops[j, _D_FINAL] += 1
                continue
            _load(p, values[v, s], k)
            count[v, s] = 0
            maxexp[v, s] = s16(be16(p, O_NEXT_EXPONENT))
            p[O_FLAGS] = p[O_FLAGS] & F_VERSION
            put16(p, O_SENDER, 0)
            put16(p, O_WORLD, world)
            out.action[i] = A_MULTICAST
            events[_E_FINALS] += 1
            job_events[j, _E_FINALS] += 1
            continue
        sender = be16(p, O_SENDER)
        if not _admitted(members, mbase, mshard, j, sender, world, index, srcs[i]):
            drops[_D_NOT_ADMITTED] += 1
            job_drops[j, _D_NOT_ADMITTED] += 1
            continue
        bit = np.uint32(1) << np.uint32(sender)
        stored = tag[v, s]
        c = count[v, s]
        d = np.uint32(t - stored)
        if d >= np.uint32(0x80000000):
            drops[_D_STALE] += 1
            job_drops[j, _D_STALE] += 1
            continue
        if d == 0 and (seen[v, s] & bit) != 0:
            if c == 0:
                # complete: the sender lost the result; answer it alone
                _as_result(p, values[v, s], k, maxexp[v, s], world, world)
                out.action[i] = A_UNICAST
                events[_E_RESULTS_RESENT] += 1
                job_events[j, _E_RESULTS_RESENT] += 1
            elif job_uplink[j] and c == world and sender == UPLINK_RESENDER:
                # waiting on the parent: the partial (or the final) was lost
                _as_partial(p, values[v, s], k, maxexp[v, s], job_rack[j], world)
                out.action[i] = A_UPLINK
                events[_E_UPLINK_RESENT] += 1
                job_events[j, _E_UPLINK_RESENT] += 1
            else:
                drops[_D_DUPLICATE] += 1
                job_drops[j, _D_DUPLICATE] += 1
            continue
        nexp = s16(be16(p, O_NEXT_EXPONENT))
        if d != 0:
            if c != 0:
                drops[_D_EARLY] += 1
                job_drops[j, _D_EARLY] += 1
                continue
            _load(p, values[v, s], k)
            c = 1
            tag[v, s] = t
            seen[v, s] = bit
            expo[v, s] = s16(be16(p, O_EXPONENT))
            maxexp[v, s] = nexp
        else:
            if c == 0:
                drops[_D_STALE] += 1
                job_drops[j, _D_STALE] += 1
                continue
            if s16(be16(p, O_EXPONENT)) != expo[v, s]:
                drops[_D_EXPONENT] += 1
                job_drops[j, _D_EXPONENT] += 1
                continue
            _add(p, values[v, s], k)
            c += 1
            seen[v, s] |= bit
            if nexp > maxexp[v, s]:
                maxexp[v, s] = nexp
        seen[1 - v, s] &= ~bit
        count[v, s] = c
        events[_E_SUMMED] += 1
        job_events[j, _E_SUMMED] += 1
        if c == world:
            if job_uplink[j]:
                _as_partial(p, values[v, s], k, maxexp[v, s], job_rack[j], world)
                out.action[i] = A_UPLINK
                events[_E_UPLINK_SENT] += 1
                job_events[j, _E_UPLINK_SENT] += 1
            else:
                count[v, s] = 0
                _as_result(p, values[v, s], k, maxexp[v, s], world, world)
                out.action[i] = A_MULTICAST
                events[_E_COMPLETED] += 1
                job_events[j, _E_COMPLETED] += 1


@hot
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


@_inline
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


@_inline
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


@_inline
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
