"""The switch-mode data path: docs/protocol.md's slot rules over a batch.

One numba call applies the rules to every datagram of a received batch
(GRO-coalesced datagrams split into records by the engine), rewriting each
packet in place into what is to be sent; a second call lays the packets to
send out contiguously per destination so that one GSO send carries a run
of them. The registers and job tables live in shared memory: the shard
processes of one aggregator each run this data path on their own range of
the pool, while the control shard installs jobs into the same tables.
"""

from __future__ import annotations

import mmap

import numba
import numpy as np

from aggnet.kernels.datagrams import (
    D_INT32, F_UPLINK, F_VERSION, O_DTYPE, O_FLAGS, O_INDEX, O_JOB, O_MAGIC, O_NEXT_EXPONENT, O_NSUM, O_REF,
    O_RESERVED, O_SENDER, O_COUNT, O_EXPONENT, O_OFFSET, O_TYPE, O_VERSION, O_WORLD, T_PROBE, T_PROBE_OK, T_PUSH,
    T_RESULT, be16, be32, put16, put32, s16, shard_delta,
)
from aggnet.kernels.cpu import _accumulate_be_i32, _byteswap32
from aggnet.protocol import MAX_WORKERS
from aggnet.wire import HEADER_SIZE, MAGIC, VERSION

MAX_JOBS = 64

# actions the data path asks of the I/O loop
A_DROP, A_MULTICAST, A_UNICAST, A_UPLINK, A_CONTROL = 0, 1, 2, 3, 4

#: counter names, by index; drops first
COUNTERS = (
    "dropped_short", "dropped_magic", "dropped_version", "dropped_reserved", "dropped_dtype", "dropped_length",
    "dropped_unknown_job", "dropped_not_admitted", "dropped_index", "dropped_stale", "dropped_duplicate",
    "dropped_early", "dropped_exponent", "dropped_final",
    "received", "summed", "completed", "results_resent", "uplink_sent", "uplink_resent", "finals", "probes",
    "dropped_other_shard", "dropped_control_at_data_shard",
)
C = {name: i for i, name in enumerate(COUNTERS)}
_SHORT, _MAGIC, _VERS, _RESERVED, _DTYPE, _LENGTH = 0, 1, 2, 3, 4, 5
_UNKNOWN_JOB, _NOT_ADMITTED, _INDEX, _STALE, _DUPLICATE, _EARLY, _EXPONENT, _FINAL = 6, 7, 8, 9, 10, 11, 12, 13
_RECEIVED, _SUMMED, _COMPLETED, _RESENT, _UP_SENT, _UP_RESENT, _FINALS, _PROBES = 14, 15, 16, 17, 18, 19, 20, 21
_OTHER_SHARD = 22
assert COUNTERS[_PROBES] == "probes" and COUNTERS[_OTHER_SHARD] == "dropped_other_shard"

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


@_jit
def process_batch(arena, offsets, lengths, srcs, n, values, count, seen, tag, expo, maxexp,
                  job_ids, job_used, job_base, job_slots, job_world, job_k, job_uplink, job_rack,
                  job_parent, job_pbase, job_pshard, members, mbase, mshard, shard_lo, shard_hi,
                  counters, job_counters, actions, act_job, out_len):
    """Apply docs/protocol.md to ``n`` received packets, in order."""
    for i in range(n):
        length = lengths[i]
        o = offsets[i]
        p = arena[o:o + length]
        actions[i] = A_DROP
        act_job[i] = -1
        out_len[i] = length
        counters[_RECEIVED] += 1
        if length < HEADER_SIZE:
            counters[_SHORT] += 1
            continue
        if be16(p, O_MAGIC) != MAGIC:
            counters[_MAGIC] += 1
            continue
        if p[O_VERSION] != VERSION:
            counters[_VERS] += 1
            continue
        mtype = p[O_TYPE]
        if mtype != T_PUSH and mtype != T_RESULT and mtype != T_PROBE:
            actions[i] = A_CONTROL
            continue
        if be32(p, O_RESERVED) != 0:
            counters[_RESERVED] += 1
            continue
        flags = p[O_FLAGS]
        job = be32(p, O_JOB)
        j = -1
        for q in range(job_ids.size):
            if job_used[q] and job_ids[q] == job:
                j = q
                break
        if j < 0:
            counters[_UNKNOWN_JOB] += 1
            continue
        act_job[i] = j
        index = be32(p, O_INDEX)
        world = job_world[j]
        k = job_k[j]
        if index >= np.uint32(job_slots[j]):
            counters[_INDEX] += 1
            job_counters[j, _INDEX] += 1
            continue
        s = job_base[j] + np.int64(index)
        if s < shard_lo or s >= shard_hi:
            counters[_OTHER_SHARD] += 1
            job_counters[j, _OTHER_SHARD] += 1
            continue
        v = np.int64(flags & F_VERSION)
        t = be32(p, O_REF)
        if mtype == T_PROBE:
            if length != HEADER_SIZE:
                counters[_LENGTH] += 1
                job_counters[j, _LENGTH] += 1
                continue
            p[O_TYPE] = T_PROBE_OK
            put16(p, O_NSUM, count[v, s])
            put32(p, O_REF, seen[v, s])
            put16(p, O_WORLD, world)
            put32(p, O_OFFSET, 0)
            put32(p, O_OFFSET + 4, tag[v, s])
            actions[i] = A_UNICAST
            counters[_PROBES] += 1
            job_counters[j, _PROBES] += 1
            continue
        if p[O_DTYPE] != D_INT32:
            counters[_DTYPE] += 1
            job_counters[j, _DTYPE] += 1
            continue
        if be32(p, O_COUNT) != np.uint32(k) or length != HEADER_SIZE + 4 * k:
            counters[_LENGTH] += 1
            job_counters[j, _LENGTH] += 1
            continue
        if mtype == T_RESULT:
            # only a parent's final sum, arriving at a rack that sent its partial up
            if (flags & F_UPLINK) == 0 or not job_uplink[j] or \
                    srcs[i] != job_parent[j] + shard_delta(job_pbase[j], job_pshard[j], index):
                counters[_NOT_ADMITTED] += 1
                job_counters[j, _NOT_ADMITTED] += 1
                continue
            if tag[v, s] != t or count[v, s] != world:
                counters[_FINAL] += 1
                job_counters[j, _FINAL] += 1
                continue
            _load(p, values[v, s], k)
            count[v, s] = 0
            maxexp[v, s] = s16(be16(p, O_NEXT_EXPONENT))
            p[O_FLAGS] = p[O_FLAGS] & F_VERSION
            put16(p, O_SENDER, 0)
            put16(p, O_WORLD, world)
            actions[i] = A_MULTICAST
            counters[_FINALS] += 1
            job_counters[j, _FINALS] += 1
            continue
        sender = be16(p, O_SENDER)
        if sender >= world or members[j, sender] < 0 or \
                members[j, sender] + shard_delta(mbase[j, sender], mshard[j, sender], index) != srcs[i]:
            counters[_NOT_ADMITTED] += 1
            job_counters[j, _NOT_ADMITTED] += 1
            continue
        bit = np.uint32(1) << np.uint32(sender)
        stored = tag[v, s]
        c = count[v, s]
        d = np.uint32(t - stored)
        if d >= np.uint32(0x80000000):
            counters[_STALE] += 1
            job_counters[j, _STALE] += 1
            continue
        if d == 0 and (seen[v, s] & bit) != 0:
            if c == 0:
                # complete: the sender lost the result; answer it alone
                _as_result(p, values[v, s], k, maxexp[v, s], world, world)
                actions[i] = A_UNICAST
                counters[_RESENT] += 1
                job_counters[j, _RESENT] += 1
            elif job_uplink[j] and c == world:
                # waiting on the parent: the partial (or the final) was lost
                _as_partial(p, values[v, s], k, maxexp[v, s], job_rack[j], world)
                actions[i] = A_UPLINK
                counters[_UP_RESENT] += 1
                job_counters[j, _UP_RESENT] += 1
            else:
                counters[_DUPLICATE] += 1
                job_counters[j, _DUPLICATE] += 1
            continue
        nexp = s16(be16(p, O_NEXT_EXPONENT))
        if d != 0:
            if c != 0:
                counters[_EARLY] += 1
                job_counters[j, _EARLY] += 1
                continue
            _load(p, values[v, s], k)
            c = 1
            tag[v, s] = t
            seen[v, s] = bit
            expo[v, s] = s16(be16(p, O_EXPONENT))
            maxexp[v, s] = nexp
        else:
            if c == 0:
                counters[_STALE] += 1
                job_counters[j, _STALE] += 1
                continue
            if s16(be16(p, O_EXPONENT)) != expo[v, s]:
                counters[_EXPONENT] += 1
                job_counters[j, _EXPONENT] += 1
                continue
            _add(p, values[v, s], k)
            c += 1
            seen[v, s] |= bit
            if nexp > maxexp[v, s]:
                maxexp[v, s] = nexp
        seen[1 - v, s] &= ~bit
        count[v, s] = c
        counters[_SUMMED] += 1
        job_counters[j, _SUMMED] += 1
        if c == world:
            if job_uplink[j]:
                _as_partial(p, values[v, s], k, maxexp[v, s], job_rack[j], world)
                actions[i] = A_UPLINK
                counters[_UP_SENT] += 1
                job_counters[j, _UP_SENT] += 1
            else:
                count[v, s] = 0
                _as_result(p, values[v, s], k, maxexp[v, s], world, world)
                actions[i] = A_MULTICAST
                counters[_COMPLETED] += 1
                job_counters[j, _COMPLETED] += 1


@_jit
def plan_sends(arena, offsets, out_len, srcs, actions, act_job, n, members, mbase, mshard, job_parent, job_pbase,
               job_pshard, ent_dest, ent_size, ent_pkt, order, run_dest, run_seg, run_start, run_bytes):
    """Group the packets to send into runs (destination, segment size,
    arena offset, bytes) of packets that lie one after another in the
    arena, where the data path rewrote them: a GSO send takes a run as it
    is, and a multicast sends the same run to each member, at the port of
    the member's shard that serves the slot. Nothing is copied. Returns
    the number of runs."""
    e = 0
    for i in range(n):
        a = actions[i]
        if a == 0 or a == 4:  # A_DROP, A_CONTROL
            continue
        size = out_len[i]
        if a == 2:  # A_UNICAST
            ent_dest[e], ent_size[e], ent_pkt[e] = srcs[i], size, i
            e += 1
            continue
        j = act_job[i]
        index = be32(arena[offsets[i]:offsets[i] + size], O_INDEX)
        if a == 3:  # A_UPLINK
            ent_dest[e] = job_parent[j] + shard_delta(job_pbase[j], job_pshard[j], index)
            ent_size[e], ent_pkt[e] = size, i
            e += 1
            continue
        for r in range(members.shape[1]):
            key = members[j, r]
            if key < 0:
                continue
            ent_dest[e] = key + shard_delta(mbase[j, r], mshard[j, r], index)
            ent_size[e], ent_pkt[e] = size, i
            e += 1
    if e == 0:
        return 0
    # group by destination with a counting sort (a handful of
    # destinations, thousands of packets), keeping arena order within one
    ndest = 0
    for q in range(e):
        d = ent_dest[q]
        found = -1
        for u in range(ndest):
            if run_dest[u] == d:
                found = u
                break
        if found < 0:
            found = ndest
            run_dest[ndest] = d
            run_bytes[ndest] = 0
            ndest += 1
        run_bytes[found] += 1  # entries per destination, for now
        ent_dest[q] = found
    starts = np.empty(ndest + 1, np.int64)
    starts[0] = 0
    for u in range(ndest):
        starts[u + 1] = starts[u] + run_bytes[u]
    fill = starts[:ndest].copy()
    for q in range(e):
        u = ent_dest[q]
        order[fill[u]] = q
        fill[u] += 1
    dests = run_dest[:ndest].copy()
    runs = -1
    for q in range(e):
        x = order[q]
        dest, size = dests[ent_dest[x]], ent_size[x]
        o = offsets[ent_pkt[x]]
        if runs >= 0 and run_dest[runs] == dest and run_seg[runs] == size \
                and run_start[runs] + run_bytes[runs] == o:
            run_bytes[runs] += size
        else:
            runs += 1
            run_dest[runs], run_seg[runs], run_start[runs], run_bytes[runs] = dest, size, o, size
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


class SwitchRegisters:
    """The data path's state: the pool's registers, the job tables and
    per-shard counters, all shared by the shard processes."""

    def __init__(self, pool: int, max_elements: int, shards: int = 1):
        self.pool = pool
        self.max_elements = max_elements
        self.shards = shards
        self.values = _shared((2, pool, max_elements), np.int32)
        self.count = _shared((2, pool), np.int32)
        self.seen = _shared((2, pool), np.uint32)
        self.tag = _shared((2, pool), np.uint32)
        self.expo = _shared((2, pool), np.int16)
        self.maxexp = _shared((2, pool), np.int16)
        self.job_ids = _shared(MAX_JOBS, np.uint32)
        self.job_used = _shared(MAX_JOBS, np.bool_)
        self.job_base = _shared(MAX_JOBS, np.int64)
        self.job_slots = _shared(MAX_JOBS, np.int64)
        self.job_world = _shared(MAX_JOBS, np.int32)
        self.job_k = _shared(MAX_JOBS, np.int64)
        self.job_uplink = _shared(MAX_JOBS, np.bool_)
        self.job_rack = _shared(MAX_JOBS, np.int32)
        self.job_parent = _shared(MAX_JOBS, np.int64, -1)
        self.job_pbase = _shared(MAX_JOBS, np.int64)
        self.job_pshard = _shared(MAX_JOBS, np.int64)
        self.members = _shared((MAX_JOBS, MAX_WORKERS), np.int64, -1)
        self.mbase = _shared((MAX_JOBS, MAX_WORKERS), np.int64)
        self.mshard = _shared((MAX_JOBS, MAX_WORKERS), np.int64)
        self.counters = _shared((shards, len(COUNTERS)), np.int64)
        self.job_counters = _shared((shards, MAX_JOBS, len(COUNTERS)), np.int64)
        #: pool slots per shard; shard i serves [i * shard_slots, (i + 1) * shard_slots)
        self.shard_slots = -(-pool // shards)

    def shard_range(self, shard: int) -> tuple[int, int]:
        lo = shard * self.shard_slots
        return lo, min(self.pool, lo + self.shard_slots)

    def reset_slice(self, base: int, slots: int) -> None:
        """A new job starts from empty registers."""
        sl = slice(base, base + slots)
        for arr in (self.values, self.count, self.seen, self.tag, self.expo, self.maxexp):
            arr[:, sl] = 0

    def job_counter_totals(self, row: int) -> np.ndarray:
        return self.job_counters[:, row].sum(axis=0)

    def run(self, sock, shard: int, actions, act_job, out_len) -> None:
        lo, hi = self.shard_range(shard)
        process_batch(sock.arena, sock.offsets, sock.lengths, sock.sources, sock.count, self.values, self.count,
                      self.seen, self.tag, self.expo, self.maxexp, self.job_ids, self.job_used, self.job_base,
                      self.job_slots, self.job_world, self.job_k, self.job_uplink, self.job_rack, self.job_parent,
                      self.job_pbase, self.job_pshard, self.members, self.mbase, self.mshard, lo, hi,
                      self.counters[shard], self.job_counters[shard], actions, act_job, out_len)


class SendPlan:
    """Preallocated arrays for :func:`plan_sends`."""

    def __init__(self, max_datagrams: int):
        entries = max_datagrams * MAX_WORKERS
        self.ent_dest = np.zeros(entries, np.int64)
        self.ent_size = np.zeros(entries, np.int64)
        self.ent_pkt = np.zeros(entries, np.int64)
        self.order = np.zeros(entries, np.int64)
        self.run_dest = np.zeros(entries, np.int64)
        self.run_seg = np.zeros(entries, np.int64)
        self.run_start = np.zeros(entries, np.int64)
        self.run_bytes = np.zeros(entries, np.int64)

    def plan(self, sock, regs: SwitchRegisters, actions, act_job, out_len) -> int:
        return plan_sends(sock.arena, sock.offsets, out_len, sock.sources, actions, act_job, sock.count,
                          regs.members, regs.mbase, regs.mshard, regs.job_parent, regs.job_pbase, regs.job_pshard,
                          self.ent_dest, self.ent_size, self.ent_pkt, self.order, self.run_dest, self.run_seg,
                          self.run_start, self.run_bytes)

    def send(self, sock, runs: int) -> None:
        arena = sock.arena
        for r in range(runs):
            start, nbytes = int(self.run_start[r]), int(self.run_bytes[r])
            try:
                sock.send_segments(arena[start:start + nbytes], int(self.run_seg[r]), nbytes, int(self.run_dest[r]))
            except OSError:
                pass  # counted by the socket (send_errors); the protocol's retransmissions cover the loss
