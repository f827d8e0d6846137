"""``aggnet bench-spectrain`` and the stale and staged systems of ``aggnet
bench-ddp`` run tiny in real processes: each prints its table, writes its JSON and
draws its plot, and the figures in the JSON are the ones the experiments'
targets are read from."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch.distributed")


def _run(tmp_path, *argv, timeout=240):
    run = subprocess.run([sys.executable, "-m", "aggnet", *argv], capture_output=True, text=True, timeout=timeout,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


@pytest.mark.slow
def test_prediction_check_writes_errors_per_version_difference(tmp_path):
    pytest.importorskip("matplotlib")
    out = _run(tmp_path, "bench-spectrain", "prediction", "--seeds", "1", "--steps", "60", "--lrs", "0.01",
               "--jobs", "1")
    assert "predicted/stale" in out and "[1/1" in out  # progress as each run lands
    doc = json.loads((tmp_path / "bench-spectrain-prediction.json").read_text())
    rows = doc["summary"]
    assert [r["s"] for r in rows] == [1, 2, 3]
    # the stale weights drift further the older they are; a prediction is closer
    assert rows[0]["stale"] < rows[1]["stale"] < rows[2]["stale"]
    assert all(r["predicted"] < r["stale"] for r in rows)
    assert (tmp_path / "bench-spectrain-prediction.png").stat().st_size > 1000


@pytest.mark.slow
def test_pipeline_modes_table_has_every_mode_with_its_spread(tmp_path):
    pytest.importorskip("matplotlib")
    out = _run(tmp_path, "bench-spectrain", "modes", "--stages", "2", "--seeds", "2", "--steps", "200",
               "--lrs", "0.1", "--jobs", "2")
    doc = json.loads((tmp_path / "bench-spectrain-modes.json").read_text())
    assert {r["mode"] for r in doc["table"]} == {"sync", "vanilla", "stash", "spectrain"}
    for r in doc["table"]:
        assert r["seeds"] == 2 and 0.1 < r["best_valid_acc"] <= 1 and r["best_valid_acc_std"] >= 0
    assert "valid acc %" in out
    assert (tmp_path / "bench-spectrain-modes.png").stat().st_size > 1000


@pytest.mark.slow
def test_ddp_bench_times_stale_steps_beside_their_halves(tmp_path):
    systems = ("aggnet-float32,aggnet-float32-stale1,aggnet-float32-stale1-predict,compute,comm-float32,"
               "comm-float32-buckets,comm-float32-pipelined")
    out = _run(tmp_path, "bench-ddp", "--workers", "2", "--width", "64", "--batch", "4", "--steps", "3",
               "--systems", systems, "--json", "ddp.json")
    records = json.loads((tmp_path / "ddp.json").read_text())
    assert [r["system"] for r in records] == systems.split(",")
    assert all(r["median_s"] > 0 and r["worker_cpu_s_per_step"] >= 0 for r in records)  # 10 ms ticks: 3 short steps may read 0
    assert "aggnet-float32-stale1-predict" in out and "cpu s/step" in out


def test_an_unknown_ddp_system_is_refused_with_the_list(tmp_path):
    run = subprocess.run([sys.executable, "-m", "aggnet", "bench-ddp", "--systems", "gloo,aggnet-int32-stale0"],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert run.returncode != 0
    assert "unknown system 'aggnet-int32-stale0'" in run.stderr and "aggnet-CODEC-staleS" in run.stderr
    assert "Traceback" not in run.stderr


def test_ddp_bench_takes_cpu_buckets_through_the_device_staging_and_refuses_unknown_systems(tmp_path):
    """``aggnet-CODEC-staged`` times the GPU path's host side on a CPU
    (``staging="always"``); a system it does not know fails in one line
    naming the ones it does."""
    systems = "aggnet-float32-staged,aggnet-int32-staged"
    _run(tmp_path, "bench-ddp", "--workers", "2", "--width", "64", "--batch", "4", "--steps", "2",
         "--systems", systems, "--json", "ddp.json")
    records = json.loads((tmp_path / "ddp.json").read_text())
    assert [r["system"] for r in records] == systems.split(",") and all(r["median_s"] > 0 for r in records)
    run = subprocess.run([sys.executable, "-m", "aggnet", "bench-ddp", "--systems", "aggnet-float32-staging"],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert "unknown system 'aggnet-float32-staging'" in run.stderr and "aggnet-CODEC-staged" in run.stderr


def test_ddp_bench_times_ddp_over_the_aggnet_backend(tmp_path):
    """``backend-CODEC``: DDP without a hook over a process group of the
    aggnet backend, one group per system, left once it is timed."""
    systems = "backend-float32,backend-int32"
    out = _run(tmp_path, "bench-ddp", "--workers", "2", "--width", "64", "--batch", "4", "--steps", "2",
               "--systems", systems, "--json", "ddp.json")
    records = json.loads((tmp_path / "ddp.json").read_text())
    assert [r["system"] for r in records] == systems.split(",") and all(r["median_s"] > 0 for r in records)
    assert "backend-int32" in out
    run = subprocess.run([sys.executable, "-m", "aggnet", "bench-ddp", "--systems", "backend-int32-sync"],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert "unknown system 'backend-int32-sync'" in run.stderr and "backend-CODEC" in run.stderr


def test_a_ddp_bench_worker_that_fails_stops_the_run_at_once_in_one_line(tmp_path):
    # a chunk size the client refuses fails inside the workers, once gloo
    # is timed: the parent waited an hour for results that never came
    import os

    run = subprocess.run([sys.executable, "-m", "aggnet", "bench-ddp", "--workers", "2", "--width", "64", "--batch",
                          "4", "--steps", "2", "--systems", "gloo,aggnet-int32"], capture_output=True, text=True,
                         timeout=90, cwd=tmp_path, env={**os.environ, "AGGNET_CHUNK_BYTES": "3"})
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("aggnet bench-ddp: worker ") and "chunk_bytes must be between" in last, last
