"""Every kernel backend against the NumPy reference, edge cases included."""

import math

import numpy as np
import pytest

from aggnet import kernels
from aggnet.kernels import reference as ref
from aggnet.protocol.wire import EXPONENT_NONFINITE, EXPONENT_ZERO

F32 = np.finfo(np.float32)


def _gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


BACKENDS = [
    "cpu",
    pytest.param("gpu", marks=pytest.mark.skipif(not _gpu_available(), reason="no CUDA GPU with CuPy on this machine")),
]


class Dev:
    """Moves arrays to and from the backend under test."""

    def __init__(self, name):
        self.name = name
        self.k = kernels.load(name)
        if name == "gpu":
            import cupy

            self.xp = cupy
        else:
            self.xp = np

    def put(self, a):
        return self.xp.asarray(a)

    def get(self, a):
        return a.get() if self.name == "gpu" else a

    def empty(self, n, dtype):
        return self.xp.empty(n, dtype)


@pytest.fixture(params=BACKENDS)
def dev(request):
    return Dev(request.param)


def edge_floats(n_random=5001, seed=0):
    rng = np.random.default_rng(seed)
    special = np.array(
        [0.0, -0.0, 1.0, -1.0, 0.5, 1.5, 2.5, -2.5, F32.max, -F32.max, F32.tiny, -F32.tiny,
         F32.smallest_subnormal, -F32.smallest_subnormal, 3 * F32.smallest_subnormal,
         65504.0, 65519.0, 65520.0, 6.1e-5, 5.96e-8, 2.98e-8, 1e-40, 3.3895314e38, 1e-3, 0.1],
        dtype=np.float32,
    )
    mags = rng.standard_normal(n_random).astype(np.float32) * np.float32(2.0) ** rng.integers(-30, 30, n_random).astype(np.float32)
    return np.concatenate([special, mags]).astype(np.float32)


LENGTHS = [0, 1, 7, 1000, 4099]


def test_every_backend_exports_the_api():
    for name in ("reference", "cpu"):
        mod = kernels.load(name)
        assert all(callable(getattr(mod, f)) for f in kernels.KERNEL_API)
    with pytest.raises(ValueError, match="known: reference, cpu, gpu"):
        kernels.load("fpga")


@pytest.mark.parametrize("n", LENGTHS)
def test_block_stats(dev, n):
    x = edge_floats()[:n].copy()
    assert dev.k.block_stats(dev.put(x)) == ref.block_stats(x)
    if n:
        x[n // 2] = np.nan
        x[0] = -np.inf
        assert dev.k.block_stats(dev.put(x)) == ref.block_stats(x)
        assert ref.block_stats(x)[1] == (2 if n > 1 else 1)
        # every value non-finite: each counted, no finite maximum
        x[::2], x[1::2] = np.nan, -np.inf
        assert dev.k.block_stats(dev.put(x)) == ref.block_stats(x) == (0, n)


def test_exponent_of_bounds_every_value():
    x = edge_floats()
    for v in x:
        bits, nonfinite = ref.block_stats(np.array([v], np.float32))
        e = kernels.exponent_of(bits, nonfinite)
        if v == 0:
            assert e == EXPONENT_ZERO
        else:
            assert abs(float(v)) < 2.0 ** e <= 2 * abs(float(v))
    assert kernels.exponent_of(0, 3) == EXPONENT_NONFINITE


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("big_endian", [False, True])
@pytest.mark.parametrize("world", [1, 3, 32])
def test_quantize_dequantize_match_reference(dev, n, big_endian, world):
    x = edge_floats()[:n].copy()
    # a small-valued block, where the shift is large, and a full-range one
    for block in (x, x * np.float32(1e-30)):
        e = kernels.exponent_of(*ref.block_stats(block))
        shift = kernels.quant_shift(e, world)
        want = np.empty(n, np.int32)
        ref.quantize(block, shift, want, big_endian)
        got = dev.empty(n, np.int32)
        dev.k.quantize(dev.put(block), shift, got, big_endian)
        np.testing.assert_array_equal(dev.get(got), want)
        # the sum of `world` copies of the largest value stays within int32
        native = want.byteswap() if big_endian else want
        assert np.all(np.abs(native.astype(np.int64)) * world < 2**31)
        back_want = np.empty(n, np.float32)
        ref.dequantize(want, shift, back_want, big_endian, 0.5)
        back = dev.empty(n, np.float32)
        dev.k.dequantize(dev.put(want), shift, back, big_endian, 0.5)
        np.testing.assert_array_equal(dev.get(back), back_want)
        # round trip error is at most half a quantization step
        ref.dequantize(want, shift, back_want, big_endian, 1.0)
        step = 2.0 ** -shift
        assert np.all(np.abs(back_want.astype(np.float64) - block.astype(np.float64)) <= 0.5 * step + np.abs(block) * 2**-23)


def test_quantize_clamps_instead_of_overflowing(dev):
    x = np.array([1.0, -1.0, 3.0], np.float32)
    got = dev.empty(3, np.int32)
    dev.k.quantize(dev.put(x), 40, got, False)
    np.testing.assert_array_equal(dev.get(got), [2**31 - 1, -(2**31 - 1), 2**31 - 1])


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_accumulate(dev, n, dtype):
    rng = np.random.default_rng(n)
    if dtype == np.int32:
        a = rng.integers(-(2**31), 2**31, n, dtype=np.int64).astype(np.int32)
        b = rng.integers(-(2**31), 2**31, n, dtype=np.int64).astype(np.int32)
        if n:
            a[0], b[0] = 2**31 - 1, 1  # wraps, as a switch adder does
    else:
        a, b = edge_floats()[:n] / 4, edge_floats(seed=1)[:n] / 4
    want = a.copy()
    ref.accumulate(want, b)
    got = dev.put(a.copy())
    dev.k.accumulate(got, dev.put(b))
    np.testing.assert_array_equal(dev.get(got), want)
    if dtype == np.int32 and n:
        assert want[0] == -(2**31)
        # big-endian source, native accumulator
        got = dev.put(a.copy())
        dev.k.accumulate(got, dev.put(b.byteswap()), big_endian=True)
        np.testing.assert_array_equal(dev.get(got), want)


@pytest.mark.parametrize("n", LENGTHS)
def test_byteswap32(dev, n):
    a = np.arange(n, dtype=np.int32) * 16777259 - 7
    out = dev.empty(n, np.int32)
    dev.k.byteswap32(dev.put(a), out)
    np.testing.assert_array_equal(dev.get(out), a.byteswap())


def all_halves():
    return np.arange(2**16, dtype=np.uint32).astype(np.uint16)


@pytest.mark.parametrize("fmt", ["f16", "bf16"])
def test_half_unpack_every_bit_pattern(dev, fmt):
    h = all_halves()
    want = np.empty(h.size, np.float32)
    ref.from_half(h, want, fmt)
    got = dev.empty(h.size, np.float32)
    dev.k.from_half(dev.put(h), got, fmt)
    got = dev.get(got)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    # signs of zeros survive
    np.testing.assert_array_equal(np.signbit(got[~nan]), np.signbit(want[~nan]))


@pytest.mark.parametrize("fmt", ["f16", "bf16"])
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("multiplier", [1.0, 0.25, 1 / 3])
def test_half_pack(dev, fmt, n, multiplier):
    x = edge_floats()[:n].copy()
    if n > 3:
        x[1], x[2], x[3] = np.nan, np.inf, -np.inf
    want = np.empty(n, np.uint16)
    ref.to_half(x, want, fmt, multiplier)
    got = dev.empty(n, np.uint16)
    dev.k.to_half(dev.put(x), got, fmt, multiplier)
    got = dev.get(got)
    back_w, back_g = np.empty(n, np.float32), np.empty(n, np.float32)
    ref.from_half(want, back_w, fmt)
    ref.from_half(got, back_g, fmt)
    nan = np.isnan(back_w)
    assert np.array_equal(np.isnan(back_g), nan)
    np.testing.assert_array_equal(got[~nan], want[~nan])


def test_f16_pack_rounds_every_tie_to_even():
    # midpoints between all adjacent finite halves, and just off them
    h = np.arange(0, 0x7BFF, dtype=np.uint16)
    lo = h.view(np.float16).astype(np.float64)
    hi = (h + 1).view(np.float16).astype(np.float64)
    mid = ((lo + hi) / 2).astype(np.float32)
    k = kernels.load("cpu")
    got = np.empty(mid.size, np.uint16)
    k.to_half(mid, got, "f16")
    np.testing.assert_array_equal(got, mid.astype(np.float16).view(np.uint16))


def test_bf16_matches_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes gives an independent bfloat16 reference")
    x = edge_floats(100000)
    want = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    got = np.empty(x.size, np.uint16)
    kernels.load("cpu").to_half(x, got, "bf16")
    np.testing.assert_array_equal(got, want)
    back = np.empty(x.size, np.float32)
    kernels.load("cpu").from_half(got, back, "bf16")
    np.testing.assert_array_equal(back, want.view(ml_dtypes.bfloat16).astype(np.float32))


@pytest.mark.parametrize("fmt", ["f16", "bf16"])
@pytest.mark.parametrize("n", LENGTHS)
def test_accumulate_half_in_float32(dev, fmt, n):
    h = all_halves()[::13][:n]
    h = np.where(np.isfinite(_vals(h, fmt)), h, 0).astype(np.uint16)
    acc0 = edge_floats()[:n].copy() / 3
    want = acc0.copy()
    ref.accumulate_half(want, h, fmt)
    got = dev.put(acc0.copy())
    dev.k.accumulate_half(got, dev.put(h), fmt)
    np.testing.assert_array_equal(dev.get(got), want)


def _vals(h, fmt):
    out = np.empty(h.size, np.float32)
    ref.from_half(h, out, fmt)
    return out


def test_quant_shift_rejects_bad_world():
    with pytest.raises(ValueError, match="world size must be >= 1, got 0"):
        kernels.quant_shift(0, 0)
    assert kernels.quant_shift(0, 1) == 30
    assert kernels.quant_shift(0, 2) == 29
    assert kernels.quant_shift(0, 4) == 28
    assert kernels.quant_shift(0, 5) == 27
    assert math.isclose(2.0 ** kernels.quant_shift(-3, 32), 2.0 ** (30 + 3 - 5))


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("block", [1, 64, 1000])
def test_block_exponents(dev, n, block):
    x = edge_floats()[:n].copy()
    if n > 70:
        x[65] = np.nan
    blocks = -(-n // block)
    want = np.empty(blocks, np.int16)
    ref.block_exponents(x, block, want)
    got = dev.empty(blocks, np.int16)
    dev.k.block_exponents(dev.put(x), block, got)
    np.testing.assert_array_equal(dev.get(got), want)
    for j in range(blocks):
        part = x[j * block:(j + 1) * block]
        bits, bad = ref.block_stats(part)
        assert want[j] == kernels.exponent_of(bits, bad)
