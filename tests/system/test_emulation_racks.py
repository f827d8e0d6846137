"""Racks under a root in network namespaces: all-reduces through rack
aggregators and the root, exact under drops on rack and spine links, the
bytes that cross racks beside gloo's ring, the DDP demo across racks, the
teardown on Ctrl-C, and the same topology in Mininet."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aggnet.emulation import fabric_runs
from aggnet.emulation.fabric import Fabric
from aggnet.emulation.fabric_plan import plan
from aggnet.emulation.netns import can_emulate

OK, WHY = can_emulate()
pytestmark = [pytest.mark.requires_netns, pytest.mark.skipif(not OK, reason=f"no network namespaces here: {WHY}")]
MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]
TWO_RACKS = str(REPO / "examples" / "topologies" / "two-racks.toml")


def namespaces(prefix: str) -> list[str]:
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    return [n for n in names if n.startswith(prefix)]


def unshaped(racks: int = 2, workers: int = 2):
    """The two-racks topology reshaped, on unshaped links (short tests)."""
    return plan(TWO_RACKS, racks=racks, workers=workers, host_mbit=0, uplink_mbit=0)


@pytest.mark.slow
def test_two_racks_of_host_switches_under_a_root_sum_int32_exactly():
    with Fabric(unshaped(), prefix="agr") as fabric:
        fabric.start_aggregators()
        fabric.wait_reachable()
        res = fabric_runs.run_system(fabric, "aggnet", 4 * MiB, dtype="int32")
        root = fabric.stats()
        racks = [fabric.stats(i) for i in range(2)]
    assert res["exact"] == [True] * 4
    assert len({tuple(c) for c in res["checksums"]}) == 1
    assert root["totals"]["completed"] > 0
    assert all(r["totals"]["uplink_sent"] > 0 and r["totals"]["finals"] > 0 for r in racks)
    # each rack's partial went up and the result came down: S each way per rack
    for u in res["uplinks"]:
        assert u["up"] >= 4 * MiB and u["down"] >= 4 * MiB, res["uplinks"]
    assert not namespaces("agr")


@pytest.mark.parametrize("drop", [0.01, 0.10], ids=["drop1%", "drop10%"])
@pytest.mark.slow
def test_racks_under_a_root_stay_exact_under_drops_on_rack_and_spine_links(drop):
    with Fabric(unshaped(), prefix="agl") as fabric:
        fabric.start_aggregators()
        fabric.wait_reachable()
        # iptables drops a GSO batch (up to 7 packets) at once: 8 MiB gives
        # 1% of some hundreds of batches per link some drops on every kind
        fabric.impair(drop)
        res = fabric_runs.run_system(fabric, "aggnet", 8 * MiB, dtype="int32")
        drops = fabric.impairment_counts()
        racks = [fabric.stats(i) for i in range(2)]
    assert drops["rack_links"] > 0 and drops["spine_links"] > 0, drops
    assert res["exact"] == [True] * 4
    assert sum(s["retransmissions"] for s in res["client_stats"]) > 0
    # what the spine dropped was recovered: partials went up again
    assert sum(r["totals"].get("uplink_resent", 0) for r in racks) > 0, racks


@pytest.mark.slow
def test_bench_writes_cross_rack_bytes_near_R_times_S_for_aggnet(tmp_path):
    pytest.importorskip("torch", reason="gloo's side of the benchmark needs PyTorch")
    out = tmp_path / "fabric.json"
    size = 32 * MiB  # the first use of each of 64 slots primes it: 1.6% of 32 MiB
    # shaped links: unshaped ones leave the all-reduce CPU-bound, and a
    # loaded 2-core machine then drops (and resends) at socket buffers
    r = subprocess.run([sys.executable, "-m", "aggnet", "emulate", "--topology", TWO_RACKS, "bench", "--workers", "2",
                        "--rate", "400", "--uplink-rate", "200", "--size", "32MiB", "--prefix", "agw",
                        "--json", str(out)],
                       capture_output=True, text=True, timeout=110)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "aggnet time / gloo time" in r.stdout
    data = json.loads(out.read_text())
    assert (data["racks"], data["workers"], data["bytes"]) == (2, 2, size)
    rec = {x["system"]: x for x in data["records"]}
    assert set(rec) == {"aggnet", "gloo", "floor"}
    assert "aggnet time / floor time" in r.stdout
    assert all(x["median_s"] > 0 and x["worker_cpu_s_per_gb"] > 0 for x in rec.values())
    assert "cpu s/GB" in r.stdout
    rs = 2 * size
    for way in ("up", "down"):
        assert 1.0 <= rec["aggnet"]["cross_rack_bytes"][way] / rs <= 1.05, rec["aggnet"]["cross_rack_bytes"]
        # the ring crosses the 2 racks twice, each time with 2S(N-1)/N = 1.5 S
        assert rec["gloo"]["cross_rack_bytes"][way] / rs > 1.4, rec["gloo"]["cross_rack_bytes"]
        # the floor's racks move what aggnet's do, over TCP
        assert 1.0 <= rec["floor"]["cross_rack_bytes"][way] / rs <= 1.05, rec["floor"]["cross_rack_bytes"]
    # the floor's rack sums went up to its root and back: every worker
    # holds the sum over both racks, as aggnet's and gloo's do
    sums = {system: x["checksums"][0][0] for system, x in rec.items()}
    assert abs(sums["floor"] - sums["gloo"]) <= 1e-3 * max(1.0, abs(sums["gloo"])), sums
    assert len({tuple(c) for c in rec["floor"]["checksums"]}) == 1
    assert not namespaces("agw")


@pytest.mark.slow
def test_ddp_demo_trains_across_racks():
    pytest.importorskip("torch", reason="the demo trains with PyTorch")
    pytest.importorskip("sklearn", reason="the demo's data set ships with scikit-learn")
    with Fabric(unshaped(workers=1), prefix="agj") as fabric:
        fabric.start_aggregators()
        fabric.wait_reachable()
        lines = fabric_runs.run_demo(fabric, epochs=1, codec="float32", extra=["--hidden", "64"], timeout=100)
        root = fabric.stats()
    assert any("through the racks of" in line for line in lines), lines
    assert any("test accuracy" in line for line in lines), lines
    assert root["totals"]["completed"] > 0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_an_interrupted_run_leaves_no_namespace_behind(sig):
    # shaped links: 64 MiB take seconds, so the signal lands mid-run; Ctrl-C
    # as in a terminal even where this test runs in the background (a
    # background job inherits SIGINT ignored, and Python keeps it so)
    p = subprocess.Popen([sys.executable, "-m", "aggnet", "emulate", "--topology", TWO_RACKS, "allreduce",
                          "--workers", "2", "--size", "64MiB", "--rate", "100", "--uplink-rate", "100",
                          "--prefix", "agi"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        # interrupt once the workers are running
        while len(namespaces("agi")) < 9 or not _workers_running("agi"):
            assert p.poll() is None, p.stderr.read()[-2000:]
            assert time.monotonic() < deadline, "the fabric did not come up within 60 s"
            time.sleep(0.2)
        p.send_signal(sig)
        p.wait(60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    assert p.returncode != 0
    assert not namespaces("agi")


def _workers_running(prefix: str) -> bool:
    pids = subprocess.run(["ip", "netns", "pids", f"{prefix}1-w1"], capture_output=True, text=True).stdout.split()
    return bool(pids)


def _mininet_unavailable() -> str | None:
    if not os.path.exists("/usr/bin/python3"):
        return "no /usr/bin/python3 to run Mininet"
    r = subprocess.run(["/usr/bin/python3", "-c", "import mininet.net, mininet.nodelib"], capture_output=True)
    if r.returncode != 0:
        return "Debian's mininet is not installed (apt-get install mininet)"
    if shutil.which("brctl") is None:
        return "Mininet's LinuxBridge needs brctl (apt-get install bridge-utils)"
    return None


@pytest.mark.skipif(_mininet_unavailable() is not None, reason=str(_mininet_unavailable()))
@pytest.mark.slow
def test_the_same_topology_in_mininet_sums_exactly():
    r = subprocess.run(["/usr/bin/python3", str(REPO / "emulation" / "mininet_topo.py"), TWO_RACKS, "--workers", "2",
                        "--size", "4MiB", "--prefix", "mk", "--python", sys.executable],
                       capture_output=True, text=True, timeout=110)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["exact"] is True and summary["racks"] == 2 and summary["world"] == 4
    # Mininet's switches and their ports live in this namespace: all gone
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert "mk0s" not in links and "mkspine" not in links


@pytest.mark.timeout(330)  # 31 s alone; three times that and more beside the other pytest worker
@pytest.mark.slow
def test_bench_hybrid_keeps_gradients_in_the_racks_and_moves_what_the_plan_predicts(tmp_path):
    pytest.importorskip("torch", reason="the hybrid benchmark trains with PyTorch")
    out = tmp_path / "hybrid.json"
    r = subprocess.run([sys.executable, "-m", "aggnet", "emulate", "--topology",
                        str(REPO / "examples" / "topologies" / "service-racks.toml"), "bench-hybrid", "--workers", "2",
                        "--rate", "400", "--uplink-rate", "400", "--steps", "3", "--model", "narrow-cut",
                        "--prefix", "agh", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "aggnet plan picks" in r.stdout
    (model,) = json.loads(out.read_text())["models"]
    rows = {x["system"]: x for x in model["rows"]}
    assert set(rows) == {"hybrid", "aggnet", "gloo"}
    # a stage per rack: only the 32-wide cut's activations cross, no gradient
    assert rows["hybrid"]["cross_rack_bytes"] < 0.01 * rows["aggnet"]["cross_rack_bytes"]
    assert rows["hybrid"]["cross_rack_bytes"] < 2 * rows["hybrid"]["predicted_cross_rack_bytes"]
    for system in ("aggnet", "gloo"):
        x = rows[system]
        assert 0.95 <= x["cross_rack_bytes"] / x["predicted_cross_rack_bytes"] <= 1.05, x
    assert model["pick"] == "hybrid"
    assert not namespaces("agh")
