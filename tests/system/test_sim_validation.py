"""``aggnet sim validate`` against a real emulated rack: the model's
prediction beside the measured all-reduce, for aggnet and gloo, where the
shaped link sets the pace (so a calibration of this machine's CPU does not
decide the outcome)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from aggnet.emulation.netns import can_emulate

OK, WHY = can_emulate()
pytestmark = [pytest.mark.requires_netns, pytest.mark.skipif(not OK, reason=f"no network namespaces here: {WHY}")]


@pytest.mark.slow
def test_validate_puts_the_model_beside_the_emulated_rack_and_they_agree_where_the_link_binds(tmp_path):
    hw = tmp_path / "hw.json"
    hw.write_text(json.dumps({"base": "emulation", "name": "uncalibrated"}))
    out = tmp_path / "v.json"
    r = subprocess.run([sys.executable, "-m", "aggnet", "sim", "validate", "--hardware", str(hw), "--points",
                        "1x2@100", "--size", "4MiB", "--reps", "2", "--json", str(out)],
                       capture_output=True, text=True, timeout=110)
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["point"] == "1x2@100"
    for system in ("aggnet", "gloo"):
        got = row[system]
        assert got["bottleneck"] in ("host link", "rack aggregator link"), got
        assert len(got["times"]) == 2
        # 4 MiB through 100 Mbit/s: about a third of a second each way
        assert abs(got["error"]) < 0.25, (system, got["measured_s"], got["predicted_s"])
    assert "1x2@100" in r.stdout and "within 10%" in r.stdout
