"""``aggnet bench`` end to end, small: aggnet beside gloo and a memory copy,
with the CPU-seconds per GB of every worker and of the aggregator."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest


@pytest.mark.slow
def test_bench_reports_cpu_seconds_per_gb_beside_gloo(tmp_path):
    pytest.importorskip("torch", reason="gloo's side of the benchmark needs PyTorch")
    out = tmp_path / "bench.json"
    # short: the ipc socket's path must fit a Unix socket address
    scratch = Path(tempfile.mkdtemp(prefix="agb-", dir="/tmp"))
    r = subprocess.run([sys.executable, "-m", "aggnet", "bench", "--workers", "2", "--sizes", "4MiB",
                        "--transports", "ipc", "--dtypes", "float32", "--reps", "3", "--shards", "1",
                        "--json", str(out)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "TMPDIR": str(scratch)})
    assert r.returncode == 0, r.stderr[-3000:]
    # the service's socket folder goes with the run
    left = list(scratch.iterdir())
    shutil.rmtree(scratch)
    assert not left, left
    assert "cpu s/GB" in r.stdout and "agg s/GB" in r.stdout and "floor/this" in r.stdout
    records = {x["system"]: x for x in json.loads(out.read_text())["records"]}
    assert set(records) == {"memcpy", "gloo", "floor", "aggnet"}
    # a worker spends CPU on every all-reduce, and so does the aggregator
    # (which gloo does not have); the floor's shards are its aggregator
    for system in ("gloo", "floor", "aggnet"):
        assert 0 < records[system]["worker_cpu_s_per_gb"] < 100, records[system]
    for system in ("floor", "aggnet"):
        assert 0 < records[system]["aggregator_cpu_s_per_gb"] < 100, records[system]
    assert "aggregator_cpu_s_per_gb" not in records["gloo"]
    assert records["floor"]["chunk_bytes"] == records["aggnet"]["chunk_bytes"] or \
        records["aggnet"]["transport"] != "tcp"
