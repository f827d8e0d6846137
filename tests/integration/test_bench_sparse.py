"""``aggnet bench-sparse`` run tiny in real processes (a service, two
workers, gloo): its JSON names every system, and the PS path's measured
bytes per worker agree with the model the benchmark prints, so the figures
in docs/benchmarks.md are checked against the formula they are set beside."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch.distributed")

from aggnet.bench.sparse import batch_tokens, parse_alpha  # noqa: E402


@pytest.mark.slow
def test_tiny_run_records_every_system_and_ps_bytes_match_the_model(tmp_path):
    out = tmp_path / "sparse.json"
    run = subprocess.run([sys.executable, "-m", "aggnet", "bench-sparse", "--rows", "10000", "--width", "16",
                          "--workers", "2", "--alphas", "1%,5%", "--steps", "2", "--warmup", "1",
                          "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "αm(2w+24)" in run.stdout  # the formula is printed beside the numbers
    doc = json.loads(out.read_text())
    records = doc["records"]
    assert {r["system"] for r in records} == {"aggnet-ps", "aggnet-allreduce", "gloo-sparse", "dense"}
    for r in records:
        for key in ("system", "workers", "alpha", "table_bytes", "step_s", "bytes_per_worker"):
            assert key in r, (key, r)
        assert r["workers"] == 2 and r["table_bytes"] == 10000 * 16 * 4
        assert r["step_s"] > 0 and r["bytes_per_worker"] > 0
    assert sorted({r["alpha"] for r in records}) == [0.01, 0.05]
    for r in records:
        if r["system"] == "aggnet-ps":
            assert abs(r["bytes_per_worker"] / r["model_bytes_per_worker"] - 1) <= 0.10, r
            assert abs(r["alpha_measured"] / r["alpha"] - 1) <= 0.10, r
        if r["system"] == "dense":  # gloo's ring moves 2wm(N-1)/N each way
            assert abs(r["bytes_per_worker"] / r["model_bytes_per_worker"] - 1) <= 0.10, r


def test_alpha_and_batch_size():
    assert parse_alpha("1%") == 0.01 and parse_alpha("0.05") == 0.05
    with pytest.raises(ValueError, match="between 0 and 1"):
        parse_alpha("150%")
    # B uniform tokens over m rows touch about α·m of them
    assert batch_tokens(1_000_000, 0.01) == pytest.approx(10050, abs=2)
