"""One aggregator shard: a process (or, for tests, a thread) that owns its
chunk keys, its socket and its accumulators, and shares nothing with other
shards, so no lock is ever taken on the data path (PHub's per-core design).

The shard sums contributions as they arrive (the first one into an empty
slot is copied, later ones are added), and when every worker of the job has
contributed it sends the result to all of them. Bad messages are dropped
and counted, and the sender is told why; they never touch another job.
"""

from __future__ import annotations

import bisect
import collections
import logging
import os
import time

import numpy as np

from aggnet import kernels, pids
from aggnet.protocol import control, wire
from aggnet.protocol.control import ControlError
from aggnet.protocol.keys import Keyring
from aggnet.transport import Listener
from aggnet.protocol.wire import (PLAN_VALUES, DType, ErrorCode, Flag, Header, MsgType, round_at_or_before,
                                  settled_through)

from aggnet.buffers import BufferPool

from aggnet.hosts.admission import Disagreement, PendingJoin, admit
from aggnet.hosts.parent import refusal, whole_here
from aggnet.hosts.jobs import ACC_DTYPE, KEEP_UP_CHUNKS, SHARED_MAPS, Job, Segment, SharedRound, Slot
from aggnet.transport.shm import SharedBuffer
from aggnet.protocol.replay import final_of
from aggnet.hosts.sparse import MESSAGES as SPARSE_MESSAGES, SparseTables
from aggnet.hosts.aggregator import STOP_POLL
from aggnet.hosts.uplink import Uplink

log = logging.getLogger("aggnet.hosts.shard")

#: how often pending slots are checked for workers that went silent
STALL_CHECK_INTERVAL = 0.25
#: seconds a worker's closed connection waits before it is logged: a
#: Ctrl-C ends the workers and then the aggregator that a harness started
#: for them, and that aggregator should not report the workers it outlived
#: by milliseconds (its counters still count them)
CLOSE_LOG_DELAY = 0.5
#: seconds a job lives on a shard with none of its members heard from
#: (workers killed without LEAVE, junk JOINs from a service open to many
#: hosts), then its memory is reclaimed; None: never (a job that pauses
#: for an hour-long evaluation keeps its place). A member that comes back
#: after its job was reclaimed is told NOT_JOINED, joins again and
#: finishes its all-reduce (a client with resume off fails that one and
#: joins again on its next)
JOB_LEASE = None
_HALF_FMT = {DType.FLOAT16: "f16", DType.BFLOAT16: "bf16"}


class Histogram:
    """Counts of durations per bucket (upper bounds in seconds), for the
    metrics endpoint: a fixed, small set, so a shard keeps no samples."""

    BOUNDS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)

    def __init__(self):
        self.counts = [0] * (len(self.BOUNDS) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.BOUNDS, seconds)] += 1
        self.sum += seconds

    def describe(self) -> dict:
        return {"bounds": list(self.BOUNDS), "counts": list(self.counts), "sum": self.sum}


def _with_transport_drops(counters, listener) -> dict:
    """The counters and what the listener itself dropped or held back: a
    tcp:// listener's streams closed for what they sent (not aggnet's
    greeting or framing), for holding memory without sending, or past its
    limit, counted beside the messages the shard dropped."""
    out = dict(counters)
    for name, v in transport_counters(listener).items():
        out[name] = out.get(name, 0) + v
    return out


def memory_of(listener) -> dict:
    """This process's resident memory now and at its peak, and where its
    listener bounds what peers make it hold (a tcp:// listener's budgets
    and what they hold now): what an operator alerts on and what
    ``aggnet fuzz --hoard`` checks."""
    out = pids.memory()  # {} where the system keeps no /proc: the listener's part alone
    gauges = getattr(listener, "memory_gauges", None)
    if gauges is not None:
        out.update(gauges())
    return out


def transport_counters(listener) -> dict:
    """A listener's own counters, where its transport keeps some."""
    counters = getattr(listener, "transport_counters", None)
    return counters() if counters is not None else {}


class Shard:
    def __init__(self, listener: Listener, index: int = 0, keyring: Keyring | None = None,
                 uplink: Uplink | None = None, job_lease: float | None = JOB_LEASE):
        if job_lease is not None and not job_lease > 0:
            raise ValueError(f"job_lease must be a positive number of seconds, got {job_lease!r}")
        self.job_lease = job_lease
        self.listener = listener
        self.index = index
        self.keyring = keyring or Keyring()
        #: a rack under a root: complete chunks go up before they go back
        self.uplink = uplink
        self.jobs: dict[int, Job] = {}
        self.counters: collections.Counter = collections.Counter()
        self.k = kernels.load("cpu")
        self.pool = BufferPool()
        self.latency = Histogram()
        self._next_stall_check = 0.0
        #: (when, message) of closed connections, logged once CLOSE_LOG_DELAY old
        self._closes_to_log: list = []
        #: sparse tables (parameter server) beside the dense chunks
        self.sparse = SparseTables(self)

    # -- the loop ----------------------------------------------------------------

    def serve(self, should_stop) -> None:
        """Serve until ``should_stop()`` is true (checked at least every
        STOP_POLL seconds: a stop is that quick)."""
        while not should_stop():
            if self.uplink is None:
                msg = self.listener.recv(STOP_POLL)
            else:
                self.listener.wait(STOP_POLL, self.uplink.connections)
                self.from_root()
                if self.uplink.lost():
                    for job in list(self.jobs.values()):
                        if not job.whole:
                            self.root_lost(job)
                msg = self.listener.recv(0)
            while msg is not None:
                self.handle(msg.peer, msg.header, msg.payload)
                msg = self.listener.recv(0)
            closed = self.listener.gone()
            if closed:
                self.connections_closed(closed)
            now = time.monotonic()
            if now >= self._next_stall_check:
                self._next_stall_check = now + STALL_CHECK_INTERVAL
                self.check_stalls(now)
                if self.uplink is not None:
                    self.uplink.tick(now)

    def handle(self, peer, header_buf, payload) -> None:
        """One message in; no input from the network raises out of here."""
        self.counters["messages"] += 1
        try:
            self._dispatch(peer, header_buf, payload)
        except Exception:
            self.counters["internal_error"] += 1
            log.exception("shard %d: a message from %r failed; the shard goes on", self.index, peer)
            try:
                self._reply(peer, Header(MsgType.ERROR), wire.error_payload(
                    ErrorCode.REFUSED, "the aggregator failed on this message (its log says why); it goes on"))
            except Exception:
                pass

    def _dispatch(self, peer, header_buf, payload) -> None:
        if len(header_buf) > wire.HEADER_SIZE:  # a short one is refused by unpack_header
            self._drop(peer, "malformed_header_length", ErrorCode.MALFORMED,
                       f"header frame of {len(header_buf)} bytes; aggnet headers are {wire.HEADER_SIZE}", None)
            return
        try:
            h = wire.unpack_header(header_buf)
            wire.check_payload(h, len(payload))
        except wire.WireError as exc:
            self._drop(peer, f"malformed_{exc.reason}", ErrorCode.MALFORMED, str(exc), None)
            return
        job = self.jobs.get(h.job_id)
        if job is not None and job.members.get(h.sender) == peer:
            job.last_heard = job.member_heard[h.sender] = time.monotonic()
        t = h.msg_type
        if t == MsgType.PUSH:
            self._on_push(peer, h, payload)
            return
        if t in SPARSE_MESSAGES:
            self.sparse.handle(peer, h, payload)
            return
        try:
            if t == MsgType.JOIN:
                self._on_join(peer, h, payload)
            elif t == MsgType.LEAVE:
                self._on_leave(peer, h)
            elif t == MsgType.SHARE:
                self._on_share(peer, h, payload)
            elif t == MsgType.HELLO:
                self._reply(peer, Header(MsgType.HELLO_OK), wire.json_payload(
                    {"service": "aggnet", "version": wire.VERSION, "shards": [str(self.listener.address)]}))
            elif t == MsgType.STATS:
                shown = self.keyring.stats_view(h, payload, peer)
                self._reply(peer, Header(MsgType.STATS_OK), wire.json_payload(self.stats(shown)))
            else:
                self._drop(peer, "unexpected_type", ErrorCode.REFUSED,
                           f"an aggregator does not accept {t.name} messages", h)
        except ControlError as exc:
            self._drop(peer, exc.reason, exc.code, str(exc), h)
            job = self.jobs.get(h.job_id)
            if isinstance(exc, Disagreement) and job is not None:
                err = Header(MsgType.ERROR, job_id=h.job_id)
                for member in job.members.values():
                    if member != peer:
                        self._reply(member, err, wire.error_payload(exc.code, str(exc)))

    # -- replies and drops ---------------------------------------------------------

    def _reply(self, peer, h: Header, payload: bytes | None = None) -> None:
        packed = h.pack() if payload is None else h.pack_for(payload)
        if not self.listener.send(peer, packed, payload):
            self.counters["send_unreachable"] += 1

    def _drop(self, peer, counter: str, code: ErrorCode, text: str, h: Header | None) -> None:
        self.counters[f"dropped_{counter}"] += 1
        log.debug("shard %d dropped a message (%s): %s", self.index, counter, text)
        err = Header(MsgType.ERROR)
        if h is not None:
            err.job_id, err.round, err.index, err.sender = h.job_id, h.round, h.index, h.sender
        self._reply(peer, err, wire.error_payload(code, text))

    # -- membership ------------------------------------------------------------------

    def _on_join(self, peer, h: Header, payload) -> None:
        info = control.parse(control.JOIN, payload, "JOIN")
        name = info.get("name", str(h.job_id))
        timeout = info["timeout"]
        job = self.jobs.get(h.job_id)
        admit(self.keyring, h, name, info, peer, job)
        if "data" in info:
            raise ControlError(ErrorCode.REFUSED, f"the JOIN for job {name!r} names a data address "
                                                  f"({info['data']}); only a switch-mode aggregator (udp://) takes "
                                                  f"members that send datagrams from elsewhere", "bad_join")
        shm = info.get("shm")
        whole = self._check_join_path(h, info, job)
        created = job is None
        old = None if created else job.members.get(h.sender)
        came_back = False
        if old is not None and old != peer:
            came_back = self._check_takeover(job, h, name)
        if not created and job.whole != whole:
            raise Disagreement(f"job {name!r} completes {'here' if job.whole else 'at the root'}, but rank "
                               f"{h.sender} joined it as {'all' if whole else 'part'} of the job's workers; "
                               f"give every worker the same world size", "world_mismatch")
        if created:
            job = Job(h.job_id, name, h.world, timeout, whole=whole)
            self.jobs[h.job_id] = job
        try:
            if shm is not None:
                self._join_shm(h, job, shm)
        except ControlError:
            if created:
                self._drop_job(job)
            raise
        if created:
            log.info("shard %d: job %r (id %08x) registered with world size %d", self.index, name, h.job_id, h.world)
        if old is not None and old != peer:
            log.warning("shard %d: job %r rank %d re-joined from a new connection", self.index, name, h.sender)
            self.counters["rejoins"] += 1
        job.members[h.sender] = peer
        job.departed.pop(h.sender, None)
        if info.get("rack"):
            job.racks.add(h.sender)
        if came_back:
            log.info("shard %d: job %r rack %d is back after %.1fs", self.index, name, h.sender,
                     time.monotonic() - job.away.pop(h.sender))
            self.counters["racks_back"] += 1
        # the least patient worker decides (it names the missing ranks
        # before its own deadline); the schema keeps it at 0.5 s or more
        job.stall_timeout = min(job.stall_timeout, timeout)
        self.counters["joins"] += 1
        details = {"job": name, "shard": self.index, "world": job.world}
        if shm is not None:
            details["shm"] = job.segment.describe()
        ok = Header(MsgType.JOIN_OK, job_id=h.job_id, sender=h.sender, world=job.world)
        if created and self.uplink is not None and not job.whole:
            job.parent.lost()
        if job.parent.ready:
            self._reply(peer, ok, wire.json_payload(details))
        else:
            # the workers hear JOIN_OK once the root took the job from this
            # rack: before that, no chunk of theirs could complete
            job.parent.hold(PendingJoin(peer, ok, wire.json_payload(details)))
            self.uplink.join(job.job_id, job.name, job.stall_timeout)

    def _check_join_path(self, h: Header, info: dict, job: Job | None) -> bool:
        """Refuse a JOIN this shard cannot serve (shared memory over a
        network, a rack cut off from its root); True when the job completes
        here rather than at the root."""
        shm = info.get("shm")
        if shm is not None:
            if self.listener.address.scheme != "shm":
                raise ControlError(ErrorCode.REFUSED, f"shared memory is offered to workers on the aggregator's "
                                                      f"host only (shm:// addresses), not over "
                                                      f"{self.listener.address.scheme}", "field_shm")
            control.check_shm(h.world, shm)
        whole = self.uplink is not None and whole_here(h, info)
        if self.uplink is not None and self.uplink.error is not None and not whole:
            # workers resend their JOIN until answered: the next one hears it
            if job is not None and not job.parent.ready:
                self._drop_job(job)
            raise ControlError(ErrorCode.REFUSED, f"this rack cannot reach its root: {self.uplink.error}",
                               "uplink_failed")
        return whole

    def _check_takeover(self, job: Job, h: Header, name: str) -> bool:
        """A rank joins again from a new connection: refuse it while the old
        one is live (two runs under one job name); True when it is a rack
        this shard counted as away."""
        # a restarted rack's JOIN can come before this loop heard that its
        # predecessor's connection closed
        closed = self.listener.gone()
        if closed:
            self.connections_closed(closed)
        came_back = h.sender in job.away
        if not self.keyring.enforced and not came_back:
            quiet = job.live_member(h.sender, time.monotonic())
            if quiet is not None:
                # taking a live rank over would fail both runs; a job key
                # holder may still take over (a signed JOIN is the job's own)
                raise ControlError(
                    ErrorCode.JOB_MISMATCH,
                    f"rank {h.sender} of job {name!r} is running at another connection (heard {quiet:.1f}s ago): "
                    f"two runs use the same job name; give each its own (job=... of AggnetState or Client), "
                    f"or start this one after the other finishes", "rank_in_use")
        return came_back

    def _join_shm(self, h: Header, job: Job, want: dict) -> None:
        """Give a same-host worker the job's shared-memory rings."""
        window, chunk_bytes = want["window"], want["chunk_bytes"]
        if job.segment is None:
            name = f"aggnet-{os.getpid()}-{job.job_id:08x}-{self.index}"
            try:
                job.segment = Segment(name, job.world, window, chunk_bytes, create=True)
            except (OSError, ValueError) as exc:
                raise ControlError(ErrorCode.REFUSED, f"shared memory is unavailable on the aggregator host ({exc}); "
                                                      f"use a zmq+ipc:// address", "shm_unavailable") from None
        elif (job.segment.window, job.segment.chunk_bytes) != (window, chunk_bytes):
            raise ControlError(ErrorCode.JOB_MISMATCH,
                               f"job {job.name!r} shares memory in {job.segment.chunk_bytes}-byte chunks with window "
                               f"{job.segment.window}, but rank {h.sender} asked for {chunk_bytes} and {window}; "
                               f"all workers of a job must use the same chunk_bytes and window", "shm_mismatch")
        job.shm_members.add(h.sender)

    def _on_share(self, peer, h: Header, payload) -> None:
        """A member's buffer of round ``h.round`` lies in its own shared
        memory: map it (once per buffer) and read that round's chunks
        there. A refusal is remembered, so that the round's chunks are
        dropped rather than read from the member's ring slots."""
        job = self.jobs.get(h.job_id)
        if job is None or job.members.get(h.sender) != peer or h.sender not in job.shm_members:
            raise ControlError(ErrorCode.NOT_JOINED, f"rank {h.sender} named a shared buffer without joining job "
                                                     f"{h.job_id:08x} over shm from this connection",
                               "share_not_joined")
        try:
            info = control.parse(control.SHARE, payload, "SHARE")
            if info["at"] >= info["bytes"]:
                raise ControlError(ErrorCode.MALFORMED, f"SHARE: the buffer starts at byte {info['at']} of a "
                                                        f"{info['bytes']}-byte segment", "share_bounds")
            buf = job.shared_maps.pop(info["name"], None)
            if buf is not None and buf.size < info["bytes"]:
                buf.close()  # a segment of that name cannot grow: named larger, it is refused below
                buf = None
            if buf is None:
                try:
                    buf = SharedBuffer.open(info["name"], info["bytes"])
                except (OSError, ValueError) as exc:
                    raise ControlError(ErrorCode.REFUSED, f"cannot read rank {h.sender}'s shared buffer: {exc}; "
                                                          f"the worker and the aggregator must share /dev/shm",
                                       "share_unavailable") from None
            job.shared_maps[info["name"]] = buf
            while len(job.shared_maps) > SHARED_MAPS:
                job.shared_maps.popitem(last=False)[1].close()
        except ControlError:
            job.remember_shared(h.sender, h.round, SharedRound(None))
            raise
        job.remember_shared(h.sender, h.round, SharedRound(buf, info["at"], info["chunks"],
                                                           min(info["results"], info["chunks"]),
                                                           info["multiplier"]))
        self.counters["shares"] += 1

    def _on_leave(self, peer, h: Header) -> None:
        # echoed, so the worker knows it may close: a connection closed
        # right behind its last message may lose it (UCX closes by abort)
        self._reply(peer, Header(MsgType.LEAVE, job_id=h.job_id, sender=h.sender, world=h.world))
        job = self.jobs.get(h.job_id)
        if job is None or job.members.get(h.sender) != peer:
            return
        self._depart(job, h.sender, f"rank {h.sender} left job {job.name!r}")

    def _depart(self, job: Job, rank: int, what: str) -> None:
        """``rank`` is no longer a member: what is open now can never have
        every rank's part, so say so at once to those waiting, rather than
        after the stall timeout."""
        del job.members[rank]
        job.shm_members.discard(rank)
        for key in [k for k in job.shared if k[0] == rank]:
            del job.shared[key]  # nothing more is read from, or written to, its buffers
        if not job.members:
            self._drop_job(job)
            log.info("shard %d: job %r finished (every worker left)", self.index, job.name)
            return
        job.departed[rank] = what
        for slot in list(job.slots.values()):
            self._abandon(job, slot, ErrorCode.STALL,
                          f"{what} while round {slot.key[0]} {self._what(slot)} was open; it cannot complete")

    def connections_closed(self, peers) -> None:
        """Members whose connection closed without LEAVE (a killed worker):
        they depart now, and the others' open rounds fail naming them."""
        for peer in peers:
            closed_because = getattr(self.listener, "closed_because", None)
            why = closed_because(peer) if closed_because is not None else None
            for job in list(self.jobs.values()):
                for rank, member in list(job.members.items()):
                    if member == peer and rank in job.racks:
                        # a rack's shard: its supervisor restarts it, and it
                        # joins again; its open chunks wait (the stall
                        # timeout still names it if it does not)
                        if rank not in job.away:
                            self.counters["racks_disconnected"] += 1
                            log.warning("shard %d: job %r rack %d's connection closed; its open chunks wait for "
                                        "it to join again", self.index, job.name, rank)
                            job.away[rank] = time.monotonic()
                    elif member == peer:
                        self.counters["members_disconnected"] += 1
                        self._closes_to_log.append((time.monotonic(), f"shard {self.index}: job {job.name!r} rank "
                                                                      f"{rank}'s connection closed without LEAVE"))
                        self._depart(job, rank, f"rank {rank} of job {job.name!r} was disconnected by the "
                                                f"aggregator: {why}" if why is not None else
                                     f"rank {rank} of job {job.name!r} lost its connection to the aggregator "
                                     f"without leaving (the worker died or closed its client)")

    @staticmethod
    def _what(slot: Slot) -> str:
        index = slot.key[1]
        if index == wire.SCALE_INDEX:
            return "exponent agreement"
        if index == wire.PLAN_INDEX:
            return "buffer-size agreement"
        return f"chunk {index & ~wire.REDO_BIT} sent again" if index & wire.REDO_BIT else f"chunk {index}"

    def _drop_job(self, job: Job, tell_root: bool = True) -> None:
        if self.uplink is not None and not job.whole and tell_root:
            self.uplink.leave(job.job_id)
        job.slots.clear()
        job.close_shared()
        if job.segment is not None:
            job.segment.close()
            job.segment = None
        self.jobs.pop(job.job_id, None)

    def close(self) -> None:
        """Release every job's resources (shared memory above all).

        A rack shard does not tell the root its jobs left: their workers
        did not, and a rack that stops while they are members is one that
        restarts (a supervisor, Ray, an operator) more often than one that
        is gone. The root then keeps the rack's place as for a closed
        connection, and its stall timeout names the rack if it never comes
        back."""
        for job in list(self.jobs.values()):
            self._drop_job(job, tell_root=False)
        if self.uplink is not None:
            self.uplink.close()

    # -- aggregation -----------------------------------------------------------------

    def _on_push(self, peer, h: Header, payload) -> None:
        checked = self._admit_push(peer, h, payload)
        if checked is None:
            return
        job, payload, owner = checked
        op_max = bool(h.flags & Flag.OP_MAX)
        key = (h.round, h.index, op_max)
        if h.flags & Flag.FINAL:
            self._on_final(job, peer, h, key, payload)
            return
        if self._answered_before(job, peer, h, key):
            return
        slot = self._slot_for(job, h, key, owner)
        if slot is None:
            return
        bit = 1 << h.sender
        if slot.seen & bit:
            self.counters["dropped_duplicate"] += 1
            return
        # CPU time of this thread, not wall time: a shard that shares cores
        # with workers is preempted, and that is not summation speed
        t0 = time.thread_time()
        self._accumulate(slot, h, payload)
        self.counters["sum_seconds"] += time.thread_time() - t0
        self.counters["sum_bytes"] += len(payload)
        slot.seen |= bit
        slot.nsum += 1
        slot.next_exponent = max(slot.next_exponent, h.next_exponent)
        self.counters["pushes"] += 1
        self.counters["bytes_in"] += len(payload)
        job.counters["pushes"] += 1
        job.counters["bytes_in"] += len(payload)
        if slot.nsum == job.world:
            if self.uplink is not None and not job.whole:
                self._send_up(job, slot)
            else:
                self._complete(job, slot)

    def _admit_push(self, peer, h: Header, payload):
        """The PUSH's job, its payload (read from the shared-memory slot
        where it lies there) and the rank its result is for, or None when
        the PUSH was dropped and answered."""
        job = self.jobs.get(h.job_id)
        if job is None:
            self._drop(peer, "unknown_job", ErrorCode.NOT_JOINED,
                       f"job id {h.job_id:08x} is not registered on this aggregator; JOIN first", h)
            return None
        if job.members.get(h.sender) != peer:
            self._drop(peer, "not_member", ErrorCode.NOT_JOINED,
                       f"rank {h.sender} has not joined job {job.name!r} from this connection", h)
            return None
        if h.dtype not in ACC_DTYPE:
            self._drop(peer, "bad_dtype", ErrorCode.REFUSED, f"cannot sum {h.dtype.name} payloads", h)
            return None
        owner = h.nsum if h.flags & Flag.TO_OWNER else None  # a reduce-scatter's chunk: its one receiver
        if owner is not None and owner >= job.world:
            self._drop(peer, "bad_owner", ErrorCode.MALFORMED,
                       f"the chunk's result is for rank {owner}, outside world size {job.world}", h)
            return None
        if h.flags & Flag.SHM:
            seg = job.segment
            if seg is None or h.sender not in job.shm_members:
                self._drop(peer, "shm_not_joined", ErrorCode.NOT_JOINED,
                           f"rank {h.sender} sent a shared-memory payload without joining job {job.name!r} over shm", h)
                return None
            shared = job.shared.get((h.sender, h.round))
            if shared is not None:
                return self._read_shared(job, peer, h, shared, owner)
            if h.payload_bytes > seg.chunk_bytes:
                self._drop(peer, "shm_too_large", ErrorCode.MALFORMED,
                           f"{h.payload_bytes}-byte payload exceeds the {seg.chunk_bytes}-byte shared-memory slot", h)
                return None
            payload = seg.input_slot(h.sender, h.ref)[: h.payload_bytes]
        return job, payload, owner

    def _read_shared(self, job: Job, peer, h: Header, shared: SharedRound, owner):
        """A chunk read where it lies in the member's shared buffer."""
        buf = shared.buffer
        if buf is None:  # its SHARE was refused, and the member told why
            self.counters["dropped_share_refused"] += 1
            return None
        start = shared.start + h.offset * wire.ITEMSIZE[h.dtype]
        if start + h.payload_bytes > buf.size:
            self._drop(peer, "share_bounds", ErrorCode.MALFORMED,
                       f"chunk {h.index} of round {h.round} ends at byte {start + h.payload_bytes} of shared buffer "
                       f"{buf.name}, which has {buf.size}", h)
            return None
        shared.reads_left -= 1
        if shared.done:  # every chunk named is read (and written): the record goes
            del job.shared[(h.sender, h.round)]
        self.counters["shared_pushes"] += 1
        return job, buf.array[start:start + h.payload_bytes], owner

    def _answered_before(self, job: Job, peer, h: Header, key) -> bool:
        """Answer a PUSH for a chunk this shard finished, gave up or cannot
        finish (its result replayed, resent or refused): True when answered."""
        final = job.finals.get(key)
        if final is not None:
            self._answer_final(job, peer, h.sender, key, final)
            return True
        recent = job.recent.get(key)
        if recent is not None:
            # a rack shard that restarted asks again for a result its
            # predecessor got (and lost): this member's part is in it
            self.counters["results_resent"] += 1
            if not self.listener.send(peer, *recent):
                self.counters["send_unreachable"] += 1
            return True
        if key in job.done:
            given_up = job.abandoned.get(key)
            if given_up is not None:
                self.counters["dropped_abandoned"] += 1
                self._reply(peer, Header(MsgType.ERROR, job_id=job.job_id, round=h.round, index=h.index,
                                         sender=h.sender), given_up)
            else:
                self.counters["dropped_late"] += 1
            return True
        if key not in job.slots and job.departed:
            gone = sorted(job.departed)
            job.remember_done(key)
            self.counters["dropped_member_left"] += 1
            err = Header(MsgType.ERROR, job_id=job.job_id, round=h.round, index=h.index, sender=h.sender)
            self._reply(peer, err, wire.error_payload(
                ErrorCode.STALL, f"rank(s) {gone} left job {job.name!r} or lost their connection "
                                 f"({job.departed[gone[0]]}); round {h.round} cannot complete until they join again"))
            return True
        return False

    def _slot_for(self, job: Job, h: Header, key, owner):
        """The open chunk ``key`` sums into, opened by its first PUSH; None
        when this PUSH disagrees with the first (and was answered so)."""
        seg = job.segment
        slot = job.slots.get(key)
        op_max = key[2]
        if slot is None:
            acc_dtype = ACC_DTYPE[h.dtype]
            nbytes = h.count * np.dtype(acc_dtype).itemsize
            # a chunk sent again (REDO_BIT) comes inline from every worker,
            # outside the rings' numbering: its sum may not take a ring slot
            in_ring = not op_max and not h.index & wire.REDO_BIT
            if seg is not None and in_ring and nbytes <= seg.chunk_bytes and acc_dtype in (np.float32, np.int32):
                # sum straight into the shared result slot the workers read
                buf, acc = None, seg.result_slot(h.ref)[:nbytes].view(acc_dtype)
            else:
                buf = self.pool.take(nbytes)
                acc = buf[:nbytes].view(acc_dtype)
            slot = Slot(key, h.dtype, h.count, h.offset, h.exponent, op_max, buf, acc, ref=h.ref, owner=owner)
            job.slots[key] = slot
        elif (h.dtype, h.count, h.offset, h.exponent, owner) != \
                (slot.dtype, slot.count, slot.offset, slot.exponent, slot.owner) or \
                (seg is not None and h.ref != slot.ref):  # ring positions matter only in shared memory
            self._mismatch(job, slot, h)
            return None
        return slot

    def _on_final(self, job: Job, peer, h: Header, key, payload) -> None:
        """A member that has the result of ``key`` from before this shard
        restarted sends it: those waiting get it now, later askers from
        what is kept. The result is the first sum's, to the bit: the
        members that had it and those that get it now agree."""
        if h.flags & (Flag.SHM | Flag.TO_OWNER):
            self._drop(peer, "bad_final", ErrorCode.MALFORMED,
                       "a FINAL carries its result in the message, for every member", h)
            return
        bit = 1 << h.sender
        kept = job.finals.get(key)
        if kept is not None:
            kept[2] |= bit
            self.counters["dropped_duplicate_final"] += 1
            return
        if key in job.done:
            self.counters["dropped_late_final"] += 1
            return
        self.counters["finals_replayed"] += 1
        slot = job.slots.get(key)
        if slot is None:
            # nobody asked yet: the members that do get it from here
            result = Header(MsgType.RESULT, job_id=job.job_id, round=h.round, index=h.index,
                            flags=h.flags & (Flag.LITTLE_ENDIAN | Flag.OP_MAX), dtype=h.dtype, count=h.count,
                            exponent=h.exponent, next_exponent=h.next_exponent, nsum=h.nsum, world=job.world,
                            ref=h.ref, offset=h.offset)
            job.keep_final(key, result, bytes(payload), bit)
            job.remember_done(key)
            return
        if (h.dtype, h.count, h.offset) != (slot.dtype, slot.count, slot.offset):
            self._mismatch(job, slot, h)
            return
        slot.nsum = 0  # the result replaces the partial sum
        self._accumulate(slot, h, payload)
        slot.nsum, slot.exponent, slot.next_exponent = h.nsum, h.exponent, h.next_exponent
        self._complete(job, slot)

    def _answer_final(self, job: Job, peer, rank: int, key, final) -> None:
        header, payload, seen = final
        if not self.listener.send(peer, header.pack(), payload):
            self.counters["send_unreachable"] += 1
        self.counters["results"] += 1
        final[2] = seen | 1 << rank
        if final[2] == (1 << job.world) - 1:
            job.forget_final(key)

    def _accumulate(self, slot: Slot, h: Header, payload) -> None:
        acc = slot.acc
        little = bool(h.flags & Flag.LITTLE_ENDIAN)
        big_endian_i32 = not little and h.dtype == DType.INT32
        if h.dtype in _HALF_FMT:
            src = np.frombuffer(payload, np.uint16, h.count)
            if not little:
                src = src.byteswap()
            if slot.nsum == 0:
                self.k.from_half(src, acc, _HALF_FMT[h.dtype])
            else:
                self.k.accumulate_half(acc, src, _HALF_FMT[h.dtype])
            return
        src = np.frombuffer(payload, acc.dtype, h.count)
        if slot.op_max:
            if not little:
                src = src.byteswap()
            if slot.nsum == 0:
                acc[...] = src
            else:
                np.maximum(acc, src, out=acc)
        elif slot.nsum == 0:
            if big_endian_i32:
                self.k.byteswap32(src, acc)
            else:
                np.copyto(acc, src)
        else:
            self.k.accumulate(acc, src, big_endian_i32)

    def _complete(self, job: Job, slot: Slot) -> None:
        del job.slots[slot.key]
        job.remember_done(slot.key)
        if job.finals and slot.key[1] == wire.PLAN_INDEX and slot.count == PLAN_VALUES:
            # the workers' agreement says which rounds every worker has
            # finished: nobody will ask for their replayed results
            mark = settled_through(slot.key[0], slot.acc)
            for key in [k for k in job.finals if round_at_or_before(k[0], mark)]:
                job.forget_final(key)
        h = Header(MsgType.RESULT, job_id=job.job_id, round=slot.key[0], index=slot.key[1],
                   flags=Flag.LITTLE_ENDIAN | (Flag.OP_MAX if slot.op_max else 0), dtype=slot.dtype,
                   count=slot.count, exponent=slot.exponent, next_exponent=slot.next_exponent,
                   nsum=slot.nsum, world=job.world, ref=slot.ref, offset=slot.offset)
        out = slot.acc
        out_buf = None
        in_shm = slot.buf is None  # summed in a shared result slot
        seg = job.segment
        if slot.dtype in _HALF_FMT:
            in_shm = seg is not None and slot.count * 2 <= seg.chunk_bytes
            if in_shm:
                out = seg.result_slot(slot.ref)[: slot.count * 2].view(np.uint16)
            else:
                out_buf = self.pool.take(slot.count * 2)
                out = out_buf[: slot.count * 2].view(np.uint16)
            self.k.to_half(slot.acc, out, _HALF_FMT[slot.dtype])
        # members whose SHARE asked for the result in their buffer have it
        # there now: their RESULT says so and carries nothing
        placed = self._write_shared(job, slot, out) if job.shared and not slot.op_max else ()
        placed_header = None
        if placed:
            self.counters["results_in_place"] += len(placed)
            h.msg_type, h.flags = MsgType.RESULT_IN_PLACE, h.flags | Flag.SHM
            placed_header = h.pack()
            h.msg_type, h.flags = MsgType.RESULT, h.flags & ~Flag.SHM
        inline = out
        shm_header = None
        if in_shm:
            h.flags |= Flag.SHM
            shm_header = h.pack()
            h.flags &= ~Flag.SHM
            # a socket peer must not read a slot that will be reused: copy
            inline = bytes(out) if len(job.shm_members) < job.world else None
        header = h.pack()
        # a reduce-scatter's chunk: the sum to its owner, an empty RESULT
        # to the others (it frees their window, as a result would, and
        # brings the chunk's MAX exponent: an int32 round's every worker
        # decides alike whether the chunk goes again, and what its key's
        # next round carries)
        ack = None if slot.owner is None else Header(
            MsgType.RESULT, job_id=job.job_id, round=slot.key[0], index=slot.key[1],
            flags=Flag.LITTLE_ENDIAN | Flag.TO_OWNER, dtype=slot.dtype, world=job.world, offset=slot.offset,
            exponent=slot.exponent, next_exponent=slot.next_exponent).pack()
        for rank, peer in job.members.items():
            if ack is not None and rank != slot.owner:
                sent = self.listener.send(peer, ack)
            elif rank in placed:
                sent = self.listener.send(peer, placed_header)
            elif shm_header is not None and rank in job.shm_members:
                sent = self.listener.send(peer, shm_header)
            else:
                sent = self.listener.send(peer, header, inline)
            if not sent:
                self.counters["send_unreachable"] += 1
        if job.racks and slot.owner is None and inline is not None:
            # held by reference: the pool hands the buffer out again only
            # once it falls out of here
            job.recent[slot.key] = (header, inline)
            if len(job.recent) > KEEP_UP_CHUNKS:
                job.recent.popitem(last=False)
        readers = len(job.members) if slot.owner is None else 1
        self.counters["results"] += 1
        self.counters["bytes_out"] += out.nbytes * readers
        job.counters["results"] += 1
        job.counters["bytes_out"] += out.nbytes * readers
        self.latency.observe(time.monotonic() - slot.first_seen)

    @staticmethod
    def _write_shared(job: Job, slot: Slot, out: np.ndarray) -> set:
        """Write a chunk's result into the shared buffer of each member whose
        SHARE of the round asked for it (times its multiplier: an average);
        the ranks written. A reduce-scatter's chunk goes to its owner only.
        A worker copies nothing of such a result: a GPU bucket's pinned
        buffer then holds it for the copy to the device."""
        placed = set()
        for rank in job.members if slot.owner is None else (slot.owner,):
            rec = job.shared.get((rank, slot.key[0]))
            if rec is None or rec.buffer is None or rec.writes_left <= 0:
                continue
            buf, multiplier = rec.buffer, rec.multiplier
            start = rec.start + slot.offset * out.itemsize
            if start + out.nbytes > buf.size or (multiplier != 1.0 and out.dtype != np.float32):
                continue  # the member decodes it from the RESULT as any other
            dest = buf.array[start:start + out.nbytes].view(out.dtype)
            if multiplier != 1.0:
                # as the client's decode does: the same float32 product
                np.multiply(out, np.float32(multiplier), out=dest)
            else:
                np.copyto(dest, out)
            rec.writes_left -= 1
            if rec.done:
                del job.shared[(rank, slot.key[0])]
            placed.add(rank)
        return placed

    # -- a rack under a root (hosts/uplink.py) ----------------------------------------

    def _send_up(self, job: Job, slot: Slot) -> None:
        """The rack's partial of a complete chunk goes to the root; 16-bit
        floats go up as the float32 they were summed in, so racks lose no
        precision a single aggregator would keep."""
        up = self.uplink
        h = Header(MsgType.PUSH, job_id=job.job_id, round=slot.key[0], index=slot.key[1],
                   sender=up.config.rack_id, world=up.config.racks,
                   flags=Flag.LITTLE_ENDIAN | (Flag.OP_MAX if slot.op_max else 0),
                   dtype=DType.FLOAT32 if slot.dtype in _HALF_FMT else slot.dtype, count=slot.count,
                   exponent=slot.exponent, next_exponent=slot.next_exponent, offset=slot.offset)
        slot.sent_up = True
        if not job.parent.ready and up.error is None:
            # the root has not taken the job (back) yet, as when this shard
            # has just restarted: the partial goes once it has (_replay_up)
            job.replay_up = True
            return
        job.counters["partials_up"] += 1
        if not up.send_partial(h.pack(), slot.acc):
            why = up.error or "not connected yet"
            self._abandon(job, slot, ErrorCode.STALL, f"this rack cannot reach its root ({why}); round "
                                                      f"{slot.key[0]} {self._what(slot)} cannot complete")

    def from_root(self) -> None:
        """What the root sent: job acceptances, finals and refusals."""
        for h, payload in self.uplink.receive():
            try:
                self._on_root(h, payload)
            except Exception:
                self.counters["internal_error"] += 1
                log.exception("shard %d: a message from the root failed; the shard goes on", self.index)

    def _on_root(self, h: Header, payload) -> None:
        job = self.jobs.get(h.job_id)
        if job is None:
            self.counters["uplink_dropped_unknown_job"] += 1
            return
        if h.msg_type == MsgType.JOIN_OK:
            self.uplink.joined(job.job_id)
            if not job.parent.ready:
                log.info("shard %d: the root took job %r from rack %d", self.index, job.name,
                         self.uplink.config.rack_id)
                for p in job.parent.accepted():
                    self._reply(p.member, p.header, p.payload)
            if job.replay_up:
                job.replay_up = False
                self._replay_up(job)
            return
        if h.msg_type == MsgType.ERROR:
            code, text = wire.parse_error(payload)
            key = (h.round, h.index, False)
            slot = job.slots.get(key) or job.slots.get((h.round, h.index, True))
            if code == ErrorCode.NOT_JOINED and (job.parent.ready or job.replay_up):
                # the root lost the job (it restarted): join it again and
                # send it what it lost; the rounds in flight go on
                self.root_lost(job)
                return
            if slot is not None and slot.sent_up:
                # the workers are members here: a job the root lost is this
                # rack's to join again, not theirs (they would rejoin for
                # nothing, and the next round would wait on them)
                relay = (ErrorCode.REFUSED if code == ErrorCode.NOT_JOINED else
                         ErrorCode(code) if code in ErrorCode._value2member_map_ else ErrorCode.STALL)
                self._abandon(job, slot, relay,
                              f"the root aggregator {self.uplink.config.parent} gave up round {h.round} "
                              f"{self._what(slot)} of job {job.name!r}: {text}")
            elif not job.parent.ready and not h.round:
                # the root's answer to this rack's JOIN (a round's late
                # error, of a slot given up already, is no answer to it)
                self.uplink.joined(job.job_id)
                told = refusal(self.uplink.config.parent, job.name, self.uplink.config.rack_id, text)
                for p in job.parent.refused():
                    self._reply(p.member, Header(MsgType.ERROR, job_id=job.job_id),
                                wire.error_payload(ErrorCode.REFUSED, told))
                self._drop_job(job)
            else:
                self.counters["uplink_errors"] += 1
                log.warning("shard %d: the root reported for job %r: %s", self.index, job.name, text)
            return
        if h.msg_type != MsgType.RESULT:
            self.counters["uplink_dropped_unexpected"] += 1
            return
        slot = job.slots.get((h.round, h.index, bool(h.flags & Flag.OP_MAX)))
        if slot is None or not slot.sent_up:
            self.counters["uplink_dropped_late"] += 1
            return
        if h.count != slot.count or h.payload_bytes != slot.count * slot.acc.itemsize:
            self.counters["uplink_dropped_mismatch"] += 1
            self._abandon(job, slot, ErrorCode.JOB_MISMATCH,
                          f"the root returned {h.count} {h.dtype.name} for round {h.round} {self._what(slot)} of "
                          f"job {job.name!r}, this rack summed {slot.count}; do all racks run the same job?")
            return
        np.copyto(slot.acc, np.frombuffer(payload, slot.acc.dtype, slot.count))
        slot.next_exponent = h.next_exponent
        slot.nsum = h.nsum
        job.counters["finals_down"] += 1
        self._keep_up(job, h, payload)
        self._complete(job, slot)

    def _keep_up(self, job: Job, h: Header, payload) -> None:
        """Keep a final of the root's for a root that restarts (another
        rack can lack only the finals of its open partials, which its
        workers' windows bound), until the workers' agreement settles it."""
        job.kept_up.keep(h, payload)
        if h.index == wire.PLAN_INDEX and h.count == PLAN_VALUES:
            job.kept_up.forget_through(settled_through(h.round, np.frombuffer(payload, np.int32, h.count)))

    def root_lost(self, job: Job) -> None:
        """The root forgot ``job`` (it restarted, or the connection to it
        closed): join it again; the replay follows its answer."""
        if job.replay_up:
            return
        log.warning("shard %d: the root lost job %r; joining it again to finish the rounds in flight", self.index,
                    job.name)
        self.counters["uplink_rejoins"] += 1
        job.replay_up = True
        job.parent.lost()
        self.uplink.join(job.job_id, job.name, job.stall_timeout)

    def _replay_up(self, job: Job) -> None:
        """What a restarted root needs from this rack: each final that
        another rack may still wait for, and every partial still open."""
        up = self.uplink
        finals = job.kept_up.results()
        for h, payload in finals:
            up.send_final(final_of(h, up.config.rack_id, up.config.racks).pack(), payload)
        resent = [slot for slot in job.slots.values() if slot.sent_up]
        for slot in resent:
            self._send_up(job, slot)
        log.info("shard %d: the root took job %r back: %d final(s) and %d partial(s) sent again", self.index,
                 job.name, len(finals), len(resent))

    def _mismatch(self, job: Job, slot: Slot, h: Header) -> None:
        text = (f"job {job.name!r} round {slot.key[0]} chunk {slot.key[1]}: rank {h.sender} sent "
                f"{h.count} {h.dtype.name} at offset {h.offset} (exponent {h.exponent}) but ranks "
                f"{job.present(slot.seen)} sent {slot.count} {slot.dtype.name} at offset {slot.offset} "
                f"(exponent {slot.exponent}); all workers must all-reduce the same buffers in the same order")
        if h.exponent != slot.exponent and (h.dtype, h.count, h.offset) == (slot.dtype, slot.count, slot.offset):
            text += (" and, with the int32 codec, carry exponents from round to round alike (the same "
                     "predict_scale, AGGNET_PREDICT_SCALE, on every worker)")
        self.counters["dropped_mismatch"] += 1
        log.warning("shard %d: %s", self.index, text)
        self._abandon(job, slot, ErrorCode.JOB_MISMATCH, text, extra_ranks=[h.sender])

    def _abandon(self, job: Job, slot: Slot, code: ErrorCode, text: str, extra_ranks=()) -> None:
        """Give up a slot and tell every worker that contributed to it."""
        job.slots.pop(slot.key, None)
        job.remember_done(slot.key)
        payload = wire.error_payload(code, text)
        # a rank that has not sent its part yet hears the same when it does
        job.remember_abandoned(slot.key, payload)
        err = Header(MsgType.ERROR, job_id=job.job_id, round=slot.key[0], index=slot.key[1])
        for rank in sorted(set(job.present(slot.seen)) | set(extra_ranks)):
            peer = job.members.get(rank)
            if peer is not None:
                err.sender = rank
                self._reply(peer, err, payload)

    def check_stalls(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        while self._closes_to_log and now - self._closes_to_log[0][0] >= CLOSE_LOG_DELAY:
            log.warning(self._closes_to_log.pop(0)[1])
        for job in list(self.jobs.values()):
            if self.job_lease is not None and now - job.last_heard > self.job_lease:
                log.info("shard %d: job %r reclaimed: none of its members (%s) heard from for %.0fs", self.index,
                         job.name, sorted(job.members), now - job.last_heard)
                self.counters["jobs_reclaimed"] += 1
                self._drop_job(job)
                continue
            for slot in list(job.slots.values()):
                waited = now - slot.first_seen
                if waited < job.stall_timeout:
                    continue
                if slot.sent_up:
                    # the root times out first and names the missing rack;
                    # only a root that says nothing at all is reported here
                    if waited < 2 * job.stall_timeout + 1.0:
                        continue
                    text = (f"waited {waited:.1f}s for the root aggregator {self.uplink.config.parent} to return "
                            f"round {slot.key[0]} {self._what(slot)} of job {job.name!r}; is the root running?")
                    log.warning("shard %d: %s", self.index, text)
                    self.counters["stalls"] += 1
                    self._abandon(job, slot, ErrorCode.STALL, text)
                    continue
                missing = job.missing(slot.seen)
                what = self._what(slot)
                text = (f"waited {waited:.1f}s for rank(s) {missing} of job {job.name!r} (world size "
                        f"{job.world}) to contribute to round {slot.key[0]} {what}; rank(s) "
                        f"{job.present(slot.seen)} did. Is rank {missing[0]} alive and calling "
                        f"allreduce in the same order as the others?")
                log.warning("shard %d: %s", self.index, text)
                self.counters["stalls"] += 1
                self._abandon(job, slot, ErrorCode.STALL, text)

    def stats(self, jobs: set | None = None) -> dict:
        """Counters; with ``jobs`` (names), only those jobs are shown."""
        return {
            "shard": self.index,
            "pid": os.getpid(),
            **({"uplink": {"root_shard": self.uplink.root_shard, "error": self.uplink.error,
                           **self.uplink.counters}} if self.uplink is not None else {}),
            "address": str(self.listener.address),
            "counters": _with_transport_drops(self.counters, self.listener),
            "pool_buffers": self.pool.allocated,
            "memory": memory_of(self.listener),
            "histograms": {"chunk_seconds": self.latency.describe()},
            "sparse": self.sparse.describe(jobs),
            "jobs": {
                job.name: {"id": job.job_id, "world": job.world, "members": sorted(job.members),
                           "open_slots": len(job.slots), "counters": dict(job.counters)}
                for job in self.jobs.values() if jobs is None or job.name in jobs
            },
        }
