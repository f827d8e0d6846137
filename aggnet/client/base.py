"""The aggnet client: one per worker process, all-reducing through a service.

``Client.allreduce(buf)`` returns a future at once; a background I/O thread
moves the buffer to the aggregators and writes each result into the
caller's buffer in place as it arrives. All-reduces are collective: every
worker of the job calls them in the same order with buffers of the same
size and dtype.

``Client(address)`` picks the protocol from the address: aggregator
services (``zmq+tcp``, ``zmq+ipc``, ``shm``, ``inproc``) get chunks over
messages (:mod:`aggnet.client.chunked`); switches and aggregator hosts in
switch mode (``udp``) get the in-network aggregation protocol
(:mod:`aggnet.client.switch`). Every wait is bounded: an all-reduce that
makes no progress for ``timeout`` seconds fails naming the job, the round
and what it is waiting on.
"""

from __future__ import annotations

import collections
import functools
import importlib
import itertools
import logging
import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from aggnet.protocol import keys
from aggnet.protocol.address import parse
from aggnet.client import device
from aggnet.client.arrays import host_view
from aggnet.client.codec import Encoding, Quantized
from aggnet.client.config import ClientConfig
from aggnet.errors import ClientClosed
from aggnet.protocol.wire import DType, job_id_of

log = logging.getLogger("aggnet.client")

#: fraction of the client's timeout after which its aggregator reports the
#: workers a slot is still waiting for; half leaves the aggregator's answer,
#: which names the missing ranks, time to arrive before the client's own
#: timeout (which can only name the shard) fires, over any transport
STALL_FRACTION = 0.5


@dataclass
class ClientStats:
    allreduces: int = 0
    chunks_sent: int = 0  #: chunks (or packets) sent, retransmissions included
    bytes_sent: int = 0
    bytes_received: int = 0
    results: int = 0
    retransmissions: int = 0
    fast_retransmissions: int = 0  #: of which sent early, on later results
    #: replies dropped: malformed, from an address that is not the
    #: aggregator's, or naming nothing this client waits for
    dropped_replies: int = 0
    #: ERRORs and timeouts that failed one of this client's all-reduces
    errors: int = 0
    #: times the client joined its aggregator again (after a restart)
    rejoins: int = 0
    #: int32 rounds quantized with exponents carried from the last round of
    #: their key (no agreement first), and their chunks sent again because
    #: the values outgrew those exponents or were too small for them
    scales_carried: int = 0
    chunks_sent_again: int = 0
    #: int32 rounds admitted while their key's last round was still open:
    #: each waited for that round's results before it was quantized (the
    #: rounds of one key run one at a time)
    scales_awaited: int = 0
    #: int32 rounds of a key that agreed their exponents instead of carrying
    #: them: carried, the key's last round would have sent more than a
    #: quarter of its chunks again (values that grow or shrink by octaves
    #: from round to round, as a buffer all-reduced in place over and over)
    scales_unsteady: int = 0
    #: chunks an aggregator read where they lie in the caller's shared
    #: memory (shm://, aggnet.shared_array), copied by nobody on the way in
    chunks_shared: int = 0
    #: results an aggregator wrote into that shared memory itself (the
    #: caller's buffer, when nothing needs restoring): copied by nobody here
    results_in_place: int = 0
    seconds: float = 0.0  #: wall time from submission to completion, summed


@dataclass(eq=False)
class Request:
    """One all-reduce in flight."""

    round: int
    buf: np.ndarray  #: flat view of the caller's buffer
    caller_buf: object  #: what the future resolves to
    enc: Encoding
    future: Future
    key: int | None
    submitted: float
    failed: bool = False
    #: the error the request ends with once its outstanding work is done
    error: Exception | None = None
    #: a reduce-scatter: rank r's share is buf[bounds[r]:bounds[r + 1]],
    #: and this worker's share of the result goes to ``out``
    bounds: list | None = None
    out: np.ndarray | None = None
    #: an int32 buffer its owner quantizes once the exponents are agreed
    quantized: Quantized | None = None
    #: the buffer is the client's own staging copy of a device buffer,
    #: which is written back only when the round succeeds: nothing in it
    #: needs restoring when one fails
    scratch: bool = False


_WIRE_NAMES = {"float32": None, "int32": "int32", "float16": "fp16", "fp16": "fp16", "bfloat16": "bf16", "bf16": "bf16"}


def _codec_for_dtype(buf, dtype: str, codec: str | None) -> str | None:
    """The codec that makes ``dtype`` travel for ``buf``."""
    if dtype not in _WIRE_NAMES:
        raise ValueError(f"dtype must be one of {sorted(_WIRE_NAMES)}, got {dtype!r}")
    if codec is not None:
        raise ValueError("give codec or dtype, not both")
    if getattr(buf, "dtype", None) is not None and buf.dtype.name == dtype:
        return None  # the buffer's own type: nothing to convert
    return _WIRE_NAMES[dtype]


#: address scheme -> "module:class" of the client that speaks to that kind
#: of aggregator, imported on first use (as the transports are): a new
#: aggregator kind is one module and one line here or a call to
#: :func:`register_client_kind`
CLIENT_KINDS = {
    "udp": "aggnet.client.switch:SwitchClient",
    "tcp": "aggnet.client.chunked:ChunkClient",
    "zmq+tcp": "aggnet.client.chunked:ChunkClient",
    "zmq+ipc": "aggnet.client.chunked:ChunkClient",
    "shm": "aggnet.client.chunked:ChunkClient",
    "ucx": "aggnet.client.chunked:ChunkClient",
    "inproc": "aggnet.client.chunked:ChunkClient",
}
#: the kind of the embedded local aggregator (no address configured)
_EMBEDDED_KIND = "aggnet.client.chunked:ChunkClient"


def register_client_kind(scheme: str, target: str) -> None:
    """Serve ``scheme://`` addresses with the client class at ``target``
    ("module:Class")."""
    CLIENT_KINDS[scheme] = target


def _client_class(address, config: ClientConfig | None, topology=None, rank=0):
    if address is None and topology is None:
        config = config or ClientConfig.from_env()
        address = config.address
        if address is None and config.topology is not None:
            topology = config.topology
    if address is None and topology is not None:
        from aggnet.protocol import topology as topo

        address = topo.load(topology).place(rank).address
    target = _EMBEDDED_KIND if address is None else CLIENT_KINDS.get(parse(address).scheme)
    if target is None:
        raise ValueError(f"no aggregator kind serves {address}; kinds exist for {', '.join(CLIENT_KINDS)}")
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def _check_identity(job, rank, world_size, member_rank, members) -> None:
    """One line naming the argument that is out of range."""
    if not isinstance(world_size, int) or world_size < 1 or world_size > 65535:
        raise ValueError(f"world_size must be an integer from 1 to 65535, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an integer in [0, {world_size}), got {rank!r}")
    if not job or not isinstance(job, str):
        raise ValueError(f"job must be a non-empty name, got {job!r}")
    members = world_size if members is None else members
    member_rank = rank if member_rank is None else member_rank
    if not isinstance(members, int) or not 1 <= members <= world_size:
        raise ValueError(f"members must be an integer from 1 to world_size={world_size}, got {members!r}")
    if not isinstance(member_rank, int) or not 0 <= member_rank < members:
        raise ValueError(f"member_rank must be an integer in [0, {members}), got {member_rank!r}")


class Client(ABC):
    """A worker's connection to aggregators for one job.

    ``address`` names them (``zmq+tcp://host:port``, ``zmq+ipc:///path``,
    ``shm:///path``, ``udp://host:port``, ``inproc://name``); None uses
    ``AGGNET_ADDRESS``, or an embedded aggregator on this machine that
    rank 0 starts and stops. ``topology`` (a topology file, see
    :mod:`aggnet.protocol.topology`; ``AGGNET_TOPOLOGY``) places ``rank`` in its rack
    instead: the rack's aggregator, the world size and the job's name come
    from it. Without one, ``member_rank``/``members`` place the worker among
    the workers of its own rack by hand (``rank``/``world_size`` stay those
    of the whole job).
    """

    def __new__(cls, address: str | None = None, **kwargs):
        if cls is Client:
            cls = _client_class(address, kwargs.get("config"), kwargs.get("topology"), kwargs.get("rank", 0))
        return super().__new__(cls)

    def __init__(
        self,
        address: str | None = None,
        *,
        job: str | None = None,
        rank: int = 0,
        world_size: int | None = None,
        config: ClientConfig | None = None,
        member_rank: int | None = None,
        members: int | None = None,
        topology=None,
        **settings,
    ):
        self.config = config.replace(**settings) if config else ClientConfig.from_env(**settings)
        if topology is None and address is None and self.config.address is None:
            topology = self.config.topology
        #: where this worker sits in a topology of racks (None: no topology)
        self.placement = None
        #: a rack's host aggregator, used when its P4 switch has no room or is dead
        self.fallback_address: str | None = None
        #: Mbit/s of this worker's rack's uplink to a root, where the
        #: topology gives it (chunks are cut to suit it)
        self.uplink_mbit: float | None = None
        if topology is not None:
            if address is not None:
                raise ValueError("give address or topology, not both: the topology names each rack's aggregator")
            if member_rank is not None or members is not None:
                raise ValueError("member_rank and members come from the topology; leave them out")
            address, job, world_size, member_rank, members = self._place(topology, rank, job, world_size)
        job = "default" if job is None else job
        world_size = 1 if world_size is None else world_size
        _check_identity(job, rank, world_size, member_rank, members)
        #: this worker's place among the workers of its own aggregator (a
        #: rack of a hierarchy); the whole job by default
        self.members = world_size if members is None else members
        self.member_rank = rank if member_rank is None else member_rank
        if address is None:
            address = self.config.address
        self.job = job
        self.job_id = job_id_of(job)
        self.rank = rank
        self.world_size = world_size
        self.stats = ClientStats()
        self._embedded = None
        self._key = keys.parse_key(self.config.job_key) if self.config.job_key else None
        if address is None:
            from aggnet.client.embedded import local_aggregator

            self._embedded, address, key = local_aggregator(job, rank, self.config)
            if self._key is None:
                self._key = key
        self.address = str(parse(address))
        self._lock = threading.Lock()
        self._submitted: collections.deque[Request] = collections.deque()
        self._in_hand: list[Request] = []  #: taken by the I/O thread, being admitted
        self._active: dict[int, Request] = {}
        self._rounds = itertools.count(1)
        self._failed: BaseException | None = None
        #: the aggregator's verdict that this job cannot run as configured
        #: (a member joined with another world size): every all-reduce,
        #: pending or later, fails with it
        self._verdict: BaseException | None = None
        self._closing = False
        try:
            self._connect()
        except BaseException:
            self._disconnect(leave=False)
            if self._embedded is not None:
                self._embedded.release(job)
            raise
        self._thread = threading.Thread(target=self._run, name=f"aggnet-io-{job}-{rank}", daemon=True)
        self._thread.start()

    def _place(self, topology, rank: int, job: str | None, world_size: int | None) -> tuple:
        """Address, job, world and place among its rack's members of
        ``rank`` in ``topology`` (a file or a loaded one)."""
        from aggnet.protocol import topology as topo

        t = topo.load(topology)
        if world_size is not None and world_size != t.world:
            raise ValueError(f"world_size={world_size} but topology {t.source} holds {t.world} workers; "
                             f"leave world_size out or fix the topology")
        self.placement = t.place(rank)
        self.uplink_mbit = t.root_uplink_mbit
        if self.placement.rack.fallback is not None:
            self.fallback_address = self.placement.rack.fallback.address
        return (self.placement.address, t.job if job is None else job, t.world, self.placement.member_rank,
                self.placement.members)

    def _context(self) -> str:
        return f"job {self.job!r} rank {self.rank} at {self.address}"

    def _signed(self, kind: str, h, fields: dict) -> dict:
        """``fields`` with the job key's signature over them and ``h``'s
        job, rank and world (unchanged without a key)."""
        if self._key is not None:
            fields = {**fields, "auth": keys.sign(self._key, kind, h.job_id, h.sender, h.world, fields)}
        return fields

    # -- what each protocol provides ---------------------------------------------

    @abstractmethod
    def _connect(self) -> None:
        """Reach the aggregators and join the job (raises naming why not)."""

    @abstractmethod
    def _disconnect(self, leave: bool) -> None:
        """Leave the job (if ``leave``) and release sockets and memory."""

    @abstractmethod
    def _wakeup(self) -> None:
        """Make the I/O thread look at new requests now."""

    def _encoding(self, buf, codec, op, wire_hint) -> Encoding:
        """How ``buf`` travels; refuses what this protocol cannot carry."""
        return Encoding(buf, codec, op, self.world_size, wire_hint)

    @abstractmethod
    def _io_loop(self) -> None:
        """Move requests to the aggregators and results back, until closed."""

    # -- public API ----------------------------------------------------------

    def allreduce(self, buf, op: str = "sum", codec: str | None = None, *, dtype: str | None = None,
                  key: int | None = None, _wire_hint: DType | None = None,
                  _quantized: Quantized | None = None, _scratch: bool = False) -> Future:
        """Sum (or average) ``buf`` over every worker of the job, in place.

        ``buf`` is a NumPy array, a torch tensor (CPU or CUDA; its own
        memory receives the result), a CuPy array, or another array with
        ``__dlpack__``. Returns a :class:`concurrent.futures.Future` that
        resolves to ``buf`` once every element holds the result. ``codec``
        compresses float32 buffers on the wire (``"int32"``, ``"fp16"``,
        ``"bf16"``; ``"float32"`` or None sends them as they are); ``dtype``
        says the same as the type that travels (``"float32"``, ``"int32"``,
        ``"float16"``, ``"bfloat16"``). ``key`` names the buffer for
        placement on aggregator shards (e.g. a DDP bucket index) and, with
        the int32 codec, for carrying its exponents from the last round of
        that key instead of agreeing them first: give each buffer of a step
        its own key (a round waits for the last round of its key if that is
        still open). The buffer must not be touched until the future is done.
        """
        caller = buf
        on_device = hasattr(buf, "__cuda_array_interface__")
        if on_device:
            direct = self._sends_device_memory()
            buf = device.device_view(buf)
            if not direct:
                return device.staged(buf, caller, self._pinned, lambda host: self.allreduce(
                    host, op, codec, dtype=dtype, key=key, _wire_hint=_wire_hint, _scratch=True))
        else:
            buf, hint = host_view(buf, "allreduce")
            _wire_hint = hint if _wire_hint is None else _wire_hint
        if dtype is not None:
            codec = _codec_for_dtype(buf, dtype, codec)
        if not buf.flags.c_contiguous or not getattr(buf.flags, "writeable", True):
            raise ValueError("allreduce needs a C-contiguous, writable buffer (results are written in place)")
        if _quantized is not None:
            return self._submit_quantized(buf, codec, op, key, _quantized, _scratch)
        enc = self._encoding(buf, codec, op, _wire_hint)
        return self._submit(buf.reshape(-1), caller, enc, key, scratch=_scratch)

    #: whether the owner of an int32-codec buffer may quantize it itself
    #: (:class:`~aggnet.client.codec.Quantized`); a client kind that
    #: agrees exponents per chunk of ``chunk_bytes`` says so
    takes_quantized = False

    def _submit_quantized(self, buf, codec, op, key, quantized: Quantized, scratch: bool = False,
                          bounds: list[int] | None = None, out=None) -> Future:
        """``bounds`` and ``out``: a reduce-scatter's, whose shares are
        chunked each on its own (and so are the exponents)."""
        if not self.takes_quantized:
            raise TypeError(f"{self._context()}: this aggregator path quantizes int32 itself; give the client the "
                            f"float32 buffer")
        enc = Encoding(buf, codec, op, self.world_size, prequantized=True)
        block = self.chunk_bytes // 4
        shares = bounds if bounds is not None else [0, buf.size]
        chunks = sum(-(-(e - b) // block) for b, e in zip(shares, shares[1:]))
        exps = np.asarray(quantized.exponents)
        if exps.dtype != np.int16 or exps.shape != (chunks,):
            raise ValueError(f"a prequantized buffer of {buf.size} elements has {chunks} chunks of "
                             f"{block}: give as many int16 exponents, got {exps.dtype} {exps.shape}")
        if out is None:
            return self._submit(buf.reshape(-1), buf, enc, key, quantized=quantized, scratch=scratch)
        return self._submit(buf.reshape(-1), out, enc, key, quantized=quantized, scratch=scratch, bounds=bounds,
                            out=out.reshape(-1))

    #: whether device (CUDA) buffers may be passed as they are: a client
    #: whose transport sends device memory says so
    device_buffers = False
    _direct_default: bool | None = None

    def _sends_device_memory(self) -> bool:
        """Whether a device buffer goes as it is (else through pinned host
        memory: aggnet/client/device.py says when each pays)."""
        path = self.config.device_path
        if path == "direct" and not self.device_buffers:
            raise TypeError(f"device_path='direct' (AGGNET_DEVICE_PATH) sends device buffers as they are, which only "
                            f"ucx:// does; {self.address} takes them staged through host memory: leave device_path "
                            f"unset")
        if path is None:
            if self._direct_default is None:
                self._direct_default = self.device_buffers and device.gpudirect_rdma()
            return self._direct_default
        return path == "direct"

    @functools.cached_property
    def _pinned(self) -> device.PinnedPool:
        return device.PinnedPool(shared=getattr(self, "takes_shared", False))

    #: whether this client can have each chunk's result sent to one rank
    #: (:meth:`reduce_scatter`); a client kind that can says so
    owner_results = False

    def reduce_scatter(self, buf, out, bounds: list[int] | None = None, op: str = "sum", codec: str | None = None,
                       *, dtype: str | None = None, key: int | None = None,
                       _wire_hint: DType | None = None, _quantized: Quantized | None = None,
                       _scratch: bool = False) -> Future:
        """Sum (or average) ``buf`` over every worker of the job; this
        worker receives only its own share of the sum, in ``out``.

        Rank ``r``'s share is ``buf[bounds[r]:bounds[r + 1]]`` (by default
        equal shares: ``buf.size`` must divide by the world size). Each
        worker sends all of ``buf`` and receives only its share, so it
        moves S up and S/N down where an all-reduce moves S both ways.
        ``buf`` is left as it was, but for ``out``, which may be this rank's
        own share of ``buf`` (``buf[bounds[r]:bounds[r + 1]]``, the same
        memory: a buffer in shared memory then receives its share where it
        lies over ``shm://``). The future resolves to ``out``. Neither may be
        touched until it is done. Options as for :meth:`allreduce`. Device
        buffers (CuPy arrays, CUDA tensors; both of them) go through pinned
        host memory as :meth:`allreduce` stages them, and only this rank's
        share comes back to the device.
        """
        if not self.owner_results:
            raise NotImplementedError(
                f"{self._context()}: this aggregator path cannot send one rank its share alone (a switch, or "
                f"a worker in a rack of a hierarchy); all-reduce the buffer and keep your share instead")
        on_device = [hasattr(a, "__cuda_array_interface__") for a in (buf, out)]
        if any(on_device):
            if not all(on_device):
                where = ["device" if d else "host" for d in on_device]
                raise TypeError(f"reduce_scatter takes buf and out both in device memory or both in host memory, "
                                f"got buf in {where[0]} memory and out in {where[1]} memory")
            return self._reduce_scatter_staged(buf, out, bounds, op, codec, dtype, key)
        caller_out = out
        buf, hint = host_view(buf, "reduce_scatter")
        out, _ = host_view(out, "reduce_scatter", "out")
        _wire_hint = hint if _wire_hint is None else _wire_hint
        if dtype is not None:
            codec = _codec_for_dtype(buf, dtype, codec)
        bounds = self._check_share(buf, out, bounds)
        if _quantized is not None:
            return self._submit_quantized(buf, codec, op, key, _quantized, _scratch, bounds=bounds, out=out)
        enc = self._encoding(buf, codec, op, _wire_hint)
        return self._submit(buf.reshape(-1), caller_out, enc, key, bounds=bounds, out=out.reshape(-1),
                            scratch=_scratch)

    def _check_share(self, buf, out, bounds: list[int] | None) -> list[int]:
        """The shares' bounds (equal shares by default), once ``buf`` and
        ``out`` (NumPy or CuPy arrays) can take a reduce-scatter into them."""
        for name, a in (("buf", buf), ("out", out)):
            if not a.flags.c_contiguous:
                raise ValueError(f"reduce_scatter needs a C-contiguous {name}")
        if not getattr(out.flags, "writeable", True) or out.dtype != buf.dtype:
            raise ValueError(f"reduce_scatter writes its result into out: it must be writable and of buf's dtype "
                             f"({buf.dtype}), got {out.dtype}")
        n = self.world_size
        if bounds is None:
            if buf.size % n:
                raise ValueError(f"buf of {buf.size} elements does not split into {n} equal shares; give bounds")
            bounds = [r * (buf.size // n) for r in range(n + 1)]
        bounds = [int(b) for b in bounds]
        if len(bounds) != n + 1 or bounds[0] != 0 or bounds[-1] != buf.size or \
                any(b > e for b, e in zip(bounds, bounds[1:])):
            raise ValueError(f"bounds must be {n + 1} non-decreasing offsets from 0 to buf.size={buf.size}, "
                             f"got {bounds}")
        share = bounds[self.rank + 1] - bounds[self.rank]
        if out.size != share:
            raise ValueError(f"rank {self.rank}'s share is {share} elements (bounds {bounds}), out holds {out.size}")
        return bounds

    def _reduce_scatter_staged(self, buf, out, bounds, op, codec, dtype, key) -> Future:
        """A reduce-scatter of device buffers (CuPy arrays, CUDA tensors)
        through pinned host memory, as :meth:`allreduce` stages them: all
        of ``buf`` goes to the host, the reduce-scatter receives this
        rank's share there in place, and only that share comes back, into
        ``out``. Over ``shm://`` the host memory is shared: the shards read
        the chunks and write the share where they lie."""
        view, into = device.device_view(buf), device.device_view(out)
        bounds = self._check_share(view, into, bounds)
        mine = slice(bounds[self.rank], bounds[self.rank + 1])

        def reduce_scatter_host(host):
            flat = host.reshape(-1)
            return self.reduce_scatter(flat, flat[mine], bounds, op, codec, dtype=dtype, key=key, _scratch=True)

        return device.staged(view, out, self._pinned, reduce_scatter_host, share=mine, into=into)

    def _submit(self, flat, caller_buf, enc: Encoding, key, **extra) -> Future:
        if key is not None:
            if isinstance(key, bool) or not isinstance(key, (int, np.integer)):
                raise TypeError(f"key must be an int that names the buffer alike on every worker (a bucket's "
                                f"index), or None; got {key!r}")
            key = int(key)
        with self._lock:
            if self._failed is not None:
                raise ClientClosed(f"{self._context()} failed earlier and cannot continue: {self._failed}")
            if self._closing:
                raise ClientClosed(f"{self._context()} is closed")
            fut: Future = Future()
            fut.set_running_or_notify_cancel()
            if self._verdict is not None:
                fut.set_exception(type(self._verdict)(str(self._verdict)))
                return fut
            req = self._request_class(next(self._rounds) & 0xFFFFFFFF, flat, caller_buf, enc, fut, key,
                                      time.monotonic(), **extra)
            self._submitted.append(req)
        self._wakeup()
        return fut

    _request_class = Request

    def close(self) -> None:
        """Leave the job and stop the I/O thread (waits at most a few seconds)."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._wakeup()
        thread = getattr(self, "_thread", None)
        if thread is not None:
            thread.join(timeout=5.0)
        self._disconnect(leave=True)
        if self._embedded is not None:
            self._embedded.release(self.job)
            self._embedded = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- the I/O thread ------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._io_loop()
        except BaseException as exc:  # the thread must never die silently
            log.exception("aggnet I/O thread failed")
            self._fail_all(exc if isinstance(exc, Exception) else ClientClosed(str(exc)), poison=True)
            return
        self._fail_all(ClientClosed(f"{self._context()} was closed with the all-reduce pending"), poison=False)

    def _take_submitted(self) -> tuple[list, bool]:
        """(new requests, whether the client is closing). They stay in hand
        until the I/O thread has admitted them: one that fails (or closes)
        before fails them too, not only those it had admitted."""
        with self._lock:
            new = list(self._submitted)
            self._submitted.clear()
            self._in_hand = new
            return new, self._closing

    def _complete(self, req: Request) -> None:
        self._active.pop(req.round, None)
        if req.error is not None:
            req.failed = True
            self._restore(req)
            req.future.set_exception(req.error)
            return
        self._release(req)
        self.stats.allreduces += 1
        self.stats.seconds += time.monotonic() - req.submitted
        req.future.set_result(req.caller_buf)

    def _fail(self, req: Request, exc: Exception, poison: bool) -> None:
        if req.failed:
            return
        req.failed = True
        self._active.pop(req.round, None)
        self._restore(req)
        req.future.set_exception(exc)
        if poison:
            self._fail_all(exc, poison=True)

    def _job_refused(self, exc: Exception) -> None:
        """The aggregator says the job cannot run as its members started it
        (another member joined with another world size): what is pending
        fails with that, and so does every later all-reduce."""
        with self._lock:
            self._verdict = self._verdict or exc
        self._fail_all(exc, poison=False)

    def _fail_all(self, exc: Exception, poison: bool) -> None:
        with self._lock:
            if poison:
                self._failed = self._failed or exc
            pending = list(self._submitted)
            self._submitted.clear()
        reqs = list(self._active.values()) + self._in_hand + pending
        self._in_hand = []
        self._active = {}
        for r in reqs:
            if not r.failed and not r.future.done():
                r.failed = True
                self._restore(r)
                r.future.set_exception(exc)

    def _restore(self, req: Request) -> None:
        """A failed all-reduce leaves the caller's buffer as it was given
        (a client kind that writes results as they come puts back what
        it overwrote)."""

    def _release(self, req: Request) -> None:
        """A completed all-reduce's bookkeeping may go."""
