"""The CUDA C source of aggnet's device kernels, as plain text.

Kept apart from :mod:`aggnet.kernels.gpu` (which compiles it with CuPy) so
that it can be compiled without CuPy or a GPU: the test suite compiles it
with NVRTC alone where NVRTC is installed, so a kernel that does not build
fails on any machine, not first on a GPU's.
"""

# Four values per thread and 16-byte loads: one element per thread (an
# ElementwiseKernel) reached about 56% of a device-to-device copy's
# bandwidth on an H100; wide loads and stores over a grid-stride loop reach
# the copy's. Compiled without flushing float32 subnormals, so every result
# equals the CPU kernels' bit for bit.
VECTOR_SOURCE = r"""
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

/* out[i] = op(in[i], i) over n 32-bit values: four a thread with 16-byte
   loads and stores where `vec` (both 16-byte aligned), one otherwise */
template <class Op>
__device__ __forceinline__ void map32(const unsigned int* in, unsigned int* out, long long n, bool vec, Op op) {
    long long n4 = vec ? n / 4 : 0;
    GRID_LOOP(k, n4) {
        uint4 v = reinterpret_cast<const uint4*>(in)[k];
        long long i = 4 * k;
        reinterpret_cast<uint4*>(out)[k] = make_uint4(op(v.x, i), op(v.y, i + 1), op(v.z, i + 2), op(v.w, i + 3));
    }
    GRID_LOOP(k, n - n4 * 4) out[n4 * 4 + k] = op(in[n4 * 4 + k], n4 * 4 + k);
}

/* one scale for every value, or one per chunk of `block` values */
struct Quantize {
    double scale; bool be;
    __device__ unsigned int operator()(unsigned int v, long long) const { return quant1(v, scale, be); }
};
struct Dequantize {
    double factor; bool be;
    __device__ unsigned int operator()(unsigned int v, long long) const { return dequant1(v, factor, be); }
};
struct QuantizeChunks {
    const double* factors; long long block;
    __device__ unsigned int operator()(unsigned int v, long long i) const {
        return quant1(v, factors[i / block], false);
    }
};
struct DequantizeChunks {
    const double* factors; long long block;
    __device__ unsigned int operator()(unsigned int v, long long i) const {
        return dequant1(v, factors[i / block], false);
    }
};

extern "C" __global__ void aggnet_quantize4(const unsigned int* x, unsigned int* out, long long n, double scale,
                                            bool be) {
    map32(x, out, n, true, Quantize{scale, be});
}

extern "C" __global__ void aggnet_dequantize4(const unsigned int* q, unsigned int* out, long long n, double factor,
                                              bool be) {
    map32(q, out, n, true, Dequantize{factor, be});
}

extern "C" __global__ void aggnet_to_half4(const unsigned int* x, unsigned short* out, long long n, double m,
                                           bool scale, bool f16) {
    long long n4 = n / 4;
    GRID_LOOP(k, n4) {
        uint4 v = reinterpret_cast<const uint4*>(x)[k];
        unsigned short a, b, c, d;
        if (f16) {
            a = f16_1(v.x, m, scale); b = f16_1(v.y, m, scale); c = f16_1(v.z, m, scale); d = f16_1(v.w, m, scale);
        } else {
            a = bf16_1(v.x, m, scale); b = bf16_1(v.y, m, scale); c = bf16_1(v.z, m, scale); d = bf16_1(v.w, m, scale);
        }
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

/* ---- the int32 codec chunk by chunk, as the DDP stager runs it: chunk c
   holds elements c * block .. (c + 1) * block - 1 of the pass, each with
   its own factor (aggnet.torch.quantize) ---- */
__device__ __forceinline__ unsigned int umax(unsigned int a, unsigned int b) { return a > b ? a : b; }
__device__ __forceinline__ long long llmin2(long long a, long long b) { return a < b ? a : b; }
#define ABS_BITS 0x7FFFFFFFu

/* Each chunk's largest magnitude as bits (NaN and Inf have the largest
   patterns once the sign is cleared): a warp reads a tile of at most
   `tile` elements of one chunk; `per` tiles make a chunk, combined with
   atomicMax into `best` (zeroed by the caller) when there are several.
   `vec`: block and tile are multiples of 4 and x is 16-byte aligned. */
extern "C" __global__ void aggnet_chunk_max_bits(const unsigned int* x, unsigned int* best, long long n,
                                                 long long block, long long per, long long tile, bool vec) {
    const int lane = threadIdx.x & 31;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    const long long tiles = (n + block - 1) / block * per;
    for (long long w = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); w < tiles; w += warps) {
        const long long c = w / per;
        const long long start = c * block + (w - c * per) * tile;
        const long long end = llmin2(llmin2(start + tile, (c + 1) * block), n);
        if (start >= end) continue;  /* a tile past the short last chunk (the whole warp skips it) */
        unsigned int m = 0;
        long long whole = start;
        if (vec) {
            whole = start + ((end - start) & ~3LL);
            for (long long k = start + 4 * lane; k < whole; k += 128) {
                uint4 v = *reinterpret_cast<const uint4*>(x + k);
                m = umax(m, umax(umax(v.x & ABS_BITS, v.y & ABS_BITS), umax(v.z & ABS_BITS, v.w & ABS_BITS)));
            }
        }
        for (long long k = whole + lane; k < end; k += 32) m = umax(m, x[k] & ABS_BITS);
        for (int s = 16; s > 0; s >>= 1) m = umax(m, __shfl_down_sync(0xFFFFFFFFu, m, s));
        if (lane == 0) {
            if (per == 1) best[c] = m;
            else atomicMax(best + c, m);
        }
    }
}

/* The block exponent of each largest magnitude's bits, as frexp gives it:
   -150 for zero, 32767 for NaN/Inf. */
extern "C" __global__ void aggnet_exponents_of_bits(const unsigned int* best, short* out, long long count) {
    GRID_LOOP(k, count) {
        const unsigned int b = best[k];
        int e;
        if (b >= 0x7F800000u) e = 32767;
        else if (b == 0u) e = -150;
        else if (b < 0x00800000u) e = (32 - __clz(b)) - 149;  /* a subnormal: b units of 2**-149 */
        else e = (int)(b >> 23) - 126;
        out[k] = (short)e;
    }
}

/* rint(x * factor) in float64, clamped to +-(2**31 - 1), with each
   chunk's factor; `vec`: both 16-byte aligned. */
extern "C" __global__ void aggnet_quantize_chunks(const unsigned int* x, unsigned int* out, long long n,
                                                  long long block, const double* factors, bool vec) {
    map32(x, out, n, vec, QuantizeChunks{factors, block});
}

/* float32(q * factor), the product in float64 rounded once, with each
   chunk's factor. */
extern "C" __global__ void aggnet_dequantize_chunks(const unsigned int* q, unsigned int* out, long long n,
                                                    long long block, const double* factors, bool vec) {
    map32(q, out, n, vec, DequantizeChunks{factors, block});
}
"""

#: threads a block of every kernel above
THREADS = 256
#: elements one warp reads of a chunk when finding its largest magnitude
TILE = 1024
_MAX_BLOCKS = 65535 * 8


def blocks_for(n: int) -> int:
    """Blocks a grid-stride kernel over ``n`` values is launched with
    (four values a thread)."""
    return min(max(1, -(-n // (4 * THREADS))), _MAX_BLOCKS)


def chunk_max_geometry(n: int, block: int, aligned: bool) -> tuple[int, int, int, bool]:
    """(blocks, tiles a chunk, elements a tile, 16-byte loads) that
    ``aggnet_chunk_max_bits`` runs with over ``n`` values in chunks of
    ``block``: a warp a tile, so chunks of thousands of values are read by
    several warps at once."""
    tile = min(block, TILE)
    per = -(-block // tile)
    vec = block % 4 == 0 and aligned  # (and so is the tile: 1024 or the block)
    warps = -(-n // block) * per
    return min(max(1, -(-warps // (THREADS // 32))), _MAX_BLOCKS), per, tile, vec


__all__ = ["VECTOR_SOURCE", "THREADS", "TILE", "blocks_for", "chunk_max_geometry"]
