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


@pytest.mark.parametrize("transports, sizes, ratio", [(("ucx", "zmq+tcp"), (32 << 10, 1 << 20), "ucx/zmq+tcp"),
                                                    (("tcp", "zmq+tcp"), (64 << 10, 1 << 20), "tcp/zmq+tcp")],
                         ids=["ucx", "tcp"])
def test_bench_transport_rates_every_transport_at_every_size_with_cpu(tmp_path, transports, sizes, ratio):
    if "ucx" in transports:
        pytest.importorskip("ucxx", reason="ucxx is not installed (pip install 'aggnet[rdma]')")
    out = tmp_path / "transport.json"
    r = _bench("--transports", ",".join(transports), "--sizes", ",".join(f"{s >> 10}KiB" for s in sizes),
               "--volume", "8MiB", "--reps", "2", "--json", str(out))
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    records = json.loads(out.read_text())
    assert {(x["transport"], x["bytes"]) for x in records} == {(t, s) for t in transports for s in sizes}
    assert all(x["median_gb_per_s"] > 0 and x["reps"] == 2 and 0 < x["cpu_s_per_gb"] < 100 for x in records)
    assert ratio in r.stdout and f"{transports[0]} CPU s/GB" in r.stdout


def test_a_size_over_the_message_limit_is_refused_in_one_line():
    r = _bench("--transports", "zmq+tcp", "--sizes", f"{(MAX_MESSAGE_BYTES >> 20) + 1}MiB")
    assert r.returncode == 2
    assert "largest message a listener takes" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
