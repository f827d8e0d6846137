"""The aggregator host in switch mode: docs/protocol.md, exactly.

``aggnet serve --mode switch`` speaks the in-network aggregation protocol
over UDP the way the P4 program does: the same packets in give the same
packets out, so it stands in for a top-of-rack switch, serves as the parent
level of a hierarchy, and is the reference the P4 program is tested
against.

It runs K shard processes (one per core by default). Shard ``i`` owns the
contiguous range ``[i * P/K, (i + 1) * P/K)`` of the pool and its own UDP
socket at the listen port plus ``i``; a job's slice may span shards, and
workers send each slot's packets to the port of the shard that owns it
(the JOIN_OK says how many pool slots a shard holds, in ``ref``). Each
shard receives with GRO, runs the data path (:mod:`.switch_datapath`) as
one numba call per batch and sends results with GSO. Shard 0, at the
listen port, also answers control messages (JOIN, LEAVE, STATS), as a
switch's control plane would; the registers and job tables are shared
memory, so what it installs the other shards see at once.
"""

from __future__ import annotations

import collections
import logging
import socket
import time
from dataclasses import dataclass, field

import numpy as np

from aggnet.protocol import control, wire
from aggnet.protocol.address import Address, advertised_as, parse
from aggnet.protocol.control import ControlError
from aggnet.protocol.keys import Keyring
from aggnet.protocol.limits import (
    DEFAULT_HOST_ELEMENTS, DEFAULT_POOL, MAX_ELEMENTS, MAX_JOB_SLOTS, MAX_JOBS, MAX_SHARD_PORTS, MAX_WORKERS, Drop,
    auto_slots, check_shard_layout,
)
from aggnet.protocol.messages import Heartbeat, JoinHeartbeats, JoinOk, JoinShards, ask_padding
from aggnet.protocol.pool import Placement, SlotPool
from aggnet.transport.udp import BATCH_BYTES, DatagramSocket, addr_key, key_addr
from aggnet.protocol.wire import HEADER_SIZE, ErrorCode, Header, MsgType

from aggnet.hosts.admission import Disagreement, PendingJoin, admit, data_address
from aggnet.hosts.parent import Joins, Standing, refusal, whole_here
from aggnet.hosts.switch_datapath import A_CONTROL, COUNTERS, SendPlan, SwitchRegisters, verdicts_for
from aggnet.hosts.aggregator import STOP_POLL, Aggregator
from aggnet.hosts.supervisor import ShardSupervisor

log = logging.getLogger("aggnet.hosts.switch")

#: UDP requests whose datagram may run past their payload: padding that
#: entitles them to a reply as large (messages.padding_asked)
_PADDED = (MsgType.HELLO, MsgType.STATS)

#: a job whose packets stopped this long ago may give its slice to a new
#: job when the pool is full: its workers died without LEAVE (a killed
#: process sends none). Only under pressure, so a job pausing for a long
#: evaluation keeps its slice while there is room.
DEFAULT_RECLAIM_IDLE = 300.0
#: how often the loop notes which jobs saw packets
ACTIVITY_CHECK_INTERVAL = 1.0
#: a member whose heartbeats (the client sends a few per lapse) stop for
#: this long is gone: the others hear it at once, not after their stall
#: timeout. Only members whose JOIN asked for heartbeats are judged (a
#: rack joining its parent, and older clients, ask for none). A datagram
#: path has no connection whose closing says a worker died, as a ZeroMQ
#: service has. Seconds, not less: a training process on a loaded host (its
#: data loaders busy, a collection of a large heap) can stop for over a
#: second and is alive, and a false lapse fails the whole job.
DEFAULT_HEARTBEAT_LAPSE = 3.0
#: how often the loop looks for lapsed members
HEARTBEAT_CHECK_INTERVAL = 0.1
#: a pass of the loop longer than this (with the check interval) is the
#: aggregator's own pause: it was not reading, so the heartbeats still
#: queued in its socket say nothing of its members
OWN_PAUSE = 0.5
#: datagrams one receive takes at most (a few MiB of packets)
MAX_BATCH = 8192
#: seconds a shard waits for datagrams before looking at its stop flag
POLL_SECONDS = STOP_POLL


@dataclass
class SwitchJob:
    index: int  #: row in the job tables
    job_id: int
    name: str
    world: int
    base: int
    slots: int
    elements: int
    members: dict = field(default_factory=dict)  #: rank -> (ip, port)
    #: uplink: the parent accepted this rack (JOIN_OK) or is still asked
    #: under a parent: whether it took the job, and the members' JOIN_OKs
    #: held until it does
    parent: Standing = field(default_factory=Standing)
    #: every member joins here (hosts.parent.whole_here): completes here under a parent too
    whole: bool = False
    #: the job's packet counters' sum when last looked at, and when it last changed
    activity: int = 0
    last_active: float = field(default_factory=time.monotonic)
    #: rank -> when its last heartbeat came (members that send them)
    heard: dict = field(default_factory=dict)


def _bind_shards(addr: Address, shards: int, io: str | None, max_bytes: int) -> list[DatagramSocket]:
    """Sockets at consecutive ports: the listen port (any free one for 0)
    and the next ``shards - 1``."""
    tries = 20 if addr.port == 0 else 1
    for attempt in range(tries):
        socks: list[DatagramSocket] = []
        try:
            first = DatagramSocket((addr.host, addr.port), io=io, max_datagrams=MAX_BATCH,
                                   max_datagram_bytes=max_bytes)
            socks.append(first)
            port = first.address[1]
            for i in range(1, shards):
                socks.append(DatagramSocket((addr.host, port + i), io=io, max_datagrams=MAX_BATCH,
                                            max_datagram_bytes=max_bytes))
            return socks
        except OSError:
            for s in socks:
                s.close()
            if attempt == tries - 1:
                raise
    raise OSError(f"no {shards} consecutive free UDP ports on {addr.host}")


class SwitchService(Aggregator):
    """K shard sockets over one shared data path; control on shard 0."""

    kind = "switch"
    title = "aggnet switch-mode aggregator"

    def __init__(self, listen: str | Address, *, pool: int = DEFAULT_POOL, elements: int = DEFAULT_HOST_ELEMENTS,
                 parent: str | None = None, rack_id: int = 0, racks: int = 1,
                 reclaim_idle: float = DEFAULT_RECLAIM_IDLE, shards: int = 1,
                 max_elements: int | None = None, io: str | None = None, keyring: Keyring | None = None,
                 advertise: str | None = None, heartbeat_lapse: float = DEFAULT_HEARTBEAT_LAPSE):
        addr = parse(listen)
        #: the host HELLO_OK names (workers use the address they sent to;
        #: the list is for people and tools)
        self.advertise = advertise
        self.keyring = keyring or Keyring()
        if max_elements is None:
            max_elements = max(elements, DEFAULT_HOST_ELEMENTS)
        if addr.scheme != "udp":
            raise ValueError(f"switch mode listens on udp://host:port, not {addr}")
        if not 1 <= max_elements <= MAX_ELEMENTS:
            raise ValueError(f"max elements per packet must be 1..{MAX_ELEMENTS}, got {max_elements}")
        if not 1 <= elements <= max_elements:
            raise ValueError(f"elements per packet must be 1..{max_elements}, got {elements}")
        if pool < 1:
            raise ValueError(f"pool must hold at least one slot, got {pool}")
        if not 1 <= shards <= min(pool, MAX_SHARD_PORTS):
            raise ValueError(f"shards must be 1..{min(pool, MAX_SHARD_PORTS)}, got {shards}")
        if not reclaim_idle > 0:
            raise ValueError(f"reclaim_idle must be a positive number of seconds, got {reclaim_idle!r}")
        if not 0 <= heartbeat_lapse <= 60:
            raise ValueError(f"heartbeat lapse must be 0 (off) to 60 seconds, got {heartbeat_lapse!r}")
        #: seconds without a heartbeat after which a member is gone (0: never)
        self.heartbeat_lapse = heartbeat_lapse
        self._next_heartbeat_check = 0.0
        self._heartbeats_checked: float | None = None
        if not 0 <= rack_id < racks <= MAX_WORKERS:
            raise ValueError(f"rack id {rack_id} of {racks} racks: a parent takes 1..{MAX_WORKERS} racks")
        self.reclaim_idle = reclaim_idle
        self._next_activity_check = 0.0
        self.default_elements = elements
        self.shards = shards
        self.regs = SwitchRegisters(pool, max_elements, shards)
        # room for any packet of the largest K, and for control messages
        self.socks = _bind_shards(addr, shards, io, max(HEADER_SIZE + 4 * max_elements, 4096) + 64)
        self.sock = self.socks[0]
        host, port = self.sock.address
        self.address = Address("udp", host, port)
        self.verdicts = verdicts_for(MAX_BATCH)
        self.plan = SendPlan(MAX_BATCH)
        self.jobs: dict[int, SwitchJob] = {}
        self.pool = SlotPool(pool, MAX_JOBS)
        self.parent = None
        if parent is not None:
            p = parse(parent)
            if p.scheme != "udp":
                raise ValueError(f"the parent of a switch-mode aggregator is udp://host:port, not {parent}")
            self.parent = (socket.gethostbyname(p.host), p.port)
        self._parent_joins = Joins(self._ask_parent)
        self.rack_id = rack_id
        self.racks = racks
        self.control_counters: collections.Counter = collections.Counter()
        self._supervisor: ShardSupervisor | None = None  #: shards 1.. once serving
        self._warm_data_path()

    @property
    def io(self) -> str:
        return self.sock.io

    @property
    def shard_slots_advertised(self) -> int:
        """What JOIN_OK says in ``ref``: pool slots per shard, 0 for one
        socket (as a P4 switch, which leaves ``ref`` alone)."""
        return self.regs.shard_slots if self.shards > 1 else 0

    # -- the loop ------------------------------------------------------------------

    def serve(self, should_stop, started=None) -> None:
        """Fork the data shards, then serve shard 0 (data and control)
        until ``should_stop()``; the shards stop with it. ``started`` runs
        once the shards serve (threads started earlier would be copied
        into them half-way)."""
        self._start_shards()
        try:
            if started is not None:
                started()
            while not should_stop():
                n = self.sock.receive(POLL_SECONDS, BATCH_BYTES)
                self._step(self.sock, 0, n)
                now = time.monotonic()
                if now >= self._next_heartbeat_check:
                    self._next_heartbeat_check = now + HEARTBEAT_CHECK_INTERVAL
                    self._check_heartbeats(now)
                if now >= self._next_activity_check:
                    self._next_activity_check = now + ACTIVITY_CHECK_INTERVAL
                    self._note_activity(now)
                    dead = self._supervisor.exited()
                    if dead:
                        # a shard's slots would go unanswered: no restart, the
                        # registers it held may be half-written
                        log.error("switch-mode shard %d (pid %d) died with status %s; stopping the aggregator",
                                  dead[0].index, dead[0].pid, dead[0].exitcode)
                        break
        finally:
            self._stop_shards()

    def _start_shards(self) -> None:
        """Fork shards 1..K-1: each inherits its bound socket and the shared
        registers, and shares nothing else it uses."""
        self._supervisor = ShardSupervisor(self._shard_main, self.shards - 1, first=1, label="switch-mode shard")
        self._supervisor.start()
        for s in self.socks[1:]:
            s.close()  # the shard processes own them now

    def _shard_main(self, index: int, report, should_stop) -> None:
        for i, s in enumerate(self.socks):
            if i != index:
                s.close()
        sock = self.socks[index]
        report.ready(str(Address("udp", *sock.address)))
        while not should_stop():
            n = sock.receive(POLL_SECONDS, BATCH_BYTES)
            self._step(sock, index, n)

    def _stop_shards(self) -> None:
        if self._supervisor is not None:
            self._supervisor.stop()

    def _step(self, sock: DatagramSocket, shard: int, n: int) -> None:
        for _ in range(sock.take_truncated()):
            # larger than any packet of a job: a wrong length, on every io path
            self.regs.count_drop(shard, Drop.LENGTH)
        if not n:
            return
        self.regs.run(sock, shard, self.verdicts)
        for i in np.flatnonzero(self.verdicts.action[:n] == A_CONTROL):
            if shard == 0:
                self._control_guarded(int(i))
            else:
                self.regs.count_drop(shard, Drop.CONTROL_AT_DATA_SHARD)
        runs = self.plan.plan(sock, self.regs, self.verdicts)
        if runs:
            self.plan.send(sock, runs)

    def _warm_data_path(self) -> None:
        """Compile (or load from numba's cache) the data path's kernels on
        an empty batch, before serving. Compiled at the first packet
        instead, they took seconds on a cold cache (a fresh install) in the
        one loop that also hears heartbeats: the first members of the first
        job were dropped as silent. The shards fork after this and inherit
        the compiled kernels."""
        self.regs.run(self.sock, 0, self.verdicts)
        self.plan.plan(self.sock, self.regs, self.verdicts)

    def _send(self, data, dest) -> None:
        self.sock.send(data, dest)

    # -- control ---------------------------------------------------------------------

    def _control_guarded(self, i: int) -> None:
        """No control message, however malformed, stops the aggregator."""
        try:
            self._control(i)
        except Exception:
            self.control_counters["internal_error"] += 1
            log.exception("switch: control message from %s failed", key_addr(int(self.sock.sources[i])))

    def _control(self, i: int) -> None:
        raw = self.sock.datagram(i)
        src = self.sock.addr_of(int(self.sock.sources[i]))
        try:
            h = wire.unpack_header(raw)
            payload = raw[HEADER_SIZE:]
            if h.msg_type in _PADDED and len(payload) > h.count:
                payload = payload[:h.count]  # the rest pads the request (messages.padding_asked)
            wire.check_payload(h, len(payload))
        except wire.WireError as exc:
            self.control_counters[f"dropped_malformed_{exc.reason}"] += 1
            return
        if h.msg_type == MsgType.JOIN:
            try:
                self._join(h, payload, src, raw)
            except ControlError as exc:
                self.control_counters[f"dropped_{exc.reason}"] += 1
                self._error(src, h, exc.code, str(exc))
                job = self.jobs.get(h.job_id)
                if isinstance(exc, Disagreement) and job is not None:
                    # every member hears the verdict at once, not a timeout
                    for rank, member in job.members.items():
                        if member != src:
                            self._reply(member, MsgType.ERROR, wire.error_payload(exc.code, str(exc)),
                                        Header(MsgType.ERROR, job_id=h.job_id, sender=rank))
        elif h.msg_type == MsgType.LEAVE:
            self._leave(h, src)
        elif h.msg_type == MsgType.HEARTBEAT:
            self._heartbeat(h, src)
        elif h.msg_type == MsgType.JOIN_OK and self.parent is not None and src == self.parent:
            self._parent_joined(h)
        elif h.msg_type == MsgType.ERROR and self.parent is not None and src == self.parent:
            self._parent_refused(h, payload)
        elif h.msg_type == MsgType.STATS:
            try:
                view = self.keyring.stats_view(h, payload, src)
            except ControlError as exc:
                self.control_counters[f"dropped_{exc.reason}"] += 1
                self._error(src, h, exc.code, str(exc))
                return
            signed = self.keyring.enforced and view != set()
            self._reply_bounded(src, MsgType.STATS_OK, wire.json_payload(self.collect_stats(view)), len(raw), signed)
        elif h.msg_type == MsgType.HELLO:
            self._reply_bounded(src, MsgType.HELLO_OK, wire.json_payload(
                {"service": "aggnet", "mode": "switch", "version": wire.VERSION,
                 "shards": [str(advertised_as(self.address.with_port(self.address.port + i), self.advertise))
                            for i in range(self.shards)],
                 "shard_slots": self.regs.shard_slots, "elements": self.default_elements,
                 "max_elements": self.regs.max_elements, "pool": self.regs.pool, "io": self.io}), len(raw), False)
        else:
            self.control_counters["dropped_unexpected_type"] += 1

    def _reply_bounded(self, dest, msg_type: MsgType, payload: bytes, asked: int, signed: bool) -> None:
        """A reply to a UDP request that anyone can send from a forged
        source: unless signed with a key, no more bytes than the request
        had; a larger one is asked for again, padded (messages.padding_asked)."""
        if signed or HEADER_SIZE + len(payload) <= asked:
            self._reply(dest, msg_type, payload)
            return
        self.control_counters["padding_asked"] += 1
        self._send(ask_padding(msg_type, HEADER_SIZE + len(payload)).pack(), dest)

    def _reply(self, dest, msg_type: MsgType, payload: bytes, h: Header | None = None) -> None:
        out = Header(msg_type) if h is None else h
        out.msg_type = msg_type
        self._send(out.pack_for(payload) + payload, dest)

    def _error(self, dest, h: Header, code: ErrorCode, text: str) -> None:
        self.control_counters[f"refused_{code.value}"] += 1
        self._reply(dest, MsgType.ERROR, wire.error_payload(code, text),
                    Header(MsgType.ERROR, job_id=h.job_id, sender=h.sender))

    def _join(self, h: Header, payload, src, raw) -> None:
        info = control.parse(control.JOIN, payload, "JOIN")
        name = info.get("name", str(h.job_id))
        job = self.jobs.get(h.job_id)
        # a rack joining its parent is not a worker: it holds no job key,
        # and the parent is configured with the racks' addresses instead
        admit(self.keyring, h, name, info, src, job, max_world=MAX_WORKERS)
        # a P4 switch under this root is joined by its control plane: its
        # partials come from, and its finals go to, the switch's address
        member = data_address(info, src)
        # a member's shard layout (a sharded rack joining its parent): where
        # its packets for a slot come from and where results go
        layout = JoinShards.from_header(h)
        if not layout.shard_slots:
            layout = JoinShards(0, 0)
        created = job is None
        job = self._job_joined(h, info, name, job)
        if job is None:
            return
        if not created and self.parent is not None and job.whole != whole_here(h, info):
            raise Disagreement(f"job {name!r} completes {'here' if job.whole else 'at the parent'}, but rank "
                               f"{h.sender} joined it as {'all' if whole_here(h, info) else 'part'} of the job's "
                               f"workers; give every worker the same world size", "world_mismatch")
        if layout.shard_slots:
            try:
                check_shard_layout(layout.base, job.slots, layout.shard_slots, member[1])
            except ValueError as exc:
                if created:
                    self._remove(job)  # a refused JOIN installs nothing
                raise ControlError(ErrorCode.MALFORMED, f"JOIN's shard layout for job {name!r}: {exc}") from None
        self._take_member(job, h, name, member, src, info["heartbeats"])
        self.regs.set_member(job.index, h.sender, addr_key(member), layout.base, layout.shard_slots)
        # the reply is the JOIN itself, answered in its header as the P4
        # program does; a sharded host adds its pool slots per shard
        JoinOk(job.slots, job.elements, job.base, h.world, self.shard_slots_advertised).to_header(h)
        if info["heartbeats"] and self.heartbeat_lapse:
            JoinHeartbeats(round(self.heartbeat_lapse * 1000)).to_header(h)
        if job.parent.ready:
            reply = bytearray(raw)
            wire.pack_into(reply, h)
            self._send(reply, src)
        else:
            job.parent.hold(PendingJoin(src, h, bytes(payload)))
            self._parent_joins.want(job.job_id, time.monotonic())

    def _job_joined(self, h: Header, info: dict, name: str, job: SwitchJob | None) -> SwitchJob | None:
        """The job a JOIN joins: installed by its first JOIN (None when the
        pool has no room yet), else checked against what this JOIN asks."""
        kmax = self.regs.max_elements
        asked = info["elements"]
        fits = info.get("max_elements", kmax)
        if job is None:
            k = asked or min(self.default_elements, fits)
            if k > kmax:
                raise ControlError(ErrorCode.JOB_MISMATCH,
                                   f"this aggregator sums at most {kmax} elements per packet, job {name!r} asked "
                                   f"for {k}; set the client's elements to {kmax} or fewer")
            if k > fits:
                raise ControlError(ErrorCode.JOB_MISMATCH,
                                   f"job {name!r} asked for {k} elements per packet, but this worker's path MTU "
                                   f"fits {fits}; ask for fewer elements or raise the MTU (jumbo frames)")
            return self._install(h.job_id, name, h.world, info["slots"] or self._auto_slots(k), k,
                                 whole_here(h, info))
        if asked and asked != job.elements:
            raise ControlError(ErrorCode.JOB_MISMATCH,
                               f"job {name!r} sums {job.elements} elements per packet, rank {h.sender} asked for "
                               f"{asked}; all workers must agree (or leave elements unset)")
        if fits < job.elements:
            raise ControlError(ErrorCode.JOB_MISMATCH,
                               f"job {name!r} sums {job.elements} elements per packet ({HEADER_SIZE + 4 * job.elements}"
                               f"-byte datagrams), more than rank {h.sender}'s path MTU fits ({fits} elements); "
                               f"raise that worker's MTU or start the job with fewer elements")
        return job

    def _take_member(self, job: SwitchJob, h: Header, name: str, member, src, heartbeats: bool) -> None:
        """Records where a rank's datagrams come from, refusing a second run
        that uses a live rank's name."""
        old = job.members.get(h.sender)
        heard = job.heard.get(h.sender)
        if old is not None and old != member and heard is not None and not self.keyring.enforced:
            # its heartbeats say the member is alive: taking it over would
            # fail both runs (a job key holder may: a signed JOIN is the job's own)
            raise ControlError(
                ErrorCode.JOB_MISMATCH,
                f"rank {h.sender} of job {name!r} is running at another address ({old[0]}:{old[1]}, heard "
                f"{time.monotonic() - heard:.1f}s ago): two runs use the same job name; give each its own (job=... "
                f"of AggnetState or Client), or start this one after the other finishes", "rank_in_use")
        if old is not None and old != member:
            log.warning("switch: job %r rank %d re-joined from %s (was %s)", name, h.sender, member, old)
            self.control_counters["rejoins"] += 1
        if member != src:
            log.info("switch: job %r rank %d joined by %s:%d for %s:%d", name, h.sender, *src, *member)
        job.members[h.sender] = member
        if heartbeats and self.heartbeat_lapse:
            # a JOIN is a sign of life too: the member is judged from now on
            # (it sends JOIN again until answered, then heartbeats)
            job.heard[h.sender] = time.monotonic()
        else:
            job.heard.pop(h.sender, None)
        job.last_active = time.monotonic()

    def _install(self, job_id: int, name: str, world: int, slots: int, k: int, whole: bool = False) -> SwitchJob:
        if not 1 <= slots <= min(MAX_JOB_SLOTS, self.regs.pool):
            raise ControlError(ErrorCode.REFUSED, f"job {name!r} asked for {slots} slots; this aggregator gives a "
                                                  f"job 1..{min(MAX_JOB_SLOTS, self.regs.pool)}")
        place = self._place(slots)
        if place is None and self._reclaim_idle_jobs(name):
            place = self._place(slots)
        if place is None and self.pool.free_row() is None:
            raise ControlError(ErrorCode.REFUSED,
                               f"no room for job {name!r}: this aggregator holds its most jobs ({MAX_JOBS}) and none "
                               f"of them is idle; wait for one to finish, or run the job on another aggregator")
        if place is None:
            raise ControlError(ErrorCode.REFUSED,
                               f"no room for job {name!r} in the pool: its largest free run is "
                               f"{self.pool.largest_free} slots, the job asked for {slots} ({len(self.jobs)} jobs "
                               f"hold the rest); ask for fewer (AGGNET_SLOTS) or wait for a job to finish")
        row, base = place
        # a job whole at this rack (hosts.parent.whole_here) completes here
        up = self.parent if not whole else None
        self.regs.install(row, job_id, base, slots, world, k, rack=self.rack_id,
                          parent=addr_key(up) if up is not None else -1)
        job = SwitchJob(row, job_id, name, world, base, slots, k, parent=Standing(ready=up is None), whole=whole)
        self.jobs[job_id] = job
        log.info("switch: job %r (id %08x) installed: world %d, slots %d..%d, %d elements per packet%s", name,
                 job_id, world, base, base + slots - 1, k,
                 f", uplink to {self.parent} as rack {self.rack_id}" if self.parent else "")
        return job

    def _auto_slots(self, k: int) -> int:
        """A job that did not say gets about 1 MiB in flight, at most a
        quarter of the pool (room for other jobs), less when that is all
        that is free."""
        largest = self.pool.largest_free
        want = max(1, min(auto_slots(k), self.regs.pool // 4))
        return max(1, min(want, largest)) if largest else want

    def _ask_parent(self, job_id: int) -> None:
        """Ask the parent to take the job (members resend their JOINs until
        answered, and each asks again, at most every RETRY_INTERVAL)."""
        job = self.jobs.get(job_id)
        if job is None or job.parent.ready:
            self._parent_joins.answered(job_id)
            return
        # this rack's shard layout rides along, as a worker's never does
        h = JoinShards(job.base if self.shards > 1 else 0, self.shard_slots_advertised).to_header(
            Header(MsgType.JOIN, job_id=job.job_id, sender=self.rack_id, world=self.racks))
        payload = wire.json_payload({"name": job.name, "slots": job.slots, "elements": job.elements})
        self._send(h.pack_for(payload) + payload, self.parent)

    def _parent_joined(self, h: Header) -> None:
        job = self.jobs.get(h.job_id)
        if job is None or job.parent.ready:
            return
        self._parent_joins.answered(job.job_id)
        ok = JoinOk.from_header(h)
        if ok.elements != job.elements or ok.slots != job.slots:
            for p in job.parent.refused():
                self._error(p.member, p.header, ErrorCode.JOB_MISMATCH,
                            f"the parent aggregator {self.parent} gave job {job.name!r} {ok.slots} slots of "
                            f"{ok.elements} elements, this rack uses {job.slots} of {job.elements}; configure both "
                            f"alike")
            return
        self.regs.set_parent_shards(job.index, ok.base, ok.shard_slots)
        log.info("switch: parent %s accepted job %r from rack %d", self.parent, job.name, self.rack_id)
        for p in job.parent.accepted():
            self._send(p.header.pack_for(p.payload) + p.payload, p.member)

    def _parent_refused(self, h: Header, payload) -> None:
        job = self.jobs.get(h.job_id)
        if job is None:
            return
        self._parent_joins.answered(job.job_id)
        code, text = wire.parse_error(payload)
        told = refusal(f"udp://{self.parent[0]}:{self.parent[1]}", job.name, self.rack_id, text)
        for p in job.parent.refused():
            self._error(p.member, p.header, ErrorCode(code) if code in ErrorCode._value2member_map_ else
                        ErrorCode.REFUSED, told)

    def _leave(self, h: Header, src) -> None:
        job = self.jobs.get(h.job_id)
        if job is None or job.members.get(h.sender) != src:
            return
        del job.members[h.sender]
        job.heard.pop(h.sender, None)
        self.regs.remove_member(job.index, h.sender)
        if not job.members:
            self._remove(job)
            log.info("switch: job %r finished (every worker left)", job.name)

    def _heartbeat(self, h: Header, src) -> None:
        """A member's heartbeat says it is alive. One from a worker that is
        not a member (any more) is answered, so that a worker dropped for
        silence (a paused process, a cut-off host) learns that its job went
        on without it, or ended with it: a job whose every member lapsed,
        or that this host lost in a restart, is no longer here at all. The
        answer is as large as the heartbeat: no amplifier for forged
        sources."""
        if self.heartbeat_lapse == 0 or h.count:
            self.control_counters["dropped_heartbeat"] += 1
            return
        job = self.jobs.get(h.job_id)
        if job is not None and job.members.get(h.sender) == src:
            job.heard[h.sender] = time.monotonic()
            return
        self.control_counters["heartbeats_of_non_members"] += 1
        self._send(Heartbeat(0).to_header(Header(MsgType.HEARTBEAT, job_id=h.job_id, sender=h.sender,
                                                 world=h.world if job is None else job.world)).pack(), src)

    def _check_heartbeats(self, now: float) -> None:
        """Members whose heartbeats stopped are gone: each other member
        hears it at once, as an ERROR that fails its open all-reduce."""
        if self.heartbeat_lapse == 0:
            return
        last, self._heartbeats_checked = self._heartbeats_checked, now
        paused = 0.0 if last is None else now - last - HEARTBEAT_CHECK_INTERVAL
        if paused > min(OWN_PAUSE, self.heartbeat_lapse / 3):
            # descheduled on a loaded host, a long batch, a slow send: a
            # member's silence is measured over time this loop listened
            self.control_counters["own_pauses"] += 1
            log.info("switch: the aggregator's loop paused %.1fs; members' heartbeat lapses start again", paused)
            for job in self.jobs.values():
                for rank in job.heard:
                    job.heard[rank] += paused
            return
        for job in list(self.jobs.values()):
            for rank, heard in list(job.heard.items()):
                silent = now - heard
                if silent >= self.heartbeat_lapse:
                    self._member_lost(job, rank, silent)

    def _member_lost(self, job: SwitchJob, rank: int, silent: float) -> None:
        self.control_counters["members_disconnected"] += 1
        log.warning("switch: job %r rank %d sent no heartbeat for %.1fs; it is no longer a member", job.name, rank,
                    silent)
        del job.members[rank]
        del job.heard[rank]
        self.regs.remove_member(job.index, rank)
        if not job.members:
            self._remove(job)
            return
        text = (f"rank {rank} of job {job.name!r} sent no heartbeat to the aggregator for {silent:.1f}s (the "
                f"worker died, or it or its host stopped); the job's rounds cannot complete without it")
        for other, member in job.members.items():
            self._reply(member, MsgType.ERROR, wire.error_payload(ErrorCode.STALL, text),
                        Header(MsgType.ERROR, job_id=job.job_id, sender=other))

    def _remove(self, job: SwitchJob) -> None:
        if self.parent is not None and not job.whole:
            # the parent holds the job's slots for this rack: without a
            # LEAVE they stay taken until its idle reclaim (minutes)
            self._send(Header(MsgType.LEAVE, job_id=job.job_id, sender=self.rack_id, world=self.racks).pack(),
                       self.parent)
        self.regs.remove(job.index)
        self.pool.release(job.index, job.base, job.slots)
        del self.jobs[job.job_id]

    def _note_activity(self, now: float) -> None:
        """A job is active while its packet counters move; reading them
        once a second keeps the data path free of clocks."""
        for job in self.jobs.values():
            total = int(self.regs.job_counter_totals(job.index).sum())
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

    def _place(self, slots: int) -> Placement | None:
        """A free job row and a free run of ``slots`` slots, or None."""
        return self.pool.place(slots)

    def collect_stats(self, jobs: set | None = None) -> dict:
        """The STATS reply: counters; with ``jobs`` (names), only those jobs' tables."""
        r = self.regs
        totals = {name: int(v) for name, v in zip(COUNTERS, r.counters.sum(axis=0)) if v}
        totals.update(self.control_counters)
        shown = {}
        for job in list(self.jobs.values()):
            if jobs is not None and job.name not in jobs:
                continue
            shown[job.name] = {"id": job.job_id, "world": job.world, "base": job.base, "slots": job.slots,
                               "elements": job.elements, "members": sorted(job.members),
                               "counters": {name: int(v) for name, v in
                                            zip(COUNTERS, r.job_counter_totals(job.index)) if v}}
        per_shard = [{name: int(v) for name, v in zip(COUNTERS, row) if v} for row in r.counters]
        return {"mode": "switch", "address": str(self.address), "elements": self.default_elements,
                "max_elements": r.max_elements, "pool": r.pool, "shards": self.shards,
                "shard_slots": r.shard_slots, "io": self.io, "totals": totals, "per_shard": per_shard,
                "pool_used": int(sum(job.slots for job in list(self.jobs.values()))), "jobs": shown}

    def stats(self) -> dict:
        """collect_stats() in the shape of hosts/aggregator.py: the shards
        share the registers, so one read holds them all."""
        reply = self.collect_stats()
        jobs = {name: {"members": len(j["members"]), "open_slots": None, "counters": dict(j["counters"])}
                for name, j in reply["jobs"].items()}
        return {"kind": self.kind, "totals": dict(reply["totals"]), "jobs": jobs,
                "histograms": dict(reply.get("histograms") or {}),
                "pool": {"slots": reply["pool"], "used": reply["pool_used"], "buffers": None},
                "shards": [], "restarts": None}

    @property
    def shard_count(self) -> int:
        return self.shards

    def close(self) -> None:
        self._stop_shards()
        for s in self.socks:
            try:
                s.close()
            except OSError:
                pass


def describe_key(key: int) -> str:
    ip, port = key_addr(key)
    return f"{ip}:{port}"


__all__ = ["SwitchService", "SwitchJob", "COUNTERS", "MAX_JOBS", "DEFAULT_RECLAIM_IDLE"]
