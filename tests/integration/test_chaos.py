"""Training through faults: DDP through two racks of aggregator services
under a root while a rack's shard and a root shard are killed (SIGKILL)
and restarted mid-training. With the int32 codec every sum is exact, so
the faults may cost time but must not change one bit of the weights."""

from __future__ import annotations

import threading
import time

import pytest

from harness import ddp_workers as W
from aggnet.bench.soak import kill_shard
from harness.helpers import free_port, run_workers
from harness.racks import Racks

pytestmark = pytest.mark.timeout(300)

STEPS = 150


def _root_results(r: Racks) -> int:
    # a loaded machine can keep the root's answer waiting while its shards
    # take rejoining racks back: the callers' deadlines bound the wait
    return sum(s["counters"].get("results", 0) for s in r.stats(r.root, timeout=30)["shards"] if s is not None)


@pytest.mark.slow
def test_ddp_through_racks_survives_shard_kills_bit_for_bit():
    r = Racks("service", root_args=["--restart"], rack_args=["--restart"])
    try:
        options = {"topology": r.topology, "codec": "int32", "steps": STEPS}
        quiet = run_workers("spawn://", 4, W.ddp_run, 4, free_port(), "aggnet", options, timeout=240,
                            start_method="spawn")
        base = _root_results(r)
        faults: list[str] = []
        failure: list[BaseException] = []

        def inject():
            try:
                # a rack shard once training is under way, then a root shard
                for when, proc, shard, what in ((base + 20, r.racks[0], 0, "rack 0 shard 0"),
                                                (base + 80, r.root, 1, "root shard 1")):
                    deadline = time.monotonic() + 120
                    while _root_results(r) < when:
                        assert time.monotonic() < deadline, f"training never reached the point to kill {what}"
                        time.sleep(0.1)  # each look is a STATS through every root shard
                    kill_shard(proc.address, shard)
                    faults.append((what, time.monotonic()))
            except BaseException as exc:  # reported by the test thread
                failure.append(exc)

        injector = threading.Thread(target=inject, daemon=True)
        injector.start()
        faulted = run_workers("spawn://", 4, W.ddp_run, 4, free_port(), "aggnet", options, timeout=240,
                              start_method="spawn")
        finished = time.monotonic()
        injector.join(120)
        assert not failure, failure
        assert [what for what, _ in faults] == ["rack 0 shard 0", "root shard 1"], faults
        # both successors served before the training ended: the faults were survived, not outrun
        assert all(at < finished for _, at in faults), (faults, finished)
        for q, f in zip(quiet, faulted):
            assert f["calls"] == [STEPS]
            for a, b in zip(q["params"][0], f["params"][0]):
                assert a.tobytes() == b.tobytes()
        # every fault shows in the counters
        root = [s["counters"] for s in r.stats(r.root)["shards"]]
        racks = [s["counters"] for rack in r.racks for s in r.stats(rack)["shards"]]
        assert sum(c.get("racks_disconnected", 0) for c in root) >= 1, root
        assert sum(c.get("uplink_rejoins", 0) for c in racks) >= 1, racks
        assert r.stats(r.root)["restarts"] == 1 and r.stats(r.racks[0])["restarts"] == 1
    finally:
        r.stop()
