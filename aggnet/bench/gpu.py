"""``aggnet bench-gpu``: the device-side codec's kernels beside a
device-to-device copy of the same bytes, in one run.

A kernel that reads and writes memory once can go no faster than a copy
of the same bytes on the same GPU; the figure that matters is each
kernel's bandwidth (bytes read plus written, per second) as a fraction of
the copy's. Each kernel's output is also checked bit for bit against
aggnet's CPU kernels on a sample that holds NaN, Inf, subnormals and
values that overflow the half formats, so a fast kernel is also a right
one.

Kernels: the CuPy ones of :mod:`aggnet.kernels.gpu` where CuPy is
installed (int32 quantize and dequantize, native and big-endian for the
switch; fp16/bf16 narrowing and widening; the block-exponent pass; and
the int32 codec chunk by chunk as the DDP hook's staging runs it there:
each chunk's largest magnitude, quantization and dequantization with a
factor per chunk), and the torch operations the staging runs on the
device (:mod:`aggnet.torch.staging`: narrowing, with and without the
average's multiply, the NaN/Inf count, and the same int32 passes where
CuPy is not installed), a slice at a time as the stager runs them.
"""

from __future__ import annotations

import json
import time

import numpy as np

from aggnet.bench.cpu import own_cpu_seconds
from aggnet.client.config import parse_size


def add_arguments(p) -> None:
    p.add_argument("--size", default="256MiB", help="float32 buffer size (default %(default)s)")
    p.add_argument("--reps", type=int, default=20, help="timed repetitions per kernel (default %(default)s)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the records here")


def _time(torch, fn, reps: int) -> float:
    """Seconds per call on the device (CUDA events, after two warm-ups)."""
    fn()
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def sample_values(n: int = 1 << 20, seed: int = 0) -> np.ndarray:
    """float32 values across every case the codecs treat apart."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * np.exp2(rng.integers(-30, 30, n))).astype(np.float32)
    specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-40, 7e4, -1e5, 3.4e38, 65504, 65520],
                        np.float32)
    x[: specials.size] = specials
    return x


def _check_against_cpu(cp, g, cpu) -> list[str]:
    """Names of the CuPy kernels whose output differs from the CPU
    kernels' on :func:`sample_values` (NaN payloads compared as NaN)."""
    x = sample_values()
    finite = x.copy()
    finite[~np.isfinite(finite)] = 0
    bad = []
    for shift in (0, 7, -3):
        for big in (False, True):
            want = np.empty(x.size, np.int32)
            cpu.quantize(finite, shift, want, big)
            got = cp.empty(x.size, cp.int32)
            g.quantize(cp.asarray(finite), shift, got, big)
            if not np.array_equal(cp.asnumpy(got), want):
                bad.append(f"quantize shift {shift} big_endian {big}")
            back = np.empty(x.size, np.float32)
            cpu.dequantize(want, shift, back, big, 0.5)
            got_back = cp.empty(x.size, cp.float32)
            g.dequantize(cp.asarray(want), shift, got_back, big, 0.5)
            if not np.array_equal(cp.asnumpy(got_back), back):
                bad.append(f"dequantize shift {shift} big_endian {big}")
    for fmt in ("f16", "bf16"):
        for mult in (1.0, 1 / 3):
            want = np.empty(x.size, np.uint16)
            cpu.to_half(x, want, fmt, mult)
            got = cp.empty(x.size, cp.uint16)
            g.to_half(cp.asarray(x), got, fmt, mult)
            got = cp.asnumpy(got)
            wide_w, wide_g = np.empty(x.size, np.float32), np.empty(x.size, np.float32)
            cpu.from_half(want, wide_w, fmt)
            cpu.from_half(got, wide_g, fmt)
            if not np.array_equal(wide_w, wide_g, equal_nan=True):
                bad.append(f"to_half {fmt} x{mult:.3g}")
    exps_w = np.empty(-(-x.size // 256), np.int16)
    cpu.block_exponents(x, 256, exps_w)
    exps_g = cp.empty(exps_w.size, cp.int16)
    g.block_exponents(cp.asarray(x), 256, exps_g)
    if not np.array_equal(cp.asnumpy(exps_g), exps_w):
        bad.append("block_exponents")
    return bad


def _cupy_kernels(torch, n: int, reps: int) -> tuple[list[dict], list[str]]:
    try:
        import cupy as cp
    except ImportError:
        return [], []
    from aggnet import kernels

    g, cpu = kernels.load("gpu"), kernels.load("cpu")
    x = cp.random.standard_normal(n, dtype=cp.float32)
    q = cp.empty(n, cp.int32)
    h = cp.empty(n, cp.uint16)
    y = cp.empty(n, cp.float32)
    e = cp.empty(-(-n // 256), cp.int16)
    rows = [
        ("cupy quantize int32", lambda: g.quantize(x, 20, q, False), 8),
        ("cupy quantize int32 big-endian", lambda: g.quantize(x, 20, q, True), 8),
        ("cupy dequantize int32", lambda: g.dequantize(q, 20, y, False, 0.5), 8),
        ("cupy to bf16", lambda: g.to_half(x, h, "bf16"), 6),
        ("cupy to fp16", lambda: g.to_half(x, h, "f16"), 6),
        ("cupy from bf16", lambda: g.from_half(h, y, "bf16"), 6),
        ("cupy block exponents (256)", lambda: g.block_exponents(x, 256, e), 4),
    ]
    # the stager's int32 passes as aggnet's kernels run them on torch's
    # tensors (a float32 buffer of whole and partial chunks)
    from aggnet.torch import quantize as Q

    t = torch.randn(n, device="cuda")
    chunked, written = int32_staging_rows(torch, t, ops=Q.CupyOps(g))
    out = [{"kernel": name, "bytes": n * per, "seconds": _time(torch, fn, reps)}
           for name, fn, per in rows + chunked]
    wrong = _check_against_cpu(cp, g, cpu)
    wrong += [f"cupy {name}" for name in int32_staging_mismatches(torch, t, written)]
    return out, wrong


def _torch_kernels(torch, n: int, reps: int) -> tuple[list[dict], list[str]]:
    x = torch.randn(n, device="cuda")
    half = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    scaled = torch.empty(n, device="cuda")
    wide = torch.empty(n, device="cuda")

    def narrow_avg():
        torch.mul(x, 0.5, out=scaled)
        half.copy_(scaled)

    rows = [
        ("torch to bf16 (staging)", lambda: half.copy_(x), 6),
        ("torch to bf16 with avg (staging)", narrow_avg, 6 + 8),
        ("torch from bf16 (staging)", lambda: wide.copy_(half), 6),
        ("torch NaN/Inf count (staging)", lambda: torch.count_nonzero(~torch.isfinite(x)), 4),
    ]
    chunked, written = int32_staging_rows(torch, x)
    out = [{"kernel": name, "bytes": n * per, "seconds": _time(torch, fn, reps)} for name, fn, per in rows + chunked]
    return out, [f"torch {name}" for name in int32_staging_mismatches(torch, x, written)]


#: elements per chunk the int32 rows cut a buffer into (1 MiB chunks)
INT32_BLOCK = 1 << 18


def int32_staging_rows(torch, x, world: int = 2, ops=None) -> tuple[list, dict]:
    """(name, call, bytes per element read and written) of the int32
    codec as the stager runs it on a device (:mod:`aggnet.torch.quantize`'s
    ``ops``, torch's operations by default, over slices of ``SLICE``
    elements through scratch of that size where they need it): each
    chunk's largest magnitude, the quantization with agreed exponents, the
    dequantization of sums; and the tensors the calls write, for a check
    against the CPU kernels."""
    from aggnet.torch import quantize as Q
    from aggnet.torch.staging import SLICE

    ops = ops or Q.TorchOps()

    n, block = x.numel(), INT32_BLOCK
    step = block * max(1, SLICE // block)
    chunks = -(-n // block)
    best = torch.empty(chunks, dtype=torch.int32, device=x.device)
    agreed = np.full(chunks, 3, np.int16)  # randn's largest values are below 2**3
    up = torch.from_numpy(Q.quantize_factors(agreed, world)).to(x.device)
    down = torch.from_numpy(Q.dequantize_factors(agreed, world, 1.0 / world)).to(x.device)
    q = torch.empty(n, dtype=torch.int32, device=x.device)
    back = torch.empty(n, device=x.device)
    bits = torch.empty(ops.bits_for(min(step, n), block), dtype=torch.int32, device=x.device)
    wide = torch.empty(min(step, n), dtype=torch.float64, device=x.device) if ops.needs_scratch else None

    def cut(scratch, k):
        return None if scratch is None else scratch[:k]

    def passes():
        for at in range(0, n, step):
            k = min(step, n - at)
            yield slice(at, at + k), slice(at // block, at // block + -(-k // block)), k

    def exponents():
        for part, which, k in passes():
            best[which] = ops.chunk_max_bits(x[part], block, bits[:ops.bits_for(k, block)])

    def quantize():
        for part, which, k in passes():
            ops.quantize_chunks(x[part], up[which], block, q[part], cut(wide, k))

    def dequantize():
        for part, which, k in passes():
            ops.dequantize_chunks(q[part], down[which], block, back[part], cut(wide, k))

    rows = [(f"{ops.name} int32 chunk exponents (staging)", exponents, 4),
            (f"{ops.name} quantize to int32 (staging)", quantize, 8),
            (f"{ops.name} dequantize int32 (staging)", dequantize, 8)]
    return rows, {"best": best, "quantized": q, "dequantized": back, "agreed": agreed}


def int32_staging_mismatches(torch, x, out: dict, world: int = 2) -> list[str]:
    """Which of :func:`int32_staging_rows`' outputs (after their calls ran)
    differ from aggnet's CPU kernels on the same values."""
    from aggnet import kernels
    from aggnet.torch import quantize as Q

    cpu = kernels.load("cpu")
    xs, block, bad = x.cpu().numpy(), INT32_BLOCK, []
    exps = np.empty(-(-xs.size // block), np.int16)
    cpu.block_exponents(xs, block, exps)
    if not np.array_equal(Q.exponents_of_bits(out["best"].cpu().numpy()), exps):
        bad.append("int32 chunk exponents")
    want_q, want = np.empty(xs.size, np.int32), np.empty(xs.size, np.float32)
    for i, e in enumerate(out["agreed"]):
        part = slice(i * block, (i + 1) * block)
        shift = kernels.quant_shift(int(e), world)
        cpu.quantize(xs[part], shift, want_q[part], False)
        cpu.dequantize(want_q[part], shift, want[part], False, 1 / world)
    if not np.array_equal(out["quantized"].cpu().numpy(), want_q):
        bad.append("quantize to int32 per chunk")
    if not np.array_equal(out["dequantized"].cpu().numpy().view(np.uint32), want.view(np.uint32)):
        bad.append("dequantize int32 per chunk")
    return bad


def main(args) -> int:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("aggnet bench-gpu: no CUDA GPU is visible here (torch.cuda.is_available() is False); "
                         "run it on a machine with one")
    try:
        n = parse_size(args.size) // 4
    except ValueError as exc:
        raise SystemExit(f"aggnet bench-gpu: --size: {exc}") from None
    cpu0 = own_cpu_seconds()
    t0 = time.perf_counter()
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    copy_s = _time(torch, lambda: dst.copy_(src), args.reps)
    copy_bw = 2 * n * 4 / copy_s
    records, wrong = _cupy_kernels(torch, n, args.reps)
    more, wrong_torch = _torch_kernels(torch, n, args.reps)
    records, wrong = records + more, wrong + wrong_torch
    name = torch.cuda.get_device_name()
    print(f"{name}: {n * 4 / 2**20:.0f} MiB of float32, {args.reps} repetitions each")
    print(f"{'kernel':>36} {'ms':>8} {'GB/s (read+written)':>20} {'/copy':>6}")
    print(f"{'device-to-device copy':>36} {copy_s * 1e3:8.3f} {copy_bw / 1e9:20.0f} {1:6.2f}")
    for r in records:
        r["gb_per_s"] = r["bytes"] / r["seconds"] / 1e9
        r["of_copy"] = r["bytes"] / r["seconds"] / copy_bw
        print(f"{r['kernel']:>36} {r['seconds'] * 1e3:8.3f} {r['gb_per_s']:20.0f} {r['of_copy']:6.2f}")
    if not any(r["kernel"].startswith("cupy") for r in records):
        print("CuPy is not installed: only the staging's torch operations were timed (pip install aggnet[gpu])")
    print("bit-exact against the CPU kernels: " + ("yes" if not wrong else "NO: " + ", ".join(wrong)))
    record = {"device": name, "elements": n, "reps": args.reps, "copy_seconds": copy_s,
              "copy_gb_per_s": copy_bw / 1e9, "kernels": records, "mismatches": wrong,
              "host_cpu_seconds": own_cpu_seconds() - cpu0, "wall_seconds": time.perf_counter() - t0}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
        print(f"wrote {args.json}")
    return 1 if wrong else 0
