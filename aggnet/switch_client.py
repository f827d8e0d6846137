"""The worker side of the switch protocol (docs/protocol.md), over UDP.

The job's slice of the aggregator's pool is the worker's window: every slot
carries one block of K int32 values at a time, and a slot's next use is
sent when its previous result arrives. A float32 buffer is quantized per
block with the exponent all workers agreed through the previous use of the
slot (an all-reduce starts with one priming use per slot for that); int32
buffers travel as they are. Each outstanding use is retransmitted after a
timeout that doubles per retry; results are written into the caller's
buffer in place. Packets live in one preallocated buffer per slot.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import struct
import time
from dataclasses import dataclass

import numpy as np

from . import kernels, wire
from .address import parse
from .client import Client, Request
from .codec import Encoding
from .errors import AggregationError, AggregationTimeout, AggregatorUnreachable, JobMismatch, NonFiniteError
from .protocol import MAX_WORKERS, RTO_INITIAL, RTO_MAX, RTO_MIN
from .transport.udp import PacketBatch, open_udp
from .wire import EXPONENT_NONFINITE, EXPONENT_ZERO, HEADER_SIZE, DType, Flag, Header, MsgType

log = logging.getLogger("aggnet.client")

#: seconds to wait for a probe's answer before blaming the aggregator
PROBE_WAIT = 1.0
#: later uses answered while one is not, before that one is resent
FAST_RETRANSMIT = 3
_IDLE, _PRIMING, _DATA = 0, 1, 2
# the fields a result is matched and decoded by: type, flags, job, index,
# exponent, next_exponent, ref
_RESULT_FIELDS = struct.Struct(">3xBB3xI4xI4xhh4xI")


@dataclass(eq=False)
class SwitchRequest(Request):
    blocks: int = 0
    used: int = 0  #: slots this all-reduce uses
    remaining: int = 0  #: data blocks whose result has not been written
    exps: np.ndarray | None = None  #: local block exponents (quantized)
    local_nonfinite: int = 0


class SwitchClient(Client):
    """Client of a switch, or of an aggregator host in switch mode."""

    _request_class = SwitchRequest

    def _connect(self) -> None:
        addr = parse(self.address)
        if self.members > MAX_WORKERS:
            raise ValueError(f"a switch-protocol aggregator takes at most {MAX_WORKERS} workers per job, got "
                             f"{self.members}; split them into racks (member_rank/members) under a parent")
        self.aggregator = (socket.gethostbyname(addr.host), addr.port)
        self.sock = open_udp(("0.0.0.0", 0))
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._join()
        k, s = self.elements, self.slots
        self.packet_bytes = HEADER_SIZE + 4 * k
        self.packets = np.zeros((s, self.packet_bytes), np.uint8)
        self._views = [memoryview(self.packets[i]) for i in range(s)]
        self._payloads = [self.packets[i, HEADER_SIZE:].view(np.int32) for i in range(s)]
        self.tags = np.zeros(s, np.uint32)
        self.kind = np.zeros(s, np.int8)
        self.block = np.zeros(s, np.int64)
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
        self.batch = PacketBatch(256, max(self.packet_bytes, 4096) + 64)
        self._header = Header(MsgType.PUSH, job_id=self.job_id, sender=self.member_rank, dtype=DType.INT32,
                              count=k, world=self.members)

    def _join(self) -> None:
        # at its aggregator a worker is one of `members` (its rack's workers)
        h = Header(MsgType.JOIN, job_id=self.job_id, sender=self.member_rank, world=self.members)
        payload = wire.json_payload({"name": self.job, "slots": self.config.slots, "elements": self.config.elements,
                                     "world": self.world_size})
        packed = h.pack_for(payload) + payload
        deadline = time.monotonic() + self.config.connect_timeout
        next_send = 0.0
        while True:
            now = time.monotonic()
            if now >= deadline:
                raise AggregatorUnreachable(
                    f"no aggregator answered at {self.address} within {self.config.connect_timeout:g}s "
                    f"({self._context()}): start one with `aggnet serve --mode switch --listen {self.address}`, "
                    f"or check that the switch's control plane installed the job")
            if now >= next_send:
                try:
                    self.sock.sendto(packed, self.aggregator)
                except OSError:
                    pass  # a local filter or a full buffer: the next try may pass
                next_send = now + 0.5
            r, _, _ = select.select([self.sock], [], [], min(0.5, deadline - now))
            if not r:
                continue
            data, src = self.sock.recvfrom(65536)
            try:
                reply = wire.unpack_header(data)
            except wire.WireError:
                continue
            if reply.job_id != self.job_id:
                continue
            if reply.msg_type == MsgType.ERROR:
                code, text = wire.parse_error(memoryview(data)[HEADER_SIZE:])
                kind = JobMismatch if code == wire.ErrorCode.JOB_MISMATCH.value else AggregationError
                raise kind(f"aggregator {self.address} refused {self._context()}: {text}")
            if reply.msg_type == MsgType.JOIN_OK:
                # answered in the header: slots in index, K in nsum
                self.slots = reply.index
                self.elements = reply.nsum
                if not (1 <= self.slots <= 65536 and 1 <= self.elements):
                    raise AggregationError(f"aggregator {self.address} answered the JOIN with {self.slots} slots "
                                           f"of {self.elements} elements")
                log.info("%s joined: %d slots of %d elements", self._context(), self.slots, self.elements)
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
        sock = getattr(self, "sock", None)
        if sock is None:
            return
        if leave:
            # datagrams get lost: say it three times (LEAVE is idempotent)
            h = Header(MsgType.LEAVE, job_id=self.job_id, sender=self.member_rank, world=self.members).pack()
            for _ in range(3):
                try:
                    sock.sendto(h, self.aggregator)
                except OSError:
                    pass
        sock.close()
        self.sock = None
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)

    # -- the I/O thread --------------------------------------------------------------

    def _io_loop(self) -> None:
        queue: list[SwitchRequest] = []
        self._req: SwitchRequest | None = None
        self._last_progress = time.monotonic()
        self._probing: float | None = None
        while True:
            new, closing = self._take_submitted()
            queue.extend(new)
            if closing:
                return
            if self._req is None and queue:
                self._start(queue.pop(0))
            now = time.monotonic()
            busy = self.kind != _IDLE
            wait = 0.5
            if busy.any():
                wait = max(0.0, min(0.05, float(np.min(self.sent_at[busy] + self.rto[busy])) - now))
            r, _, _ = select.select([self.sock, self._wake_r], [], [], wait)
            if self._wake_r in r:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
            if self.sock in r:
                n = self.batch.receive(self.sock, 0)
                for i in range(n):
                    self._on_packet(self.batch.views[i][: self.batch.lengths[i]])
            if self._req is not None:
                self._retransmit()
                self._check_progress()

    def _start(self, req: SwitchRequest) -> None:
        k = self.elements
        req.blocks = -(-req.buf.size // k)
        req.remaining = req.blocks
        if req.blocks == 0:
            self._complete(req)
            return
        req.used = min(self.slots, req.blocks)
        self._req = req
        self._active[req.round] = req
        self._last_progress = time.monotonic()
        self._probing = None
        self._header.round = req.round
        if req.enc.quantized:
            req.exps = np.empty(req.blocks, np.int16)
            req.enc.k.block_exponents(req.buf, k, req.exps)
            req.local_nonfinite = int(np.count_nonzero(req.exps == EXPONENT_NONFINITE))
            for i in range(req.used):
                self._send_use(i, _PRIMING, i, 0)
        else:
            for i in range(req.used):
                self._send_use(i, _DATA, i, 0)

    def _next_exponent(self, req: SwitchRequest, block: int) -> int:
        """The exponent of the block this slot carries after ``block``."""
        nxt = block + req.used
        return int(req.exps[nxt]) if req.exps is not None and nxt < req.blocks else EXPONENT_ZERO

    def _send_use(self, slot: int, kind: int, block: int, exponent: int) -> None:
        """Fill the slot's packet with its next use and send it."""
        req, k = self._req, self.elements
        tag = (int(self.tags[slot]) + 1) & 0xFFFFFFFF or 1
        self.tags[slot] = tag
        h = self._header
        h.index, h.ref, h.flags = slot, tag, Flag.VERSION if tag & 1 else 0
        payload = self._payloads[slot]
        if kind == _PRIMING:
            h.exponent, h.offset = 0, 0
            h.next_exponent = int(req.exps[block])
            payload[:] = 0
        else:
            start = block * k
            src = req.buf[start:start + k]
            n = src.size
            h.offset = start
            if req.enc.quantized:
                h.exponent = exponent
                h.next_exponent = self._next_exponent(req, block)
                req.enc.k.quantize(src, kernels.quant_shift(exponent, self.world_size), payload[:n], True)
            else:
                h.exponent = h.next_exponent = 0
                req.enc.k.byteswap32(src, payload[:n])
            if n < k:
                payload[n:] = 0
        wire.pack_into(self.packets[slot], h)
        self.kind[slot] = _IDLE
        self.block[slot] = block
        self.rto[slot] = self.base_rto
        self.first_try[slot] = True
        self.fast_done[slot] = False
        self.results_at_send[slot] = self.results_seen
        self.older_at_send[slot] = int(np.count_nonzero(self.kind != _IDLE))
        self.kind[slot] = kind  # counted above before marking this one busy
        self._transmit(slot)

    def _transmit(self, slot: int) -> None:
        self.sent_at[slot] = time.monotonic()
        try:
            self.sock.sendto(self._views[slot], self.aggregator)
        except OSError as exc:  # a full buffer or an ICMP error: the retransmission covers it
            log.debug("send of slot %d failed: %s", slot, exc)
        self.stats.chunks_sent += 1
        self.stats.bytes_sent += self.packet_bytes

    def _retransmit(self) -> None:
        """Resend a use whose timeout expired, or at once when more than
        FAST_RETRANSMIT later uses came back while it did not (a loss, as
        TCP's duplicate acknowledgements tell; every worker sees it, so the
        one whose packet was lost resends it)."""
        now = time.monotonic()
        busy = self.kind != _IDLE
        later = self.results_seen - self.results_at_send - self.older_at_send
        fast = busy & ~self.fast_done & (later > FAST_RETRANSMIT)
        due = np.flatnonzero((busy & (self.sent_at + self.rto <= now)) | fast)
        if due.size and not fast[due].all():
            # a timer fired: keep the backed-off timeout for new uses too
            # until a clean round trip is measured (RFC 6298, 5.7), or an
            # estimate that is too short would never see a clean sample
            self.base_rto = min(RTO_MAX, self.base_rto * 2)
        for slot in due:
            self.packets[slot, 4] |= Flag.RETRANSMIT
            if fast[slot]:
                self.fast_done[slot] = True
                self.stats.fast_retransmissions += 1
            else:
                self.rto[slot] = min(RTO_MAX, self.rto[slot] * 2)
            self.first_try[slot] = False
            self.stats.retransmissions += 1
            self._transmit(slot)

    def _on_packet(self, data) -> None:
        if len(data) < HEADER_SIZE or data[0] != 0xA6 or data[1] != 0x6E:
            return
        mtype, flags, job, index, exponent, next_exp, ref = _RESULT_FIELDS.unpack_from(data)
        if job != self.job_id or index >= self.slots:
            return
        if mtype == MsgType.PROBE_OK:
            self._on_probe(data)
            return
        if mtype != MsgType.RESULT or len(data) != self.packet_bytes or self.kind[index] == _IDLE \
                or ref != self.tags[index]:
            return  # a duplicate result, or not for this use
        now = time.monotonic()
        self._last_progress = now
        self._probing = None
        self.results_seen += 1
        if self.first_try[index]:
            self._sample_rtt(now - self.sent_at[index])
        req = self._req
        slot, kind, block = index, self.kind[index], int(self.block[index])
        self.kind[slot] = _IDLE
        self.stats.results += 1
        self.stats.bytes_received += len(data)
        if kind == _DATA:
            self._decode(req, block, data, exponent)
            req.remaining -= 1
            block += req.used
            if block >= req.blocks:
                self._maybe_done(req)
                return
        # the next use of this slot: the agreed exponent came with this result
        if req.enc.quantized and next_exp == EXPONENT_NONFINITE:
            self._nonfinite(req, block)
            self._maybe_done(req)
            return
        self._send_use(slot, _DATA, block, next_exp if req.enc.quantized else 0)

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

    def _decode(self, req: SwitchRequest, block: int, data, exponent: int) -> None:
        k = self.elements
        start = block * k
        dest = req.buf[start:start + k]
        q = np.frombuffer(data, np.int32, dest.size, HEADER_SIZE)
        if req.enc.quantized:
            req.enc.k.dequantize(q, kernels.quant_shift(exponent, self.world_size), dest, True, req.enc.multiplier)
        else:
            req.enc.k.byteswap32(q, dest)

    def _nonfinite(self, req: SwitchRequest, block: int) -> None:
        """Every worker got the same NaN/Inf marker for this slot's next
        block: all stop using the slot for this all-reduce."""
        skipped = len(range(block, req.blocks, req.used))
        req.remaining -= skipped
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

    def _maybe_done(self, req: SwitchRequest) -> None:
        if req.remaining == 0 and not (self.kind != _IDLE).any():
            self._req = None
            self._complete(req)

    # -- when nothing moves --------------------------------------------------------------

    def _check_progress(self) -> None:
        now = time.monotonic()
        if self._probing is not None:
            if now >= self._probing:
                self._fail(self._req, AggregationTimeout(
                    f"{self._context()}: no progress for {now - self._last_progress:.1f}s and no answer to a probe "
                    f"within {PROBE_WAIT:g}s: is the aggregator at {self.address} running?"), poison=True)
                self._req = None
            return
        if now - self._last_progress < self.config.timeout:
            return
        # ask the aggregator which workers the oldest waiting slot lacks
        busy = np.flatnonzero(self.kind != _IDLE)
        slot = int(busy[np.argmin(self.sent_at[busy])]) if busy.size else 0
        self._probe_slot = slot
        tag = int(self.tags[slot])
        h = Header(MsgType.PROBE, job_id=self.job_id, index=slot, sender=self.member_rank,
                   flags=Flag.VERSION if tag & 1 else 0, ref=tag, world=self.members)
        try:
            self.sock.sendto(h.pack(), self.aggregator)
        except OSError:
            pass
        self._probing = now + PROBE_WAIT

    def _on_probe(self, data) -> None:
        if self._probing is None or self._req is None:
            return
        h = wire.unpack_header(data)
        if h.index != self._probe_slot:
            return
        idle = time.monotonic() - self._last_progress
        if h.offset != self.tags[h.index]:
            # the slot's registers still hold an older use: nobody's packet
            # for this one arrived
            missing = list(range(self.members))
            detail = f"the aggregator has no contribution to it yet (it holds use {h.offset})"
        elif h.nsum == 0:
            missing = []
            detail = "the aggregator finished it, but no result reached this worker"
        else:
            missing = [r for r in range(self.members) if not (h.ref >> r) & 1]
            who = "rank(s)" if self.members == self.world_size else "rack member(s)"
            detail = f"the aggregator has {h.nsum} of {self.members} contributions; {who} {missing} never sent theirs"
        self._fail(self._req, AggregationTimeout(
            f"{self._context()}: no progress for {idle:.1f}s; slot {h.index} (use {self.tags[h.index]}): {detail}. "
            f"Is rank {missing[0] if missing else '?'} alive and calling allreduce in the same order?"), poison=True)
        self._req = None


def query_stats(address: str, timeout: float = 5.0) -> dict:
    """The counters of a switch-mode aggregator (STATS over UDP)."""
    addr = parse(address)
    dest = (socket.gethostbyname(addr.host), addr.port)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(timeout)
        s.sendto(Header(MsgType.STATS).pack(), dest)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                data, _ = s.recvfrom(1 << 20)
            except socket.timeout:
                break
            h = wire.unpack_header(data)
            if h.msg_type == MsgType.STATS_OK:
                return wire.parse_json(memoryview(data)[HEADER_SIZE:])
    raise AggregatorUnreachable(f"no STATS answer from {address} within {timeout:g}s")
