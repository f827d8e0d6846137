"""The aggregator host in switch mode: docs/protocol.md, exactly.

``aggnet serve --mode switch`` speaks the in-network aggregation protocol
over UDP the way the P4 program does: the same packets in give the same
packets out, so it stands in for a top-of-rack switch, serves as the parent
level of a hierarchy, and is the reference the P4 program is tested
against. The data path is one numba function over a batch of received
datagrams: it parses and validates each header, applies the slot rules on
preallocated registers (values, counts, seen bitmaps, tags, exponents, two
versions per slot) and rewrites the packet in place into what is to be
sent; Python only moves datagrams and answers control messages (JOIN,
LEAVE, STATS), as a switch's control plane would.
"""

from __future__ import annotations

import collections
import logging
import socket
import time
from dataclasses import dataclass, field

import numba
import numpy as np

from aggnet import wire
from aggnet.address import Address, parse
from aggnet.protocol import DEFAULT_ELEMENTS, DEFAULT_JOB_SLOTS, DEFAULT_POOL, MAX_ELEMENTS, MAX_WORKERS
from aggnet.transport.udp import PacketBatch, addr_key, key_addr, open_udp
from aggnet.wire import HEADER_SIZE, ErrorCode, Header, MsgType

log = logging.getLogger("aggnet.hosts.switch")

MAX_JOBS = 64
BATCH = 256
#: a job whose packets stopped this long ago may give its slice to a new
#: job when the pool is full: its workers died without LEAVE (a killed
#: process sends none). Only under pressure, so a job pausing for a long
#: evaluation keeps its slice while there is room.
DEFAULT_RECLAIM_IDLE = 300.0
#: how often the loop notes which jobs saw packets
ACTIVITY_CHECK_INTERVAL = 1.0

# actions the data path asks of the I/O loop
A_DROP, A_MULTICAST, A_UNICAST, A_UPLINK, A_CONTROL = 0, 1, 2, 3, 4

#: counter names, by index; drops first
COUNTERS = (
    "dropped_short", "dropped_magic", "dropped_version", "dropped_reserved", "dropped_dtype", "dropped_length",
    "dropped_unknown_job", "dropped_not_admitted", "dropped_index", "dropped_stale", "dropped_duplicate",
    "dropped_early", "dropped_exponent", "dropped_final",
    "received", "summed", "completed", "results_resent", "uplink_sent", "uplink_resent", "finals", "probes",
)
C = {name: i for i, name in enumerate(COUNTERS)}

_PUSH, _RESULT, _PROBE, _PROBE_OK = int(MsgType.PUSH), int(MsgType.RESULT), int(MsgType.PROBE), int(MsgType.PROBE_OK)
_VERSION, _RETRANSMIT, _UPLINK, _LE = 0x01, 0x10, 0x08, 0x02
_INT32 = int(wire.DType.INT32)


@numba.njit(cache=True, inline="always")
def _be16(p, o):
    return (np.int32(p[o]) << 8) | np.int32(p[o + 1])


@numba.njit(cache=True, inline="always")
def _be32(p, o):
    return (np.uint32(p[o]) << np.uint32(24)) | (np.uint32(p[o + 1]) << np.uint32(16)) | \
        (np.uint32(p[o + 2]) << np.uint32(8)) | np.uint32(p[o + 3])


@numba.njit(cache=True, inline="always")
def _put16(p, o, v):
    v = np.int32(v) & 0xFFFF
    p[o] = np.uint8(v >> 8)
    p[o + 1] = np.uint8(v & 0xFF)


@numba.njit(cache=True, inline="always")
def _put32(p, o, v):
    v = np.uint32(v)
    p[o] = np.uint8(v >> np.uint32(24))
    p[o + 1] = np.uint8((v >> np.uint32(16)) & np.uint32(0xFF))
    p[o + 2] = np.uint8((v >> np.uint32(8)) & np.uint32(0xFF))
    p[o + 3] = np.uint8(v & np.uint32(0xFF))


@numba.njit(cache=True, inline="always")
def _s16(v):
    return v - 65536 if v >= 32768 else v


@numba.njit(cache=True)
def _load(p, vals, k):
    """values = payload (big-endian int32)."""
    for e in range(k):
        o = HEADER_SIZE + 4 * e
        vals[e] = np.int32(_be32(p, o))


@numba.njit(cache=True)
def _add(p, vals, k):
    for e in range(k):
        o = HEADER_SIZE + 4 * e
        vals[e] = np.int32(np.uint32(vals[e]) + _be32(p, o))


@numba.njit(cache=True)
def _store(p, vals, k):
    for e in range(k):
        _put32(p, HEADER_SIZE + 4 * e, np.uint32(vals[e]))


@numba.njit(cache=True)
def _as_result(p, vals, k, maxexp, nsum, world):
    """Rewrite the packet into the slot's result."""
    p[3] = _RESULT
    p[4] = p[4] & (_VERSION | _UPLINK)
    _put16(p, 6, 0)
    _put16(p, 26, maxexp)
    _put16(p, 28, nsum)
    _put16(p, 30, world)
    _store(p, vals, k)


@numba.njit(cache=True)
def _as_partial(p, vals, k, maxexp, rack, world):
    """Rewrite the packet into this rack's partial sum for its parent."""
    p[3] = _PUSH
    p[4] = (p[4] & _VERSION) | _UPLINK
    _put16(p, 6, rack)
    _put16(p, 26, maxexp)
    _put16(p, 28, world)
    _put16(p, 30, world)
    _store(p, vals, k)


@numba.njit(cache=True, nogil=True)
def process_batch(pkts, lens, srcs, n, k, values, count, seen, tag, expo, maxexp,
                  job_ids, job_used, job_base, job_slots, job_world, job_uplink, job_rack, job_parent, members,
                  counters, job_counters, actions, act_job, out_len):
    """Apply docs/protocol.md to ``n`` received packets, in order."""
    plen = HEADER_SIZE + 4 * k
    for i in range(n):
        p = pkts[i]
        length = lens[i]
        actions[i] = A_DROP
        act_job[i] = -1
        out_len[i] = length
        counters[14] += 1
        if length < HEADER_SIZE:
            counters[0] += 1
            continue
        if _be16(p, 0) != 0xA66E:
            counters[1] += 1
            continue
        if p[2] != 1:
            counters[2] += 1
            continue
        mtype = p[3]
        if mtype != _PUSH and mtype != _RESULT and mtype != _PROBE:
            actions[i] = A_CONTROL
            continue
        if _be32(p, 36) != 0:
            counters[3] += 1
            continue
        flags = p[4]
        job = _be32(p, 8)
        j = -1
        for q in range(job_ids.size):
            if job_used[q] and job_ids[q] == job:
                j = q
                break
        if j < 0:
            counters[6] += 1
            continue
        act_job[i] = j
        index = _be32(p, 16)
        world = job_world[j]
        if index >= np.uint32(job_slots[j]):
            counters[8] += 1
            job_counters[j, 8] += 1
            continue
        s = job_base[j] + np.int32(index)
        v = np.int32(flags & _VERSION)
        t = _be32(p, 32)
        if mtype == _PROBE:
            if length != HEADER_SIZE:
                counters[5] += 1
                job_counters[j, 5] += 1
                continue
            p[3] = _PROBE_OK
            _put16(p, 28, count[v, s])
            _put32(p, 32, seen[v, s])
            _put16(p, 30, world)
            _put32(p, 40, 0)
            _put32(p, 44, tag[v, s])
            actions[i] = A_UNICAST
            counters[21] += 1
            job_counters[j, 21] += 1
            continue
        if p[5] != _INT32:
            counters[4] += 1
            job_counters[j, 4] += 1
            continue
        if _be32(p, 20) != np.uint32(k) or length != plen:
            counters[5] += 1
            job_counters[j, 5] += 1
            continue
        if mtype == _RESULT:
            # only a parent's final sum, arriving at a rack that sent its partial up
            if (flags & _UPLINK) == 0 or not job_uplink[j] or srcs[i] != job_parent[j]:
                counters[7] += 1
                job_counters[j, 7] += 1
                continue
            if tag[v, s] != t or count[v, s] != world:
                counters[13] += 1
                job_counters[j, 13] += 1
                continue
            _load(p, values[v, s], k)
            count[v, s] = 0
            maxexp[v, s] = _s16(_be16(p, 26))
            p[4] = p[4] & _VERSION
            _put16(p, 6, 0)
            _put16(p, 30, world)
            actions[i] = A_MULTICAST
            counters[20] += 1
            job_counters[j, 20] += 1
            continue
        sender = _be16(p, 6)
        if sender >= world or members[j, sender] != srcs[i]:
            counters[7] += 1
            job_counters[j, 7] += 1
            continue
        bit = np.uint32(1) << np.uint32(sender)
        stored = tag[v, s]
        c = count[v, s]
        d = np.uint32(t - stored)
        if d >= np.uint32(0x80000000):
            counters[9] += 1
            job_counters[j, 9] += 1
            continue
        if d == 0 and (seen[v, s] & bit) != 0:
            if c == 0:
                # complete: the sender lost the result; answer it alone
                _as_result(p, values[v, s], k, maxexp[v, s], world, world)
                actions[i] = A_UNICAST
                counters[17] += 1
                job_counters[j, 17] += 1
            elif job_uplink[j] and c == world:
                # waiting on the parent: the partial (or the final) was lost
                _as_partial(p, values[v, s], k, maxexp[v, s], job_rack[j], world)
                actions[i] = A_UPLINK
                counters[19] += 1
                job_counters[j, 19] += 1
            else:
                counters[10] += 1
                job_counters[j, 10] += 1
            continue
        nexp = _s16(_be16(p, 26))
        if d != 0:
            if c != 0:
                counters[11] += 1
                job_counters[j, 11] += 1
                continue
            _load(p, values[v, s], k)
            c = 1
            tag[v, s] = t
            seen[v, s] = bit
            expo[v, s] = _s16(_be16(p, 24))
            maxexp[v, s] = nexp
        else:
            if c == 0:
                counters[9] += 1
                job_counters[j, 9] += 1
                continue
            if _s16(_be16(p, 24)) != expo[v, s]:
                counters[12] += 1
                job_counters[j, 12] += 1
                continue
            _add(p, values[v, s], k)
            c += 1
            seen[v, s] |= bit
            if nexp > maxexp[v, s]:
                maxexp[v, s] = nexp
        seen[1 - v, s] &= ~bit
        count[v, s] = c
        counters[15] += 1
        job_counters[j, 15] += 1
        if c == world:
            if job_uplink[j]:
                _as_partial(p, values[v, s], k, maxexp[v, s], job_rack[j], world)
                actions[i] = A_UPLINK
                counters[18] += 1
                job_counters[j, 18] += 1
            else:
                count[v, s] = 0
                _as_result(p, values[v, s], k, maxexp[v, s], world, world)
                actions[i] = A_MULTICAST
                counters[16] += 1
                job_counters[j, 16] += 1


class SwitchRegisters:
    """The data path's state: the pool's registers and the job tables."""

    def __init__(self, pool: int, elements: int):
        self.pool = pool
        self.elements = elements
        self.values = np.zeros((2, pool, elements), np.int32)
        self.count = np.zeros((2, pool), np.int32)
        self.seen = np.zeros((2, pool), np.uint32)
        self.tag = np.zeros((2, pool), np.uint32)
        self.expo = np.zeros((2, pool), np.int16)
        self.maxexp = np.zeros((2, pool), np.int16)
        self.job_ids = np.zeros(MAX_JOBS, np.uint32)
        self.job_used = np.zeros(MAX_JOBS, np.bool_)
        self.job_base = np.zeros(MAX_JOBS, np.int32)
        self.job_slots = np.zeros(MAX_JOBS, np.int32)
        self.job_world = np.zeros(MAX_JOBS, np.int32)
        self.job_uplink = np.zeros(MAX_JOBS, np.bool_)
        self.job_rack = np.zeros(MAX_JOBS, np.int32)
        self.job_parent = np.full(MAX_JOBS, -1, np.int64)
        self.members = np.full((MAX_JOBS, MAX_WORKERS), -1, np.int64)
        self.counters = np.zeros(len(COUNTERS), np.int64)
        self.job_counters = np.zeros((MAX_JOBS, len(COUNTERS)), np.int64)

    def reset_slice(self, base: int, slots: int) -> None:
        """A new job starts from empty registers."""
        sl = slice(base, base + slots)
        for arr in (self.values, self.count, self.seen, self.tag, self.expo, self.maxexp):
            arr[:, sl] = 0

    def run(self, batch: PacketBatch, actions, act_job, out_len) -> None:
        process_batch(batch.data, batch.lengths, batch.sources, batch.count, self.elements, self.values,
                      self.count, self.seen, self.tag, self.expo, self.maxexp, self.job_ids, self.job_used,
                      self.job_base, self.job_slots, self.job_world, self.job_uplink, self.job_rack,
                      self.job_parent, self.members, self.counters, self.job_counters, actions, act_job, out_len)


@dataclass
class SwitchJob:
    index: int  #: row in the job tables
    job_id: int
    name: str
    world: int
    base: int
    slots: int
    members: dict = field(default_factory=dict)  #: rank -> (ip, port)
    #: uplink: the parent accepted this rack (JOIN_OK) or is still asked
    uplink_ready: bool = True
    pending_joins: list = field(default_factory=list)
    #: the job's packet counters' sum when last looked at, and when it last changed
    activity: int = 0
    last_active: float = field(default_factory=time.monotonic)


class SwitchService:
    """One UDP socket, one data path; control messages in Python."""

    def __init__(self, listen: str | Address, pool: int = DEFAULT_POOL, elements: int = DEFAULT_ELEMENTS,
                 parent: str | None = None, rack_id: int = 0, racks: int = 1,
                 reclaim_idle: float = DEFAULT_RECLAIM_IDLE):
        addr = parse(listen)
        if addr.scheme != "udp":
            raise ValueError(f"switch mode listens on udp://host:port, not {addr}")
        if not 1 <= elements <= MAX_ELEMENTS:
            raise ValueError(f"elements per packet must be 1..{MAX_ELEMENTS}, got {elements}")
        if pool < 1:
            raise ValueError(f"pool must hold at least one slot, got {pool}")
        if not reclaim_idle > 0:
            raise ValueError(f"reclaim_idle must be a positive number of seconds, got {reclaim_idle!r}")
        self.reclaim_idle = reclaim_idle
        self._next_activity_check = 0.0
        self.regs = SwitchRegisters(pool, elements)
        self.sock = open_udp(addr)
        host, port = self.sock.getsockname()
        self.address = Address("udp", host, port)
        self.mtu = HEADER_SIZE + 4 * elements
        # room for control messages too (JOIN's JSON), whatever K is
        self.batch = PacketBatch(BATCH, max(self.mtu, 4096) + 64)
        self.actions = np.zeros(BATCH, np.int8)
        self.act_job = np.zeros(BATCH, np.int32)
        self.out_len = np.zeros(BATCH, np.int32)
        self.jobs: dict[int, SwitchJob] = {}
        self.free = [(0, pool)]  # free (base, slots) runs of the pool
        self.parent = None
        if parent is not None:
            p = parse(parent)
            self.parent = (socket.gethostbyname(p.host), p.port)
        self.rack_id = rack_id
        self.racks = racks
        self._multicast: dict[int, list] = {}
        self.control_counters: collections.Counter = collections.Counter()
        # compile the data path before serving: a first packet must not wait
        self.batch.count = 0
        self.regs.run(self.batch, self.actions, self.act_job, self.out_len)

    # -- the loop ------------------------------------------------------------------

    def serve(self, should_stop) -> None:
        batch, sock = self.batch, self.sock
        while not should_stop():
            n = batch.receive(sock, 0.2)
            if n:
                self.step(n)
            now = time.monotonic()
            if now >= self._next_activity_check:
                self._next_activity_check = now + ACTIVITY_CHECK_INTERVAL
                self._note_activity(now)

    def step(self, n: int) -> None:
        self.regs.run(self.batch, self.actions, self.act_job, self.out_len)
        views, addrs, actions, out_len, act_job = self.batch.views, self.batch.addrs, self.actions, self.out_len, self.act_job
        for i in range(n):
            a = actions[i]
            if a == A_DROP:
                continue
            if a == A_CONTROL:
                self._control(i)
                continue
            data = views[i][: out_len[i]]
            if a == A_UNICAST:
                self._send(data, addrs[i])
            elif a == A_MULTICAST:
                for dest in self._multicast.get(int(act_job[i]), ()):
                    self._send(data, dest)
            elif a == A_UPLINK:
                self._send(data, self.parent)

    def _send(self, data, dest) -> None:
        try:
            self.sock.sendto(data, dest)
        except OSError as exc:  # a peer gone (ICMP) or a full buffer: the protocol retransmits
            self.control_counters[f"send_error_{exc.errno}"] += 1

    # -- control ---------------------------------------------------------------------

    def _control(self, i: int) -> None:
        raw = self.batch.views[i][: self.batch.lengths[i]]
        src = self.batch.addrs[i]
        try:
            h = wire.unpack_header(raw)
            payload = raw[HEADER_SIZE:]
            wire.check_payload(h, len(payload))
        except wire.WireError as exc:
            self.control_counters[f"dropped_malformed_{exc.reason}"] += 1
            return
        if h.msg_type == MsgType.JOIN:
            self._join(h, payload, src, raw)
        elif h.msg_type == MsgType.LEAVE:
            self._leave(h, src)
        elif h.msg_type == MsgType.JOIN_OK and self.parent is not None and src == self.parent:
            self._parent_joined(h)
        elif h.msg_type == MsgType.ERROR and self.parent is not None and src == self.parent:
            self._parent_refused(h, payload)
        elif h.msg_type == MsgType.STATS:
            self._reply(src, MsgType.STATS_OK, wire.json_payload(self.stats()))
        elif h.msg_type == MsgType.HELLO:
            self._reply(src, MsgType.HELLO_OK, wire.json_payload(
                {"service": "aggnet", "mode": "switch", "version": wire.VERSION, "shards": [str(self.address)],
                 "elements": self.regs.elements, "pool": self.regs.pool}))
        else:
            self.control_counters["dropped_unexpected_type"] += 1

    def _reply(self, dest, msg_type: MsgType, payload: bytes, h: Header | None = None) -> None:
        out = Header(msg_type) if h is None else h
        out.msg_type = msg_type
        self._send(out.pack_for(payload) + payload, dest)

    def _error(self, dest, h: Header, code: ErrorCode, text: str) -> None:
        self.control_counters[f"refused_{code.value}"] += 1
        self._reply(dest, MsgType.ERROR, wire.error_payload(code, text),
                    Header(MsgType.ERROR, job_id=h.job_id, sender=h.sender))

    def _join(self, h: Header, payload, src, raw) -> None:
        try:
            info = wire.parse_json(payload)
        except wire.WireError as exc:
            self._error(src, h, ErrorCode.MALFORMED, str(exc))
            return
        name = str(info.get("name", h.job_id))
        world = h.world
        if not 1 <= world <= MAX_WORKERS or h.sender >= world:
            self._error(src, h, ErrorCode.REFUSED,
                        f"rank {h.sender} and world size {world}: an aggregator takes 1..{MAX_WORKERS} workers per job")
            return
        elements = int(info.get("elements", self.regs.elements))
        if elements != self.regs.elements:
            self._error(src, h, ErrorCode.JOB_MISMATCH,
                        f"this aggregator sums {self.regs.elements} elements per packet, the worker asked for "
                        f"{elements}; set the client's elements to {self.regs.elements}")
            return
        job = self.jobs.get(h.job_id)
        if job is None:
            job = self._install(h.job_id, name, world, int(info.get("slots", DEFAULT_JOB_SLOTS)), src, h)
            if job is None:
                return
        elif job.name != name:
            self._error(src, h, ErrorCode.JOB_MISMATCH,
                        f"job id {h.job_id:08x} belongs to job {job.name!r}, not {name!r}; choose another job name")
            return
        elif job.world != world:
            self._error(src, h, ErrorCode.JOB_MISMATCH,
                        f"job {name!r} is registered with world size {job.world} but rank {h.sender} joined "
                        f"with world size {world}; all workers must agree")
            return
        old = job.members.get(h.sender)
        if old is not None and old != src:
            log.warning("switch: job %r rank %d re-joined from %s (was %s)", name, h.sender, src, old)
        job.members[h.sender] = src
        job.last_active = time.monotonic()
        self.regs.members[job.index, h.sender] = addr_key(src)
        self._multicast[job.index] = [job.members[r] for r in sorted(job.members)]
        # the reply is the JOIN itself, answered in its header (slots in
        # index, K in nsum, base in offset, world), as the P4 program does
        h.msg_type, h.index, h.nsum, h.offset, h.world = MsgType.JOIN_OK, job.slots, self.regs.elements, job.base, world
        reply = bytearray(raw)
        wire.pack_into(reply, h)
        if job.uplink_ready:
            self._send(reply, src)
        else:
            job.pending_joins.append((src, bytes(reply), h))
            self._ask_parent(job)

    def _install(self, job_id: int, name: str, world: int, slots: int, src, h: Header) -> SwitchJob | None:
        place = self._place(slots)
        if place is None and self._reclaim_idle_jobs(name):
            place = self._place(slots)
        if place is None:
            self._error(src, h, ErrorCode.REFUSED,
                        f"no room for job {name!r}: {len(self.jobs)} jobs, largest free run of the pool "
                        f"{max((s for _, s in self.free), default=0)} slots, asked for {slots}")
            return None
        row, base = place
        r = self.regs
        r.reset_slice(base, slots)
        r.job_ids[row], r.job_base[row], r.job_slots[row], r.job_world[row] = job_id, base, slots, world
        r.members[row, :] = -1
        r.job_counters[row, :] = 0
        r.job_uplink[row] = self.parent is not None
        r.job_rack[row] = self.rack_id
        r.job_parent[row] = addr_key(self.parent) if self.parent is not None else -1
        r.job_used[row] = True
        job = SwitchJob(row, job_id, name, world, base, slots, uplink_ready=self.parent is None)
        self.jobs[job_id] = job
        log.info("switch: job %r (id %08x) installed: world %d, slots %d..%d%s", name, job_id, world, base,
                 base + slots - 1, f", uplink to {self.parent} as rack {self.rack_id}" if self.parent else "")
        return job

    def _ask_parent(self, job: SwitchJob) -> None:
        h = Header(MsgType.JOIN, job_id=job.job_id, sender=self.rack_id, world=self.racks)
        payload = wire.json_payload({"name": job.name, "slots": job.slots, "elements": self.regs.elements})
        self._send(h.pack_for(payload) + payload, self.parent)

    def _parent_joined(self, h: Header) -> None:
        job = self.jobs.get(h.job_id)
        if job is None or job.uplink_ready:
            return
        job.uplink_ready = True
        log.info("switch: parent %s accepted job %r from rack %d", self.parent, job.name, self.rack_id)
        for src, reply, _ in job.pending_joins:
            self._send(reply, src)
        job.pending_joins.clear()

    def _parent_refused(self, h: Header, payload) -> None:
        job = self.jobs.get(h.job_id)
        if job is None:
            return
        code, text = wire.parse_error(payload)
        for src, _, reply in job.pending_joins:
            self._error(src, reply, ErrorCode(code) if code in ErrorCode._value2member_map_ else ErrorCode.REFUSED,
                        f"the parent aggregator {self.parent} refused job {job.name!r}: {text}")
        job.pending_joins.clear()

    def _leave(self, h: Header, src) -> None:
        job = self.jobs.get(h.job_id)
        if job is None or job.members.get(h.sender) != src:
            return
        del job.members[h.sender]
        self.regs.members[job.index, h.sender] = -1
        self._multicast[job.index] = [job.members[r] for r in sorted(job.members)]
        if not job.members:
            self._remove(job)
            log.info("switch: job %r finished (every worker left)", job.name)

    def _remove(self, job: SwitchJob) -> None:
        self.regs.job_used[job.index] = False
        self.regs.members[job.index, :] = -1
        self._multicast.pop(job.index, None)
        self._release(job.base, job.slots)
        del self.jobs[job.job_id]

    def _note_activity(self, now: float) -> None:
        """A job is active while its packet counters move; reading them
        once a second keeps the data path free of clocks."""
        for job in self.jobs.values():
            total = int(self.regs.job_counters[job.index].sum())
            if total != job.activity:
                job.activity, job.last_active = total, now

    def _reclaim_idle_jobs(self, wanted_by: str) -> bool:
        """Remove the jobs silent for ``reclaim_idle`` seconds; true when any was."""
        now = time.monotonic()
        self._note_activity(now)
        idle = [job for job in self.jobs.values() if now - job.last_active >= self.reclaim_idle]
        for job in idle:
            log.warning("switch: job %r (id %08x, ranks %s joined) sent nothing for %.0fs; its slots %d..%d go to "
                        "job %r (its workers must have stopped without LEAVE)", job.name, job.job_id,
                        sorted(job.members), now - job.last_active, job.base, job.base + job.slots - 1, wanted_by)
            self.control_counters["jobs_reclaimed"] += 1
            self._remove(job)
        return bool(idle)

    def _place(self, slots: int) -> tuple[int, int] | None:
        """A free job row and a free run of ``slots`` slots, or None."""
        free_rows = np.flatnonzero(~self.regs.job_used)
        if free_rows.size == 0:
            return None
        base = self._allocate(slots)
        return None if base is None else (int(free_rows[0]), base)

    def _allocate(self, slots: int) -> int | None:
        for i, (base, size) in enumerate(self.free):
            if size >= slots:
                self.free[i] = (base + slots, size - slots)
                if self.free[i][1] == 0:
                    del self.free[i]
                return base
        return None

    def _release(self, base: int, slots: int) -> None:
        runs = sorted(self.free + [(base, slots)])
        merged = []
        for b, s in runs:
            if merged and merged[-1][0] + merged[-1][1] == b:
                merged[-1] = (merged[-1][0], merged[-1][1] + s)
            else:
                merged.append((b, s))
        self.free = merged

    def stats(self) -> dict:
        r = self.regs
        totals = {name: int(v) for name, v in zip(COUNTERS, r.counters) if v}
        totals.update(self.control_counters)
        jobs = {}
        for job in self.jobs.values():
            jobs[job.name] = {"id": job.job_id, "world": job.world, "base": job.base, "slots": job.slots,
                              "members": sorted(job.members),
                              "counters": {name: int(v) for name, v in zip(COUNTERS, r.job_counters[job.index]) if v}}
        return {"mode": "switch", "address": str(self.address), "elements": r.elements, "pool": r.pool,
                "totals": totals, "jobs": jobs}

    def close(self) -> None:
        self.sock.close()


def describe_key(key: int) -> str:
    ip, port = key_addr(key)
    return f"{ip}:{port}"
