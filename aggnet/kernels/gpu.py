"""CuPy kernels: the API of :mod:`aggnet.kernels` on device arrays.

Imported lazily (only when a CuPy array reaches the library), so aggnet runs
without CuPy; the import error names the extra to install. Each kernel is
one fused element-wise pass; reductions use CuPy's own.
"""

from __future__ import annotations

import numpy as np

try:
    import cupy as cp
except ImportError as exc:  # pragma: no cover - depends on the machine
    raise ImportError(
        "aggnet's GPU kernels need CuPy: install it with `pip install aggnet[gpu]`"
    ) from exc

_bswap = """
__device__ inline unsigned int bswap32(unsigned int v) {
    return (v << 24) | ((v & 0xFF00u) << 8) | ((v >> 8) & 0xFF00u) | (v >> 24);
}
"""

_quantize = cp.ElementwiseKernel(
    "float32 x, float64 scale, bool big_endian",
    "uint32 out",
    """
    double v = rint((double)x * scale);
    v = fmin(fmax(v, -2147483647.0), 2147483647.0);
    unsigned int q = (unsigned int)(int)v;
    out = big_endian ? bswap32(q) : q;
    """,
    "aggnet_quantize",
    preamble=_bswap,
)

_dequantize = cp.ElementwiseKernel(
    "uint32 q, float64 factor, bool big_endian",
    "float32 out",
    """
    unsigned int b = big_endian ? bswap32(q) : q;
    out = (float)((double)(int)b * factor);
    """,
    "aggnet_dequantize",
    preamble=_bswap,
)

_acc_be = cp.ElementwiseKernel(
    "uint32 src", "uint32 acc", "acc = acc + bswap32(src);", "aggnet_acc_be", preamble=_bswap
)
_swap = cp.ElementwiseKernel(
    "uint32 src", "uint32 out", "out = bswap32(src);", "aggnet_bswap", preamble=_bswap
)
_to_bf16 = cp.ElementwiseKernel(
    "uint32 u",
    "uint16 out",
    """
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) out = (unsigned short)((u >> 16) | 0x40u);
    else out = (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    """,
    "aggnet_to_bf16",
)
_acc_bf16 = cp.ElementwiseKernel(
    "uint16 h", "float32 acc", "acc += __uint_as_float(((unsigned int)h) << 16);", "aggnet_acc_bf16"
)
_acc_f16 = cp.ElementwiseKernel(
    "float16 h", "float32 acc", "acc += (float)h;", "aggnet_acc_f16"
)


# -- vectorized kernels: four values per thread and 16-byte loads ---------------
# One element per thread (an ElementwiseKernel) reached about 56% of a
# device-to-device copy's bandwidth on an H100; wide loads and stores over
# a grid-stride loop reach the copy's. Compiled without flushing float32
# subnormals, so every result equals the CPU kernels' bit for bit.

_VECTOR_SOURCE = r"""
#include <cuda_fp16.h>
/* float32 <-> float64 by the bits: exact, subnormals kept. CuPy's kernels
   run with float32 subnormals flushed to zero (seen on an H100), where the
   CPU kernels keep them; every float32 value a kernel reads or writes goes
   through these, so its results equal the CPU's bit for bit. */
__device__ __forceinline__ double f2d(unsigned int u) {
    unsigned int e = (u >> 23) & 0xFFu, m = u & 0x7FFFFFu;
    unsigned long long sign = (unsigned long long)(u >> 31) << 63;
    if (e == 0) return __longlong_as_double(sign | __double_as_longlong((double)m * 0x1p-149));
    unsigned long long de = e == 255u ? 2047ull : (unsigned long long)(e - 127u + 1023u);
    return __longlong_as_double(sign | (de << 52) | ((unsigned long long)m << 29));
}
__device__ __forceinline__ unsigned int d2f(double d) {
    unsigned int sign = (__double_as_longlong(d) < 0) ? 0x80000000u : 0u;
    double a = fabs(d);
    /* below the smallest normal float, the float's bits are the value in
       units of 2**-149, rounded to nearest even (2**23 units: the smallest
       normal's bits) */
    if (a < 0x1p-126) return sign | (unsigned int)__double2ll_rn(a * 0x1p149);
    return __float_as_uint(__double2float_rn(d));
}
__device__ __forceinline__ unsigned int bswap32(unsigned int v) {
    return (v << 24) | ((v & 0xFF00u) << 8) | ((v >> 8) & 0xFF00u) | (v >> 24);
}
__device__ __forceinline__ unsigned int quant1(unsigned int x, double scale, bool be) {
    double v = rint(f2d(x) * scale);
    v = fmin(fmax(v, -2147483647.0), 2147483647.0);
    unsigned int u = (unsigned int)(int)v;
    return be ? bswap32(u) : u;
}
__device__ __forceinline__ unsigned int dequant1(unsigned int b, double factor, bool be) {
    b = be ? bswap32(b) : b;
    return d2f((double)(int)b * factor);
}
__device__ __forceinline__ unsigned int scaled(unsigned int x, double m, bool scale) {
    return scale ? d2f(f2d(x) * m) : x;  /* the float product, rounded once */
}
__device__ __forceinline__ unsigned short bf16_1(unsigned int x, double m, bool scale) {
    unsigned int u = scaled(x, m, scale);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (unsigned short)((u >> 16) | 0x40u);
    return (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ unsigned short f16_1(unsigned int x, double m, bool scale) {
    /* a float32 subnormal is below half's range: it rounds to a signed zero
       whether or not the conversion flushes it */
    return __half_as_ushort(__float2half_rn(__uint_as_float(scaled(x, m, scale))));
}
#define GRID_LOOP(k, n) for (long long k = blockIdx.x * (long long)blockDim.x + threadIdx.x; k < (n); \
                             k += (long long)gridDim.x * blockDim.x)

extern "C" __global__ void aggnet_quantize4(const unsigned int* x, unsigned int* out, long long n, double scale,
                                            bool be) {
    long long n4 = n / 4;
    GRID_LOOP(k, n4) {
        uint4 v = reinterpret_cast<const uint4*>(x)[k];
        reinterpret_cast<uint4*>(out)[k] = make_uint4(quant1(v.x, scale, be), quant1(v.y, scale, be),
                                                      quant1(v.z, scale, be), quant1(v.w, scale, be));
    }
    GRID_LOOP(k, n - n4 * 4) out[n4 * 4 + k] = quant1(x[n4 * 4 + k], scale, be);
}

extern "C" __global__ void aggnet_dequantize4(const unsigned int* q, unsigned int* out, long long n, double factor,
                                              bool be) {
    long long n4 = n / 4;
    GRID_LOOP(k, n4) {
        uint4 v = reinterpret_cast<const uint4*>(q)[k];
        reinterpret_cast<uint4*>(out)[k] = make_uint4(dequant1(v.x, factor, be), dequant1(v.y, factor, be),
                                                      dequant1(v.z, factor, be), dequant1(v.w, factor, be));
    }
    GRID_LOOP(k, n - n4 * 4) out[n4 * 4 + k] = dequant1(q[n4 * 4 + k], factor, be);
}

extern "C" __global__ void aggnet_to_half4(const unsigned int* x, unsigned short* out, long long n, double m,
                                           bool scale, bool f16) {
    long long n4 = n / 4;
    GRID_LOOP(k, n4) {
        uint4 v = reinterpret_cast<const uint4*>(x)[k];
        unsigned short a, b, c, d;
        if (f16) { a = f16_1(v.x, m, scale); b = f16_1(v.y, m, scale); c = f16_1(v.z, m, scale); d = f16_1(v.w, m, scale); }
        else { a = bf16_1(v.x, m, scale); b = bf16_1(v.y, m, scale); c = bf16_1(v.z, m, scale); d = bf16_1(v.w, m, scale); }
        reinterpret_cast<uint2*>(out)[k] = make_uint2(a | ((unsigned int)b << 16), c | ((unsigned int)d << 16));
    }
    GRID_LOOP(k, n - n4 * 4) {
        unsigned int v = x[n4 * 4 + k];
        out[n4 * 4 + k] = f16 ? f16_1(v, m, scale) : bf16_1(v, m, scale);
    }
}

__device__ __forceinline__ unsigned int widen1(unsigned short h, bool f16) {
    /* a half subnormal is a normal float32: nothing to flush */
    return f16 ? __float_as_uint(__half2float(__ushort_as_half(h))) : (unsigned int)h << 16;
}

extern "C" __global__ void aggnet_from_half4(const unsigned short* h, unsigned int* out, long long n, bool f16) {
    long long n4 = n / 4;
    GRID_LOOP(k, n4) {
        uint2 v = reinterpret_cast<const uint2*>(h)[k];
        reinterpret_cast<uint4*>(out)[k] = make_uint4(widen1(v.x & 0xFFFFu, f16), widen1(v.x >> 16, f16),
                                                      widen1(v.y & 0xFFFFu, f16), widen1(v.y >> 16, f16));
    }
    GRID_LOOP(k, n - n4 * 4) out[n4 * 4 + k] = widen1(h[n4 * 4 + k], f16);
}

extern "C" __global__ void aggnet_add_f32(unsigned int* acc, const unsigned int* src, long long n) {
    /* exact in double, rounded once (innocuous double rounding for a sum) */
    GRID_LOOP(k, n) acc[k] = d2f(f2d(acc[k]) + f2d(src[k]));
}

extern "C" __global__ void aggnet_add_half(unsigned int* acc, const unsigned short* src, long long n, bool f16) {
    GRID_LOOP(k, n) acc[k] = d2f(f2d(acc[k]) + f2d(widen1(src[k], f16)));
}
"""

_vector = cp.RawModule(code=_VECTOR_SOURCE)
_THREADS = 256


def _launch(name: str, n: int, *args) -> None:
    if n == 0:
        return
    blocks = min(max(1, -(-n // (4 * _THREADS))), 65535 * 8)
    _vector.get_function(name)((blocks,), (_THREADS,), args)


def _aligned(*arrays) -> bool:
    """Contiguous, 16-byte aligned: what the wide loads need (views at
    other offsets take the one-value-per-thread kernels)."""
    return all(a.flags.c_contiguous and a.data.ptr % 16 == 0 for a in arrays)


def block_stats(x) -> tuple[int, int]:
    if x.size == 0:
        return 0, 0
    bits = x.view(cp.uint32) & cp.uint32(0x7FFFFFFF)
    finite = bits < cp.uint32(0x7F800000)
    nonfinite = int(x.size - int(cp.count_nonzero(finite)))
    best = int(cp.max(cp.where(finite, bits, cp.uint32(0))))
    return best, nonfinite


def quantize(x, shift: int, out, big_endian: bool) -> None:
    if _aligned(x, out) and -1000 < shift < 1000:
        _launch("aggnet_quantize4", x.size, x.view(cp.uint32), out.view(cp.uint32), cp.int64(x.size),
                cp.float64(2.0 ** shift), cp.bool_(big_endian))
        return
    _quantize(x, 2.0 ** shift, big_endian, out.view(cp.uint32))


def dequantize(q, shift: int, out, big_endian: bool, multiplier: float = 1.0) -> None:
    factor = (2.0 ** -shift) * multiplier
    if _aligned(q, out):
        _launch("aggnet_dequantize4", out.size, q.view(cp.uint32), out.view(cp.uint32), cp.int64(out.size),
                cp.float64(factor),
                cp.bool_(big_endian))
        return
    _dequantize(q.view(cp.uint32), factor, big_endian, out)


def accumulate(acc, src, big_endian: bool = False) -> None:
    if big_endian:
        _acc_be(src.view(cp.uint32), acc.view(cp.uint32))
    elif acc.dtype == cp.int32:
        # unsigned add wraps modulo 2**32 like the switch's adder
        a = acc.view(cp.uint32)
        cp.add(a, src.view(cp.uint32), out=a)
    elif acc.dtype == cp.float32 and acc.flags.c_contiguous and src.flags.c_contiguous:
        # CuPy's own add flushes float32 subnormals to zero; the CPU's keeps them
        _launch("aggnet_add_f32", acc.size * 4, acc.view(cp.uint32), src.view(cp.uint32), cp.int64(acc.size))
    else:
        cp.add(acc, src, out=acc)


def byteswap32(src, out) -> None:
    _swap(src.view(cp.uint32), out.view(cp.uint32))


def to_half(x, out, fmt: str, multiplier: float = 1.0) -> None:
    if _aligned(x, out):
        _launch("aggnet_to_half4", x.size, x.view(cp.uint32), out.view(cp.uint16), cp.int64(x.size),
                cp.float64(np.float32(multiplier)),
                cp.bool_(multiplier != 1.0), cp.bool_(fmt == "f16"))
        return
    if multiplier != 1.0:
        x = x * cp.float32(multiplier)
    if fmt == "f16":
        out.view(cp.float16)[...] = x.astype(cp.float16)
    else:
        _to_bf16(x.view(cp.uint32), out.view(cp.uint16))


def from_half(h, out, fmt: str) -> None:
    if _aligned(h, out):
        _launch("aggnet_from_half4", out.size, h.view(cp.uint16), out.view(cp.uint32), cp.int64(out.size),
                cp.bool_(fmt == "f16"))
        return
    if fmt == "f16":
        out[...] = h.view(cp.float16).astype(cp.float32)
    else:
        out.view(cp.uint32)[...] = h.view(cp.uint16).astype(cp.uint32) << 16


def accumulate_half(acc, src, fmt: str) -> None:
    if acc.flags.c_contiguous and src.flags.c_contiguous:
        _launch("aggnet_add_half", acc.size * 4, acc.view(cp.uint32), src.view(cp.uint16), cp.int64(acc.size),
                cp.bool_(fmt == "f16"))
        return
    if fmt == "f16":
        _acc_f16(src.view(cp.float16), acc)
    else:
        _acc_bf16(src.view(cp.uint16), acc)


def block_exponents(x, block: int, out) -> None:
    n = x.size
    blocks = out.size
    padded = cp.zeros(blocks * block, cp.uint32)
    padded[:n] = x.view(cp.uint32) & cp.uint32(0x7FFFFFFF)
    rows = padded.reshape(blocks, block)
    bad = (rows >= cp.uint32(0x7F800000)).any(axis=1)
    best = cp.where(rows >= cp.uint32(0x7F800000), cp.uint32(0), rows).max(axis=1)
    # the exponent from the bits, in float64: a float32 subnormal read as
    # float32 would be flushed to zero here
    subnormal = best < cp.uint32(0x00800000)
    value = cp.where(subnormal, best.astype(cp.float64) * 2.0 ** -149, best.view(cp.float32).astype(cp.float64))
    _, e = cp.frexp(value)
    e = cp.where(best == 0, -150, e)
    out[...] = cp.where(bad, 32767, e).astype(cp.int16)
