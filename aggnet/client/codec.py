"""How a caller's buffer becomes wire payloads and how results come back.

A :class:`Encoding` is chosen once per all-reduce from the buffer's dtype and
the requested codec:

================  ==========  ================================================
buffer            codec       on the wire
================  ==========  ================================================
float32           ``None``    float32, sent zero-copy from the buffer
                  (``"float32"`` says the same)
float32           ``int32``   int32 quantized with a per-chunk exponent agreed
                              by all workers (MAX), so N * max never overflows
float32           ``fp16``    IEEE half, summed in float32 by the aggregator
float32           ``bf16``    bfloat16, summed in float32 by the aggregator
int32             ``None``    int32 (sums wrap modulo 2**32)
float16/bfloat16  ``None``    the same 16-bit format, summed in float32
int32             ``int32``   int32 its owner quantized (``prequantized``):
                              sent and received as they are; the owner
                              gave each chunk's exponent and dequantizes
================  ==========  ================================================

``avg`` divides by the world size: on decode for 32-bit payloads, before
encoding for 16-bit ones (dividing first keeps fp16 sums from overflowing).

A CuPy buffer (a client over ``ucx://``) is encoded on its device, into
device staging that UCX sends as it is; results arrive in host memory and
are copied to the device once, then decoded there. Each encode and decode
waits for its kernels before it returns: UCX reads device memory on its
own stream, and the caller's future must find the result in place.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from aggnet import kernels
from aggnet.protocol.wire import DType

__all__ = ["CODECS", "OPS", "Encoding", "Quantized"]

CODECS = (None, "float32", "int32", "fp16", "bf16")
OPS = ("sum", "avg")


@dataclass
class Quantized:
    """What the owner of an int32 buffer it quantizes itself (a GPU bucket,
    quantized on its device) gives the client with it.

    The int32 codec's scale is agreed per chunk before any value is
    quantized; the owner cannot quantize until that agreement is in, and
    the client cannot send until the owner has. So the owner gives its
    exponents (``exponents[i]``: chunk ``i`` of ``client.chunk_bytes // 4``
    elements, as ``kernels.block_exponents`` finds them), and the client
    calls ``quantize(agreed, None)`` on its I/O thread once every chunk's
    exponent is agreed (or carried from the last round of the buffer's
    key), then sends the buffer as it is; results are int32 sums, which
    the owner dequantizes with the exponents it was given last.
    ``quantize(agreed, chunks)`` quantizes only the chunks listed again,
    with their new exponents in ``agreed``: chunks whose values outgrew a
    carried exponent go again. ``quantize`` returns with the buffer
    written, or, for the whole buffer (``chunks`` None), may return a
    :class:`concurrent.futures.Future` instead, done once it is written
    (a device's copy to host memory, waited for on a thread of the
    owner's): the client's I/O thread then goes on with other rounds
    meanwhile (their results, their chunks) and sends this one's once
    the future is done; one that fails fails this round only."""

    exponents: np.ndarray
    quantize: Callable[[np.ndarray, list | None], Future | None]
    #: NaN/Inf in the owner's values (named when the agreement refuses them)
    nonfinite: int = 0


def _is_bf16(dtype: np.dtype) -> bool:
    return dtype.name == "bfloat16"


class Encoding:
    """Per-request encode/decode of chunks between buffer and wire."""

    def __init__(self, buf: np.ndarray, codec: str | None, op: str, world: int, wire_hint: DType | None = None,
                 prequantized: bool = False):
        if op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {op!r}")
        if codec not in CODECS:
            raise ValueError(f"codec must be one of {CODECS}, got {codec!r}")
        dt = buf.dtype
        if codec == "float32":  # the wire type named, as AggnetState and ClientConfig name it
            if dt != np.float32:
                raise ValueError(f"codec 'float32' sends a float32 buffer as it is; this buffer is {dt}: "
                                 f"leave codec out to send it as it is")
            codec = None
        self.k = kernels.for_array(buf)
        #: CuPy on the buffer's device; None for host buffers
        self.device = _cupy_of(buf)
        self.world = world
        self.avg = op == "avg"
        self.half_fmt: str | None = None
        self.native_half = False
        self.quantized = False
        self.zero_copy = False
        #: int32 the caller quantized with the agreed exponents (a GPU bucket
        #: quantized on its device): the agreement runs, the bytes go as they are
        self.prequantized = prequantized
        if prequantized:
            if dt != np.int32 or codec != "int32" or self.device is not None:
                raise ValueError("a prequantized buffer is a host int32 array all-reduced with codec='int32'")
            self.wire = DType.INT32
            self.quantized = self.zero_copy = True
        elif wire_hint in (DType.BFLOAT16, DType.FLOAT16) and dt == np.uint16:
            kind = "bf16" if wire_hint == DType.BFLOAT16 else "f16"
            self._native_half(kind)
        elif dt == np.float32:
            if codec is None:
                self.wire = DType.FLOAT32
                self.zero_copy = True
            elif codec == "int32":
                self.wire = DType.INT32
                self.quantized = True
            else:
                self.wire = DType.FLOAT16 if codec == "fp16" else DType.BFLOAT16
                self.half_fmt = "f16" if codec == "fp16" else "bf16"
        elif codec is not None:
            raise ValueError(f"codec {codec!r} compresses float32 buffers; this buffer is {dt}")
        elif dt == np.int32:
            if self.avg:
                raise ValueError("op='avg' needs a floating-point buffer; int32 buffers support op='sum'")
            self.wire = DType.INT32
            self.zero_copy = True
        elif dt == np.float16:
            self._native_half("f16")
        elif _is_bf16(dt):
            self._native_half("bf16")
        else:
            raise ValueError(
                f"aggnet all-reduces float32, int32, float16 and bfloat16 buffers, not {dt}"
            )
        self.multiplier = 1.0 / world if self.avg else 1.0

    def _native_half(self, fmt: str) -> None:
        self.wire = DType.FLOAT16 if fmt == "f16" else DType.BFLOAT16
        self.half_fmt = fmt
        self.native_half = True
        self.zero_copy = not self.avg

    @property
    def wire_itemsize(self) -> int:
        return 2 if self.half_fmt else 4

    @property
    def staging_dtype(self):
        return np.uint16 if self.half_fmt else np.int32

    def new_staging(self, elements: int):
        """A chunk-sized staging buffer (4 bytes an element) where this
        encoding's buffer lives: host memory, or the device's."""
        return (self.device or np).empty(elements, np.int32)

    def encode(self, src, staging, shift: int = 0):
        """The wire payload for chunk ``src``: ``src`` itself when it can go
        zero-copy, else written into ``staging`` (a chunk-sized buffer)."""
        if self.zero_copy:
            return src
        out = staging[: src.size]
        if self.quantized:
            self.k.quantize(src, shift, out, False)
        elif self.native_half:
            # avg on a 16-bit buffer: widen, divide, narrow (divide first so
            # that the float32 sum of fp16 values stays in fp16 range)
            wide = (self.device or np).empty(src.size, np.float32)
            self.k.from_half(src.view(np.uint16), wide, self.half_fmt)
            self.k.to_half(wide, out, self.half_fmt, self.multiplier)
        else:
            self.k.to_half(src, out, self.half_fmt, self.multiplier)
        if self.device is not None:
            self.device.cuda.get_current_stream().synchronize()  # UCX reads it on a stream of its own
        return out

    def encode_into(self, src: np.ndarray, out: np.ndarray, shift: int = 0) -> None:
        """Encode chunk ``src`` into ``out`` (raw bytes, e.g. a shared-memory
        slot), copying where the wire format is the buffer's own."""
        if self.zero_copy:
            np.copyto(out.view(src.dtype), src)
        else:
            self.encode(src, out.view(self.staging_dtype), shift)

    def decode(self, payload, dest, shift: int = 0) -> None:
        """Write a result payload into ``dest`` (the chunk of the caller's
        buffer), undoing the encoding."""
        if self.device is not None:
            self._decode_on_device(payload, dest, shift)
            return
        if self.prequantized:  # the owner dequantizes, with the exponents it was given
            np.copyto(dest, np.frombuffer(payload, np.int32, dest.size))
        elif self.quantized:
            q = np.frombuffer(payload, np.int32, dest.size)
            self.k.dequantize(q, shift, dest, False, self.multiplier)
        elif self.half_fmt:
            h = np.frombuffer(payload, np.uint16, dest.size)
            if dest.dtype == np.float32:
                self.k.from_half(h, dest, self.half_fmt)
            else:
                # native 16-bit buffer: already divided before encoding
                dest.view(np.uint16)[...] = h
        else:
            src = np.frombuffer(payload, dest.dtype, dest.size)
            if self.avg:
                np.multiply(src, np.float32(self.multiplier), out=dest)
            else:
                np.copyto(dest, src)

    def _decode_on_device(self, payload, dest, shift: int) -> None:
        cp = self.device
        wire_dtype = np.int32 if self.quantized else np.uint16 if self.half_fmt else dest.dtype
        if hasattr(payload, "__cuda_array_interface__"):
            got = cp.asarray(payload).view(wire_dtype)[: dest.size]
        else:  # one copy to the device, then the same kernels as on the host
            got = cp.asarray(np.frombuffer(payload, wire_dtype, dest.size))
        if self.quantized:
            self.k.dequantize(got, shift, dest, False, self.multiplier)
        elif self.half_fmt and dest.dtype == np.float32:
            self.k.from_half(got, dest, self.half_fmt)
        elif self.half_fmt:
            dest.view(np.uint16)[...] = got
        elif self.avg:
            cp.multiply(got, dest.dtype.type(self.multiplier), out=dest)
        else:
            dest[...] = got
        cp.cuda.get_current_stream().synchronize()  # the future finds the result in place


def _cupy_of(buf):
    """The CuPy module for a CuPy buffer, else None (no import for host buffers)."""
    if type(buf).__module__.startswith("cupy"):
        import cupy

        return cupy
    return None
