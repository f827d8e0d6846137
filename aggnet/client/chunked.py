"""The client side of aggregator services: chunks over messages.

The buffer is cut into chunks (:mod:`aggnet.client.chunking`), each owned by one
aggregator shard; a window of chunks is kept in flight to every shard, and
each result is written into the caller's buffer as it arrives. Over
``shm://`` the payloads go through shared-memory rings (:mod:`aggnet.transport.shm`)
and only headers cross the socket. The int32 codec first agrees every
chunk's exponent with a MAX over workers (one small message per shard);
a buffer all-reduced under the same ``key`` every step (a DDP bucket)
instead carries its exponents from its last round: every chunk's result
brings the MAX of the workers' own exponents, the next round quantizes
one octave above it at once, and a chunk whose values outgrew that (or
that it would quantize too coarsely) goes again with the agreed one.

A shard that restarts loses the rounds it was summing. The client hears it
(the shard's connection closes, or the shard answers NOT_JOINED), joins
the shard's successor and sends it again what it owes: its contributions
to what it still waits for, and, as a FINAL, every result it already has
that another worker may still wait for (it keeps results until the
buffer-size agreement of a later round shows that every worker has them).
Until a round completes, each result overwrites the caller's buffer only
after the elements it replaces are saved, so a round that fails leaves
the buffer as it was given.
"""

from __future__ import annotations

import collections
import os
import socket
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from aggnet import kernels
from aggnet.buffers import BufferPool
from aggnet.client import chunking, session
from aggnet.protocol import wire
from aggnet.protocol.address import parse, reached_via
from aggnet.client.base import STALL_FRACTION, Client, Request
from aggnet.client.codec import Encoding
from aggnet.errors import AggregationError, AggregationTimeout, AggregatorUnreachable, JobMismatch, NonFiniteError
from aggnet.transport import TransportError, connect, shm
from aggnet.protocol.replay import KeptResults, final_of
from aggnet.protocol.wire import (
    EXPONENT_NONFINITE, EXPONENT_ZERO, PLAN_VALUES, REDO_BIT, DType, Flag, Header, MsgType, round_at_or_before,
    settled_through,
)

log = logging.getLogger("aggnet.client")

#: how often the I/O thread looks at deadlines while idle
_TICK = 0.05
#: how long a closing client waits for its shards to echo its LEAVE (an
#: aggregator that is gone costs a close this much)
LEAVE_ACK_TIMEOUT = 1.0
#: seconds between JOINs to a shard that restarted, until it answers
REJOIN_INTERVAL = 0.5
#: seconds a round with a held error (another worker left) waits for the
#: answers that may name a better cause (a mismatch reaches every worker
#: at once, just before the departure it causes); a shard the departed
#: worker never joined never answers, and would otherwise hold the round
#: until its stall timeout
HELD_GRACE = 2.0
#: chunk results kept per shard (at least twice the window) for a shard
#: that restarts. A shard completes its chunks in the order every worker
#: sends them, and a worker has at most a window of them open there, so
#: what another worker can lack is among the last window results this
#: one received: keeping a few costs no memory and no copy
KEEP_CHUNKS = 16
#: a carried exponent is the last round's agreed one plus this: a chunk's
#: largest magnitude grows by an octave from one step to the next about
#: one time in five (a transformer's gradients), by two about one in 300
SCALE_HEADROOM = 1
#: a carried exponent may exceed the agreed one by this much before the
#: chunk goes again: its quantization step is then at most 2**SCALE_SLACK
#: times the agreed one's (typically 2x, from SCALE_HEADROOM)
SCALE_SLACK = 3
#: a key whose last round, carried, would have sent more than 1/UNSTEADY of
#: its chunks again agrees its next round instead: values that grow or
#: shrink by octaves every round (a buffer all-reduced in place over and
#: over, the step after a loss spike) would send most chunks twice
UNSTEADY = 4
#: set in the buffer-size agreement's dtype word by a round that carries
#: its exponents: workers that carry and workers that agree (a different
#: predict_scale, or a round of the key that failed on some only) fail
#: the round at once, saying so, instead of waiting on each other
CARRIED_PLAN_FLAG = 0x100
#: the buffer-size agreement's word for a round without a key (placed by
#: its round number)
NO_KEY_PLAN = 0x7FFFFFFF
#: keys whose exponents a client keeps for their next round (a DDP model
#: has a few dozen buckets); past it the oldest key's next round agrees
MAX_CARRIED_KEYS = 4096


def plan_key(key: int | None) -> int:
    """A round's key as one non-negative int32 of the buffer-size agreement."""
    return NO_KEY_PLAN if key is None else key & 0x7FFFFFFF


def _fits(carried, agreed):
    """Whether a chunk quantized with exponent ``carried`` sums right when
    the workers' MAX exponent of it is ``agreed``: no value reached
    ``2**carried`` and the step is at most ``2**SCALE_SLACK`` times the
    agreed one's (all zeros sum to zero at any scale). Scalars or arrays."""
    return ((carried - SCALE_SLACK <= agreed) & (agreed <= carried)) | (agreed == EXPONENT_ZERO)


def _steady(before: tuple | None, maxima: np.ndarray) -> bool:
    """Whether a round whose chunks' MAX exponents were ``maxima`` would
    have sent at most 1/UNSTEADY of them again had it carried the
    exponents of its key's round ``before`` (what it carried, if it did):
    every worker has both, so every worker decides alike."""
    if before is None or before[1] is None or before[1].size != maxima.size:
        return True
    return int((~_fits(before[1].astype(np.int32), maxima)).sum()) * UNSTEADY <= maxima.size


@dataclass(eq=False)
class ChunkRequest(Request):
    chunks: list = field(default_factory=list)
    remaining: int = 0
    #: per shard: this request's chunks on it, in order
    queues: dict = field(default_factory=dict)
    #: int32 codec: shards whose exponent agreement is still open
    scale_pending: set = field(default_factory=set)
    exponents: np.ndarray | None = None  # agreed (or carried) per chunk (int32 codec)
    local_exponents: np.ndarray | None = None  #: this worker's own, per chunk (int32 codec)
    #: per chunk, the MAX of the workers' own exponents its result brought
    maxima: np.ndarray | None = None
    #: quantized with exponents carried from its key's last round
    carried: bool = False
    #: the same key's previous round, still open: this one's exponents are
    #: chosen once that one is over (on every worker alike)
    after: "ChunkRequest | None" = None
    #: whether the buffer holds what is to be sent: a prequantized one is
    #: written by its owner once every exponent is agreed
    payload_ready: bool = True
    local_nonfinite: int = 0
    #: shards whose chunks are not sent (their exponents held NaN/Inf): every
    #: worker sees the same agreed exponents, so all skip the same chunks
    skip_shards: set = field(default_factory=set)
    plan: np.ndarray | None = None  #: size, wire dtype: what the buffer-size agreement compares
    plan_sent: np.ndarray | None = None  #: the agreement's payload as sent
    plan_shard: int = 0
    plan_done: bool = False
    #: (offset, count, saved copy) of the caller's elements each result
    #: overwrote, put back if the round fails
    saved: list = field(default_factory=list)
    #: a chunk given up because another worker stopped: reported once the
    #: buffer-size agreement and the chunks in flight have answered, since
    #: one of them may name the cause (a JobMismatch), which is the error
    #: worth reporting; no further chunk of the round is sent meanwhile
    held_error: Exception | None = None
    held_at: float = 0.0  #: when it was held
    #: (segment, its size, the buffer's byte offset in it): the buffer lies
    #: in shared memory of this process, where the shards read its chunks
    shared: tuple | None = None
    #: and the shards write its results there too (nothing to restore)
    results_in_place: bool = False


class ChunkClient(Client):
    """Client of an aggregator service (zmq+tcp, zmq+ipc, shm, inproc)."""

    _request_class = ChunkRequest
    takes_quantized = True

    @property
    def takes_shared(self) -> bool:
        """Whether the aggregator reads buffers that lie in this process's
        shared memory (:func:`aggnet.shared_array`, a GPU bucket's staging
        buffers) where they are, instead of a copy of each chunk: over
        shm:// addresses, unless ``share_buffers=False``."""
        return self._shm and self.config.share_buffers

    @property
    def owner_results(self) -> bool:
        # a rack's aggregator knows only its own members, not the job's ranks
        return self.members == self.world_size

    def _connect(self) -> None:
        #: same-host shared-memory payloads (shm:// addresses)
        scheme = parse(self.address).scheme
        self._shm = scheme == "shm"
        # shared-memory rings are numbered alike on every worker from the
        # job's start: a restarted shard's new rings cannot take a round
        # over half-way, so over shm:// a restart fails the round
        self._resume = self.config.resume and not self._shm
        #: save what each result overwrites, for a round that fails
        self._restores = self.config.all_or_nothing is not False
        self.chunk_bytes = self.config.chunk_bytes_for(scheme, self.uplink_mbit)
        self._segments: list = []
        self._conn = None
        self._transport_options = {}
        if self.config.server_key is not None:
            if scheme != "zmq+tcp":
                raise ValueError(f"server_key (CURVE) protects zmq+tcp addresses, not {self.address}"
                                 + ("; tcp:// carries no encryption: serve and connect at zmq+tcp:// to use CURVE"
                                    if scheme == "tcp" else ""))
            from aggnet.transport.zmq import Curve

            self._transport_options["curve"] = Curve(self.config.server_key.encode())
        # UCX sends and receives device memory itself (cuda_copy, cuda_ipc,
        # GPUDirect RDMA); the other transports take host memory only
        self.device_buffers = scheme == "ucx"
        self.shards = self._discover()
        self._conn = connect(self.shards, **self._transport_options)
        self._join()

    def _wakeup(self) -> None:
        if self._conn is not None:
            self._conn.wakeup()

    def _encoding(self, buf, codec, op, wire_hint) -> Encoding:
        enc = Encoding(buf, codec, op, self.world_size, wire_hint)
        if self.chunk_bytes % enc.wire_itemsize:
            raise ValueError(f"chunk_bytes={self.chunk_bytes} is not a multiple of the wire element size")
        return enc

    def _disconnect(self, leave: bool) -> None:
        self._close_transport(leave)
        for seg in getattr(self, "_segments", ()):
            seg.close()
        self._segments = []

    def _request_reply(self, conn, endpoints, header: Header, payload, want: MsgType, deadline: float) -> dict:
        def unreachable(missing_endpoints: list[int]) -> AggregatorUnreachable:
            missing = [str(conn.addresses[e]) for e in missing_endpoints]
            # what the transport knows of its last try (tcp://: a name that
            # does not resolve, a refused connection)
            tried = [why for e in missing_endpoints if (why := getattr(conn, "last_error", lambda _: None)(e))]
            return AggregatorUnreachable(
                f"no aggregator answered at {', '.join(missing)} within {self.config.connect_timeout:g}s "
                f"({self._context()}{'; last try: ' + tried[0] if tried else ''}): "
                f"{self._unreachable_hint(conn, missing)}")

        def dropped() -> None:
            self.stats.dropped_replies += 1

        return session.request_reply(
            conn, endpoints, header, payload, want, deadline, unreachable=unreachable, dropped=dropped,
            where=lambda e: f"aggregator {conn.addresses[e]} refused {self._context()}")

    def _unreachable_hint(self, conn, missing: list[str]) -> str:
        if conn is not self._conn:
            curve = ("; if it runs with --curve-secret-file, this worker needs its public key (server_key=..., "
                     "AGGNET_SERVER_KEY, printed by `aggnet job curve-keys`)"
                     if parse(self.address).scheme == "zmq+tcp" and self.config.server_key is None else "")
            return (f"start one with `aggnet serve --listen {self.address}`, or leave the address unset to use an "
                    f"embedded local aggregator{curve}")
        # the control endpoint answered: its shards are where it said, or
        # where this worker cannot reach them
        said = sorted({a for a, r in zip(self._advertised, self.shards) if r in missing})
        return (f"the service at {self.address} answered and advertised its shards as {', '.join(said)}; if this "
                f"worker cannot reach that host, restart the service with `aggnet serve --advertise HOST` naming "
                f"an address of it that this worker can reach (and check that a firewall lets its shard ports in)")

    def _check_socket_file(self) -> None:
        """A Unix-socket service (zmq+ipc://, shm://) that is not there can be
        told at once: no socket file (after a short grace for a service
        that is starting), or a file nobody listens on (its service died)."""
        addr = parse(self.address)
        if addr.scheme not in ("zmq+ipc", "shm"):
            return
        grace = time.monotonic() + min(3.0, self.config.connect_timeout)
        while not os.path.exists(addr.path) and time.monotonic() < grace:
            time.sleep(0.05)
        if not os.path.exists(addr.path):
            raise AggregatorUnreachable(
                f"no aggregator for {self._context()}: the socket file {addr.path} does not exist; "
                f"start one with `aggnet serve --listen {self.address}`, or leave the address unset to use an "
                f"embedded local aggregator")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(1.0)
            probe.connect(addr.path)
        except ConnectionRefusedError:
            raise AggregatorUnreachable(
                f"no aggregator for {self._context()}: nothing listens on {addr.path}, left by a "
                f"service that is gone; start one with `aggnet serve --listen {self.address}`") from None
        except OSError:
            pass  # anything else: let the HELLO decide, within its timeout
        finally:
            probe.close()

    def _discover(self) -> list[str]:
        self._check_socket_file()
        deadline = time.monotonic() + self.config.connect_timeout
        with connect([self.address], **self._transport_options) as ctl:
            reply = self._request_reply(ctl, [0], Header(MsgType.HELLO), None, MsgType.HELLO_OK, deadline)[0]
        shards = reply.get("shards")
        if not shards or not isinstance(shards, list) or len(shards) > 1024 or \
                not all(isinstance(a, str) for a in shards):
            raise AggregationError(f"service at {self.address} answered without a shard list: {str(reply)[:200]}")
        try:
            reachable = [str(reached_via(a, self.address)) for a in shards]
        except ValueError as exc:
            raise AggregationError(f"service at {self.address} listed a bad shard address: {exc}") from None
        self._advertised = shards
        return reachable

    def _join_message(self) -> tuple[Header, bytes]:
        # at its aggregator a worker is one of `members` (its rack's workers)
        h = Header(MsgType.JOIN, job_id=self.job_id, sender=self.member_rank, world=self.members)
        # the aggregator names silent workers before the client's own
        # deadline runs out, so the error says who is missing
        # the job's world beside the members here: an aggregator under a
        # root completes a job whose every worker joins it (hosts.parent)
        request = {"name": self.job, "world": self.world_size, "timeout": STALL_FRACTION * self.config.timeout}
        if self._shm:
            request["shm"] = {"window": self.config.window, "chunk_bytes": self.chunk_bytes}
        return h, wire.json_payload(self._signed("JOIN", h, request))

    def _join(self) -> None:
        deadline = time.monotonic() + self.config.connect_timeout
        h, payload = self._join_message()
        replies = self._request_reply(self._conn, list(range(len(self.shards))), h, payload, MsgType.JOIN_OK, deadline)
        if self._shm:
            from aggnet.transport.shm import Segment

            for i in range(len(self.shards)):
                info = replies[i].get("shm")
                if info is None:
                    raise AggregationError(f"shard {self.shards[i]} did not offer shared memory to {self._context()}")
                self._segments.append(Segment.open(info))
        log.info("%s joined %d shard(s) with world size %d", self._context(), len(replies), self.world_size)

    def _close_transport(self, leave: bool = False) -> None:
        conn, self._conn = getattr(self, "_conn", None), None
        if conn is None:
            return
        if leave:
            self._leave(conn)
        conn.close()

    def _leave(self, conn) -> None:
        thread = getattr(self, "_thread", None)
        session.leave(conn, Header(MsgType.LEAVE, job_id=self.job_id, sender=self.member_rank, world=self.members),
                      min(LEAVE_ACK_TIMEOUT, self.config.timeout),
                      # the I/O thread, while it runs, reads the connection
                      echo_awaited=thread is None or not thread.is_alive())

    # -- the I/O thread --------------------------------------------------------

    def _io_loop(self) -> None:
        self._inflight = [0] * len(self.shards)
        #: chunks sent to each shard so far: every worker sends a shard its
        #: chunks in the same order, so this numbers them alike everywhere
        self._seq = [0] * len(self.shards)
        #: per shard: (request, chunk) still to send, in admission order
        self._to_send = [collections.deque() for _ in self.shards]
        self._staging: list[np.ndarray] = []
        self._device_staging: list = []  # for CuPy buffers (over ucx://)
        #: (round, chunk) -> staging buffer (or None) of every chunk whose
        #: result has not come back, failed rounds included
        self._outstanding: dict[tuple[int, int], np.ndarray | None] = {}
        self._last_progress = time.monotonic()
        self._rejoin_needed = False
        #: shard -> when its JOIN goes again: shards that restarted (or
        #: lost the connection) and have not taken this worker back yet
        self._rejoining: dict[int, float] = {}
        #: per shard, the results this worker has and another may still
        #: wait for (see KEEP_CHUNKS)
        self._kept = [KeptResults(max(2 * self.config.window, KEEP_CHUNKS)) for _ in self.shards]
        #: the caller's elements a result overwrote, until its round is over
        self._saves = BufferPool(max_buffers=4096)
        #: key -> (its newest int32 round that is over, the exponents its
        #: next round carries from it, or None when that round failed,
        #: whether carrying them is let: see UNSTEADY)
        self._scales: dict = {}
        #: key -> its latest int32 round admitted
        self._last_of_key: dict = {}
        #: (round, the owner's future) of rounds their owner quantizes on
        #: a thread of its own (see ``Quantized``)
        self._quantizing: list[tuple[ChunkRequest, Future]] = []
        while True:
            new, closing = self._take_submitted()
            if closing:
                return
            if new and self._rejoin_needed and not self._active:
                new = self._rejoin(new)
            for req in new:
                self._admit(req)
            self._in_hand = []
            self._send_ready()
            msg = self._conn.recv(_TICK if self._active else 0.5)
            while msg is not None:
                self._on_message(msg)
                msg = self._conn.recv(0)
                if msg is None:
                    self._send_ready()
                    msg = self._conn.recv(0)
            self._watch_shards()
            self._check_held()
            self._check_progress()

    def _rejoin(self, new: list) -> list:
        """Join every shard again before the next all-reduce: a shard that
        was restarted lost the job (a shard that kept it answers the same
        JOIN again). Returns the requests to go on with."""
        self._rejoin_needed = False
        try:
            self._join()
        except Exception as exc:
            self._rejoin_needed = True
            for req in new:
                self._fail(req, exc, poison=False)
            return []
        log.info("%s joined its shards again", self._context())
        self.stats.rejoins += 1
        return new

    # -- a shard that restarted ------------------------------------------------------

    def _watch_shards(self) -> None:
        if not self._resume:
            return
        for shard in self._conn.gone():
            self._shard_lost(shard, "closed its connection")
        now = time.monotonic()
        for shard, due in list(self._rejoining.items()):
            if now >= due:
                self._rejoining[shard] = now + REJOIN_INTERVAL
                h, payload = self._join_message()
                try:
                    self._conn.send(shard, h.pack_for(payload), payload)
                except TransportError:
                    pass  # sent again in REJOIN_INTERVAL, until the progress timeout

    def _shard_lost(self, shard: int, why: str) -> None:
        if shard not in self._rejoining:
            log.warning("%s: shard %d at %s %s; joining it again to finish the rounds in flight", self._context(),
                        shard, self.shards[shard], why)
            self._rejoining[shard] = 0.0

    def _rejoined(self, shard: int) -> None:
        """The shard took this worker (back): send it what it may have lost.
        A shard that did not restart drops what it has seen already."""
        del self._rejoining[shard]
        self.stats.rejoins += 1
        self._last_progress = time.monotonic()
        finals = self._kept[shard].results()
        log.info("%s: shard %d took this worker back; %d result(s) and the rounds in flight go to it again",
                 self._context(), shard, len(finals))
        for h, payload in finals:
            self._conn.send(shard, final_of(h, self.member_rank, self.members).pack(), payload)
        for req in list(self._active.values()):
            if req.failed:
                continue
            owed = [c for c in req.queues.get(shard, ()) if (req.round, c.index) in self._outstanding]
            if req.bounds is not None and (owed or req.queues.get(shard)):
                # an owner's share is kept by its owner alone: the others
                # cannot replay it
                self._fail_round(req, AggregationError(
                    f"{self._context()}: shard {shard} at {self.shards[shard]} restarted during reduce-scatter "
                    f"round {req.round}, which cannot be resumed; run the step again"))
                continue
            if not req.plan_done and req.plan_shard == shard and req.plan_sent is not None:
                self._send_plan(req)
            if shard in req.scale_pending:
                self._send_scale(req, shard)
            for c in owed:
                self._send_chunk(req, c, again=True)
            for c in req.queues.get(shard, ()):
                if (req.round, c.index | REDO_BIT) in self._outstanding:
                    self._send_chunk(req, c, again=True, second=True)


    def _restore(self, req: ChunkRequest) -> None:
        dest = req.buf if req.out is None else req.out
        for start, saved in reversed(req.saved):
            dest[start:start + saved.size] = saved
        req.saved = []

    def _release(self, req: ChunkRequest) -> None:
        req.saved = []

    def _admit(self, req: ChunkRequest) -> None:
        # a keyed buffer's chunks meet the same shards every round, whose
        # memory for them stays warm: rotating a one-chunk buffer by round
        # instead, to meet its buffer-size agreement's shard (one shard
        # process woken, not two), read 1.26x slower over shm at 1 MiB
        # (aggnet compare, 4 pairs: 1.08-1.52, where the same code against
        # itself read 0.62-1.18) and no faster over tcp
        rotation = req.round if req.key is None else req.key
        elements = self.chunk_bytes // req.enc.wire_itemsize
        req.chunks = (chunking.plan(req.buf.size, elements, len(self.shards), rotation) if req.bounds is None
                      else chunking.plan_owned(req.bounds, elements, len(self.shards), rotation))
        self._active[req.round] = req
        # every chunk, and the agreement on the buffer's size
        req.remaining = len(req.chunks) + 1
        for c in req.chunks:
            req.queues.setdefault(c.shard, []).append(c)
            self._to_send[c.shard].append((req, c))
        self._share(req)
        if req.enc.quantized:
            req.payload_ready = req.quantized is None
            self._find_local_exponents(req)
            if self._carries_scale(req):
                prev = self._last_of_key.get(req.key)
                self._last_of_key[req.key] = req
                if prev is None or prev.future.done():
                    self._choose_scale(req)
                elif len(prev.chunks) == len(req.chunks):
                    req.after = prev  # its exponents and buffer-size agreement once prev is over
                    self.stats.scales_awaited += 1
                else:
                    # nothing to carry from a buffer of another size, nor from
                    # an older round: on a worker where prev is over, the
                    # table holds prev's, and that one agrees too
                    self._start_scale_agreement(req)
            else:
                self._start_scale_agreement(req)
        if req.after is None and not req.failed:
            self._start_plan_agreement(req)
        if not self._active or len(self._active) == 1:
            self._last_progress = time.monotonic()

    def _share(self, req: ChunkRequest) -> None:
        """Name ``req``'s buffer to its shards when it lies in shared memory
        and goes as it is: they read its chunks there. Sent before any of
        its chunks, on the connection they take after it."""
        enc = req.enc
        if not (self.takes_shared and enc.zero_copy and enc.device is None):
            return
        req.shared = shm.find_shared(req.buf)
        if req.shared is None:
            return
        name, size, at = req.shared
        # the shards write the results there too, where no result must be
        # saved first (a failed round's buffer is thrown away, as aggnet.torch's
        # are) and each result belongs where its chunk came from: an
        # all-reduce, or a reduce-scatter whose share is received into the
        # buffer's own elements of it
        req.results_in_place = not self._restores_in(req) and (req.bounds is None or self._share_in_place(req))
        # an owner-quantized buffer's sums are its to scale
        multiplier = 1.0 if enc.prequantized else enc.multiplier
        for shard, queue in req.queues.items():
            results = 0
            if req.results_in_place:
                results = len(queue) if req.bounds is None else sum(c.owner == self.rank for c in queue)
            payload = wire.json_payload({"name": name, "bytes": size, "at": at, "chunks": len(queue),
                                         "results": results, "multiplier": multiplier})
            h = Header(MsgType.SHARE, job_id=self.job_id, round=req.round, sender=self.member_rank,
                       world=self.members)
            self._conn.send(shard, h.pack_for(payload), payload)

    def _share_in_place(self, req: ChunkRequest) -> bool:
        """Whether a reduce-scatter's output is its buffer's own share (the
        same memory), where a shard may write the share's results."""
        start = req.bounds[self.rank]
        return (req.out.size > 0 and req.out.dtype == req.buf.dtype and
                req.out.ctypes.data == req.buf.ctypes.data + start * req.buf.itemsize)

    def _start_plan_agreement(self, req: ChunkRequest) -> None:
        """A MAX over workers of the buffer's size, wire dtype and op, and
        key, and of their negations: equal only when every worker sent the
        same. Without it a worker whose buffer is a prefix of another's
        finishes, and the other times out blaming a rank that did nothing
        wrong; and workers that give one round different keys place its
        chunks on different shards (each waits there for the others), or on
        one shard sum buffers that are not the same one's."""
        size = req.buf.size
        mine = np.array([size >> 31, size & 0x7FFFFFFF, int(req.enc.wire) | (CARRIED_PLAN_FLAG if req.carried else 0),
                         plan_key(req.key)], np.int32)
        req.plan = mine
        req.plan_shard = req.round % len(self.shards)
        # rounds back to this worker's oldest unfinished one (this one: 1)
        oldest = next(iter(self._active))
        lag = min((req.round - oldest) % (1 << 32) + 1, 0x7FFFFFFF)
        req.plan_sent = np.concatenate([mine, -mine, np.array([lag], np.int32)])
        if req.plan_shard not in self._rejoining:  # else it goes once the shard takes this worker back
            self._send_plan(req)

    def _send_plan(self, req: ChunkRequest) -> None:
        h = Header(MsgType.PUSH, job_id=self.job_id, round=req.round, index=wire.PLAN_INDEX,
                   sender=self.member_rank, flags=Flag.OP_MAX | Flag.LITTLE_ENDIAN, dtype=DType.INT32,
                   count=PLAN_VALUES, world=self.members)
        self._conn.send(req.plan_shard, h.pack(), req.plan_sent)

    def _on_plan(self, req: ChunkRequest, h: Header, payload) -> None:
        req.plan_done = True
        agreed = np.frombuffer(payload, np.int32, h.count) if h.count == PLAN_VALUES else None
        if agreed is not None:
            # every worker had finished the rounds more than the largest
            # lag back when it started this one: nobody waits for their
            # results any more
            mark = settled_through(req.round, agreed)
            for kept in self._kept:
                kept.forget_through(mark)
        n = req.plan.size
        if agreed is not None and (agreed[:n] == req.plan).all() and (-agreed[n:2 * n] == req.plan).all():
            if req.held_error is not None:
                self._settle_held(req)
                return
            req.remaining -= 1
            if req.remaining == 0:
                self._complete(req)
            return
        if agreed is None:
            text = f"the buffer-size agreement came back with {h.count} values, not {PLAN_VALUES}"
        else:
            lo = (int(-agreed[n]) << 31) + int(-agreed[n + 1])
            hi = (int(agreed[0]) << 31) + int(agreed[1])
            dtypes_agree = int(agreed[2]) == int(-agreed[n + 2])
            if lo != hi or hi != req.buf.size:
                text = f"this worker all-reduces {req.buf.size} elements, the job's workers between {lo} and {hi}"
            elif dtypes_agree:
                mine = "without a key" if req.key is None else f"under key {req.key}"
                text = (f"this worker all-reduces it {mine}, another worker otherwise: give each buffer the same "
                        f"key on every worker")
            else:
                text = "the workers disagree on the buffer's dtype or codec"
            if lo == hi == req.buf.size and int(agreed[2]) ^ int(-agreed[n + 2]) == CARRIED_PLAN_FLAG:
                self._fail_round(req, JobMismatch(
                    f"{self._context()}: round {req.round}: some workers carry the int32 exponents of key "
                    f"{req.key} from its last round and some agree them: set predict_scale (AGGNET_PREDICT_SCALE) "
                    f"alike on every worker (after a round of the key that failed on some workers only, the next "
                    f"one agrees on every worker)"))
                return
        self._fail_round(req, JobMismatch(f"{self._context()}: round {req.round}: {text}; all workers must "
                                          f"all-reduce the same buffers in the same order"))

    def _fail_round(self, req: ChunkRequest, exc: Exception) -> None:
        """Fail one all-reduce and give back its window. Over shared memory
        the rings' numbering may now differ between workers, so the client
        cannot go on; over sockets the next all-reduce can."""
        for c in req.chunks:
            for index in (c.index, c.index | REDO_BIT):
                if (req.round, index) in self._outstanding:
                    staging = self._outstanding.pop((req.round, index))
                    if index == c.index:  # a chunk sent again holds no window place
                        self._inflight[c.shard] -= 1
                    if staging is not None:
                        self._give_staging(staging)
        self.stats.errors += 1
        self._fail(req, exc, poison=self._shm)

    def _find_local_exponents(self, req: ChunkRequest) -> None:
        if req.quantized is not None:  # its owner found them where the values are
            exps = np.array(req.quantized.exponents, np.int16)
            req.local_nonfinite = req.quantized.nonfinite
        else:
            k = req.enc.k
            exps = np.empty(len(req.chunks), np.int16)
            for c in req.chunks:
                bits, nonfinite = k.block_stats(req.buf[c.offset:c.offset + c.count])
                req.local_nonfinite += nonfinite
                exps[c.index] = kernels.exponent_of(bits, nonfinite)
        req.local_exponents = exps
        req.maxima = np.full(len(req.chunks), -32768, np.int16)

    def _carries_scale(self, req: ChunkRequest) -> bool:
        """Whether ``req``'s exponents may come from its key's last round:
        an all-reduce or a reduce-scatter (whose other ranks' chunks are
        acknowledged with their MAX exponent) of host memory under a key,
        when the client is let."""
        return (self.config.predict_scale and req.key is not None
                and req.enc.device is None and len(req.chunks) < REDO_BIT)

    def _choose_scale(self, req: ChunkRequest) -> None:
        """Carry the exponents of the key's last round, when it completed
        with as many chunks; else agree them. Every worker has seen the same
        results of the same rounds, so every worker chooses alike."""
        _, carried, steady = self._scales.get(req.key, (0, None, True))
        if carried is None or carried.size != len(req.chunks):
            self._start_scale_agreement(req)
            return
        if not steady:
            self.stats.scales_unsteady += 1
            self._start_scale_agreement(req)
            return
        req.carried = True
        req.exponents = carried.copy()
        self.stats.scales_carried += 1
        if not req.payload_ready:
            self._quantize_agreed(req)

    def _settled(self, req: ChunkRequest) -> None:
        """``req`` is over: what its results say of the next round of its
        key, and that round's exponents, which waited for them."""
        if req.maxima is None or req.key is None:
            return
        if self._last_of_key.get(req.key) is req:
            del self._last_of_key[req.key]
        newest = self._scales.get(req.key)
        # rounds of a key may end out of order (buffers of two sizes under
        # one key): an older one that ends later must not replace a newer
        # one's exponents, which the key's next round is told to carry
        if self._carries_scale(req) and (newest is None or not round_at_or_before(req.round, newest[0])):
            self._scales.pop(req.key, None)  # the last key to end is the last to go
            if req.failed or req.error is not None or (req.maxima == -32768).any():
                self._scales[req.key] = (req.round, None, True)
            else:
                maxima = req.maxima.astype(np.int32)
                self._scales[req.key] = (req.round, np.minimum(maxima + SCALE_HEADROOM, EXPONENT_NONFINITE - 1)
                                         .astype(np.int16), _steady(newest, maxima))
            if len(self._scales) > MAX_CARRIED_KEYS:
                del self._scales[next(iter(self._scales))]
        for later in list(self._active.values()):
            if later.after is req:
                later.after = None
                if not later.failed:
                    self._choose_scale(later)
                if not later.failed:
                    self._start_plan_agreement(later)

    def _complete(self, req: ChunkRequest) -> None:
        super()._complete(req)
        self._settled(req)

    def _fail(self, req: ChunkRequest, exc: Exception, poison: bool) -> None:
        super()._fail(req, exc, poison)
        self._settled(req)

    def _start_scale_agreement(self, req: ChunkRequest) -> None:
        req.exponents = req.local_exponents.copy()
        for shard in req.queues:
            if shard not in self._rejoining:  # else it goes once the shard takes this worker back
                self._send_scale(req, shard)
            req.scale_pending.add(shard)

    def _send_scale(self, req: ChunkRequest, shard: int) -> None:
        """This worker's exponents of its chunks on ``shard`` (before the
        agreement's answer replaces them)."""
        mine = np.ascontiguousarray(req.exponents[[c.index for c in req.queues[shard]]])
        h = Header(MsgType.PUSH, job_id=self.job_id, round=req.round, index=wire.SCALE_INDEX,
                   sender=self.member_rank, flags=Flag.OP_MAX | Flag.LITTLE_ENDIAN, dtype=DType.INT16,
                   count=mine.size, world=self.members)
        self._conn.send(shard, h.pack(), mine)

    def _take_staging(self, enc):
        # at most shards * window buffers ever exist (of each kind, host and
        # device): allocated on first use, then reused for the client's life
        pool = self._staging if enc.device is None else self._device_staging
        return pool.pop() if pool else enc.new_staging(self.chunk_bytes // 4)

    def _give_staging(self, staging) -> None:
        (self._staging if isinstance(staging, np.ndarray) else self._device_staging).append(staging)

    def _send_ready(self) -> None:
        """Send what the windows allow, one chunk per shard in turn. Each
        shard's chunks leave strictly in admission order: every worker then
        numbers them alike, which the shared-memory rings rely on."""
        window = self.config.window
        if self._quantizing:
            self._check_quantized()
        progressed = True
        while progressed:
            progressed = False
            for shard, q in enumerate(self._to_send):
                while q and (q[0][0].failed or q[0][0].held_error is not None or shard in q[0][0].skip_shards):
                    q.popleft()
                if not q or self._inflight[shard] >= window or shard in q[0][0].scale_pending or \
                        not q[0][0].payload_ready or q[0][0].after is not None or shard in self._rejoining:
                    continue
                req, c = q.popleft()
                self._send_chunk(req, c)
                progressed = True

    def _send_chunk(self, req: ChunkRequest, c: chunking.Chunk, again: bool = False, second: bool = False) -> None:
        """Send a chunk (``again``: once more, to a shard that restarted;
        its window place and staging buffer are the ones it has).

        ``second``: a second time, quantized with the exponent its first
        result agreed (index | REDO_BIT). It goes inline, outside the window
        and the shared-memory rings: every worker decides to send it on a
        result that reaches each at its own moment, so it cannot take a
        place in the order they all keep; nothing waits behind it."""
        enc = req.enc
        index = c.index | REDO_BIT if second else c.index
        src = req.buf[c.offset:c.offset + c.count]
        exponent = mine = 0
        shift = 0
        if enc.quantized:
            exponent = int(req.exponents[c.index])
            shift = kernels.quant_shift(exponent, self.world_size)
            mine = int(req.local_exponents[c.index])  # the result brings their MAX
        staging = self._outstanding.get((req.round, index)) if again else None
        in_order = not second
        seq = 0
        if in_order:
            seq = self._seq[c.shard]
            self._seq[c.shard] = (seq + 1) & 0xFFFFFFFF
        flags = Flag.LITTLE_ENDIAN
        if self._shm and in_order:
            if req.shared is not None:
                self.stats.chunks_shared += 1  # the shard reads it where it lies
            else:
                # the payload goes into this worker's input slot; only the header travels
                slot = self._segments[c.shard].input_slot(self.member_rank, seq)
                enc.encode_into(src, slot[: c.count * enc.wire_itemsize], shift)
            payload = None
            flags |= Flag.SHM
        elif enc.zero_copy:
            payload = src
        else:
            staging = staging if staging is not None else self._take_staging(enc)
            payload = enc.encode(src, staging.view(enc.staging_dtype), shift)
        self._outstanding[(req.round, index)] = staging
        if c.owner is not None:
            flags |= Flag.TO_OWNER  # the result goes to rank c.owner only (in nsum)
        h = Header(MsgType.PUSH, job_id=self.job_id, round=req.round, index=index,
                   sender=self.member_rank, flags=flags, dtype=enc.wire, count=c.count, exponent=exponent,
                   next_exponent=mine, world=self.members, ref=seq, offset=c.offset, nsum=c.owner or 0)
        self._conn.send(c.shard, h.pack(), payload)
        if not again:
            if in_order:
                self._inflight[c.shard] += 1
            else:
                self.stats.chunks_sent_again += 1
        self.stats.chunks_sent += 1
        self.stats.bytes_sent += c.count * enc.wire_itemsize

    def _on_message(self, msg) -> None:
        try:
            h = wire.unpack_header(msg.header)
            wire.check_payload(h, len(msg.payload))
        except wire.WireError as exc:
            self.stats.dropped_replies += 1
            log.debug("dropped a malformed message from %s: %s", self._conn.addresses[msg.peer], exc)
            return
        if h.job_id != self.job_id:
            self.stats.dropped_replies += 1
            return
        if h.msg_type == MsgType.RESULT:
            self._on_result(msg.peer, h, msg.payload)
        elif h.msg_type == MsgType.RESULT_IN_PLACE:
            self._on_result(msg.peer, h, msg.payload, in_place=True)
        elif h.msg_type == MsgType.ERROR:
            self._on_error(msg.peer, h, *wire.parse_error(msg.payload))
        elif h.msg_type == MsgType.JOIN_OK and msg.peer in self._rejoining:
            self._rejoined(msg.peer)

    def _on_result(self, shard: int, h: Header, payload, in_place: bool = False) -> None:
        """A chunk's result (``in_place``: the shard wrote it into this
        worker's shared buffer; the header says which)."""
        again = False
        if h.index not in (wire.SCALE_INDEX, wire.PLAN_INDEX):
            key = (h.round, h.index)
            if key not in self._outstanding:
                return  # not ours, or a duplicate
            staging = self._outstanding.pop(key)
            again = bool(h.index & REDO_BIT)
            if not again:
                self._inflight[shard] -= 1
            if staging is not None:
                self._give_staging(staging)
        req = self._active.get(h.round)
        if req is None:
            return  # a late result of a failed round
        self._last_progress = time.monotonic()
        if self._resume and not h.flags & Flag.TO_OWNER:  # an owner's share is nobody else's
            self._kept[shard].keep(h, payload)
        if h.index == wire.SCALE_INDEX:
            self._on_scale(req, shard, h, payload)
            return
        if h.index == wire.PLAN_INDEX:
            if not req.plan_done:  # else a second answer, from a shard that was sent it again
                self._on_plan(req, h, payload)
            return
        index = h.index & ~REDO_BIT
        if index >= len(req.chunks):
            self.stats.dropped_replies += 1
            return
        c = req.chunks[index]
        if req.held_error is not None:
            self._settle_held(req)
            return
        if c.owner is not None and c.owner != self.rank:
            # another rank's share: an acknowledgement, which frees the
            # window; an int32 one brings the chunk's MAX exponent, and a
            # chunk that outgrew what it carried goes again from every worker
            if req.enc.quantized and not again and self._goes_again(req, c, h):
                return
            req.remaining -= 1
            if req.remaining == 0:
                self._complete(req)
            return
        if h.count != c.count or h.offset != c.offset:
            self._fail_round(req, JobMismatch(
                f"{self._context()}: round {req.round} chunk {c.index} came back with {h.count} elements at "
                f"offset {h.offset}, sent {c.count} at {c.offset}; all workers must all-reduce the same sizes in the same order"
            ))
            return
        if req.enc.quantized and not again and self._goes_again(req, c, h):
            return
        if in_place:
            if not req.results_in_place:  # never asked for: nothing was written where this worker reads
                self.stats.dropped_replies += 1
                return
            self.stats.results_in_place += 1
            self._counted(req, h.payload_bytes)
            return
        shift = kernels.quant_shift(h.exponent, self.world_size) if req.enc.quantized else 0
        if h.flags & Flag.SHM:
            if not self._segments:
                return
            payload = self._segments[shard].result_slot(h.ref)[: h.payload_bytes]
        # a reduce-scatter's share goes to its own output buffer
        start = c.offset if req.out is None else c.offset - req.bounds[self.rank]
        dest = (req.buf if req.out is None else req.out)[start:start + c.count]
        if self._restores_in(req):
            if req.enc.device is None:
                saved = self._saves.take(dest.nbytes)[:dest.nbytes].view(dest.dtype)
                np.copyto(saved, dest)
            else:
                saved = dest.copy()  # on the device: a failed round puts it back there
            req.saved.append((start, saved))
        req.enc.decode(payload, dest, shift)
        self._counted(req, len(payload))

    def _restores_in(self, req: ChunkRequest) -> bool:
        """Whether ``req``'s results overwrite its buffer only after what
        they overwrite is saved (all_or_nothing; never in a scratch copy)."""
        return self._restores and not req.scratch

    def _counted(self, req: ChunkRequest, nbytes: int) -> None:
        """One of ``req``'s results is in its buffer."""
        self.stats.results += 1
        self.stats.bytes_received += nbytes
        req.remaining -= 1
        if req.remaining == 0:
            self._complete(req)

    def _goes_again(self, req: ChunkRequest, c: chunking.Chunk, h: Header) -> bool:
        """Whether the first result of int32 chunk ``c`` is not its sum:
        its values held NaN/Inf somewhere, or they outgrew the exponent
        carried from the last round (the sum may have overflowed) or were
        too small for it; the chunk then goes again with the agreed one,
        the MAX of every worker's own exponent, which the result brought.
        Every worker sees the same result, so all send the same chunks again."""
        agreed = h.next_exponent
        req.maxima[c.index] = agreed
        if agreed == EXPONENT_NONFINITE:  # a carried round: an agreed one never sends these
            req.error = req.error or self._nonfinite_error(req, [c])
            req.remaining -= 1
            if req.remaining == 0:
                self._complete(req)
            return True
        if not req.carried:
            return False
        if _fits(int(req.exponents[c.index]), agreed):
            return False
        req.exponents[c.index] = agreed
        if req.quantized is not None:
            try:
                req.quantized.quantize(req.exponents.copy(), [c.index])
            except Exception as exc:  # noqa: BLE001 - the owner's failure (a CUDA error) fails this round only
                self._fail_round(req, AggregationError(
                    f"{self._context()}: round {req.round}: quantizing chunk {c.index} again failed: {exc}"))
                return True
        self._send_chunk(req, c, second=True)
        return True

    def _nonfinite_error(self, req: ChunkRequest, bad: list) -> NonFiniteError:
        where = ", ".join(f"chunk {c.index} (elements {c.offset}..{c.offset + c.count - 1})" for c in bad[:4])
        if req.local_nonfinite:
            return NonFiniteError(f"rank {self.rank} of job {self.job!r}: round {req.round} buffer holds "
                                  f"{req.local_nonfinite} NaN/Inf value(s) ({where}); the int32 codec cannot "
                                  f"quantize them")
        return NonFiniteError(f"job {self.job!r} round {req.round}: another worker reported NaN/Inf values in "
                              f"{where}; that worker's own error names it (rank {self.rank} saw none)")

    def _on_scale(self, req: ChunkRequest, shard: int, h: Header, payload) -> None:
        if shard not in req.scale_pending:
            return
        req.scale_pending.discard(shard)
        agreed = np.frombuffer(payload, np.int16, h.count)
        q = req.queues.get(shard, ())
        if agreed.size != len(q):
            self._fail_round(req, JobMismatch(
                f"{self._context()}: round {req.round} has {len(q)} chunks on shard {shard} here but "
                f"{agreed.size} at the aggregator; all workers must all-reduce the same sizes in the same order"
            ))
            return
        for c, e in zip(q, agreed):
            req.exponents[c.index] = e
        if np.any(agreed == wire.EXPONENT_NONFINITE):
            bad = [c for c, e in zip(q, agreed) if e == wire.EXPONENT_NONFINITE]
            # the other shards' chunks still go, exactly as on every other
            # worker, so that no shard is left waiting and sequences agree
            req.error = req.error or self._nonfinite_error(req, bad)
            req.skip_shards.add(shard)
            req.remaining -= len(q)
            if req.remaining == 0:
                self._complete(req)
                return
        if not req.scale_pending and not req.payload_ready:
            self._quantize_agreed(req)

    def _quantize_agreed(self, req: ChunkRequest) -> None:
        """Every exponent of a prequantized buffer is agreed: its owner
        quantizes it (a skipped shard's chunks with them: they are not sent),
        at once or, answering with a future, on a thread of its own while
        this one goes on."""
        try:
            pending = req.quantized.quantize(req.exponents.copy(), None)
        except Exception as exc:  # noqa: BLE001 - the owner's failure (a CUDA error) fails this round only
            self._quantize_failed(req, exc)
            return
        if isinstance(pending, Future):
            self._quantizing.append((req, pending))
            pending.add_done_callback(lambda _: self._wakeup())
            return
        req.payload_ready = True

    def _check_quantized(self) -> None:
        """Rounds whose owner has finished quantizing may send (those that
        failed meanwhile are dropped: the owner's future is over)."""
        # (failing one may start the next round of its key, which may
        # join the list: it goes to the new one)
        checked, self._quantizing = self._quantizing, []
        for req, pending in checked:
            if not pending.done():
                self._quantizing.append((req, pending))
                continue
            exc = pending.exception()
            if req.failed:
                continue
            if exc is not None:
                self._quantize_failed(req, exc)
            else:
                req.payload_ready = True

    def _quantize_failed(self, req: ChunkRequest, exc: BaseException) -> None:
        self._fail_round(req, AggregationError(
            f"{self._context()}: round {req.round}: quantizing the buffer failed: {exc}"))

    def _on_error(self, shard: int, h: Header, code: str, text: str) -> None:
        where = f"aggregator shard {shard} at {self._conn.addresses[shard]}"
        kind = session.error_type(code)
        exc = kind(f"{self._context()}: {where}: {text}")
        if shard in self._rejoining and not h.round and code != wire.ErrorCode.NOT_JOINED.value:
            # the restarted shard refused this worker's JOIN: nothing in
            # flight can finish there
            del self._rejoining[shard]
            self._rejoin_needed = True
            for req in list(self._active.values()):
                self._fail_round(req, exc)
            if code == wire.ErrorCode.JOB_MISMATCH.value:
                self._job_refused(exc)
            return
        if code == wire.ErrorCode.JOB_MISMATCH.value and not h.round:
            # about the job, not a round: another member disagrees with it
            self._job_refused(exc)
            return
        req = self._active.get(h.round)
        if req is None:
            # a round that already failed (a stall of chunks it never sent),
            # or nothing of ours: it fails nothing
            self.stats.dropped_replies += 1
            log.debug("%s: an ERROR for no pending all-reduce: %s", self._context(), text)
            return
        if code == wire.ErrorCode.NOT_JOINED.value:
            if self._resume:
                # the shard restarted (or reclaimed the job): join it again
                # and send it what it lost; the round goes on
                self._shard_lost(shard, "answered that this worker has not joined it")
                return
            self._rejoin_needed = True
        if kind is AggregationTimeout:
            # given up because another worker stopped: if it stopped over a
            # buffer of another size or kind, the agreement or a chunk on the
            # way says so, and that is the error worth reporting
            if h.index == wire.PLAN_INDEX:
                req.plan_done = True
            elif (h.round, h.index) in self._outstanding:
                staging = self._outstanding.pop((h.round, h.index))
                if not h.index & REDO_BIT:
                    self._inflight[shard] -= 1
                if staging is not None:
                    self._give_staging(staging)
            if req.held_error is None:
                req.held_error, req.held_at = exc, time.monotonic()
            self._settle_held(req)
            return
        self._fail_round(req, exc)

    def _settle_held(self, req: ChunkRequest) -> None:
        """Fail a round with its held error once nothing more of it can
        answer, or once :data:`HELD_GRACE` has passed. Every chunk sent gets
        a reply (a result, or an ERROR when the shard gives its slot up),
        but only from a shard that knows the departed worker."""
        if not req.plan_done or any(k[0] == req.round for k in self._outstanding):
            if time.monotonic() - req.held_at < HELD_GRACE:
                return
        self._fail_round(req, req.held_error)

    def _check_held(self) -> None:
        for req in list(self._active.values()):
            if req.held_error is not None and not req.failed:
                self._settle_held(req)

    def _check_progress(self) -> None:
        if not self._active:
            return
        idle = time.monotonic() - self._last_progress
        if idle < self.config.timeout:
            return
        again = [self._active[rnd].chunks[index & ~REDO_BIT].shard for rnd, index in self._outstanding
                 if index & REDO_BIT and rnd in self._active]  # chunks sent again hold no window place
        waiting = sorted({c_shard for r in self._active.values() for c_shard in
                          ([s for s in range(len(self.shards)) if self._inflight[s]] + list(r.scale_pending))}
                         | set(again))
        where = ", ".join(f"shard {s} at {self.shards[s]}" for s in waiting) or "no shard"
        rounds = sorted(self._active)
        if self._rejoining:
            lost = ", ".join(f"shard {s} at {self.shards[s]}" for s in sorted(self._rejoining))
            exc = AggregationTimeout(
                f"{self._context()}: no progress for {idle:.1f}s on round(s) {rounds}: {lost} went away and has "
                f"not taken this worker back; is the aggregator service (and its --restart) running?")
            self._rejoining.clear()
        else:
            exc = AggregationTimeout(
                f"{self._context()}: no progress for {idle:.1f}s on round(s) {rounds}, waiting on {where}; "
                f"is the aggregator running and are all {self.world_size} workers calling allreduce?")
        for req in list(self._active.values()):
            self._fail_round(req, exc)
        # a shard that died and came back has forgotten the job
        self._rejoin_needed = True
        self._last_progress = time.monotonic()

