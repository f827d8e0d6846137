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


def _bench(*args, env=None, timeout=100):
    """``aggnet bench ARGS``, stopped inside the test's own limit (120 s):
    a run that hangs fails showing what it printed until then, and a round
    that stalls fails sooner, with the client's error naming what it
    waited for."""
    env = {"AGGNET_TIMEOUT": "40", **(os.environ if env is None else env)}
    try:
        return subprocess.run([sys.executable, "-m", "aggnet", "bench", *args], capture_output=True, text=True,
                              timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        said = [x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (exc.stdout, exc.stderr)]
        pytest.fail(f"aggnet bench {' '.join(args)} ran over {timeout}s; it printed:\n{said[0][-3000:]}\n"
                    f"{said[1][-3000:]}")


@pytest.mark.slow
def test_bench_reports_cpu_seconds_per_gb_beside_gloo(tmp_path):
    pytest.importorskip("torch", reason="gloo's side of the benchmark needs PyTorch")
    out = tmp_path / "bench.json"
    # short: the ipc socket's path must fit a Unix socket address
    scratch = Path(tempfile.mkdtemp(prefix="agb-", dir="/tmp"))
    r = _bench("--workers", "2", "--sizes", "4MiB", "--transports", "ipc", "--dtypes", "float32", "--reps", "3",
               "--shards", "1", "--json", str(out), env={**os.environ, "TMPDIR": str(scratch)})
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


@pytest.mark.slow
def test_bench_in_rounds_alternates_the_systems_and_gives_each_rounds_ratios(tmp_path):
    """``--rounds 2``: each system is timed in both rounds, the second in
    another order; a point's record holds both rounds' repetitions, and
    the printed ratios are each round's."""
    pytest.importorskip("torch", reason="gloo's side of the benchmark needs PyTorch")
    out = tmp_path / "bench.json"
    scratch = Path(tempfile.mkdtemp(prefix="agr-", dir="/tmp"))
    try:
        r = _bench("--workers", "2", "--sizes", "1MiB", "--transports", "ipc", "--dtypes", "float32", "--reps", "2",
                   "--rounds", "2", "--shards", "1", "--json", str(out), env={**os.environ, "TMPDIR": str(scratch)})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert r.returncode == 0, r.stderr[-3000:]
    records = {x["system"]: x for x in json.loads(out.read_text())["records"]}
    assert set(records) == {"memcpy", "gloo", "floor", "aggnet"}
    for system in ("gloo", "floor", "aggnet"):
        rec = records[system]
        assert rec["reps"] == 4 and len(rec["times"]) == 4 and len(rec["round_medians"]) == 2, rec
        assert rec["min_s"] == min(rec["times"]) and rec["max_s"] == max(rec["times"])
    gloo, ours = records["gloo"]["round_medians"], records["aggnet"]["round_medians"]
    line = next(x for x in r.stdout.splitlines() if x.startswith("N=2 1MiB aggnet ipc float32")
                and "gloo/this by round" in x)
    assert f"{gloo[0] / ours[0]:.2f}, {gloo[1] / ours[1]:.2f};" in line
    assert any("floor/this by round" in x for x in r.stdout.splitlines())
    # round 2 starts with the system that came second in round 1
    assert r.stderr.index("floor, 2 workers, round 2/2") < r.stderr.index("gloo, 2 workers, round 2/2")
    refused = subprocess.run([sys.executable, "-m", "aggnet", "bench", "--rounds", "0"], capture_output=True,
                             text=True, timeout=60)
    assert refused.returncode == 2 and "argument --rounds: 0: give 1 or more" in refused.stderr
    assert "Traceback" not in refused.stderr


@pytest.mark.slow
def test_bench_times_the_int32_codec_agreed_carried_and_quantized_by_its_owner(tmp_path):
    """Every int32 kind runs and checks its sums (the bench fails on a wrong
    one); a dtype it does not know is refused in one line."""
    out = tmp_path / "bench.json"
    scratch = Path(tempfile.mkdtemp(prefix="agq-", dir="/tmp"))
    kinds = ["q-int32", "q-int32-carried", "o-int32", "o-int32-carried"]
    try:
        r = _bench("--workers", "2", "--sizes", "5MiB", "--transports", "shm,tcp", "--dtypes", ",".join(kinds),
                   "--reps", "3", "--shards", "2", "--no-floor", "--json", str(out),
                   env={**os.environ, "TMPDIR": str(scratch)})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert r.returncode == 0, r.stderr[-3000:]
    got = {(x["transport"], x["dtype"]) for x in json.loads(out.read_text())["records"] if x["system"] == "aggnet"}
    assert got == {(t, k) for t in ("shm", "tcp") for k in kinds}
    refused = subprocess.run([sys.executable, "-m", "aggnet", "bench", "--dtypes", "int8"], capture_output=True,
                             text=True, timeout=60)
    assert refused.returncode == 2 and "unknown dtype 'int8'; choose from float32, int32, q-int32" in refused.stderr
    assert "Traceback" not in refused.stderr


@pytest.mark.slow
def test_bench_of_the_backend_s_reduce_scatter_times_its_staged_form_beside_gloo(tmp_path):
    """``--collective reduce_scatter``: the backend's reduce-scatter beside
    gloo's, and through the staging a CUDA tensor takes (on CPU tensors),
    each checked for the right share; ``--memory cuda`` without a GPU says
    so in one line."""
    torch = pytest.importorskip("torch", reason="the backend's side of the benchmark needs PyTorch")
    out = tmp_path / "rs.json"
    r = _bench("--collective", "reduce_scatter", "--workers", "2", "--sizes", "1MiB", "--reps", "2", "--json",
               str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    assert {x["system"] for x in data["records"]} == {
        "gloo reduce_scatter", "aggnet reduce_scatter", "aggnet reduce_scatter staged", "aggnet all_reduce",
        "client all_reduce", "gloo all_reduce"}
    assert all(x["median_s"] > 0 and x["memory"] == "host" for x in data["records"])
    # every system costs its workers CPU, and aggnet's its aggregator too
    for x in data["records"]:
        assert 0 < x["worker_cpu_s_per_gb"] < 100, x
        if not x["system"].startswith("gloo"):
            assert 0 < x["aggregator_cpu_s_per_gb"] < 100, x
    assert "cpu s/GB" in r.stdout and "agg s/GB" in r.stdout
    assert data["ratios"][0]["staged_reduce_scatter_over_gloo"] > 0
    assert "staged reduce_scatter/gloo" in r.stdout
    if not torch.cuda.is_available():
        r = subprocess.run([sys.executable, "-m", "aggnet", "bench", "--collective", "reduce_scatter", "--memory",
                            "cuda"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_worker_that_fails_stops_the_bench_at_once_in_one_line():
    # a client that refuses its chunk size fails in the worker, past the
    # parent's checks: the parent waited an hour for a result that never came
    r = _bench("--workers", "2", "--sizes", "64KiB", "--transports", "tcp", "--dtypes", "float32", "--reps", "2",
               "--no-floor", "--no-gloo", "--chunk-bytes", "3B", timeout=60)
    assert r.returncode == 1, (r.stdout[-2000:], r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("aggnet bench: worker ") and "chunk_bytes must be between" in lines[-1], lines
    assert "Traceback" not in r.stderr, r.stderr[-3000:]


def test_a_bad_aggnet_timeout_is_refused_before_anything_starts():
    for bad in ("soon", "0", "-5"):
        r = _bench("--workers", "2", "--sizes", "64KiB", "--transports", "tcp", "--reps", "1",
                   env={**os.environ, "AGGNET_TIMEOUT": bad}, timeout=30)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert r.stderr.strip() == (f"aggnet bench: AGGNET_TIMEOUT={bad!r} is not a number of seconds above 0 (e.g. "
                                    f"120, how long an all-reduce may go without progress); set it so, or unset it")
