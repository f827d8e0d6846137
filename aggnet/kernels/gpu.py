"""CuPy kernels: the API of :mod:`aggnet.kernels` on device arrays.

Imported lazily (only when a CuPy array reaches the library), so aggnet runs
without CuPy; the import error names the extra to install. Each kernel is
one fused pass over memory (the largest magnitudes a warp reduction per
block); ``block_stats`` uses CuPy's own reductions. The CUDA source is
:mod:`aggnet.kernels.cuda_source`.
"""

from __future__ import annotations

import numpy as np

from aggnet.kernels.cuda_source import THREADS, VECTOR_SOURCE, blocks_for, chunk_max_geometry

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

_vector = cp.RawModule(code=VECTOR_SOURCE)


def _launch(name: str, n: int, *args) -> None:
    if n == 0:
        return
    _vector.get_function(name)((blocks_for(n),), (THREADS,), args)


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
    best = cp.empty(out.size, cp.uint32)
    chunk_max_bits(x, block, best)
    _launch("aggnet_exponents_of_bits", 4 * best.size, best, out.view(cp.int16), cp.int64(best.size))


# -- the int32 codec chunk by chunk (aggnet.torch.staging's passes) -------------
# Beyond KERNEL_API: a bucket staged from a GPU is quantized with one agreed
# exponent per chunk of ``block`` elements, so these take one float64
# factor per chunk (``2**shift``; ``2**-shift * multiplier`` back) where the
# kernels above take one for the whole call. Each is one pass over memory.

def _contiguous(out) -> None:
    if not out.flags.c_contiguous:
        raise ValueError("aggnet: a chunked int32 kernel writes a contiguous output; pass a contiguous array")


def chunk_max_bits(x, block: int, best) -> None:
    """``best`` (one 32-bit value per chunk of ``block`` elements of
    float32 ``x``) = the bits of each chunk's largest magnitude, NaN and
    Inf above every finite value."""
    n = x.size
    _contiguous(best)
    if n == 0:
        return
    x = cp.ascontiguousarray(x)
    blocks, per, tile, vec = chunk_max_geometry(n, block, _aligned(x))
    if per > 1:
        best.fill(0)  # tiles of a chunk meet by atomicMax
    _vector.get_function("aggnet_chunk_max_bits")(
        (blocks,), (THREADS,),
        (x.view(cp.uint32), best.view(cp.uint32), cp.int64(n), cp.int64(block), cp.int64(per), cp.int64(tile),
         cp.bool_(vec)))


def quantize_chunks(x, factors, block: int, out) -> None:
    """``out`` (int32) = ``rint(x * factor)`` clamped to +-(2**31 - 1),
    each chunk of float32 ``x`` with its float64 ``factors`` entry."""
    _contiguous(out)
    x = cp.ascontiguousarray(x)
    vec = _aligned(x, out)
    _launch("aggnet_quantize_chunks", x.size, x.view(cp.uint32), out.view(cp.uint32), cp.int64(x.size),
            cp.int64(block), cp.ascontiguousarray(factors, cp.float64), cp.bool_(vec))


def dequantize_chunks(q, factors, block: int, out) -> None:
    """``out`` (float32) = each chunk of int32 ``q`` times its float64
    factor, the product rounded once."""
    _contiguous(out)
    q = cp.ascontiguousarray(q)
    vec = _aligned(q, out)
    _launch("aggnet_dequantize_chunks", q.size, q.view(cp.uint32), out.view(cp.uint32), cp.int64(q.size),
            cp.int64(block), cp.ascontiguousarray(factors, cp.float64), cp.bool_(vec))
