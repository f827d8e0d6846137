"""numba kernels for the CPU: one pass over memory per operation.

Each loop is written so LLVM vectorizes it (no data-dependent branches that
cannot become selects) and runs with the GIL released, so the client's I/O
thread and the caller's training step overlap. Quantize fuses scale, round,
clamp and byteswap; accumulate fuses byteswap and add. The 16-bit float
conversions work on bit patterns because numba has no float16 scalars.
"""

from __future__ import annotations

import numba
import numpy as np

_jit = numba.njit(nogil=True, cache=True, fastmath=False, boundscheck=False)

_ABS_MASK = np.uint32(0x7FFFFFFF)
_INF_BITS = np.uint32(0x7F800000)
_LIMIT = 2147483647.0


@_jit
def _bswap(v):
    v = np.uint32(v)
    return np.uint32(
        ((v & np.uint32(0xFF)) << np.uint32(24))
        | ((v & np.uint32(0xFF00)) << np.uint32(8))
        | ((v >> np.uint32(8)) & np.uint32(0xFF00))
        | (v >> np.uint32(24))
    )


@_jit
def _block_stats(bits):
    # selects, not branches: LLVM vectorizes it (3.6x the branching loop's
    # speed, which ran at a third of a memory copy's); a chunk has fewer
    # than 2**32 elements, so the count fits the lanes' 32 bits
    best = np.uint32(0)
    nonfinite = np.uint32(0)
    for i in range(bits.size):
        a = bits[i] & _ABS_MASK
        bad = a >= _INF_BITS
        nonfinite += np.uint32(bad)
        best = max(best, np.uint32(0) if bad else a)
    return best, nonfinite


def block_stats(x: np.ndarray) -> tuple[int, int]:
    best, nonfinite = _block_stats(x.view(np.uint32))
    return int(best), int(nonfinite)


@_jit
def _quantize(x, scale, out_bits, big_endian):
    for i in range(x.size):
        v = np.rint(np.float64(x[i]) * scale)
        v = min(max(v, -_LIMIT), _LIMIT)
        q = np.uint32(np.int32(v))
        out_bits[i] = _bswap(q) if big_endian else q


def quantize(x: np.ndarray, shift: int, out: np.ndarray, big_endian: bool) -> None:
    _quantize(x, 2.0 ** shift, out.view(np.uint32), big_endian)


@_jit
def _dequantize(q_bits, factor, out, big_endian):
    for i in range(q_bits.size):
        b = _bswap(q_bits[i]) if big_endian else q_bits[i]
        out[i] = np.float32(np.float64(np.int32(b)) * factor)


def dequantize(q: np.ndarray, shift: int, out: np.ndarray, big_endian: bool, multiplier: float = 1.0) -> None:
    _dequantize(q.view(np.uint32), (2.0 ** -shift) * multiplier, out, big_endian)


@_jit
def _accumulate(acc, src):
    for i in range(acc.size):
        acc[i] += src[i]


@_jit
def _accumulate_be_i32(acc_bits, src_bits):
    for i in range(acc_bits.size):
        acc_bits[i] = acc_bits[i] + _bswap(src_bits[i])


def accumulate(acc: np.ndarray, src: np.ndarray, big_endian: bool = False) -> None:
    if big_endian:
        # uint32 addition wraps modulo 2**32 exactly as int32 does in a switch
        _accumulate_be_i32(acc.view(np.uint32), src.view(np.uint32))
    elif acc.dtype == np.int32:
        _accumulate(acc.view(np.uint32), src.view(np.uint32))
    else:
        _accumulate(acc, src)


@_jit
def _byteswap32(src_bits, out_bits):
    for i in range(src_bits.size):
        out_bits[i] = _bswap(src_bits[i])


def byteswap32(src: np.ndarray, out: np.ndarray) -> None:
    _byteswap32(src.view(np.uint32), out.view(np.uint32))


# --- 16-bit floats on bit patterns -------------------------------------------------

_F16_MAX_BITS = np.uint32(143 << 23)  # 2**16: at or above becomes Inf
_F16_MIN_NORMAL_BITS = np.uint32(113 << 23)  # 2**-14
_F16_REBIAS = np.uint32(((15 - 127) << 23) & 0xFFFFFFFF)


@_jit
def _f32_to_f16(xf, xbits, out):
    for i in range(xbits.size):
        u = xbits[i]
        sign = np.uint32((u >> np.uint32(16)) & np.uint32(0x8000))
        a = u & _ABS_MASK
        if a >= _F16_MAX_BITS:
            o = np.uint32(0x7E00) if a > _INF_BITS else np.uint32(0x7C00)
        elif a < _F16_MIN_NORMAL_BITS:
            # subnormal half: the mantissa is |x| * 2**24, rounded to even
            o = np.uint32(np.rint(abs(np.float64(xf[i])) * 16777216.0))
        else:
            odd = (a >> np.uint32(13)) & np.uint32(1)
            o = (a + _F16_REBIAS + np.uint32(0xFFF) + odd) >> np.uint32(13)
        out[i] = np.uint16(o | sign)


# powers of two that turn a 16-bit float's integer significand into its
# value: value = significand * table[exponent field]; exact, including
# subnormals, because float32 holds every such product.
_F16_POW2 = np.array([2.0 ** (max(e, 1) - 25) for e in range(32)], np.float32)
_BF16_POW2 = np.array([2.0 ** (max(e, 1) - 134) for e in range(256)], np.float32)


@_jit
def _f16_value(v):
    e = (v >> np.uint32(10)) & np.uint32(0x1F)
    m = v & np.uint32(0x3FF)
    sig = m | np.uint32(0x400) if e != 0 else m
    val = np.float32(sig) * _F16_POW2[e]
    if e == 31:
        val = np.float32(np.inf) if m == 0 else np.float32(np.nan)
    return -val if v & np.uint32(0x8000) else val


@_jit
def _bf16_value(v):
    e = (v >> np.uint32(7)) & np.uint32(0xFF)
    m = v & np.uint32(0x7F)
    sig = m | np.uint32(0x80) if e != 0 else m
    val = np.float32(sig) * _BF16_POW2[e]
    if e == 255:
        val = np.float32(np.inf) if m == 0 else np.float32(np.nan)
    return -val if v & np.uint32(0x8000) else val


@_jit
def _f16_to_f32(h, out):
    for i in range(h.size):
        out[i] = _f16_value(np.uint32(h[i]))


@_jit
def _accumulate_f16(acc, h):
    for i in range(h.size):
        acc[i] += _f16_value(np.uint32(h[i]))


@_jit
def _f32_to_bf16(xbits, out):
    for i in range(xbits.size):
        u = xbits[i]
        if (u & _ABS_MASK) > _INF_BITS:
            out[i] = np.uint16((u >> np.uint32(16)) | np.uint32(0x40))
        else:
            r = u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
            out[i] = np.uint16(r >> np.uint32(16))


@_jit
def _bf16_to_f32(h, out_bits):
    for i in range(h.size):
        out_bits[i] = np.uint32(h[i]) << np.uint32(16)


@_jit
def _accumulate_bf16(acc, h):
    for i in range(h.size):
        acc[i] += _bf16_value(np.uint32(h[i]))


@_jit
def _to_half_scaled(x, multiplier, out, is_f16):
    # scale a cache-sized block, then convert it: one pass over memory
    block = np.empty(2048, np.float32)
    bits = block.view(np.uint32)
    for start in range(0, x.size, 2048):
        n = min(2048, x.size - start)
        for j in range(n):
            block[j] = np.float32(x[start + j] * multiplier)
        if is_f16:
            _f32_to_f16(block[:n], bits[:n], out[start:start + n])
        else:
            _f32_to_bf16(bits[:n], out[start:start + n])


def to_half(x: np.ndarray, out: np.ndarray, fmt: str, multiplier: float = 1.0) -> None:
    out16 = out.view(np.uint16)
    if multiplier != 1.0:
        _to_half_scaled(x, np.float32(multiplier), out16, fmt == "f16")
    elif fmt == "f16":
        _f32_to_f16(x, x.view(np.uint32), out16)
    else:
        _f32_to_bf16(x.view(np.uint32), out16)


def from_half(h: np.ndarray, out: np.ndarray, fmt: str) -> None:
    if fmt == "f16":
        _f16_to_f32(h.view(np.uint16), out)
    else:
        _bf16_to_f32(h.view(np.uint16), out.view(np.uint32))


def accumulate_half(acc: np.ndarray, src: np.ndarray, fmt: str) -> None:
    if fmt == "f16":
        _accumulate_f16(acc, src.view(np.uint16))
    else:
        _accumulate_bf16(acc, src.view(np.uint16))


@_jit
def _max_abs_bits(bits):
    # NaN and Inf have the largest magnitude bits: one max finds them too,
    # in a loop LLVM vectorizes
    best = np.uint32(0)
    for i in range(bits.size):
        a = bits[i] & _ABS_MASK
        best = max(best, a)
    return best


@_jit
def _block_exponents(bits, block, out):
    n = bits.size
    for j in range(out.size):
        best = _max_abs_bits(bits[j * block:min((j + 1) * block, n)])
        if best >= _INF_BITS:
            out[j] = 32767
        elif best == 0:
            out[j] = -150
        else:
            e = np.int32(best >> np.uint32(23))
            if e == 0:
                # subnormal: 2**-149 * m, frexp exponent -148 + bit length - 1
                m = best
                length = 0
                while m:
                    m >>= np.uint32(1)
                    length += 1
                out[j] = -149 + length
            else:
                out[j] = e - 126


def block_exponents(x: np.ndarray, block: int, out: np.ndarray) -> None:
    _block_exponents(x.view(np.uint32), block, out)
