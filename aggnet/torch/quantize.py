"""The int32 codec's rules as torch operations on a tensor's own device.

A GPU bucket quantized on the host costs the host three passes over it
(the exponents, the quantization, the dequantization of the sums) and
leaves the GPU idle; quantized on the device it costs the host nothing but
the send. The codec's rules are those of :mod:`aggnet.kernels`, to the bit:

* chunk ``i`` holds elements ``i * block ..`` (the client's chunks); its
  exponent ``E`` is that of its largest magnitude (``frexp``), -150 when
  all are zero, 32767 when one is NaN/Inf;
* the workers agree the largest ``E`` of each chunk; each value becomes
  ``rint(x * 2**shift)`` in float64 (``shift = quant_shift(E, world)``),
  clamped to +-(2**31 - 1);
* a sum ``q`` becomes ``float32(q * (2**-shift * multiplier))``.

Two implementations, one chosen by the tensor's device (:func:`ops_for`):

* aggnet's own CUDA kernels (:mod:`aggnet.kernels.gpu`, CuPy), one pass
  over memory each and no scratch, on a CUDA device where CuPy is
  installed;
* torch's operations on the tensor's device otherwise: a few whole-slice
  passes through scratch of the caller's (a float64 product), at the
  device's memory bandwidth on a GPU. The same functions run on CPU
  tensors, which is how the test suite checks them against the CPU
  kernels bit for bit without a GPU; on a GPU, ``./dev gpu-check`` checks
  the CuPy ones against them.

Either way a 25 MB bucket takes a fraction of a millisecond on a GPU
against milliseconds over PCIe. ``AGGNET_DEVICE_KERNELS=torch`` (or
``cupy``, which then must load) chooses instead of ``auto``.
"""

from __future__ import annotations

import contextlib
import functools
import os

import numpy as np
import torch

from aggnet import kernels
from aggnet.errors import AggnetError
from aggnet.protocol.wire import EXPONENT_NONFINITE

__all__ = ["chunk_max_bits", "exponents_of_bits", "quantize_factors", "dequantize_factors", "quantize_chunks",
           "dequantize_chunks", "ops_for", "TorchOps", "CupyOps"]

_ABS_MASK = 0x7FFFFFFF
_CPU = kernels.load("cpu")
_LIMIT = float(2**31 - 1)


def _rows(t: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the whole chunks of flat ``t`` as rows of ``block``, the last short chunk)."""
    whole = t.numel() // block
    return t[: whole * block].view(whole, block), t[whole * block:]


def chunk_max_bits(x: torch.Tensor, block: int, bits: torch.Tensor) -> torch.Tensor:
    """The bit pattern of each chunk's largest magnitude, int32 on ``x``'s
    device. NaN and Inf have the largest patterns once the sign is cleared,
    so one integer max finds them too. ``bits``: int32 scratch of ``x``'s size."""
    torch.bitwise_and(x.view(torch.int32), _ABS_MASK, out=bits)
    whole, tail = _rows(bits, block)
    best = whole.amax(dim=1)
    if tail.numel():
        best = torch.cat([best, tail.amax().view(1)])
    return best


def exponents_of_bits(best: np.ndarray) -> np.ndarray:
    """Each chunk's exponent (int16) from :func:`chunk_max_bits`: a chunk's
    exponent is that of its largest magnitude, so the kernels' own block
    exponents of those values, one value a block, are the chunks'."""
    best = np.ascontiguousarray(best, np.int32)
    out = np.empty(best.size, np.int16)
    _CPU.block_exponents(best.view(np.float32), 1, out)
    return out


def _factors(agreed: np.ndarray, world: int, sign: int, multiplier: float = 1.0) -> np.ndarray:
    agreed = np.asarray(agreed, np.int64)
    # chunks agreed NaN/Inf are not sent: a zero factor keeps what is
    # written for them finite
    bad = agreed == EXPONENT_NONFINITE
    shifts = kernels.quant_shift(0, world) - np.where(bad, 0, agreed)
    return np.where(bad, 0.0, np.ldexp(1.0, sign * shifts) * multiplier)


def quantize_factors(agreed: np.ndarray, world: int) -> np.ndarray:
    """``2**shift`` per chunk, float64."""
    return _factors(agreed, world, 1)


def dequantize_factors(agreed: np.ndarray, world: int, multiplier: float = 1.0) -> np.ndarray:
    """``2**-shift * multiplier`` per chunk, float64 (the product as the
    kernels form it)."""
    return _factors(agreed, world, -1, multiplier)


def quantize_chunks(x: torch.Tensor, factors: torch.Tensor, block: int, out: torch.Tensor,
                    scratch: torch.Tensor) -> None:
    """``out`` (int32) = each chunk of float32 ``x`` times its factor,
    rounded half to even and clamped; ``scratch``: float64 of ``x``'s size,
    ``factors``: float64 per chunk, all on ``x``'s device."""
    for part, s, f in _paired(x, scratch, factors, block):
        torch.mul(part, f, out=s)
    torch.round(scratch, out=scratch)
    scratch.clamp_(-_LIMIT, _LIMIT)
    out.copy_(scratch)


def dequantize_chunks(q: torch.Tensor, factors: torch.Tensor, block: int, out: torch.Tensor,
                      scratch: torch.Tensor) -> None:
    """``out`` (float32) = each chunk of int32 sums ``q`` times its factor
    in float64, rounded once to float32."""
    for part, s, f in _paired(q, scratch, factors, block):
        torch.mul(part, f, out=s)
    out.copy_(scratch)


def _paired(src: torch.Tensor, scratch: torch.Tensor, factors: torch.Tensor, block: int):
    """(part of ``src``, the same part of ``scratch``, its factor shaped to
    multiply it) for the whole chunks and for the short last one."""
    (sw, st), (dw, dt) = _rows(src, block), _rows(scratch, block)
    whole = sw.shape[0]
    yield sw, dw, factors[:whole].view(whole, 1)
    if st.numel():
        yield st, dt, factors[whole]


class TorchOps:
    """The passes as torch operations on the tensor's own device (any
    device), through the caller's scratch."""

    name = "torch"
    #: the caller hands each quantizing pass float64 scratch (``scratch``)
    needs_scratch = True

    @staticmethod
    def bits_for(n: int, block: int) -> int:
        """int32 scratch the exponent pass over ``n`` values takes (``bits``)."""
        return n
    chunk_max_bits = staticmethod(chunk_max_bits)
    quantize_chunks = staticmethod(quantize_chunks)
    dequantize_chunks = staticmethod(dequantize_chunks)


class CupyOps:
    """The passes as aggnet's CUDA kernels, launched on the calling
    thread's current torch stream (one of the stager's streams), on
    the tensors' memory as it is: one pass each and no scratch."""

    name = "cupy"
    needs_scratch = False

    @staticmethod
    def bits_for(n: int, block: int) -> int:
        """int32 scratch the exponent pass over ``n`` values takes: its
        result, one value a chunk."""
        return -(-n // block)

    def __init__(self, gpu):
        import cupy

        self.gpu, self.cupy = gpu, cupy

    @contextlib.contextmanager
    def _on_current_stream(self, device: torch.device):
        stream = torch.cuda.current_stream(device)
        with self.cupy.cuda.Device(device.index), self.cupy.cuda.ExternalStream(stream.cuda_stream, device.index):
            yield self.cupy.asarray

    def chunk_max_bits(self, x: torch.Tensor, block: int, bits: torch.Tensor) -> torch.Tensor:
        best = bits[:self.bits_for(x.numel(), block)]
        if x.numel():
            with self._on_current_stream(x.device) as view:
                self.gpu.chunk_max_bits(view(x), block, view(best))
        return best

    def quantize_chunks(self, x: torch.Tensor, factors: torch.Tensor, block: int, out: torch.Tensor,
                        scratch: torch.Tensor | None = None) -> None:
        if x.numel():
            with self._on_current_stream(x.device) as view:
                self.gpu.quantize_chunks(view(x), view(factors), block, view(out))

    def dequantize_chunks(self, q: torch.Tensor, factors: torch.Tensor, block: int, out: torch.Tensor,
                          scratch: torch.Tensor | None = None) -> None:
        if q.numel():
            with self._on_current_stream(q.device) as view:
                self.gpu.dequantize_chunks(view(q), view(factors), block, view(out))


_CHOICES = ("auto", "cupy", "torch")


@functools.lru_cache(maxsize=None)
def _gpu_kernels():
    """aggnet's CuPy kernel module, or the ImportError that says why not."""
    try:
        return kernels.load("gpu")
    except ImportError as exc:
        return exc


def ops_for(device: torch.device | str) -> TorchOps | CupyOps:
    """The implementation the int32 passes of tensors on ``device`` run:
    aggnet's CUDA kernels on a CUDA device where CuPy is installed, torch's
    operations otherwise; ``AGGNET_DEVICE_KERNELS=torch`` takes torch's on
    CUDA too, ``cupy`` fails with one line where CuPy cannot load."""
    choice = os.environ.get("AGGNET_DEVICE_KERNELS", "auto").strip().lower() or "auto"
    if choice not in _CHOICES:
        raise AggnetError(f"aggnet: AGGNET_DEVICE_KERNELS must be one of {', '.join(_CHOICES)}, not {choice!r}")
    if torch.device(device).type != "cuda" or choice == "torch":
        return TorchOps()  # the CPU's tensors take torch's operations whatever the choice
    gpu = _gpu_kernels()
    if isinstance(gpu, ImportError):
        if choice == "cupy":
            raise AggnetError(f"aggnet: AGGNET_DEVICE_KERNELS=cupy, but {gpu}; install CuPy or use auto")
        return TorchOps()
    return CupyOps(gpu)
