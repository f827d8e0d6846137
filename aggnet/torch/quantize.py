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

These run as a few whole-bucket operations (torch's elementwise kernels on
a GPU, at its memory bandwidth; a 25 MB bucket is a fraction of a
millisecond there against milliseconds over PCIe). The same functions run
on CPU tensors, which is how the test suite checks them against the
kernels bit for bit without a GPU. The scratch they write to is the
caller's, so a bucket allocates nothing after its first step.
"""

from __future__ import annotations

import numpy as np
import torch

from aggnet import kernels
from aggnet.protocol.wire import EXPONENT_NONFINITE

__all__ = ["chunk_max_bits", "exponents_of_bits", "quantize_factors", "dequantize_factors", "quantize_chunks",
           "dequantize_chunks"]

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
