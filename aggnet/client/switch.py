"""The worker side of the switch protocol (docs/protocol.md), over UDP.

The job's slice of the aggregator's pool is one window shared by every
outstanding all-reduce of the client: each slot carries one block of K
int32 values at a time and its next use is sent when the previous one's
result arrives. All-reduces are laid on the slots in submission order (a
request of B blocks takes the next min(slots, B) slots after the previous
request's), and each slot serves the requests that use it in that order,
so every worker computes the same (slot, tag) -> block mapping while DDP
buckets overlap, the window never drains between requests, and a small
bucket leaves the other slots to the next one.

A float32 buffer is quantized per block with the exponent all workers
agreed through the previous use of the slot; a request's first use of each
slot is a priming use that agrees the exponent of that slot's first block.
int32 buffers travel as they are. Each outstanding use is retransmitted
after an adaptive timeout (RFC 6298's estimator, Karn's rule) or early on
later results (fast retransmit). Packets are built, staged and parsed by
numba kernels (:mod:`aggnet.kernels.datagrams`), a batch per call, and
move through :class:`~aggnet.transport.udp.DatagramSocket` (GSO/GRO,
sendmmsg/recvmmsg, or one datagram per call).
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from dataclasses import dataclass

import numpy as np

from aggnet.protocol import wire
from aggnet.protocol.address import parse
from aggnet.client import session
from aggnet.client.base import Client, Request
from aggnet.client.codec import Encoding
from aggnet.errors import AggregationError, AggregationTimeout, AggregatorUnreachable, JobMismatch, NonFiniteError
from aggnet.kernels import cpu as cpu_kernels
from aggnet.kernels import datagrams as dg
from aggnet.protocol.limits import (
    IP_UDP_OVERHEAD, MAX_WORKERS, RTO_INITIAL, RTO_MAX, RTO_MIN, check_shard_layout, elements_for_mtu,
)
from aggnet.protocol.messages import Heartbeat, JoinHeartbeats, JoinOk, ProbeOk, padding_asked
from aggnet.transport.udp import BATCH_BYTES, MAX_DATAGRAM, DatagramSocket, addr_key, path_mtu
from aggnet.protocol.wire import EXPONENT_NONFINITE, HEADER_SIZE, DType, Flag, Header, MsgType

log = logging.getLogger("aggnet.client")

#: seconds to wait for a probe's answer before blaming the aggregator
PROBE_WAIT = 1.0
#: later uses answered while one is not, before that one is resent
FAST_RETRANSMIT = 3
#: seconds between looks at the retransmission timers (RTO_MIN is 20 ms)
TIMER_CHECK = 0.002
#: receive batches taken before the loop looks at timers and new requests
RECEIVES_PER_TURN = 8
#: heartbeats per lapse the aggregator allows: a few may be lost
HEARTBEATS_PER_LAPSE = 6
#: seconds before a control request over UDP (STATS, HELLO) goes again
#: unanswered, doubling up to REQUEST_RESEND_MAX
REQUEST_RESEND = 0.25
REQUEST_RESEND_MAX = 1.0
#: seconds a rack's switch may take to answer a JOIN before its workers go
#: to the rack's fallback host aggregator (when the topology names one)
FALLBACK_AFTER = 5.0
_NO_F32 = np.zeros(1, np.float32)
_NO_I32 = np.zeros(1, np.int32)
_NO_EXPS = np.zeros(1, np.int16)
#: what dg.look_at_results answers for "no such result"
_NONE = float("nan")


@dataclass(eq=False)
class SwitchRequest(Request):
    seq: int = 0  #: submission order among this client's requests
    blocks: int = 0
    used: int = 0  #: slots this all-reduce uses
    first_slot: int = 0  #: its blocks start at this slot, then wrap
    slots_left: int = 0  #: slots still serving it: it is done at 0
    exps: np.ndarray | None = None  #: local block exponents (quantized)
    local_nonfinite: int = 0
    buf_f: np.ndarray | None = None
    buf_i: np.ndarray | None = None
    fingerprint: np.ndarray | None = None  #: priming payload (dg.fingerprint)
    task: tuple | None = None  #: what the kernels see of it (dg.Task)


class SwitchClient(Client):
    """Client of a switch, or of an aggregator host in switch mode."""

    _request_class = SwitchRequest
    #: whether this worker went to its rack's fallback host aggregator
    fell_back = False

    def _connect(self) -> None:
        addr = parse(self.address)
        if self.members > MAX_WORKERS:
            raise ValueError(f"a switch-protocol aggregator takes at most {MAX_WORKERS} workers per job, got "
                             f"{self.members}; split them into racks (member_rank/members) under a parent")
        try:
            self.aggregator = (socket.gethostbyname(addr.host), addr.port)
        except OSError as exc:
            raise AggregatorUnreachable(f"cannot resolve the aggregator {self.address}: {exc}") from None
        self.path_mtu = path_mtu(self.aggregator)
        self.max_elements = elements_for_mtu(self.path_mtu)
        wanted = self.config.elements
        if wanted is not None and wanted > self.max_elements:
            ip_bytes = HEADER_SIZE + 4 * wanted + IP_UDP_OVERHEAD
            raise ValueError(f"elements={wanted} makes {ip_bytes}-byte IP packets, but the "
                             f"path MTU to {self.address} is {self.path_mtu} and aggnet never fragments: use "
                             f"elements <= {self.max_elements} or raise the MTU (jumbo frames)")
        self.dsock = DatagramSocket(("0.0.0.0", 0), io=self.config.udp_io, arena_bytes=8 << 20,
                                    max_datagrams=16384, max_datagram_bytes=min(65536, self.path_mtu))
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        if self.fallback_address is None:
            self._join(self.config.connect_timeout)
        else:
            self._join_or_fall_back()
        self._allocate()
        self._heartbeats: threading.Thread | None = None
        self._heartbeats_stop = threading.Event()
        if self.heartbeat_lapse:
            # a thread of their own: an I/O thread busy for seconds (compiling
            # kernels on a cold cache, quantizing a large buffer) is alive
            self._heartbeat_every = max(0.02, self.heartbeat_lapse / HEARTBEATS_PER_LAPSE)
            self._heartbeats = threading.Thread(target=self._send_heartbeats, daemon=True,
                                                name=f"aggnet-heartbeat-{self.job}-{self.rank}")
            self._heartbeats.start()
        # no datagram of this job is larger than a packet (PROBE_OK and
        # control replies are smaller): a receive slot per datagram is enough
        self.dsock.max_datagram_bytes = max(self.packet_bytes, 4096)

    @property
    def io(self) -> str:
        """How datagrams move: ``gso``, ``mmsg`` or ``plain``."""
        return self.dsock.io

    def _allocate(self) -> None:
        s, k = self.slots, self.elements
        self.packet_bytes = pb = HEADER_SIZE + 4 * k
        self.packets = np.zeros((s, pb), np.uint8)
        self.staging = np.zeros(s * pb, np.uint8)
        self.tags = np.zeros(s, np.uint32)
        self.busy = np.zeros(s, np.bool_)
        self.kind = np.zeros(s, np.int8)
        self.block = np.zeros(s, np.int64)
        self.rid = np.full(s, -1, np.int64)
        self.idle = np.ones(s, np.bool_)  #: served every request submitted so far
        self.sent_at = np.zeros(s, np.float64)
        self.rto = np.full(s, RTO_MIN)
        #: whether the slot's use went out once only (Karn: only those time the RTT)
        self.first_try = np.zeros(s, np.bool_)
        #: fast retransmission: results received in all, and per slot the
        #: count when its use went out and how many older uses were waiting
        self.results_seen = 0
        self.results_at_send = np.zeros(s, np.int64)
        self.older_at_send = np.zeros(s, np.int64)
        self.fast_done = np.zeros(s, np.bool_)
        self.srtt: float | None = None
        self.rttvar = 0.0
        self.base_rto = RTO_INITIAL
        cap = self.dsock.offsets.size
        self.res_slot = np.zeros(cap, np.int64)
        self.res_off = np.zeros(cap, np.int64)
        self.probe_off = np.zeros(16, np.int64)
        self.next_slots = np.zeros(s, np.int64)
        self.finished = np.zeros(s, np.int64)
        self.taken = dg.Taken(self.res_slot, self.res_off, self.probe_off)
        # each slot's destination: the aggregator's shard that owns it
        ip, port = self.aggregator
        delta = np.zeros(s, np.int64)
        if self.shard_slots:
            delta = (self.base + np.arange(s, dtype=np.int64)) // self.shard_slots
        self.slot_dest = addr_key((ip, port)) + delta
        self.sharded = bool(delta.any())
        # results, probe answers and the control port's messages (ERROR,
        # heartbeat echoes) count only from the aggregator's ports
        self.src_lo, self.src_hi = addr_key((ip, port)), int(self.slot_dest.max())
        self.template = np.frombuffer(Header(MsgType.PUSH, job_id=self.job_id, sender=self.member_rank,
                                             dtype=DType.INT32, count=k, world=self.members).pack(), np.uint8).copy()
        self.wbits = (self.world_size - 1).bit_length()
        self.window = dg.Window(self.packets, self.template, k, self.tags, self.busy, self.kind, self.block)
        self.pace = dg.Pace(self.sent_at, self.rto, self.first_try, self.fast_done, self.results_at_send,
                            self.older_at_send, self.busy, self.slot_dest, np.zeros(s + 1, np.int64))
        self.accept = dg.Accept(self.src_lo, self.src_hi, self.job_id, s, pb)

    def _join_or_fall_back(self) -> None:
        """Join the rack's switch, or its host aggregator when the switch
        has no room for the job or does not answer (ATP's fallback). Every
        worker of the rack meets the same switch, so all of them fall back
        together: a full pool refuses them all, a dead switch answers none."""
        try:
            self._join(min(self.config.connect_timeout, FALLBACK_AFTER))
            return
        except JobMismatch:
            raise
        except (AggregatorUnreachable, AggregationError) as exc:
            reason = str(exc)
        switch = self.address
        fallback = parse(self.fallback_address)
        try:
            self.aggregator = (socket.gethostbyname(fallback.host), fallback.port)
        except OSError as exc:
            raise AggregatorUnreachable(f"cannot resolve the fallback aggregator {fallback}: {exc}") from None
        self.address = str(fallback)
        self.path_mtu = min(self.path_mtu, path_mtu(self.aggregator))
        self.max_elements = elements_for_mtu(self.path_mtu)
        log.warning("%s: falling back from switch %s to host aggregator %s: %s", self._context(), switch,
                    self.address, reason)
        self.fell_back = True
        self._join(self.config.connect_timeout)

    def _join(self, timeout: float) -> None:
        # at its aggregator a worker is one of `members` (its rack's workers)
        h = Header(MsgType.JOIN, job_id=self.job_id, sender=self.member_rank, world=self.members)
        # heartbeats: an aggregator host says in its JOIN_OK how often it
        # wants them; a P4 switch says nothing, and gets none
        info = {"name": self.job, "world": self.world_size, "max_elements": self.max_elements, "heartbeats": 1}
        if self.config.slots is not None:
            info["slots"] = self.config.slots
        if self.config.elements is not None:
            info["elements"] = self.config.elements
        payload = wire.json_payload(self._signed("JOIN", h, info))
        packed = h.pack_for(payload) + payload
        sock = self.dsock.sock
        deadline = time.monotonic() + timeout
        next_send = 0.0
        while True:
            now = time.monotonic()
            if now >= deadline:
                raise AggregatorUnreachable(
                    f"no aggregator answered at {self.address} within {timeout:g}s "
                    f"({self._context()}): start one with `aggnet serve --mode switch --listen {self.address}`, "
                    f"or check that the switch's control plane installed the job")
            if now >= next_send:
                try:
                    sock.sendto(packed, self.aggregator)
                except OSError:
                    pass  # a local filter or a full buffer: the next try may pass
                next_send = now + 0.5
            r, _, _ = select.select([sock], [], [], min(0.5, deadline - now))
            if not r:
                continue
            try:
                data, src = sock.recvfrom(65536)
            except OSError:
                continue
            if src != self.aggregator:
                continue
            try:
                reply = wire.unpack_header(data)
            except wire.WireError:
                continue
            if reply.job_id != self.job_id:
                continue
            if reply.msg_type == MsgType.ERROR:
                raise session.wire_error(memoryview(data)[HEADER_SIZE:],
                                         f"aggregator {self.address} refused {self._context()}")
            if reply.msg_type == MsgType.JOIN_OK:
                ok = JoinOk.from_header(reply)
                self.slots, self.elements, self.base, self.shard_slots = ok.slots, ok.elements, ok.base, ok.shard_slots
                #: seconds of silence after which the aggregator drops this worker (0: it watches none)
                self.heartbeat_lapse = JoinHeartbeats.from_header(reply).lapse_ms / 1000
                if not (1 <= self.slots <= 65536 and 1 <= self.elements):
                    raise AggregationError(f"aggregator {self.address} answered the JOIN with {self.slots} slots "
                                           f"of {self.elements} elements")
                if self.shard_slots:
                    try:
                        check_shard_layout(self.base, self.slots, self.shard_slots, self.aggregator[1])
                    except ValueError as exc:
                        raise AggregationError(f"aggregator {self.address} placed {self._context()} on shard ports "
                                               f"a worker cannot address: {exc}") from None
                if self.elements > self.max_elements:
                    raise JobMismatch(
                        f"aggregator {self.address} sums {self.elements} elements per packet for {self._context()}, "
                        f"more than the path MTU {self.path_mtu} fits ({self.max_elements}); aggnet never "
                        f"fragments: raise the MTU or start the aggregator with fewer elements")
                if self.config.elements is not None and self.config.elements != self.elements:
                    log.info("%s: the aggregator sums %d elements per packet (asked for %d)", self._context(),
                             self.elements, self.config.elements)
                log.info("%s joined: %d slots of %d elements, UDP I/O %s", self._context(), self.slots,
                         self.elements, self.dsock.io)
                return

    def _encoding(self, buf, codec, op, wire_hint) -> Encoding:
        # a switch adds integers: float32 always travels quantized
        if codec not in (None, "int32"):
            raise ValueError(f"the switch protocol adds int32: codec {codec!r} cannot travel; float32 buffers "
                             f"are quantized to int32 (codec None or 'int32')")
        if buf.dtype == np.float32:
            codec = "int32"
        enc = Encoding(buf, codec, op, self.world_size, wire_hint)
        if enc.half_fmt:
            raise ValueError("the switch protocol adds int32: use a float32 buffer (quantized) or an int32 one, "
                             "not 16-bit floats")
        return enc

    def _wakeup(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (OSError, AttributeError):
            pass

    def _disconnect(self, leave: bool) -> None:
        dsock = getattr(self, "dsock", None)
        if dsock is None:
            return
        if leave:
            # datagrams get lost: say it three times (LEAVE is idempotent)
            h = Header(MsgType.LEAVE, job_id=self.job_id, sender=self.member_rank, world=self.members).pack()
            for _ in range(3):
                try:
                    dsock.sock.sendto(h, self.aggregator)
                except OSError:
                    pass
        self._stop_heartbeats()
        dsock.close()
        self.dsock = None
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    # -- the I/O thread --------------------------------------------------------------

    def _io_loop(self) -> None:
        self._reqs: list[SwitchRequest] = []
        self._by_seq: dict[int, SwitchRequest] = {}
        self._next_seq = 0
        self._cursor = 0
        self._last_progress = time.monotonic()
        self._probing: float | None = None
        self._next_check = 0.0
        sock = self.dsock.sock
        while True:
            new, closing = self._take_submitted()
            if closing:
                return
            for req in new:
                self._admit(req)
            self._in_hand = []
            now = time.monotonic()
            if self._reqs and now >= self._next_check:
                # timers a few times per round trip, not per datagram: at a
                # link's pace a turn of this loop carries a handful of
                # packets, and a numpy pass over every slot each turn would
                # cost more than the packets themselves
                self._retransmit()
                self._check_progress()
                self._next_check = now + TIMER_CHECK
            wait = 0.5 if not self._reqs else max(0.0, self._next_check - now)
            r, _, _ = select.select([sock, self._wake_r], [], [], wait)
            if self._wake_r in r:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
            if sock in r:
                self._receive()

    def _admit(self, req: SwitchRequest) -> None:
        k, s = self.elements, self.slots
        req.blocks = -(-req.buf.size // k)
        if req.blocks == 0:
            self._complete(req)
            return
        req.seq = self._next_seq
        self._next_seq += 1
        req.used = min(s, req.blocks)
        req.fingerprint = dg.fingerprint(req.buf.size, req.enc.quantized, k)
        req.first_slot = self._cursor
        self._cursor = (self._cursor + req.used) % s
        req.slots_left = req.used
        if req.buf.dtype == np.float32:
            req.buf_f, req.buf_i = req.buf, _NO_I32
        else:
            req.buf_f, req.buf_i = _NO_F32, req.buf.view(np.int32)
        if req.enc.quantized:
            req.exps = np.empty(req.blocks, np.int16)
            cpu_kernels.block_exponents(req.buf, k, req.exps)
            req.local_nonfinite = int(np.count_nonzero(req.exps == EXPONENT_NONFINITE))
        req.task = dg.Task(req.buf_f, req.buf_i, bool(req.enc.quantized), int(req.buf.size), self.wbits,
                           float(req.enc.multiplier), req.used, req.blocks,
                           req.exps if req.exps is not None else _NO_EXPS, req.fingerprint, self.world_size,
                           req.round, req.first_slot)
        if not self._reqs:
            self._last_progress = time.monotonic()
            self._probing = None
        self._reqs.append(req)
        self._by_seq[req.seq] = req
        self._active[req.round] = req
        mine = (req.first_slot + np.arange(req.used, dtype=np.int64)) % s
        ready = mine[self.idle[mine]]
        if ready.size:
            self._start_slots(req, ready)

    def _start_slots(self, req: SwitchRequest, slots: np.ndarray) -> None:
        """The request's first use of each of ``slots``, sent in the
        request's order of them (the same on every worker, so the uses
        complete in that order too)."""
        self.idle[slots] = False
        self.rid[slots] = req.seq
        dg.start_uses(self.window, req.task, slots, slots.size)
        self._send_slots(slots, retransmit=False)

    def _send_slots(self, slots: np.ndarray, retransmit: bool) -> None:
        """Send the packets of ``slots``, a destination's run of
        them per batch. Results come back roughly in the order uses went
        out, so the slots ready at once are mostly consecutive: their
        packets, consecutive rows of one array, go out as they lie; only a
        scattered set is first staged one after another."""
        n = slots.size
        pb = self.packets.shape[1]
        runs = dg.note_sends(self.pace, slots, n, time.monotonic(), not retransmit, float(self.base_rto),
                             self.results_seen, self.sharded)
        if retransmit:
            self.packets[slots, dg.O_FLAGS] |= dg.F_RETRANSMIT
        if runs - 1 < max(1, n // 16):
            flat = self.packets.reshape(-1)
            start = 0
            for end in self.pace.runs[:runs].tolist():
                first = int(slots[start])
                dest = int(self.slot_dest[first])
                self.dsock.send_segments(flat[first * pb:(first + end - start) * pb], pb, (end - start) * pb, dest)
                start = end
        else:
            dg.stage(self.packets, slots, n, self.staging, pb, False)
            dests = self.slot_dest[slots] if self.sharded else None
            if dests is None:
                self.dsock.send_segments(self.staging, pb, n * pb, int(self.slot_dest[0]))
            else:
                shard_cuts = np.flatnonzero(dests[1:] != dests[:-1]) + 1
                start = 0
                for end in [*shard_cuts.tolist(), n]:
                    self.dsock.send_segments(self.staging[start * pb:end * pb], pb, (end - start) * pb,
                                             int(dests[start]))
                    start = end
        self.stats.chunks_sent += n
        self.stats.bytes_sent += n * pb

    def _receive(self) -> int:
        """Take and process what is queued; returns the datagrams taken."""
        dsock = self.dsock
        total = 0
        for _ in range(RECEIVES_PER_TURN):
            n = dsock.receive(0, BATCH_BYTES)
            if n == 0:
                break
            total += n
            m, probes, dropped = dg.classify_results(
                dg.Batch(dsock.arena, dsock.offsets, dsock.lengths, dsock.sources, n), self.accept, self.window,
                self.taken)
            self.stats.dropped_replies += dropped
            for q in range(probes):
                off = int(self.probe_off[q])
                if dsock.arena[off + dg.O_TYPE] == MsgType.HEARTBEAT:
                    self._on_heartbeat(bytes(dsock.arena[off:off + HEADER_SIZE]))
                    continue
                if dsock.arena[off + dg.O_TYPE] == MsgType.ERROR:
                    at = np.flatnonzero(dsock.offsets[:n] == off)
                    self._on_error(bytes(dsock.arena[off:off + int(dsock.lengths[at[0]])]) if at.size else b"")
                    continue
                try:
                    self._on_probe(bytes(dsock.arena[off:off + HEADER_SIZE]))
                except Exception:  # no reply, however odd, stops this client
                    self.stats.dropped_replies += 1
                    log.debug("%s: dropped a PROBE_OK it could not read", self._context(), exc_info=True)
            if m:
                self._on_results(m)
            if not self._reqs:
                break
        return total

    def _on_results(self, m: int) -> None:
        now = time.monotonic()
        self._last_progress = now
        self._probing = None
        self.results_seen += m
        self.stats.results += m
        self.stats.bytes_received += m * self.packet_bytes
        # one RTT sample per batch, its middle one: np.median of the batch
        # cost a fifth of this thread's time at a slow link's pace
        sent, one = dg.look_at_results(self.pace, self.rid, self.res_slot, m, _NONE)
        if sent == sent:  # not NaN
            self._sample_rtt(now - sent)
        if one == one:
            groups = [(int(one), self.res_slot, self.res_off, m)]
        else:
            slots = self.res_slot[:m]
            rids = self.rid[slots]
            order = np.argsort(rids, kind="stable")
            rs, ro, rr = slots[order], self.res_off[:m][order], rids[order]
            cuts = [0, *(np.flatnonzero(rr[1:] != rr[:-1]) + 1).tolist(), m]
            groups = [(int(rr[a]), rs[a:b].copy(), ro[a:b].copy(), b - a) for a, b in zip(cuts[:-1], cuts[1:])]
        for seq, res_slot, res_off, count in groups:
            req = self._by_seq.get(seq)
            if req is None:
                continue  # failed meanwhile
            self._advance(req, res_slot, res_off, count)

    def _advance(self, req: SwitchRequest, res_slot, res_off, count: int) -> None:
        nn, nf, bad_block, differ = dg.advance(self.dsock.arena, res_slot, res_off, count, self.window, req.task,
                                               self.next_slots, self.finished)
        if differ:
            # every worker sees the same sums, so every one stops here; the
            # slots' uses no longer line up between them, so nothing goes on
            self.stats.errors += 1
            self._stop_everything(JobMismatch(
                f"{self._context()}: round {req.round}: the workers' buffers differ in size or dtype (this one "
                f"all-reduces {req.buf.size} {'float32' if req.enc.quantized else 'int32'} elements); all workers "
                f"must all-reduce the same buffers in the same order. Close this client and start again"))
            return
        if bad_block >= 0:
            self._nonfinite(req, bad_block)
        if nn:
            # in the order the results came: every worker sees that order, so
            # the slots complete in it again (sorting by slot would reorder
            # the wrap-around of the window differently on each worker, and
            # later uses would complete first: fast retransmits for nothing)
            self._send_slots(self.next_slots[:nn].copy(), retransmit=False)
        if nf:
            self._finish_slots(req, self.finished[:nf].copy())

    def _finish_slots(self, req: SwitchRequest, slots: np.ndarray) -> None:
        """``slots`` served their last use of ``req``: each goes on to the
        next request that uses it, or waits for one."""
        self.rid[slots] = -1
        req.slots_left -= slots.size
        if req.slots_left <= 0:
            self._reqs.remove(req)
            self._by_seq.pop(req.seq, None)
            self._complete(req)
        pending = slots
        s = self.slots
        for later in self._reqs:
            if later.seq <= req.seq:
                continue
            position = (pending - later.first_slot) % s
            mask = position < later.used
            if mask.any():
                self._start_slots(later, pending[mask][np.argsort(position[mask], kind="stable")])
                pending = pending[~mask]
                if not pending.size:
                    return
        self.idle[pending] = True

    def _retransmit(self) -> None:
        """Resend a use whose timeout expired, or at once when more than
        FAST_RETRANSMIT later uses came back while it did not (a loss, as
        TCP's duplicate acknowledgements tell; every worker sees it, so the
        one whose packet was lost resends it)."""
        busy = self.busy
        if not busy.any():
            return
        now = time.monotonic()
        later = self.results_seen - self.results_at_send - self.older_at_send
        fast = busy & ~self.fast_done & (later > FAST_RETRANSMIT)
        timed = busy & (self.sent_at + self.rto <= now)
        due = np.flatnonzero(timed | fast)
        if not due.size:
            return
        if timed.any():
            # a timer fired: keep the backed-off timeout for new uses too
            # until a clean round trip is measured (RFC 6298, 5.7), or an
            # estimate that is too short would never see a clean sample
            self.base_rto = min(RTO_MAX, self.base_rto * 2)
        is_fast = fast[due]
        self.fast_done[due[is_fast]] = True
        slow = due[~is_fast]
        self.rto[slow] = np.minimum(RTO_MAX, self.rto[slow] * 2)
        self.first_try[due] = False
        self.stats.fast_retransmissions += int(is_fast.sum())
        self.stats.retransmissions += due.size
        self._send_slots(due, retransmit=True)

    def _sample_rtt(self, rtt: float) -> None:
        """RFC 6298's estimator: the timeout follows the measured round trip
        (a Python worker's scheduling jitter is far above a switch's)."""
        if self.srtt is None:
            self.srtt, self.rttvar = rtt, rtt / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt
        # samples of a self-clocked window are correlated, so the deviation
        # understates the jitter: never time out before 2 round trips
        self.base_rto = min(RTO_MAX, max(RTO_MIN, 2 * self.srtt, self.srtt + 4 * self.rttvar))

    def _nonfinite(self, req: SwitchRequest, block: int) -> None:
        """Every worker got the same NaN/Inf marker for a slot's next block:
        all stop using the slot for this all-reduce."""
        if req.error is None:
            k = self.elements
            if req.local_nonfinite:
                text = (f"rank {self.rank} of job {self.job!r}: round {req.round} buffer holds NaN/Inf in "
                        f"{req.local_nonfinite} block(s) of {k} elements (first at element "
                        f"{int(np.argmax(req.exps == EXPONENT_NONFINITE)) * k}); the switch cannot add them")
            else:
                text = (f"job {self.job!r} round {req.round}: another worker reported NaN/Inf values near element "
                        f"{block * k}; that worker's own error names it (rank {self.rank} saw none)")
            req.error = NonFiniteError(text)

    # -- when nothing moves --------------------------------------------------------------

    def _stop_everything(self, exc: Exception) -> None:
        req = self._reqs[0]
        self._reqs = []
        self._by_seq = {}
        self.busy[:] = False
        self._fail(req, exc, poison=True)

    def _check_progress(self) -> None:
        now = time.monotonic()
        if self._probing is not None:
            if now >= self._probing:
                self._stop_everything(AggregationTimeout(
                    f"{self._context()}: no progress for {now - self._last_progress:.1f}s and no answer to a probe "
                    f"within {PROBE_WAIT:g}s: is the aggregator at {self.address} running?"))
            return
        if now - self._last_progress < self.config.timeout:
            return
        # ask the aggregator which workers the oldest waiting slot lacks
        busy = np.flatnonzero(self.busy)
        slot = int(busy[np.argmin(self.sent_at[busy])]) if busy.size else 0
        self._probe_slot = slot
        tag = int(self.tags[slot])
        h = Header(MsgType.PROBE, job_id=self.job_id, index=slot, sender=self.member_rank,
                   flags=Flag.VERSION if tag & 1 else 0, ref=tag, world=self.members)
        self.dsock.send(h.pack(), int(self.slot_dest[slot]))
        self._probing = now + PROBE_WAIT

    def _on_error(self, data: bytes) -> None:
        """An ERROR the aggregator sent on its own: a verdict about the job
        (another member joined it with another world size, a member's
        heartbeats stopped) that fails what is pending and every later
        all-reduce, at once."""
        try:
            h = wire.unpack_header(data)
            payload = data[HEADER_SIZE:]
            wire.check_payload(h, len(payload))
            exc = session.wire_error(payload, self._context())
        except (wire.WireError, ValueError):
            self.stats.dropped_replies += 1
            return
        if isinstance(exc, (JobMismatch, AggregationTimeout)):
            self._job_ended(exc)
        else:
            self.stats.dropped_replies += 1

    def _job_ended(self, exc: Exception) -> None:
        """The job cannot go on as it started: nothing of it stays in the
        window, what is pending fails with ``exc`` and so does every later
        all-reduce."""
        self._reqs = []
        self._by_seq = {}
        self.busy[:] = False
        self._probing = None
        self._job_refused(exc)

    # -- heartbeats ------------------------------------------------------------------------

    def _send_heartbeats(self) -> None:
        beat = Header(MsgType.HEARTBEAT, job_id=self.job_id, sender=self.member_rank, world=self.members).pack()
        sock, dest = self.dsock.sock, self.aggregator
        while True:
            try:
                sock.sendto(beat, dest)
            except OSError:
                pass  # a full buffer, an ICMP error: the lapse allows for a few lost
            if self._heartbeats_stop.wait(self._heartbeat_every):
                return

    def _stop_heartbeats(self) -> None:
        stop = getattr(self, "_heartbeats_stop", None)
        if stop is not None:
            stop.set()
        thread = getattr(self, "_heartbeats", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2.0)

    def _on_heartbeat(self, data: bytes) -> None:
        """The aggregator answers a heartbeat only when it no longer counts
        this worker as a member."""
        try:
            h = wire.unpack_header(data)
        except wire.WireError:
            self.stats.dropped_replies += 1
            return
        if h.sender != self.member_rank or Heartbeat.from_header(h).lapse_ms:
            self.stats.dropped_replies += 1
            return
        # the aggregator dropped this worker for silence; the other
        # workers' all-reduces failed when it did
        self._stop_heartbeats()
        self._job_ended(AggregationError(
            f"{self._context()}: the aggregator at {self.address} no longer counts this worker as a member: "
            f"its heartbeats stopped for longer than the aggregator allows (was the process paused, or its "
            f"host cut off?) and the other workers were told, or the aggregator restarted without the job; "
            f"start the job's workers again"))

    def _on_probe(self, data: bytes) -> None:
        if self._probing is None or not self._reqs:
            return
        try:
            h = wire.unpack_header(data)
        except wire.WireError:
            return
        if h.index != self._probe_slot:
            return
        state = ProbeOk.from_header(h)
        idle = time.monotonic() - self._last_progress
        if state.tag != self.tags[h.index]:
            # the slot's registers still hold an older use: nobody's packet
            # for this one arrived
            missing = list(range(self.members))
            detail = f"the aggregator has no contribution to it yet (it holds use {state.tag})"
        elif state.count == 0:
            missing = []
            detail = "the aggregator finished it, but no result reached this worker"
        else:
            missing = [r for r in range(self.members) if not (state.seen >> r) & 1]
            who = "rank(s)" if self.members == self.world_size else "rack member(s)"
            detail = (f"the aggregator has {state.count} of {self.members} contributions; {who} {missing} never "
                      f"sent theirs")
        self._stop_everything(AggregationTimeout(
            f"{self._context()}: no progress for {idle:.1f}s; slot {h.index} (use {self.tags[h.index]}): {detail}. "
            f"Is rank {missing[0] if missing else '?'} alive and calling allreduce in the same order?"))


def query_stats(address: str, timeout: float = 5.0, payload: bytes = b"") -> dict:
    """The counters of a switch-mode aggregator (STATS over UDP); ``payload``
    names the job and carries the signature (aggnet.cli.stats.stats_request)."""
    addr = parse(address)
    try:
        dest = (socket.gethostbyname(addr.host), addr.port)
    except OSError as exc:
        raise AggregatorUnreachable(f"cannot resolve {address}: {exc}") from None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        reply = udp_request(s, dest, MsgType.STATS, payload, MsgType.STATS_OK, timeout, f"{address} refused STATS")
    if reply is None:
        raise AggregatorUnreachable(f"no STATS answer from {address} within {timeout:g}s: is "
                                    f"`aggnet serve --mode switch --listen {address}` running?")
    return reply


def udp_request(sock, dest, msg_type: MsgType, payload: bytes, want: MsgType, timeout: float,
                refused: str) -> dict | None:
    """A control request over UDP and its JSON answer (None: no answer in
    time). The request goes again while no answer comes (every
    REQUEST_RESEND seconds, doubling): a lost request or answer on a lossy
    path costs a resend, not the whole timeout. An aggregator answers an
    unsigned request with no more bytes than it got; when the answer is
    larger it asks for the request again, padded
    (messages.padding_asked), and this sends it so."""
    request = Header(msg_type).pack_for(payload) + payload
    now = time.monotonic()
    deadline = now + timeout
    send_at, wait, paddings = now, REQUEST_RESEND, 0
    while now < deadline:
        if now >= send_at:
            sock.sendto(request, dest)
            send_at, wait = now + wait, min(2 * wait, REQUEST_RESEND_MAX)
        sock.settimeout(max(0.001, min(send_at, deadline) - now))
        try:
            data, src = sock.recvfrom(1 << 20)
        except socket.timeout:
            now = time.monotonic()
            continue
        except (ConnectionRefusedError, BlockingIOError):
            return None  # nothing listens there
        now = time.monotonic()
        if src != dest:
            continue
        try:
            h = wire.unpack_header(data)
        except wire.WireError:
            continue
        if h.msg_type == MsgType.ERROR:
            raise session.wire_error(memoryview(data)[HEADER_SIZE:], refused)
        if h.msg_type != want:
            continue
        needed = padding_asked(h)
        if not needed:
            return wire.parse_json(memoryview(data)[HEADER_SIZE:HEADER_SIZE + h.count])
        if needed > MAX_DATAGRAM:
            raise AggregationError(f"{refused}: its answer is {needed} bytes, more than an unsigned UDP request "
                                   f"can draw ({MAX_DATAGRAM}); sign the request with the job's key (or the "
                                   f"admin key)")
        # room for counters that grew between the two answers
        target = min(MAX_DATAGRAM, needed + needed // 4 + 256)
        if len(request) >= target:
            continue  # the ask for a shorter request sent earlier
        paddings += 1
        if paddings > 3:
            return None
        request = request + bytes(target - len(request))
        send_at, wait = now, REQUEST_RESEND
    return None
