"""The P4 program on BMv2 in an emulated rack's ToR: an all-reduce and the
DDP demo through it, end to end."""

from __future__ import annotations

import pytest

from aggnet.emulation import rack_runs
from aggnet.emulation.bmv2 import can_run_bmv2
from aggnet.emulation.netns import Rack, can_emulate

OK, WHY = can_emulate()
if OK:
    OK, WHY = can_run_bmv2()
pytestmark = [pytest.mark.requires_bmv2, pytest.mark.requires_netns,
              pytest.mark.skipif(not OK, reason=f"cannot run BMv2 in a rack here: {WHY}")]


def test_allreduce_through_bmv2_equals_the_host_switch_mode():
    size = 128 * 1024
    with Rack(3, aggregator=False, bridge=False, prefix="agp") as rack:
        switch = rack_runs.RackSwitch(rack)
        try:
            through_p4 = rack_runs.run_system(rack, "aggnet", size, reps=1, switch=switch, elements=64)
            counters = switch.counters()
        finally:
            switch.stop()
    with Rack(3, prefix="agh") as rack:
        agg = rack_runs.start_aggregator(rack, elements=64)
        try:
            through_host = rack_runs.run_system(rack, "aggnet", size, reps=1, elements=64)
        finally:
            agg.stop()
    # integer sums of the same quantized blocks: bit-identical results
    assert through_p4["checksums"] == through_host["checksums"]
    assert len({tuple(c) for c in through_p4["checksums"]}) == 1
    assert counters["events"]["completed"] >= size // 4 // 64
    assert set(counters["drops"]) <= {"type", "duplicate"}  # LEAVEs go to the control plane; retransmissions


def test_ddp_demo_through_bmv2():
    pytest.importorskip("torch", reason="the demo trains with PyTorch")
    pytest.importorskip("sklearn", reason="the demo's data set ships with scikit-learn")
    with Rack(2, aggregator=False, bridge=False, prefix="agq") as rack:
        switch = rack_runs.RackSwitch(rack)
        try:
            lines = rack_runs.run_demo(rack, epochs=1, codec="float32", switch=switch, extra=["--hidden", "32"],
                                       timeout=600)
        finally:
            switch.stop()
    assert any("via aggnet (float32) through udp://10.77.0.253" in line for line in lines), lines
    assert any("test accuracy" in line for line in lines), lines
