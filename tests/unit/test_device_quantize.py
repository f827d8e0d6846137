"""The int32 codec on a tensor's device (what a GPU bucket is quantized
with) equals aggnet's CPU kernels bit for bit: the exponents, the
quantization with agreed exponents, the dequantization of sums. Run on
CPU tensors through torch's operations, the same functions a GPU without
CuPy runs; on a GPU also through torch's operations there and through
aggnet's CUDA kernels (skipped with a reason where there is none)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the device codec runs torch operations")

from aggnet import kernels  # noqa: E402
from aggnet.errors import AggnetError  # noqa: E402
from aggnet.protocol.wire import EXPONENT_NONFINITE, EXPONENT_ZERO  # noqa: E402
from aggnet.torch import quantize as Q  # noqa: E402

CPU = kernels.load("cpu")


def _cupy_loads() -> bool:
    try:
        kernels.load("gpu")
    except ImportError:
        return False
    return True


def _cupy_ready() -> bool:
    return torch.cuda.is_available() and _cupy_loads()


_NO_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
_NO_CUPY = pytest.mark.skipif(not _cupy_ready(), reason="no CUDA GPU with CuPy on this machine")


@pytest.fixture(params=[pytest.param(("cpu", Q.TorchOps), id="torch-cpu"),
                        pytest.param(("cuda", Q.TorchOps), id="torch-cuda", marks=_NO_GPU),
                        pytest.param(("cuda", "cupy"), id="cupy-cuda", marks=_NO_CUPY)])
def device_ops(request):
    """(device, the implementation of the passes to run there)."""
    device, kind = request.param
    return torch.device(device), (Q.CupyOps(kernels.load("gpu")) if kind == "cupy" else kind())


def _scratch(ops, n: int, dtype: torch.dtype, device) -> torch.Tensor | None:
    return torch.empty(n, dtype=dtype, device=device) if ops.needs_scratch else None


def values(n: int, seed: int = 0) -> np.ndarray:
    """Magnitudes over the whole float32 range, subnormals and both zeros,
    in runs whose largest values differ."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * np.exp2(rng.integers(-60, 60, n))).astype(np.float32)
    x[:12] = [0.0, -0.0, 1e-45, -3e-39, 1.2e-38, 65504, 7e4, -1e5, 3.4e38, 1.5, 0.5, -2.5]
    return x


def block_exponents(x: np.ndarray, block: int) -> np.ndarray:
    out = np.empty(-(-x.size // block), np.int16)
    CPU.block_exponents(x, block, out)
    return out


# blocks of whole tiles and of several (the CUDA kernel's warps read 1024
# elements of a chunk each), of multiples of 4 (16-byte loads) and not,
# with a short last chunk, and a view that starts off 16-byte alignment
@pytest.mark.parametrize("n,block,skip", [(10_000, 1000, 0), (10_007, 1000, 0), (999, 1000, 0), (4096, 1, 0),
                                          (25_013, 4096, 0), (25_013, 3001, 0), (20_001, 2048, 1)])
def test_exponents_found_on_the_device_are_the_kernels(device_ops, n, block, skip):
    device, ops = device_ops
    full = values(n + skip)
    x = full[skip:]
    if n > 6 * block:
        x[3 * block:4 * block] = 0.0  # a chunk of zeros
        x[2 * block:3 * block] = 0.0  # one of subnormals
        x[2 * block + 5: 2 * block + 9] = [1e-45, -2e-45, 3e-40, 0.0]
        x[5 * block + min(7, block - 1)] = np.nan
        x[6 * block] = -np.inf
    on_device = torch.from_numpy(full).to(device)[skip:]  # off alignment there too
    best = ops.chunk_max_bits(on_device, block, torch.empty(ops.bits_for(n, block), dtype=torch.int32, device=device))
    got = Q.exponents_of_bits(best.cpu().numpy())
    np.testing.assert_array_equal(got, block_exponents(x, block))
    if n > 6 * block:
        assert got[3] == EXPONENT_ZERO and got[2] < -126 and got[5] == got[6] == EXPONENT_NONFINITE


@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("multiplier", [1.0, 0.25, 1 / 3])
@pytest.mark.parametrize("block", [4096, 3001])
def test_quantized_and_dequantized_on_the_device_as_the_kernels_do(device_ops, world, multiplier, block):
    device, ops = device_ops
    n = 25_013
    x = values(n, seed=world)
    mine = block_exponents(x, block)
    # the agreed exponents: at least this worker's, larger for some chunks
    agreed = mine + np.arange(mine.size, dtype=np.int16) % 3
    agreed[1] = EXPONENT_ZERO if not np.any(x[block:2 * block]) else agreed[1]
    want_q = np.empty(n, np.int32)
    for i, e in enumerate(agreed):
        part = slice(i * block, (i + 1) * block)
        CPU.quantize(x[part], kernels.quant_shift(int(e), world), want_q[part], False)
    got_q = torch.empty(n, dtype=torch.int32, device=device)
    scratch = _scratch(ops, n, torch.float64, device)
    ops.quantize_chunks(torch.from_numpy(x).to(device), torch.from_numpy(Q.quantize_factors(agreed, world)).to(device),
                        block, got_q, scratch)
    np.testing.assert_array_equal(got_q.cpu().numpy(), want_q)

    sums = (want_q.astype(np.int64) * world).clip(-2**31, 2**31 - 1).astype(np.int32)  # what comes back
    want = np.empty(n, np.float32)
    for i, e in enumerate(agreed):
        part = slice(i * block, (i + 1) * block)
        CPU.dequantize(sums[part], kernels.quant_shift(int(e), world), want[part], False, multiplier)
    got = torch.empty(n, dtype=torch.float32, device=device)
    ops.dequantize_chunks(torch.from_numpy(sums).to(device),
                          torch.from_numpy(Q.dequantize_factors(agreed, world, multiplier)).to(device), block, got,
                          scratch)
    np.testing.assert_array_equal(got.cpu().numpy().view(np.uint32), want.view(np.uint32))


def test_chunks_agreed_non_finite_are_written_finite(device_ops):
    """Their chunks are not sent, but what the device writes for them
    must not be NaN (a zero factor, not an infinite one)."""
    device, ops = device_ops
    agreed = np.array([EXPONENT_NONFINITE, 3], np.int16)
    q = torch.empty(8, dtype=torch.int32, device=device)
    x = torch.tensor([1.0, 2.0, float("nan"), 4.0, 1.0, 2.0, 3.0, 4.0], device=device)
    ops.quantize_chunks(x, torch.from_numpy(Q.quantize_factors(agreed, 2)).to(device), 4, q,
                        _scratch(ops, 8, torch.float64, device))
    assert q[4:].tolist() == [2**26, 2**27, 3 * 2**26, 2**28]  # shift 30 - 3 - 1 (two workers)
    out = torch.empty(8, device=device)
    ops.dequantize_chunks(q, torch.from_numpy(Q.dequantize_factors(agreed, 2)).to(device), 4, out,
                          _scratch(ops, 8, torch.float64, device))
    assert torch.isfinite(out).all() and out[4:].tolist() == [1.0, 2.0, 3.0, 4.0]


def test_the_implementation_is_chosen_by_device(monkeypatch):
    """CPU tensors take torch's operations whatever is asked; CUDA ones
    aggnet's kernels where CuPy loads, and torch's when told; a choice
    that is not one fails with one line naming the choices."""
    assert Q.ops_for("cpu").name == "torch"
    monkeypatch.setenv("AGGNET_DEVICE_KERNELS", "cupy")
    assert Q.ops_for("cpu").name == "torch"
    if not _cupy_loads():
        with pytest.raises(AggnetError, match="AGGNET_DEVICE_KERNELS=cupy, but .*CuPy"):
            Q.ops_for("cuda")
    else:
        assert Q.ops_for("cuda").name == "cupy"
    monkeypatch.setenv("AGGNET_DEVICE_KERNELS", "torch")
    assert Q.ops_for("cuda").name == "torch"
    monkeypatch.setenv("AGGNET_DEVICE_KERNELS", "auto")
    assert Q.ops_for("cuda").name == ("cupy" if _cupy_loads() else "torch")
    monkeypatch.setenv("AGGNET_DEVICE_KERNELS", "triton")
    with pytest.raises(AggnetError, match="must be one of auto, cupy, torch, not 'triton'"):
        Q.ops_for("cuda")


@pytest.mark.parametrize("bounds", [[0, 10_001, 10_001, 25_013], [0, 8192, 16384, 25_013]],
                         ids=["shares-inside-chunks", "shares-on-chunk-boundaries"])
def test_a_reduce_scatter_s_shares_are_quantized_each_from_its_start_as_the_client_chunks_them(bounds):
    """The stager quantizes a reduce-scatter's buffer share by share (an
    empty one among them), each chunked from its own start as
    ``chunking.plan_owned`` cuts it, and one share's sums come back alone."""
    from aggnet.client import chunking
    from aggnet.torch.staging import Stager

    n, block, world = 25_013, 4096, 2
    x = values(n, seed=5)
    stager = Stager(torch.device("cpu"), through_host=True)
    staged = stager.stage(torch.from_numpy(x.copy()), codec="int32", op="avg", world=world, block=block,
                          bounds=bounds)
    chunks = chunking.plan_owned(bounds, block, 1)
    want_exps = np.array([block_exponents(x[c.offset:c.offset + c.count], block)[0] for c in chunks], np.int16)
    np.testing.assert_array_equal(Q.exponents_of_bits(staged._best.numpy()), want_exps)
    agreed = want_exps + 1
    stager._quantize(staged, agreed)
    want_q = np.empty(n, np.int32)
    for c, e in zip(chunks, agreed):
        part = slice(c.offset, c.offset + c.count)
        CPU.quantize(x[part], kernels.quant_shift(int(e), world), want_q[part], False)
    np.testing.assert_array_equal(staged.host.numpy(), want_q)

    # the sums of the last share come back alone, into the output
    staged.host.numpy()[...] = want_q * 2
    last = slice(bounds[2], bounds[3])
    out = torch.empty(last.stop - last.start)
    with pytest.raises(ValueError, match="whole chunks"):
        stager.unstage(staged, slice(last.start + 1, last.stop), out[1:])
    stager.unstage(staged, last, out)
    want = np.empty(last.stop - last.start, np.float32)
    for c, e in zip(chunks, agreed):
        if c.offset >= last.start:
            at = c.offset - last.start
            CPU.dequantize(want_q[c.offset:c.offset + c.count] * 2, kernels.quant_shift(int(e), world),
                           want[at:at + c.count], False, 1 / world)
    np.testing.assert_array_equal(out.numpy().view(np.uint32), want.view(np.uint32))


def test_the_int32_rows_bench_gpu_times_compute_what_the_kernels_do(monkeypatch, device_ops):
    """``aggnet bench-gpu`` times the stager's int32 passes on the GPU; the
    same calls, run here on CPU tensors over several slices, write the
    kernels' exponents, quantization and dequantization bit for bit, and
    the bench's own check finds a wrong value among them."""
    from aggnet.bench import gpu as bench
    from aggnet.torch import staging

    device, ops = device_ops
    monkeypatch.setattr(staging, "SLICE", 2 * bench.INT32_BLOCK)
    n, world = 5 * bench.INT32_BLOCK + 1234, 2
    x = torch.randn(n, generator=torch.Generator().manual_seed(3)).to(device)
    rows, out = bench.int32_staging_rows(torch, x, world, ops)
    assert [name.split()[0] for name, _, _ in rows] == [ops.name] * 3
    for _, call, _ in rows:
        call()
    assert bench.int32_staging_mismatches(torch, x, out, world) == []
    xs = x.cpu().numpy()
    np.testing.assert_array_equal(Q.exponents_of_bits(out["best"].cpu().numpy()),
                                  block_exponents(xs, bench.INT32_BLOCK))
    want_q = np.empty(n, np.int32)
    want = np.empty(n, np.float32)
    for i, e in enumerate(out["agreed"]):
        part = slice(i * bench.INT32_BLOCK, (i + 1) * bench.INT32_BLOCK)
        CPU.quantize(xs[part], kernels.quant_shift(int(e), world), want_q[part], False)
        CPU.dequantize(want_q[part], kernels.quant_shift(int(e), world), want[part], False, 1 / world)
    np.testing.assert_array_equal(out["quantized"].cpu().numpy(), want_q)
    np.testing.assert_array_equal(out["dequantized"].cpu().numpy().view(np.uint32), want.view(np.uint32))
    out["quantized"][n - 1] += 1
    out["best"][0] = 0
    assert bench.int32_staging_mismatches(torch, x, out, world) == ["int32 chunk exponents",
                                                                    "quantize to int32 per chunk"]
