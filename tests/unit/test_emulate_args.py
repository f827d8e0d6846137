"""What ``aggnet emulate`` refuses before it builds anything: one line
that says what to do instead, exit status 2, no namespace made."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv, says", [
    (["demo", "--codec", "fp16"], "cannot travel one rack's switch protocol"),
    (["--topology", str(REPO / "examples/topologies/two-racks.toml"), "demo", "--codec", "bf16"],
     "cannot travel the switch protocol (it adds int32) of rack0, rack1"),
    (["chaos"], "runs across the racks of a topology: add --topology FILE"),
    (["--topology", str(REPO / "examples/topologies/service-racks.toml"), "chaos", "--minutes", "0"],
     "--minutes and --every must be positive"),
    (["--topology", str(REPO / "examples/topologies/p4-racks.toml"), "bench-hybrid"],
     "bench-hybrid's stages all-reduce in groups that are jobs of their own"),
], ids=["fp16-one-rack", "bf16-switch-racks", "chaos-without-topology", "chaos-no-time", "hybrid-on-p4"])
def test_emulate_refuses_in_one_line_before_building_anything(argv, says):
    r = subprocess.run([sys.executable, "-m", "aggnet", "emulate", *argv], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert says in r.stderr and r.stderr.count("\n") == 1, r.stderr
