"""aggnet's CUDA kernels compute what the CPU kernels compute, bit for bit,
checked without a GPU.

The kernels' own source (:data:`aggnet.kernels.cuda_source.VECTOR_SOURCE`),
launched with the geometry :mod:`aggnet.kernels.gpu` launches it with, is
compiled for the host against an emulation of the CUDA built-ins it uses
(``tests/harness/cuda_emulation``: every thread of the grid run, a warp's
32 threads in lockstep where they shuffle values). That checks what each
kernel computes and how it indexes (tails, chunks of several tiles,
unaligned views, per-chunk factors) on every machine with a C++ compiler;
``./dev gpu-check`` runs the same comparisons on a GPU
(tests/unit/test_kernels.py, tests/unit/test_device_quantize.py).
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from aggnet import kernels
from aggnet.kernels.cuda_source import THREADS, VECTOR_SOURCE, blocks_for, chunk_max_geometry
from aggnet.protocol.wire import EXPONENT_NONFINITE, EXPONENT_ZERO

CPU = kernels.load("cpu")
EMULATION = Path(__file__).resolve().parents[1] / "harness" / "cuda_emulation"

u32p = ctypes.POINTER(ctypes.c_uint32)
u16p = ctypes.POINTER(ctypes.c_uint16)
i16p = ctypes.POINTER(ctypes.c_int16)
f64p = ctypes.POINTER(ctypes.c_double)
I64, F64, B, U = ctypes.c_int64, ctypes.c_double, ctypes.c_bool, ctypes.c_uint32
SIGNATURES = {
    "quantize4": [u32p, u32p, I64, F64, B],
    "dequantize4": [u32p, u32p, I64, F64, B],
    "to_half4": [u32p, u16p, I64, F64, B, B],
    "from_half4": [u16p, u32p, I64, B],
    "add_f32": [u32p, u32p, I64],
    "add_half": [u32p, u16p, I64, B],
    "chunk_max_bits": [u32p, u32p, I64, I64, I64, I64, B],
    "exponents_of_bits": [u32p, i16p, I64],
    "quantize_chunks": [u32p, u32p, I64, I64, f64p, B],
    "dequantize_chunks": [u32p, u32p, I64, I64, f64p, B],
}


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler here to run the CUDA kernels' source on the CPU (apt-get install g++)")
    build = tmp_path_factory.mktemp("cuda-emulated")
    (build / "kernels.cu").write_text(VECTOR_SOURCE)
    so = build / "kernels.so"
    run = subprocess.run([cxx, "-std=c++20", "-O2", "-shared", "-fPIC", "-pthread", f"-I{EMULATION}", f"-I{build}",
                          str(EMULATION / "launchers.cpp"), "-o", str(so)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, f"the kernels' source does not build on the emulation:\n{run.stderr[-4000:]}"
    handle = ctypes.CDLL(str(so))
    for name, args in SIGNATURES.items():
        fn = getattr(handle, f"run_{name}")
        fn.argtypes, fn.restype = [U, U, *args], None
    return handle


def ptr(a: np.ndarray, kind):
    return a.ctypes.data_as(kind)


def aligned(n: int, dtype, offset: int = 0) -> np.ndarray:
    """``n`` values of ``dtype`` starting ``offset`` values past a 16-byte boundary."""
    dtype = np.dtype(dtype)
    raw = np.zeros((n + offset) * dtype.itemsize + 16, np.uint8)
    start = -raw.ctypes.data % 16
    return raw[start:start + (n + offset) * dtype.itemsize].view(dtype)[offset:]


def values(n: int, seed: int = 0) -> np.ndarray:
    """Every case the codecs treat apart: NaN, Inf, zeros, subnormals,
    half overflow, magnitudes over the whole range."""
    rng = np.random.default_rng(seed)
    x = aligned(n, np.float32)
    x[...] = (rng.standard_normal(n) * np.exp2(rng.integers(-60, 60, n))).astype(np.float32)
    x[:14] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-40, 1.2e-38, 7e4, -1e5, 3.4e38, 65504, 65520, 1.5]
    return x


def finite(x: np.ndarray) -> np.ndarray:
    out = aligned(x.size, np.float32)
    out[...] = np.where(np.isfinite(x), x, 0)
    return out


def same_floats(got: np.ndarray, want: np.ndarray) -> None:
    """Bit for bit, NaN payloads aside."""
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


N = 20_011  # four values a thread and a tail


@pytest.mark.parametrize("shift", [0, 7, -3, 40])
@pytest.mark.parametrize("big_endian", [False, True])
def test_quantize_and_dequantize(lib, shift, big_endian):
    x = finite(values(N))
    want = np.empty(N, np.int32)
    CPU.quantize(x, shift, want, big_endian)
    got = aligned(N, np.int32)
    lib.run_quantize4(blocks_for(N), THREADS, ptr(x, u32p), ptr(got, u32p), N, 2.0 ** shift, big_endian)
    np.testing.assert_array_equal(got, want)
    back_want = np.empty(N, np.float32)
    CPU.dequantize(want, shift, back_want, big_endian, 0.5)
    back = aligned(N, np.float32)
    lib.run_dequantize4(blocks_for(N), THREADS, ptr(got, u32p), ptr(back, u32p), N, 2.0 ** -shift * 0.5, big_endian)
    np.testing.assert_array_equal(back.view(np.uint32), back_want.view(np.uint32))


@pytest.mark.parametrize("fmt", ["f16", "bf16"])
@pytest.mark.parametrize("multiplier", [1.0, 1 / 3])
def test_narrowing_and_widening_the_half_formats(lib, fmt, multiplier):
    x = values(N)
    want = np.empty(N, np.uint16)
    CPU.to_half(x, want, fmt, multiplier)
    got = aligned(N, np.uint16)
    lib.run_to_half4(blocks_for(N), THREADS, ptr(x, u32p), ptr(got, u16p), N, float(np.float32(multiplier)),
                     multiplier != 1.0, fmt == "f16")
    wide_want, wide_got = np.empty(N, np.float32), np.empty(N, np.float32)
    CPU.from_half(want, wide_want, fmt)
    CPU.from_half(got, wide_got, fmt)
    same_floats(wide_got, wide_want)
    # every half pattern widens as the CPU widens it
    halves = aligned(1 << 16, np.uint16)
    halves[...] = np.arange(1 << 16, dtype=np.uint16)
    widened = aligned(1 << 16, np.float32)
    lib.run_from_half4(blocks_for(1 << 16), THREADS, ptr(halves, u16p), ptr(widened, u32p), 1 << 16, fmt == "f16")
    want_wide = np.empty(1 << 16, np.float32)
    CPU.from_half(halves, want_wide, fmt)
    same_floats(widened, want_wide)


def test_float32_and_half_sums_keep_subnormals(lib):
    acc0 = finite(values(N, seed=1)) / 3
    src = finite(values(N, seed=2))
    want = acc0.copy()
    CPU.accumulate(want, src)
    got = aligned(N, np.float32)
    got[...] = acc0
    lib.run_add_f32(blocks_for(4 * N), THREADS, ptr(got, u32p), ptr(src, u32p), N)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    for fmt in ("f16", "bf16"):
        h = aligned(N, np.uint16)
        CPU.to_half(src, h, fmt, 1.0)
        want = acc0.copy()
        CPU.accumulate_half(want, h, fmt)
        got[...] = acc0
        lib.run_add_half(blocks_for(4 * N), THREADS, ptr(got, u32p), ptr(h, u16p), N, fmt == "f16")
        same_floats(got, want)


def chunk_exponents(lib, x: np.ndarray, block: int) -> np.ndarray:
    """Each chunk's exponent as :func:`aggnet.kernels.gpu.block_exponents`
    finds it: the largest magnitude's bits, then their exponent."""
    n = x.size
    best = aligned(-(-n // block), np.uint32)
    blocks, per, tile, vec = chunk_max_geometry(n, block, x.ctypes.data % 16 == 0)
    lib.run_chunk_max_bits(blocks, THREADS, ptr(x, u32p), ptr(best, u32p), n, block, per, tile, vec)
    out = aligned(best.size, np.int16)
    lib.run_exponents_of_bits(blocks_for(4 * best.size), THREADS, ptr(best, u32p), ptr(out, i16p), best.size)
    return out


# chunks of one tile and of several (a warp reads 1024 values of a chunk),
# of multiples of 4 (16-byte loads) and not, a short last chunk, and views
# off 16-byte alignment
@pytest.mark.parametrize("n,block,offset", [(1000, 1, 0), (10_007, 64, 0), (10_007, 256, 1), (25_013, 1000, 0),
                                            (25_013, 4096, 0), (25_013, 3001, 0), (20_001, 2048, 3),
                                            (999, 4096, 0)])
def test_chunk_exponents(lib, n, block, offset):
    src = values(n + offset, seed=block)
    x = aligned(n, np.float32, offset)
    x[...] = src[offset:]
    if n > 7 * block:
        x[3 * block:4 * block] = 0.0  # a chunk of zeros
        x[2 * block:3 * block] = 0.0  # one of subnormals
        x[2 * block:2 * block + min(block, 3)] = [1e-45, -2e-45, 3e-40][:min(block, 3)]
        x[5 * block + min(7, block - 1)] = np.nan
        x[6 * block] = -np.inf
    want = np.empty(-(-n // block), np.int16)
    CPU.block_exponents(x, block, want)
    got = chunk_exponents(lib, x, block)
    np.testing.assert_array_equal(got, want)
    if n > 7 * block:
        assert got[3] == EXPONENT_ZERO and got[2] < -126 and got[5] == got[6] == EXPONENT_NONFINITE


@pytest.mark.parametrize("block,offset", [(4096, 0), (3001, 0), (1000, 1)])
@pytest.mark.parametrize("world", [2, 8])
def test_quantize_and_dequantize_chunk_by_chunk(lib, block, offset, world):
    from aggnet.torch import quantize as Q

    pytest.importorskip("torch", reason="the factors come from aggnet.torch.quantize")
    n = 25_013
    x = aligned(n, np.float32, offset)
    x[...] = values(n, seed=world)
    x[:3] = 1.0  # no NaN: those chunks are not sent
    want_e = np.empty(-(-n // block), np.int16)
    CPU.block_exponents(x, block, want_e)
    agreed = (want_e + np.arange(want_e.size) % 3).astype(np.int16)  # larger than this worker's for some
    vec = x.ctypes.data % 16 == 0
    got = aligned(n, np.int32, offset)
    up = np.ascontiguousarray(Q.quantize_factors(agreed, world))
    lib.run_quantize_chunks(blocks_for(n), THREADS, ptr(x, u32p), ptr(got, u32p), n, block, ptr(up, f64p), vec)
    want = np.empty(n, np.int32)
    back_want = np.empty(n, np.float32)
    for i, e in enumerate(agreed):
        part = slice(i * block, (i + 1) * block)
        shift = kernels.quant_shift(int(e), world)
        CPU.quantize(x[part], shift, want[part], False)
        CPU.dequantize(want[part], shift, back_want[part], False, 1 / world)
    np.testing.assert_array_equal(got, want)
    down = np.ascontiguousarray(Q.dequantize_factors(agreed, world, 1 / world))
    back = aligned(n, np.float32, offset)
    lib.run_dequantize_chunks(blocks_for(n), THREADS, ptr(got, u32p), ptr(back, u32p), n, block, ptr(down, f64p),
                              vec)
    np.testing.assert_array_equal(back.view(np.uint32), back_want.view(np.uint32))
