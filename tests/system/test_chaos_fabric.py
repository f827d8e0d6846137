"""Training through the faults of a real fabric: DDP across two racks of
aggregator services under a root, in network namespaces, while a rack
shard and a root shard are killed and restarted, a worker's cable is
pulled for 2 s and a spine link loses 10% of its packets for 3 s. With
the int32 codec the faulted training ends with the very weights of an
undisturbed one. And the chaos command, briefly, as its long form runs."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from aggnet.emulation import fabric_runs, faults
from aggnet.emulation.fabric import Fabric
from aggnet.emulation.fabric_plan import plan
from aggnet.emulation.netns import can_emulate

OK, WHY = can_emulate()
pytestmark = [pytest.mark.requires_netns, pytest.mark.skipif(not OK, reason=f"no network namespaces here: {WHY}"),
              pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]
SERVICE_RACKS = str(REPO / "examples" / "topologies" / "service-racks.toml")
#: the demo's epochs: long enough that the faults land while it trains
EPOCHS = 60


def _weights(lines: list[str]) -> str:
    done = [line for line in lines if "test accuracy" in line]
    assert done, lines
    return done[0].split("(weights ")[1].rstrip(")")


@pytest.mark.slow
def test_ddp_across_racks_survives_link_and_shard_faults_bit_for_bit():
    pytest.importorskip("torch", reason="the demo trains with PyTorch")
    pytest.importorskip("sklearn", reason="the demo's data set ships with scikit-learn")
    pl = plan(SERVICE_RACKS, workers=2, host_mbit=0, uplink_mbit=0)
    extra = ["--hidden", "256", "--seed", "3"]
    with Fabric(pl, prefix="agz") as fabric:
        fabric.start_aggregators(restart=True)
        fabric.wait_reachable()
        quiet = fabric_runs.run_demo(fabric, EPOCHS, "int32", extra=extra, timeout=300)
        training = threading.Event()
        injected: list[faults.Fault] = []
        failure: list[BaseException] = []

        def inject():
            try:
                assert training.wait(120), "the training never printed its first epoch"
                injected.append(faults.kill_shard(fabric, 0, 0))
                injected.append(faults.pull_cable(fabric, 3, 2.0))
                injected.append(faults.loss_burst(fabric, 1, 0.10, 3.0))
                injected.append(faults.kill_shard(fabric, None, 1))
            except BaseException as exc:  # reported by the test's thread
                failure.append(exc)

        def on_line(line: str) -> None:
            if "epoch   1" in line:
                training.set()

        injector = threading.Thread(target=inject, daemon=True)
        injector.start()
        faulted = fabric_runs.run_demo(fabric, EPOCHS, "int32", extra=extra, timeout=300, on_line=on_line)
        finished = time.monotonic()
        injector.join(120)
        root, racks = fabric.stats(None), [fabric.stats(i) for i in range(2)]
    assert not failure, failure
    assert [f.what for f in injected] == ["rack 0 shard 0 killed", "worker 3's link down",
                                          "10% loss on rack 1's spine link", "root shard 1 killed"]
    # every fault was over before the training ended: survived, not outrun
    assert all(f.at + f.seconds < finished for f in injected), ([f.as_dict() for f in injected], finished)
    assert _weights(faulted) == _weights(quiet)
    # each fault shows where it happened
    assert injected[1].counted["carrier_changes"] >= 2, injected[1]
    assert injected[2].counted["packets_dropped"] > 0, injected[2]
    assert root["restarts"] == 1 and racks[0]["restarts"] == 1 and racks[1]["restarts"] == 0
    counters = lambda s: [sh["counters"] for sh in s["shards"] if sh]  # noqa: E731
    assert sum(c.get("racks_disconnected", 0) for c in counters(root)) >= 1
    assert sum(c.get("uplink_rejoins", 0) for r in racks for c in counters(r)) >= 1


@pytest.mark.slow
def test_the_chaos_command_checks_every_allreduce_and_reports_each_fault(tmp_path):
    out = tmp_path / "chaos.json"
    r = subprocess.run([sys.executable, "-m", "aggnet", "emulate", "--topology", SERVICE_RACKS, "chaos",
                        "--workers", "2", "--rate", "0", "--uplink-rate", "0", "--minutes", "0.1", "--every", "2.5",
                        "--size", "1MiB", "--prefix", "agv", "--json", str(out)],
                       capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    rec = json.loads(out.read_text())
    assert rec["problems"] == [] and rec["wrong_results"] == 0 and rec["allreduces"] > 0
    kinds = {f["what"].split(" ")[0] for f in rec["faults"]}
    assert {"rack", "worker", "10%", "root"} <= kinds, rec["faults"]
    assert set(rec["aggregators"]) == {"rack 0", "rack 1", "root"}
    assert "every all-reduce exact" in r.stdout
