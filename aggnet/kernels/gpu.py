"""CuPy kernels: the API of :mod:`aggnet.kernels` on device arrays.

Imported lazily (only when a CuPy array reaches the library), so aggnet runs
without CuPy; the import error names the extra to install. Each kernel is
one fused element-wise pass; reductions use CuPy's own.
"""

from __future__ import annotations

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


def block_stats(x) -> tuple[int, int]:
    if x.size == 0:
        return 0, 0
    bits = x.view(cp.uint32) & cp.uint32(0x7FFFFFFF)
    finite = bits < cp.uint32(0x7F800000)
    nonfinite = int(x.size - int(cp.count_nonzero(finite)))
    best = int(cp.max(cp.where(finite, bits, cp.uint32(0))))
    return best, nonfinite


def quantize(x, shift: int, out, big_endian: bool) -> None:
    _quantize(x, 2.0 ** shift, big_endian, out.view(cp.uint32))


def dequantize(q, shift: int, out, big_endian: bool, multiplier: float = 1.0) -> None:
    _dequantize(q.view(cp.uint32), (2.0 ** -shift) * multiplier, big_endian, out)


def accumulate(acc, src, big_endian: bool = False) -> None:
    if big_endian:
        _acc_be(src.view(cp.uint32), acc.view(cp.uint32))
    elif acc.dtype == cp.int32:
        # unsigned add wraps modulo 2**32 like the switch's adder
        a = acc.view(cp.uint32)
        cp.add(a, src.view(cp.uint32), out=a)
    else:
        cp.add(acc, src, out=acc)


def byteswap32(src, out) -> None:
    _swap(src.view(cp.uint32), out.view(cp.uint32))


def to_half(x, out, fmt: str, multiplier: float = 1.0) -> None:
    if multiplier != 1.0:
        x = x * cp.float32(multiplier)
    if fmt == "f16":
        out.view(cp.float16)[...] = x.astype(cp.float16)
    else:
        _to_bf16(x.view(cp.uint32), out.view(cp.uint16))


def from_half(h, out, fmt: str) -> None:
    if fmt == "f16":
        out[...] = h.view(cp.float16).astype(cp.float32)
    else:
        out.view(cp.uint32)[...] = h.view(cp.uint16).astype(cp.uint32) << 16


def accumulate_half(acc, src, fmt: str) -> None:
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
    _, e = cp.frexp(best.view(cp.float32))
    e = cp.where(best == 0, -150, e)
    out[...] = cp.where(bad, 32767, e).astype(cp.int16)
