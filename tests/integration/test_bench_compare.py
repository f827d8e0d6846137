"""``aggnet compare``: a benchmark under two settings or revisions,
alternated, each pair's ratio; real runs of ``aggnet bench``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from aggnet.bench import compare as C

#: a small bench run: a few seconds, a memory copy (the peer) beside aggnet
BENCH = ["bench", "--workers", "2", "--sizes", "64KiB", "--transports", "tcp", "--dtypes", "float32", "--reps", "2",
         "--no-floor", "--no-gloo"]
REPO = Path(C.__file__).resolve().parents[2]


def _compare(*args, timeout=240):
    env = {**os.environ, "AGGNET_TIMEOUT": "40", "AGGNET_PROGRESS": "0"}
    try:
        return subprocess.run([sys.executable, "-m", "aggnet", "compare", *args], capture_output=True, text=True,
                              timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        said = [x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (exc.stdout, exc.stderr)]
        pytest.fail(f"aggnet compare ran over {timeout}s; it printed:\n{said[0][-3000:]}\n{said[1][-3000:]}")


def test_compare_alternates_the_arms_and_gives_each_pairs_ratio(tmp_path):
    out = tmp_path / "compare.json"
    r = _compare("--arm", "a", "--arm", "b:AGGNET_PREDICT_SCALE=0", "--pairs", "2", "--json", str(out), "--", *BENCH)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(out.read_text())
    # the order rotates: no arm always runs first
    assert [(x["arm"], x["pair"]) for x in got["runs"]] == [("a", 1), ("b", 1), ("b", 2), ("a", 2)]
    assert got["arms"][1]["env"] == {"AGGNET_PREDICT_SCALE": "0"}
    runs = {(x["arm"], x["pair"]): {rec["system"]: rec for rec in x["records"]} for x in got["runs"]}
    paired = {(e["row"]["system"], e["measure"]): e for e in got["paired"]}
    # every system's median time, under each arm, and b over a pair by pair
    for system in ("memcpy", "aggnet"):
        e = paired[(system, "median_s")]
        assert e["higher_is_better"] is False
        for arm in ("a", "b"):
            assert e["arms"][arm]["values"] == [runs[(arm, p)][system]["median_s"] for p in (1, 2)]
        assert e["arms"]["b"]["ratios"] == pytest.approx(
            [runs[("b", p)][system]["median_s"] / runs[("a", p)][system]["median_s"] for p in (1, 2)])
        assert e["arms"]["a"]["ratios"] == [1.0, 1.0]
    # the ranges are no rows of their own; aggnet's CPU per GB is one
    assert not any(m.startswith(("min_", "max_")) for _, m in paired)
    assert ("aggnet", "worker_cpu_s_per_gb") in paired
    assert "b/a" in r.stdout and "(a peer: the machine's noise)" in r.stdout
    assert "arm b (AGGNET_PREDICT_SCALE=0): aggnet from" in r.stdout
    # and its figure
    pytest.importorskip("matplotlib", reason="the figure needs matplotlib (pip install 'aggnet[plot]')")
    png = tmp_path / "compare.png"
    drawn = subprocess.run([sys.executable, "-m", "aggnet", "plot", "compare", str(out), "--out", str(png)],
                           capture_output=True, text=True, timeout=120)
    assert drawn.returncode == 0, drawn.stderr
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and png.stat().st_size > 10_000


def test_an_arm_whose_run_fails_is_named_with_the_run_s_error_in_one_line():
    # the arm's setting reaches the run: a bad one fails it
    r = _compare("--arm", "fine", "--arm", "broken:AGGNET_TIMEOUT=soon", "--pairs", "1", "--", *BENCH)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("aggnet compare: arm broken: `aggnet bench ") and "exited 2: aggnet bench: " \
        "AGGNET_TIMEOUT='soon' is not a number of seconds" in line, line
    log = Path(line.rsplit("its output is in ", 1)[1].rstrip(")"))
    assert "AGGNET_TIMEOUT='soon'" in log.read_text()  # kept for whoever looks
    shutil.rmtree(log.parent)


@pytest.mark.parametrize("args, said", [
    (["--arm", "a", "--", *BENCH], "name at least two arms"),
    (["--arm", "a", "--arm", "a:X=1", "--", *BENCH], "arm names must differ: a, a"),
    (["--arm", "a", "--arm", "b", "--", "serve", "--listen", "zmq+tcp://127.0.0.1:0"],
     "aggnet compare pairs the records of bench, bench-ddp"),
    (["--arm", "a", "--arm", "b", "--", *BENCH, "--json", "x.json"], "leave --json out of the command"),
    (["--arm", "a b", "--arm", "b", "--", *BENCH], "its name must be letters"),
    (["--arm", "a:NOVALUE", "--arm", "b", "--", *BENCH], "'NOVALUE' is not VAR=VALUE"),
    (["--arm", "a@", "--arm", "b", "--", *BENCH], "'@' names a git revision, and none follows it"),
])
def test_what_cannot_be_compared_is_refused_in_one_line(args, said):
    r = _compare(*args, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("aggnet compare: ") and said in lines[0], lines


def test_pairs_rows_by_what_names_them_and_measures_what_changes_between_runs(capsys):
    """Whole numbers that differ between runs (bytes sent) are measured;
    those alike in every run (a size) say which row a record is."""
    def rec(system, nbytes, t, sent):
        return {"system": system, "bytes": nbytes, "median_s": t, "min_s": t / 2, "bytes_per_worker": sent,
                "rate_gb_per_s": 1 / t}

    runs = [{"arm": "x", "pair": 1, "records": [rec("gloo", 1024, 2.0, 100), rec("aggnet", 1024, 1.0, 50)]},
            {"arm": "y", "pair": 1, "records": [rec("gloo", 1024, 4.0, 100), rec("aggnet", 1024, 3.0, 60)]},
            {"arm": "y", "pair": 2, "records": [rec("gloo", 1024, 2.0, 100), rec("aggnet", 1024, 1.0, 70)]},
            {"arm": "x", "pair": 2, "records": [rec("gloo", 1024, 2.0, 100), rec("aggnet", 1024, 2.0, 50)]}]
    got = {(e["row"]["system"], e["measure"]): e for e in C.pair_records(runs, ["x", "y"])}
    assert set(got) == {(s, m) for s in ("gloo", "aggnet") for m in ("median_s", "bytes_per_worker", "rate_gb_per_s")}
    assert got[("aggnet", "median_s")]["row"] == {"system": "aggnet", "bytes": 1024}
    assert got[("aggnet", "median_s")]["arms"]["y"]["ratios"] == [3.0, 0.5]
    assert got[("aggnet", "median_s")]["arms"]["y"]["median_ratio"] == 1.75
    assert got[("aggnet", "bytes_per_worker")]["arms"]["y"]["ratios"] == [60 / 50, 70 / 50]
    assert got[("gloo", "rate_gb_per_s")]["higher_is_better"] and not got[("gloo", "median_s")]["higher_is_better"]
    # a field measured for one row is measured for all (gloo's bytes were alike in every run)
    assert got[("gloo", "median_s")]["row"] == {"system": "gloo", "bytes": 1024}
    assert got[("gloo", "bytes_per_worker")]["arms"]["y"]["ratios"] == [1.0, 1.0]
    # times print in ms, rates as they are
    C._print(list(got.values()), ["x", "y"])
    out = capsys.readouterr().out
    assert "median_s in ms (lower is better)" in out and "aggnet: x 1500  y 2000" in out, out
    assert "rate_gb_per_s (higher is better)" in out and "aggnet: x 0.75  y 0.6667" in out, out


def _git(*args) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True,
                          timeout=60).stdout


needs_checkout = pytest.mark.skipif(not (REPO / ".git").exists() or not (REPO / "pyproject.toml").exists(),
                                    reason="aggnet is not imported from a git checkout here: a revision arm "
                                           "exports a revision of one")


@needs_checkout
def test_a_revision_arm_imports_every_aggnet_module_from_that_revision(tmp_path):
    rev = _git("rev-parse", "HEAD~1").strip()
    arm = C.parse_arm(f"before@{rev}")
    assert (arm.name, arm.rev, arm.env) == ("before", rev, {})
    arm.tree = C.export(arm.rev, tmp_path)
    for path in ("aggnet/client/chunked.py", "hosts/shard.py", "transport/base.py"):
        assert (arm.tree / path).read_text() == _git("show", f"{rev}:{path}")
    # the packages pyproject.toml places inside aggnet come from the same tree
    assert (arm.tree / "aggnet" / "transport").resolve() == (arm.tree / "transport").resolve()
    assert Path(C._where_from(arm)).resolve() == (arm.tree / "aggnet").resolve()
    # an arm as installed imports this checkout's
    assert Path(C._where_from(C.parse_arm("now"))).resolve() == (REPO / "aggnet").resolve()
    r = _compare("--arm", "nothing@no-such-revision-anywhere", "--arm", "now", "--", *BENCH, timeout=60)
    assert r.returncode == 1 and "'no-such-revision-anywhere' is no revision of" in r.stderr, r.stderr[-2000:]


@pytest.mark.slow
@needs_checkout
def test_compare_runs_a_revision_beside_the_installed_aggnet(tmp_path):
    out = tmp_path / "compare.json"
    r = _compare("--arm", "before@HEAD", "--arm", "now", "--pairs", "1", "--json", str(out), "--", *BENCH)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(out.read_text())
    before, now = got["arms"]
    assert "aggnet-compare-" in before["code"] and Path(now["code"]).resolve() == (REPO / "aggnet").resolve()
    assert {e["row"]["system"] for e in got["paired"]} == {"memcpy", "aggnet"}
    # the exported tree goes with the run
    assert not Path(before["code"]).exists()
