"""``aggnet plot`` draws docs/benchmarks.md's figures from what the
benchmarks write: a small real run, then its figure."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib", reason="the figures need matplotlib (pip install 'aggnet[plot]')")

PNG = b"\x89PNG\r\n\x1a\n"


def _aggnet(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aggnet", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_a_bench_udp_run_is_drawn(tmp_path):
    data, png = tmp_path / "udp.json", tmp_path / "udp.png"
    r = _aggnet("bench-udp", "--elements", "64,512", "--size", "1MiB", "--reps", "1", "--seconds", "0.2",
                "--json", str(data))
    assert r.returncode == 0, r.stderr[-2000:]
    r = _aggnet("plot", "udp", str(data), "--out", str(png))
    assert r.returncode == 0, r.stderr
    assert png.read_bytes().startswith(PNG) and png.stat().st_size > 10_000


@pytest.mark.slow
def test_a_bench_sparse_run_is_drawn(tmp_path):
    pytest.importorskip("torch", reason="gloo's side of the sparse benchmark needs PyTorch")
    data, png = tmp_path / "sparse.json", tmp_path / "sparse.png"
    r = _aggnet("bench-sparse", "--rows", "20000", "--width", "16", "--workers", "2", "--alphas", "1%,10%",
                "--steps", "1", "--systems", "aggnet-ps,dense", "--json", str(data))
    assert r.returncode == 0, r.stderr[-2000:]
    r = _aggnet("plot", "sparse", str(data), "--out", str(png))
    assert r.returncode == 0, r.stderr
    assert png.read_bytes().startswith(PNG)


def test_a_bench_transport_run_is_drawn(tmp_path):
    data, png = tmp_path / "transport.json", tmp_path / "transport.png"
    r = _aggnet("bench-transport", "--transports", "tcp,zmq+tcp", "--sizes", "64KiB,1MiB", "--volume", "4MiB",
                "--reps", "2", "--json", str(data))
    assert r.returncode == 0, r.stderr[-2000:]
    r = _aggnet("plot", "transport", str(data), "--out", str(png))
    assert r.returncode == 0, r.stderr
    assert png.read_bytes().startswith(PNG) and png.stat().st_size > 10_000


def test_the_wrong_json_is_one_line_naming_what_to_give(tmp_path):
    data = tmp_path / "other.json"
    data.write_text(json.dumps({"records": [{"system": "x"}]}))
    r = _aggnet("plot", "rack", str(data), "--out", str(tmp_path / "x.png"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "not rack results" in r.stderr, r.stderr
    r = _aggnet("plot", "udp", str(tmp_path / "absent.json"), "--out", str(tmp_path / "x.png"))
    assert r.returncode == 2 and "cannot read" in r.stderr and "Traceback" not in r.stderr
