"""docs/p4.md's control-plane walk-through, run as written: in a network
namespace of its own, with BMv2 and this environment's aggnet on PATH."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import uuid

import pytest

from aggnet.emulation.bmv2 import can_run_bmv2
from aggnet.emulation.netns import can_emulate

OK, WHY = can_emulate()
if OK:
    OK, WHY = can_run_bmv2()
pytestmark = [pytest.mark.requires_bmv2, pytest.mark.requires_netns,
              pytest.mark.skipif(not OK, reason=f"cannot run BMv2 in a namespace here: {WHY}")]

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "p4.md"


def _walkthrough() -> str:
    text = DOC.read_text()
    section = text[text.index("## Control plane"):]
    start = section.index("```bash\n") + len("```bash\n")
    return section[start:section.index("```", start)]


@pytest.mark.slow
def test_the_p4_docs_walkthrough_runs_as_written():
    ns = f"agdoc{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        env = dict(os.environ, PATH=f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}")
        script = "set -euo pipefail\nip link set lo up\n" + _walkthrough()
        r = subprocess.run(["ip", "netns", "exec", ns, "bash", "-c", script], capture_output=True, text=True,
                           timeout=180, env=env)
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
        # the job was installed, counted and removed again
        assert "myjob" in r.stdout, r.stdout[-3000:]
    finally:
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        for pid in pids:  # simple_switch_grpc, if the script stopped before its kill
            subprocess.run(["kill", "-9", pid], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
