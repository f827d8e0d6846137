"""``aggnet bench-transport`` end to end, small: every transport's rate in
one run, and sizes over the message limit refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from aggnet.protocol.limits import MAX_MESSAGE_BYTES


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aggnet", "bench-transport", *args], capture_output=True,
                          text=True, timeout=240)


def test_bench_transport_rates_every_transport_at_every_size(tmp_path):
    pytest.importorskip("ucxx", reason="ucxx is not installed (pip install 'aggnet[rdma]')")
    out = tmp_path / "transport.json"
    r = _bench("--transports", "ucx,zmq+tcp", "--sizes", "32KiB,1MiB", "--volume", "8MiB", "--reps", "1",
               "--json", str(out))
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    records = json.loads(out.read_text())
    assert {(x["transport"], x["bytes"]) for x in records} == {(t, s) for t in ("ucx", "zmq+tcp")
                                                               for s in (32 << 10, 1 << 20)}
    assert all(x["median_gb_per_s"] > 0 for x in records)
    assert "ucx/zmq+tcp" in r.stdout


def test_bench_transport_rates_plain_tcp_against_zeromq_with_cpu(tmp_path):
    out = tmp_path / "transport.json"
    r = _bench("--transports", "tcp,zmq+tcp", "--sizes", "64KiB,1MiB", "--volume", "8MiB", "--reps", "2",
               "--json", str(out))
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    records = json.loads(out.read_text())
    assert {(x["transport"], x["bytes"]) for x in records} == {(t, s) for t in ("tcp", "zmq+tcp")
                                                               for s in (64 << 10, 1 << 20)}
    assert all(x["median_gb_per_s"] > 0 and x["reps"] == 2 and 0 < x["cpu_s_per_gb"] < 100 for x in records)
    assert "tcp/zmq+tcp" in r.stdout and "tcp CPU s/GB" in r.stdout


def test_a_size_over_the_message_limit_is_refused_in_one_line():
    r = _bench("--transports", "zmq+tcp", "--sizes", f"{(MAX_MESSAGE_BYTES >> 20) + 1}MiB")
    assert r.returncode == 2
    assert "largest message a listener takes" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
