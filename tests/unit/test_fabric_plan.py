"""What a multi-rack emulation builds for P4 racks, decided from the
topology file before any namespace exists: BMv2 in each P4 rack's ToR at
the rack's .253, its workers on ports 0..W-1 and the uplink on port W, a
window BMv2 keeps up with, and the topology the workers read."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from aggnet.emulation.fabric_plan import BMV2_SLOTS, Names, plan, switch_mac
from aggnet.protocol import topology

REPO = Path(__file__).resolve().parents[2]
P4_RACKS = REPO / "examples/topologies/p4-racks.toml"


def test_a_p4_rack_runs_bmv2_in_its_tor_under_the_host_root():
    pl = plan(str(P4_RACKS), workers=3)
    assert pl.root.kind == "host-switch" and pl.root.address == "udp://10.77.0.1:42606"
    for i, rp in enumerate(pl.racks):
        agg = rp.aggregator
        assert agg.kind == "p4" and agg.address == f"udp://10.77.{i + 1}.253:42606"
        assert (agg.switch_ip, agg.switch_mac) == (f"10.77.{i + 1}.253", switch_mac(i))
        assert agg.ports == (0, 1, 2) and agg.uplink_port == 3
        assert agg.slots == BMV2_SLOTS  # the file gives none
    # the workers' topology: the emulated addresses, loadable, without the fallbacks
    emulated = topology.loads(pl.topology_toml(Names("agf")), "emulated.toml")
    assert [r.aggregator.address for r in emulated.racks] == ["udp://10.77.1.253:42606", "udp://10.77.2.253:42606"]
    assert all(r.fallback is None for r in emulated.racks)


def test_mininet_builds_no_p4_racks_and_says_so():
    r = subprocess.run([sys.executable, "-m", "aggnet.emulation.fabric_plan", str(P4_RACKS)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr == ("aggnet emulation plan: P4 racks (rack0, rack1) are emulated in network namespaces "
                        "(`aggnet emulate --topology FILE`), not in Mininet\n")
