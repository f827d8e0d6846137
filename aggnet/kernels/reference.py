"""NumPy reference kernels: the definition every fast kernel is tested
against. Clear rather than fast; each function matches the API of
:mod:`aggnet.kernels` exactly (see ``KERNEL_API`` there).

Conventions shared by all backends:

* float32 -> int32 quantization multiplies by ``2**shift`` in float64 (exact
  for power-of-two scales, no overflow of the intermediate), rounds half to
  even, and clamps to +-(2**31 - 1) so that a misbehaving peer can never
  produce undefined behaviour; callers pick ``shift`` from the agreed
  exponent so that the clamp is never reached.
* int32 addition wraps modulo 2**32, as a switch's adder does.
* 16-bit floats travel as their uint16 bit patterns; ``fmt`` is ``"f16"``
  (IEEE binary16) or ``"bf16"`` (bfloat16); conversions round to nearest
  even and keep NaN a NaN.
"""

from __future__ import annotations

import numpy as np

INT32_LIMIT = 2**31 - 1
_F32_INF_BITS = 0x7F800000


def block_stats(x: np.ndarray) -> tuple[int, int]:
    """(bit pattern of max |x| as uint32, number of NaN/Inf elements).

    The largest magnitude has the largest bit pattern once the sign bit is
    cleared, so an integer max finds it without a float comparison."""
    if x.size == 0:
        return 0, 0
    bits = x.view(np.uint32) & np.uint32(0x7FFFFFFF)
    nonfinite = int(np.count_nonzero(bits >= _F32_INF_BITS))
    finite = bits[bits < _F32_INF_BITS]
    return (int(finite.max()) if finite.size else 0), nonfinite


def quantize(x: np.ndarray, shift: int, out: np.ndarray, big_endian: bool) -> None:
    scaled = np.rint(x.astype(np.float64) * (2.0 ** shift))
    q = np.clip(scaled, -INT32_LIMIT, INT32_LIMIT).astype(np.int32)
    out[...] = q.byteswap() if big_endian else q


def dequantize(q: np.ndarray, shift: int, out: np.ndarray, big_endian: bool, multiplier: float = 1.0) -> None:
    v = q.byteswap() if big_endian else q
    out[...] = (v.astype(np.float64) * (2.0 ** -shift) * multiplier).astype(np.float32)


def accumulate(acc: np.ndarray, src: np.ndarray, big_endian: bool = False) -> None:
    if big_endian:
        src = src.byteswap()
    if acc.dtype == np.int32:
        acc[...] = (acc.astype(np.int64) + src.astype(np.int64)).astype(np.int32)
    else:
        acc += src


def byteswap32(src: np.ndarray, out: np.ndarray) -> None:
    out[...] = src.byteswap()


def to_half(x: np.ndarray, out: np.ndarray, fmt: str, multiplier: float = 1.0) -> None:
    if multiplier != 1.0:
        x = (x * np.float32(multiplier)).astype(np.float32)
    if fmt == "f16":
        with np.errstate(over="ignore"):  # overflow to Inf is the defined result
            out[...] = x.astype(np.float16).view(np.uint16)
        return
    bits = x.view(np.uint32).astype(np.uint64)
    nan = (bits & 0x7FFFFFFF) > _F32_INF_BITS
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    quiet_nan = (bits >> 16) | 0x40
    out[...] = np.where(nan, quiet_nan, rounded).astype(np.uint16)


def from_half(h: np.ndarray, out: np.ndarray, fmt: str) -> None:
    if fmt == "f16":
        out[...] = h.view(np.float16).astype(np.float32)
    else:
        out[...] = (h.astype(np.uint32) << 16).view(np.float32)


def accumulate_half(acc: np.ndarray, src: np.ndarray, fmt: str) -> None:
    tmp = np.empty(src.shape, np.float32)
    from_half(src, tmp, fmt)
    acc += tmp


def block_exponents(x: np.ndarray, block: int, out: np.ndarray) -> None:
    """Exponent E of every ``block``-element run of ``x`` (the last may be
    shorter): each |x| < 2**E; -150 for all zeros, 32767 for NaN/Inf."""
    for j in range(out.size):
        part = x[j * block:(j + 1) * block]
        bits, nonfinite = block_stats(part)
        if nonfinite:
            out[j] = 32767
        elif bits == 0:
            out[j] = -150
        else:
            out[j] = int(np.frexp(np.array([bits], np.uint32).view(np.float32)[0])[1])
