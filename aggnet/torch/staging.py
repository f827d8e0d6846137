"""Device tensors through aggnet: encode on the device, stage through pinned
host memory, decode on the device, all off the training stream.

The aggnet clients read and write host memory. A bucket on a GPU used to be
copied to the CPU with ``buf.to("cpu")``, which waits for every kernel
queued before it and for the copy: the backward pass stalled once per
bucket. A :class:`Stager` instead, per bucket:

1. on a side stream that first waits for the work queued so far on the
   caller's stream (the gradient is written there), counts NaN/Inf and
   converts to the wire format on the device (``fp16``/``bf16``: half the
   bytes over PCIe and none of the host's cycles; avg divides first, in
   float32, as the host codec does), then copies into a pinned host buffer
   without blocking;
2. on its own thread waits for that copy (a CUDA event) and hands the
   pinned memory to the client, which sends from it without another copy
   and writes the result back into it; buckets reach the client in the
   order submitted, and so does whatever is called straight on the client
   after them (a CPU tensor's all-reduce: :class:`ClientQueue`), as every
   worker must all-reduce in the same order however long its copies took;
3. once the client is done, copies the result to the device on a second
   side stream (on the first it would queue behind later buckets' waits
   for the training stream) and widens it into the bucket; a thread of
   the stager's waits for that copy (about a millisecond for a 25 MB
   bucket) before the bucket's future completes, so whoever waits on the
   future (DDP's reducer, the optimizer) finds the result in place
   whatever stream it runs on, while the client's I/O thread goes on
   with the next bucket's chunks.

The caller's stream never waits, so several buckets overlap their
copies, the network and the backward pass. Pinned buffers come from a
:class:`BufferPool` and go back when a bucket is done: after the first
step no bucket allocates (``Stager.stats()`` counts it). What the device
computes into (a half format, int32 and its float64 product) is a
slice of a bucket at a time (``SLICE`` elements) in scratch each stream
keeps: a stager holds tens of megabytes of device memory (151 MB for
int32 through torch's operations) whatever the model's size, where a
scratch of each bucket's size, kept per bucket, held up to 4 bytes of
device memory per byte of gradient (int32). For an
aggregator on this host (``shm://``) the pinned buffers are shared memory
page-locked for the GPU: the shards read the chunks there and write the
results back, and the host copies no byte of the bucket.

The int32 codec is quantized on the device too, where the client agrees
exponents per chunk (an aggregator service; a switch client quantizes
float32 staged as above on the host). Its scale is agreed among the
workers per chunk before any value is quantized, so the side stream first
finds each chunk's largest magnitude (a few bytes a chunk to the host);
the client agrees the exponents and calls back, and the bucket is then
quantized on a stream of its own (:mod:`aggnet.torch.quantize`; earlier
buckets' results go back to the device meanwhile) and copied to pinned
memory, from which the client sends it as it is. The int32 sums
come back into the same memory and are dequantized on the device. The
host then does for int32 what it does for float32: send and receive.

A CPU tensor is sent from where it is and encoded by the client, chunk by
chunk as chunks leave. ``Stager(cpu, through_host=True)`` (the DDP hook's
``staging="always"``) takes a CPU tensor through everything a GPU bucket
goes through instead, pools and device codec included, which is how the
test suite runs those functions without a GPU.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

import numpy as np
import torch

from aggnet import kernels
from aggnet.client.arrays import tensor_view
from aggnet.client.codec import Quantized
from aggnet.errors import AggnetError
from aggnet.torch import quantize as device_codec
from aggnet.transport import shm

log = logging.getLogger("aggnet.torch")

__all__ = ["BufferPool", "ClientQueue", "Stager", "Staged", "copy_to_host", "quantize_block", "result_nonfinite",
           "wait_event", "wire_dtype"]

#: torch dtype a float32 buffer travels in, per codec (int32: quantized on the host)
_CODEC_DTYPES = {None: torch.float32, "int32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

_CPU_KERNELS = kernels.load("cpu")

#: default bound on pinned host memory a process keeps for staging
PINNED_LIMIT = 2 << 30
#: seconds a copy between the device and pinned memory may take
COPY_TIMEOUT = 60.0
#: elements of a bucket its device passes take at once (a whole number of
#: chunks where it is quantized): the device scratch a stager keeps is a
#: few bytes per element of this, whatever the model's size, instead of
#: up to 12 per element of every bucket (int32's int32 and float64)
SLICE = 1 << 22


def quantize_block(client, codec: str | None, dtype: torch.dtype) -> int | None:
    """Elements per chunk of ``client`` where it lets a float32 buffer be
    quantized to int32 on its device (its chunks' exponents agreed per
    chunk), else None."""
    if codec != "int32" or dtype != torch.float32 or not getattr(client, "takes_quantized", False):
        return None
    return client.chunk_bytes // 4


def wire_dtype(dtype: torch.dtype, codec: str | None) -> torch.dtype:
    """The dtype a buffer of ``dtype`` is staged in for ``codec``."""
    if dtype == torch.float32:
        return _CODEC_DTYPES[codec]
    if codec is not None:
        raise ValueError(f"codec {codec!r} compresses float32 buffers; this buffer is {dtype}")
    return dtype


@dataclass
class PoolStats:
    allocations: int = 0  #: buffers ever allocated
    allocated_bytes: int = 0
    reuses: int = 0  #: takes served by a buffer given back
    unpinned: int = 0  #: takes beyond the pinned limit, served by pageable memory
    shared: int = 0  #: of the allocations, those in shared memory (read in place by an shm:// service)


class BufferPool:
    """Reusable flat byte buffers on one device (``pin``: page-locked host
    memory), taken by size and given back; a buffer is reused for any take
    that fits it. Sizes round up to a power of two so buckets of nearly the
    same size share buffers. Pinned memory beyond ``limit`` bytes is not
    allocated: such a take gets pageable memory (counted), which is slower
    to copy but never exhausts the host.

    A take with a ``key`` (a DDP bucket and what the buffer is for) gets
    the buffer last given back under that key when it still fits: every
    step then reuses exactly its own buffers, however the buckets of a
    step overlapped, so no step after the first allocates. Shared by size
    alone, the buffers a step needs would depend on how many buckets were
    in flight at once, which varies from step to step."""

    def __init__(self, device: torch.device, *, pin: bool = False, limit: int = PINNED_LIMIT, shared: bool = False):
        self.device = torch.device(device)
        self.pin = pin
        self.limit = limit
        #: host buffers in shared memory (aggnet.transport.shm), which an
        #: aggregator on this host reads in place; private memory where
        #: /dev/shm cannot hold them
        self.shared = shared
        self.stats = PoolStats()
        self._free: dict[int, list[torch.Tensor]] = {}
        self._kept: dict[object, torch.Tensor] = {}  #: key -> the buffer given back under it
        self._lock = threading.Lock()

    def take(self, nbytes: int, key=None) -> torch.Tensor:
        size = 1 << max(nbytes - 1, 0).bit_length()
        with self._lock:
            mine = self._kept.pop(key, None) if key is not None else None
            if mine is not None:
                if mine.numel() == size:
                    self.stats.reuses += 1
                    return mine
                self._free.setdefault(mine.numel(), []).append(mine)  # the key's buffer changed size
            free = self._free.get(size)
            if free:
                self.stats.reuses += 1
                return free.pop()
            pin = self.pin and self.stats.allocated_bytes + size <= self.limit
            if self.pin and not pin:
                self.stats.unpinned += 1
            self.stats.allocations += 1
            self.stats.allocated_bytes += size
        if self.shared:
            raw = shm.shared_bytes(size)
            if raw is not None:
                with self._lock:
                    self.stats.shared += 1
                buf = torch.from_numpy(raw)
                if pin and torch.cuda.is_available():
                    if _register(buf):
                        # unlocked before its memory is unmapped (a closed
                        # job's pool going): a later mapping at that address
                        # could not be page-locked otherwise
                        weakref.finalize(raw, _unregister, raw.ctypes.data)
                    else:
                        with self._lock:
                            self.stats.unpinned += 1
                return buf
        # pinning needs a CUDA runtime (a CPU build of torch has none)
        return torch.empty(size, dtype=torch.uint8, device=self.device, pin_memory=pin and torch.cuda.is_available())

    def give(self, buf: torch.Tensor, key=None) -> None:
        with self._lock:
            if key is not None and key not in self._kept:
                self._kept[key] = buf
            else:
                self._free.setdefault(buf.numel(), []).append(buf)


def _register(buf: torch.Tensor) -> bool:
    """Page-lock ``buf`` (shared memory) for the GPU's copies, as pinned
    memory is; False where CUDA refuses (it is then copied as pageable
    memory is: correct, slower)."""
    try:  # 1: cudaHostRegisterPortable, page-locked for every device's copies
        cudart = torch.cuda.cudart()
        if int(cudart.cudaHostRegister(buf.data_ptr(), buf.numel(), 1)) == 0:
            return True
        if hasattr(cudart, "cudaGetLastError"):
            cudart.cudaGetLastError()  # the refusal is handled: no later kernel launch may report it
    except (RuntimeError, AttributeError):
        pass
    return False


def _unregister(address: int) -> None:
    """Undo :func:`_register` of the buffer at ``address``, whose memory
    is about to be unmapped (at exit CUDA may be gone first: nothing to undo)."""
    try:
        torch.cuda.cudart().cudaHostUnregister(address)
    except (RuntimeError, AttributeError):
        pass


def _view(raw: torch.Tensor, dtype: torch.dtype, numel: int) -> torch.Tensor:
    return raw[: numel * dtype.itemsize].view(dtype)


@dataclass
class Staged:
    """One buffer on its way: what the client all-reduces (``host``, a view
    of pinned memory), and what was found in it before it left."""

    buf: torch.Tensor
    wire: torch.dtype
    host: torch.Tensor
    multiplier: float
    codec: str | None = None  #: the client's codec for ``host``
    op: str = "sum"  #: the client's op for ``host``
    _raw: list = field(default_factory=list)  #: (pool, buffer, key) to give back
    key: object = None  #: the caller's name for the buffer (a DDP bucket index): its buffers are its own
    _nonfinite: torch.Tensor | None = None
    narrowed: bool = False  #: encoded on the device into a narrower wire dtype (a half codec)
    _ready: object = None  #: event: the host copy is complete
    #: int32 quantized on the device: elements per chunk, each chunk's
    #: largest magnitude (host memory, once ``_ready``), and the exponents
    #: the workers agreed
    block: int | None = None
    #: element ranges each chunked on its own from its start (a
    #: reduce-scatter's shares, where they do not fall on chunk
    #: boundaries; else the whole buffer), and each chunk's first element
    #: and elements
    segments: list = field(default_factory=list)
    _chunks: list = field(default_factory=list)
    world: int = 1
    _best: torch.Tensor | None = None
    agreed: np.ndarray | None = None
    #: the whole bucket being quantized on the stager's thread: its
    #: buffers go back to the pools only once that is over
    _quantizing: Future | None = None

    def local_nonfinite(self) -> int:
        """NaN/Inf in this rank's buffer (read once the host copy is ready)."""
        return int(self._nonfinite.item()) if self._nonfinite is not None else 0


class Stager:
    """Encode, stage and decode the buffers of one device (see the module
    docstring). One thread hands ready buffers to the client in the order
    they were submitted: every worker all-reduces its buckets in the same
    order, as the aggregator requires."""

    def __init__(self, device: torch.device, *, pinned_limit: int = PINNED_LIMIT, through_host: bool | None = None,
                 shared: bool = False, order: "ClientQueue | None" = None):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        #: whether buffers are staged in host buffers of the pools (a CPU
        #: buffer is sent from where it is unless told otherwise)
        self.through_host = self.device.type != "cpu" if through_host is None else through_host
        #: ``shared``: the client's aggregator reads shared memory in place
        #: (``client.takes_shared``): the pinned buffers the client sends
        #: from are allocated there, so no chunk is copied on its way in
        self.host_pool = BufferPool(torch.device("cpu"), pin=self.cuda, limit=pinned_limit, shared=shared)
        self.device_pool = BufferPool(self.device)
        #: the way out: NaN/Inf counted, halves narrowed, each chunk's
        #: largest magnitude found, copies to pinned memory; after the work
        #: queued on the training stream
        self._side = _Lane(self.device, self.device_pool, self.cuda)
        #: int32 quantized once its exponents are agreed, on a stream of
        #: its own: on the first it would queue behind later buckets' waits
        #: for the training stream, on the last behind earlier buckets'
        #: results going back (each way's copies then overlap)
        self._quant = _Lane(self.device, self.device_pool, self.cuda)
        #: the way back: results to the device, widened or dequantized
        self._back = _Lane(self.device, self.device_pool, self.cuda)
        #: what the int32 codec's passes run on this device: aggnet's CUDA
        #: kernels (CuPy) or torch's operations (``.name`` says which)
        self.kernels = device_codec.ops_for(self.device)
        #: the order buckets reach the client in: handed over once their
        #: copy to the host is done, in the order submitted, after what the
        #: client's other callers submitted before them (``order``: the
        #: client's queue, shared with its other stagers and direct calls)
        self.order = ClientQueue() if order is None else order
        #: completed all-reduces, whose futures complete on a thread of the
        #: stager's: whoever waits on one copies the result back to the
        #: device (:meth:`unstage`), which would hold the client's I/O
        #: thread from the next bucket's chunks for as long
        self._completing = _InOrder("aggnet-unstaging", lambda item: _settle(*item))
        #: int32 buckets to quantize once their exponents are agreed, on a
        #: thread of the stager's: the client's I/O thread goes on with
        #: other buckets' results and chunks while the device works
        self._quantizing = _InOrder("aggnet-quantizing", self._quantize_whole)

    # -- out: device -> pinned host ---------------------------------------------------

    def stage(self, buf: torch.Tensor, *, codec: str | None, op: str, world: int,
              check_finite: bool = True, block: int | None = None, key=None,
              bounds: list[int] | None = None) -> Staged:
        """Start moving ``buf`` (contiguous) to pinned host memory in its
        wire dtype; returns at once (the copy runs on the side stream).
        ``staged.codec`` and ``staged.op`` are what the client is to do
        with what arrives there. ``block``: the int32 codec is quantized
        here, in chunks of that many elements (:func:`quantize_block`).
        ``key``: a name the same buffer has every step (a DDP bucket's
        index), under which its pinned and device buffers are kept for it.
        ``bounds``: a reduce-scatter's shares (``bounds[r]:bounds[r + 1]``),
        which the client chunks each on its own, and so does the quantizer."""
        buf = buf.view(-1)  # flat, as the host buffer is: the result lands in the caller's memory
        if block is not None and codec == "int32" and self.through_host:
            return self._stage_for_quantizing(buf, op, world, block, key, bounds)
        if not self.through_host:
            # a CPU buffer is sent from where it is; the client encodes it
            # chunk by chunk while earlier chunks are on the wire (narrowing
            # the whole bucket first delayed the first chunk: 5-15% slower)
            staged = Staged(buf, buf.dtype, buf, 1.0, codec=codec, op=op)
            if check_finite:
                staged._nonfinite = _count_nonfinite(buf)
            return staged
        wire = wire_dtype(buf.dtype, codec)
        n = buf.numel()
        narrowed = wire != buf.dtype
        # halves narrowed here were divided here (avg): the client sums them
        staged = Staged(buf, wire, None, (1.0 / world if op == "avg" else 1.0) if narrowed else 1.0,
                        codec="int32" if codec == "int32" else None, op="sum" if narrowed else op, key=key,
                        narrowed=narrowed)
        staged.host = self._host(wire, n, staged, "host")
        with self._on_side_stream():
            if check_finite:
                staged._nonfinite = _count_nonfinite(buf)
            if not narrowed:
                staged.host.copy_(buf, non_blocking=True)
            else:
                for part in _slices(0, n, SLICE):
                    self._narrow(buf[part], staged.host[part], staged)
            self._mark_ready(staged)
        return staged

    def _mark_ready(self, staged: Staged) -> None:
        """What ``staged`` found goes to the host; an event says when it is there."""
        if staged._nonfinite is not None:
            staged._nonfinite = staged._nonfinite.to("cpu", non_blocking=self.cuda)
        if self.cuda:
            staged._ready = torch.cuda.Event()
            staged._ready.record(self._side.stream)

    def _stage_for_quantizing(self, buf: torch.Tensor, op: str, world: int, block: int, key,
                              bounds: list[int] | None) -> Staged:
        """The first half of int32 on the device: each chunk's largest
        magnitude, found on the side stream and copied to the host (the
        client agrees exponents from it; :meth:`_quantize` does the rest)."""
        n = buf.numel()
        staged = Staged(buf, torch.int32, None, 1.0 / world if op == "avg" else 1.0,
                        codec="int32", op="sum", block=block, world=world, key=key)
        staged.segments = _segments(n, block, bounds)
        for start, end in staged.segments:
            staged._chunks += [(at, min(block, end - at)) for at in range(start, end, block)]
        staged.host = self._host(torch.int32, n, staged, "host")
        staged._best = self._host(torch.int32, len(staged._chunks), staged, "best")
        with self._on_side_stream():
            staged._nonfinite = _count_nonfinite(buf)  # named if the agreement refuses the bucket
            ops = self.kernels
            for part, which in _passes(staged):
                bits, = self._side.scratch.views(ops.bits_for(part.stop - part.start, block), torch.int32)
                staged._best[which].copy_(ops.chunk_max_bits(buf[part], block, bits), non_blocking=self.cuda)
            self._mark_ready(staged)
        return staged

    def _quantize(self, staged: Staged, agreed: np.ndarray, chunks: list | None = None) -> None:
        """The second half, called by the client once every exponent is
        agreed (or carried from the bucket's last step): quantize into
        device scratch on a stream of its own, copy to the pinned buffer
        the client sends, and wait for that copy. ``chunks``: only
        these, again, with their exponents in ``agreed`` (the rest of the
        pinned buffer may hold sums already)."""
        staged.agreed = agreed
        if chunks is None:
            passes = list(_passes(staged))
        else:
            passes = [(slice(at, at + count), slice(i, i + 1)) for i in chunks for at, count in [staged._chunks[i]]]
        with self._quant.current():
            # copied on this stream: on the calling thread's own (the
            # default one) the copy would wait for the training's kernels
            factors = torch.from_numpy(device_codec.quantize_factors(agreed, staged.world)).to(self.device)
            for part, which in passes:
                q, wide = self._int32_scratch(self._quant, part.stop - part.start)
                self.kernels.quantize_chunks(staged.buf[part], factors[which], staged.block, q, wide)
                staged.host[part].copy_(q, non_blocking=self.cuda)
            self._quant.wait(f"quantizing a bucket on {self.device}")

    def _quantize_later(self, staged: Staged, agreed: np.ndarray) -> Future:
        """:meth:`_quantize` of the whole bucket on the stager's quantizing
        thread; the future is done once the pinned buffer holds it."""
        staged.agreed = agreed  # (what comes back is dequantized with these, whenever this runs)
        done: Future = Future()
        staged._quantizing = done
        self._quantizing.put((staged, agreed, done))
        return done

    def _quantize_whole(self, item) -> None:
        staged, agreed, done = item
        try:
            self._quantize(staged, agreed)
        except BaseException as exc:  # noqa: BLE001 - a CUDA error fails this bucket's round only
            done.set_exception(exc)
        else:
            done.set_result(None)

    def _host(self, dtype: torch.dtype, n: int, staged: Staged, role: str) -> torch.Tensor:
        """Pinned host memory for ``n`` values of ``dtype``, ``staged``'s until released."""
        return self._taken(self.host_pool, dtype, n, staged, role)

    @staticmethod
    def _taken(pool: BufferPool, dtype: torch.dtype, n: int, staged: Staged, role: str) -> torch.Tensor:
        key = None if staged.key is None else (staged.key, role)
        raw = pool.take(n * dtype.itemsize, key)
        staged._raw.append((pool, raw, key))
        return _view(raw, dtype, n)

    def _narrow(self, part: torch.Tensor, host: torch.Tensor, staged: Staged) -> None:
        """A slice of ``buf`` (float32) into the half format of ``host``
        (pinned), through device scratch; scaled first in float32 (avg), one
        rounding, as the host codec does."""
        n = part.numel()
        if staged.multiplier != 1.0:
            half, scaled = self._side.scratch.views(n, host.dtype, torch.float32)
            torch.mul(part, staged.multiplier, out=scaled)
            half.copy_(scaled)
        else:
            half, = self._side.scratch.views(n, host.dtype)
            half.copy_(part)
        host.copy_(half, non_blocking=self.cuda)

    def _on_side_stream(self):
        """The side stream as the current one, after the work queued so far
        on the caller's stream (which writes the gradient); one bucket's
        pass at a time."""
        return self._side.current(torch.cuda.current_stream(self.device) if self.cuda else None)

    # -- the client, in submission order ------------------------------------------------

    def submit(self, staged: Staged, send: Callable[..., Future]) -> Future:
        """Once ``staged``'s host copy is ready, ``send(array, **options)``
        (the client's all-reduce, given ``_wire_hint`` or, for int32
        quantized here, ``_quantized``, and ``_scratch`` for pinned memory of
        the stager's own); the returned future is the client's."""
        out: Future = Future()
        if not self.through_host:  # nothing to wait for: sent from where it is, once earlier buckets are
            self.order.now_or_later(lambda: self._send(staged, send, out))
        else:
            # every staged bucket, a CPU one through host memory too, takes
            # the GPU's way: no path here that the suite runs and a GPU skips
            self.order.later(lambda: self._hand_over(staged, send, out))
        return out

    def _hand_over(self, staged: Staged, send, out: Future) -> None:
        try:
            wait_event(staged._ready, f"copying a bucket from {self.device}")
        except BaseException as exc:  # a CUDA error: the bucket fails, the thread goes on
            out.set_exception(exc if isinstance(exc, AggnetError) else
                              AggnetError(f"aggnet: copying a bucket from {self.device} failed: {exc}"))
            return
        self._send(staged, send, out)

    def _send(self, staged: Staged, send, out: Future) -> None:
        try:
            arr, hint = tensor_view(staged.host)
            # pinned memory of the stager's own: a failed round leaves the
            # caller's buffer as it was, so nothing in it need be saved
            mine = {"_scratch": True} if staged.host is not staged.buf else {}
            if staged.block is None:
                inner = send(arr, _wire_hint=hint, **mine)
            else:
                exps = device_codec.exponents_of_bits(staged._best.numpy())

                def quantize(agreed, chunks):
                    if chunks is None:  # the whole bucket: on a thread of the stager's
                        return self._quantize_later(staged, agreed)
                    self._quantize(staged, agreed, chunks)  # a few chunks again, at once
                    return None

                inner = send(arr, _quantized=Quantized(exps, quantize, staged.local_nonfinite()), **mine)
        except BaseException as exc:
            out.set_exception(exc)
            return

        def done(f: Future) -> None:
            if not self.through_host:  # nothing comes back: the result is in the caller's buffer
                _settle(out, f)
                return
            # its callbacks (the caller's unstage) run there; concurrent.futures logs theirs
            self._completing.put((out, f))

        inner.add_done_callback(done)

    # -- back: pinned host -> device ---------------------------------------------------

    def unstage(self, staged: Staged, part: slice | None = None, out: torch.Tensor | None = None) -> None:
        """Copy the result back into ``staged.buf`` on the stream of what
        comes back and wait for it; then the buffers go back to their
        pools. ``part``: only those elements come back, into ``out`` (flat,
        on the device) where given: a reduce-scatter's share, which is all
        the rank received."""
        if part is not None:
            self._unstage_part(staged, part, staged.buf[part] if out is None else out)
            return
        buf, host = staged.buf, staged.host
        with self._back.current():
            if host is buf:
                pass
            elif staged.block is not None:
                if staged.agreed is not None:  # else an empty bucket
                    self._dequantize(staged, list(_passes(staged)), buf, 0)
            elif staged.narrowed:
                self._widen(staged, slice(0, buf.numel()), buf)
            else:
                buf.copy_(host, non_blocking=self.cuda)
            # the bucket is complete once the copy is; the pools hand the
            # buffers out again only after it has read them
            self._back.wait(f"copying a result to {self.device}")
        self.release(staged)

    def _dequantize(self, staged: Staged, passes: list, out: torch.Tensor, origin: int) -> None:
        """The int32 sums of ``passes`` ((elements, chunks), chunk-aligned)
        as float32 into ``out``, whose first element is element ``origin``
        of the buffer: through device scratch, a slice at a time."""
        factors = torch.from_numpy(device_codec.dequantize_factors(staged.agreed, staged.world,
                                                                   staged.multiplier)).to(self.device)
        for part, which in passes:
            q, wide = self._int32_scratch(self._back, part.stop - part.start)
            q.copy_(staged.host[part], non_blocking=self.cuda)
            self.kernels.dequantize_chunks(q, factors[which], staged.block, out[part.start - origin:part.stop - origin],
                                           wide)

    def _int32_scratch(self, lane: "_Lane", n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``lane``'s scratch for ``n`` int32 values, and for their float64
        product where torch's operations compute one."""
        if self.kernels.needs_scratch:
            q, wide = lane.scratch.views(n, torch.int32, torch.float64)
            return q, wide
        q, = lane.scratch.views(n, torch.int32)
        return q, None

    def _widen(self, staged: Staged, part: slice, out: torch.Tensor) -> None:
        """Half-format results ``part`` into float32 ``out``, through device
        scratch, a slice at a time."""
        for sub in _slices(part.start, part.stop, SLICE):
            half, = self._back.scratch.views(sub.stop - sub.start, staged.host.dtype)
            half.copy_(staged.host[sub], non_blocking=self.cuda)
            out[sub.start - part.start:sub.stop - part.start].copy_(half)

    def _unstage_part(self, staged: Staged, part: slice, out: torch.Tensor) -> None:
        with self._back.current():
            if staged.block is not None:
                which = _chunks_of(staged, part)
                if staged.agreed is not None:
                    self._dequantize(staged, list(_passes_of(staged, part.start, part.stop, which.start)), out,
                                     part.start)
            elif staged.narrowed:
                self._widen(staged, part, out)
            else:
                out.copy_(staged.host[part], non_blocking=self.cuda)
            self._back.wait(f"copying a result to {self.device}")
        self.release(staged)

    def after_result(self, fn: Callable[[], object]) -> None:
        """``fn()``: device work on a result already back (copied on into
        the caller's non-contiguous tensor, an integer average's division),
        on the stream of what comes back, and waited for as the result was.
        Queued on the calling thread's own stream it would be waited for by
        nothing: a future completing meanwhile would let another stream
        read the tensor before it holds the result."""
        with self._back.current():
            fn()
            self._back.wait(f"finishing a result on {self.device}")

    def back_on_device(self, fn: Callable[[], object], after=None) -> None:
        """``fn()``: results copied back into the caller's tensor from host
        memory the caller keeps, on the stream of what comes back, after
        CUDA event ``after`` (what must read the tensor first). The calling
        thread's current stream then waits for them on the device, not the
        host: a CUDA future completed from this thread hands that wait on
        to whoever waits on it (the stale-gradient hook's)."""
        with self._back.current(after):
            fn()
            if self.cuda:
                copied = torch.cuda.Event()
                copied.record(self._back.stream)
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(copied)

    def release(self, staged: Staged) -> None:
        """``staged``'s buffers go back to their pools, once nothing of the
        stager's writes them any more (a round can fail while its bucket is
        being quantized)."""
        if staged._quantizing is not None:
            wait([staged._quantizing], COPY_TIMEOUT)
        for pool, raw, key in staged._raw:
            pool.give(raw, key)
        staged._raw.clear()

    def stats(self) -> dict:
        """Allocations of the pinned and device pools: constant after the
        first step when buckets reuse their buffers."""
        return {"pinned": self.host_pool.stats, "device": self.device_pool.stats}


#: seconds a stager's thread waits for work before it ends (and a stager
#: no one uses any more holds no thread, and is freed)
IDLE = 5.0


class _InOrder:
    """Calls of ``run`` on items put here, one after another in the order
    put, on a thread that starts with the first and ends after ``IDLE``
    seconds without one."""

    def __init__(self, name: str, run: Callable):
        self.name, self.run = name, run
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def put(self, item) -> None:
        self._queue.put(item)
        with self._lock:  # after the put: a thread ending now has seen the queue empty, and is gone
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=IDLE)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            self.run(item)
            del item  # what it held (a bucket, a client's future) is not kept while this waits


class ClientQueue:
    """The order one client's collectives reach it in. Every worker must
    all-reduce its buffers in the same order, and a staged bucket reaches
    the client from a thread once its copy to the host is done: a
    collective that needs no copy (a CPU tensor sent from where it is, an
    agreement of the DDP hook's), called straight on the client, would
    overtake buckets submitted before it on some ranks and not on others.
    The round then fails as a mismatch, or, for buffers of one size, sums
    one rank's bucket with another's tensor. One queue per client, shared
    by its stagers (one per device) and its callers' direct calls
    (:meth:`call`): at once while no bucket waits, else after them."""

    def __init__(self):
        self._lock = threading.Lock()
        self._waiting = 0  #: calls put on the thread and not yet over
        self._thread = _InOrder("aggnet-staging", self._run)

    def later(self, fn: Callable[[], None]) -> None:
        """``fn()`` on the queue's thread, after everything queued before
        (``fn`` reports its own errors)."""
        with self._lock:
            self._waiting += 1
        self._thread.put(fn)

    def _run(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - the calls queued after it still reach the client
            log.error("aggnet: a call queued for the client failed outside its future: %s", exc)
        finally:
            with self._lock:
                self._waiting -= 1

    def _idle(self) -> bool:
        with self._lock:
            return self._waiting == 0

    def now_or_later(self, fn: Callable[[], None]) -> None:
        """``fn()`` here and now when nothing queued waits, else :meth:`later`."""
        if self._idle():
            fn()
        else:
            self.later(fn)

    def call(self, send: Callable[[], Future]) -> Future:
        """The client's future of ``send()`` (a collective on the client),
        called once every bucket queued before it has reached the client:
        here and now when none waits (its errors raised here), else on the
        queue's thread (its errors in the future)."""
        return send() if self._idle() else self.call_later(send)

    def call_later(self, send: Callable[[], Future]) -> Future:
        """:meth:`call` on the queue's thread whatever waits: ``send`` may
        wait for the device (a copy to the host) before it calls the client."""
        out: Future = Future()

        def run() -> None:
            try:
                inner = send()
            except BaseException as exc:  # noqa: BLE001 - the caller's future reports it
                out.set_exception(exc)
                return
            inner.add_done_callback(lambda f: _settle(out, f))

        self.later(run)
        return out


def _settle(out: Future, inner: Future) -> None:
    """``out`` completes as ``inner`` did."""
    exc = inner.exception()
    if exc is not None:
        out.set_exception(exc)
    else:
        out.set_result(inner.result())


def _segments(n: int, block: int, bounds: list[int] | None) -> list[tuple[int, int]]:
    """The element ranges a buffer of ``n`` is chunked in, each on its own
    from its start: a reduce-scatter's shares (``bounds``), else the whole
    buffer. Shares that each start on a chunk boundary of the whole buffer
    are chunked as the whole buffer is: one range then, and one pass of
    the device's kernels instead of one per rank."""
    if bounds is None or all(b % block == 0 for b in bounds[:-1]):
        return [(0, n)] if n else []
    return [(b, e) for b, e in zip(bounds, bounds[1:]) if e > b]


def _slices(start: int, end: int, step: int):
    for at in range(start, end, step):
        yield slice(at, min(end, at + step))


def _passes_of(staged: Staged, start: int, end: int, first: int):
    """(elements, their chunks) of the device passes over elements
    ``start..end``, which begin at chunk ``first`` and lie in one segment:
    whole chunks, about SLICE elements a pass."""
    block = staged.block
    step = block * max(1, SLICE // block)
    for part in _slices(start, end, step):
        c0 = first + (part.start - start) // block
        yield part, slice(c0, c0 + -(-(part.stop - part.start) // block))


def _passes(staged: Staged):
    """The device passes over every segment of a buffer quantized on the device."""
    first = 0
    for start, end in staged.segments:
        yield from _passes_of(staged, start, end, first)
        first += -(-(end - start) // staged.block)


class _Lane:
    """One of a stager's CUDA streams (none on the CPU), the device scratch
    its passes write (a slice of a bucket at a time) and a lock that holds
    one bucket's whole pass on it, so that no other bucket's pass queues
    between its slices and reuses the scratch before the copies queued from
    it have run."""

    def __init__(self, device: torch.device, pool: "BufferPool", cuda: bool):
        self.stream = torch.cuda.Stream(device=device) if cuda else None
        self.scratch = _Scratch(pool)
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def current(self, after=None):
        """This lane's stream as the current one, after the work queued so
        far on stream ``after``, or after event ``after``, where given."""
        with self.lock:
            if self.stream is None:
                yield
                return
            if isinstance(after, torch.cuda.Event):
                self.stream.wait_event(after)
            elif after is not None:
                self.stream.wait_stream(after)
            with torch.cuda.stream(self.stream):
                yield

    def wait(self, what: str) -> None:
        """Wait for the work queued on this lane's stream."""
        if self.stream is not None:
            done = torch.cuda.Event()
            done.record(self.stream)
            wait_event(done, what)


class _Scratch:
    """Device memory for one stream's passes, a slice of a bucket at a
    time, kept for the stager's life: it grows to the largest pass asked
    for. Taken while its stream is the current one, so the memory of a
    smaller one it lets go is handed out again by torch's allocator only
    to work queued on that stream after what still reads it."""

    def __init__(self, pool: BufferPool):
        self.pool = pool
        self.raw: torch.Tensor | None = None

    def views(self, n: int, *dtypes: torch.dtype) -> list[torch.Tensor]:
        """One view of ``n`` elements per dtype, one after another."""
        sizes = [-(-n * d.itemsize // 8) * 8 for d in dtypes]  # each view 8-byte aligned
        if self.raw is None or self.raw.numel() < sum(sizes):
            self.raw = self.pool.take(sum(sizes))
        out, at = [], 0
        for d, size in zip(dtypes, sizes):
            out.append(self.raw[at:at + n * d.itemsize].view(d))
            at += size
        return out


def _chunks_of(staged: Staged, part: slice) -> slice:
    """The chunks that make up elements ``part`` of a buffer quantized on
    the device, which must start and end on chunk boundaries and lie in one
    of its segments (a reduce-scatter's share does)."""
    starts = [at for at, _ in staged._chunks]
    first = bisect.bisect_left(starts, part.start)
    last = bisect.bisect_left(starts, part.stop)  # the chunk after the part's last
    inside = any(start <= part.start and part.stop <= end for start, end in staged.segments)
    if part.start == part.stop:
        return slice(first, first)
    if first == len(starts) or starts[first] != part.start or not inside or \
            staged._chunks[last - 1][0] + staged._chunks[last - 1][1] != part.stop:
        raise ValueError(f"elements {part.start}..{part.stop} of a buffer quantized on the device come back alone "
                         f"only as whole chunks of one of its segments {staged.segments}")
    return slice(first, last)


def copy_to_host(t: torch.Tensor, *, always: bool = False) -> tuple[torch.Tensor, object]:
    """``t`` in host memory, and the CUDA event that says the copy is
    complete (None: it already is). A device tensor goes to pinned memory
    without blocking, on the current stream (the one that wrote it): a
    blocking copy holds the calling thread until the device has run every
    kernel queued before it. A CPU tensor is itself, or with ``always`` a
    copy (its memory is written again before the copy is read)."""
    if not t.is_cuda:
        return (t.clone() if always else t), None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(t.device))
    return host, copied


def wait_event(event, what: str, limit: float = COPY_TIMEOUT) -> None:
    """Wait for a CUDA event, at most ``limit`` seconds (an event's own
    ``synchronize`` waits without one). Polled, from a few microseconds up
    to a fifth of a millisecond apart: a bucket's copy takes milliseconds."""
    if event is None:  # a copy on the CPU, done when it was queued
        return
    deadline = time.monotonic() + limit
    pause = 5e-6
    while not event.query():
        if time.monotonic() > deadline:
            raise AggnetError(f"aggnet: {what} did not finish within {limit:g}s; is the GPU still working "
                              f"(nvidia-smi)?")
        time.sleep(pause)
        pause = min(2 * pause, 2e-4)


def _count_nonfinite(t: torch.Tensor) -> torch.Tensor:
    """NaN/Inf in ``t`` as a 0-d tensor on its device (read later, so the
    count does not wait for the device); on the CPU one pass of aggnet's
    kernel with no temporaries."""
    if t.device.type == "cpu" and t.dtype == torch.float32:
        return torch.tensor(_CPU_KERNELS.block_stats(t.numpy())[1])
    return torch.count_nonzero(~torch.isfinite(t))


def result_nonfinite(staged: Staged) -> int:
    """NaN/Inf in the aggregated result, read in host memory before it goes
    back to the device (no wait for the device)."""
    host = staged.host
    if not host.is_floating_point():
        return 0
    if host.dtype == torch.float32:
        return _CPU_KERNELS.block_stats(host.numpy())[1]
    bits = host.view(torch.int16).numpy().view(np.uint16)
    mask = np.uint16(0x7C00 if host.dtype == torch.float16 else 0x7F80)
    return int(np.count_nonzero((bits & mask) == mask))


