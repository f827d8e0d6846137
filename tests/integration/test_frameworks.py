"""Lightning, Accelerate and the HF Trainer train on the aggnet backend by
the recipes in docs/torch.md (examples/frameworks_train.py, which users
run as it is), two processes under torchrun each, and end
with the weights the same run on gloo ends with: Lightning's
``self.log(..., sync_dist=True)`` (an integer average), Accelerate and
the Trainer keeping the group ``aggnet.torch.init_process_group()``
made."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch.distributed")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples/frameworks_train.py"
MODULES = {"lightning": "lightning", "accelerate": "accelerate", "trainer": "transformers"}


def _run(framework: str, backend: str, tmp_path) -> dict:
    out = tmp_path / f"{framework}-{backend}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("AGGNET_ADDRESS", None)  # the embedded aggregator rank 0 starts
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(EXAMPLE),
                        framework, "--backend", backend, "--out", str(out)],
                       capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.timeout(500)  # two torchrun runs of up to 240 s each; Lightning's took 84 s beside the other worker
@pytest.mark.parametrize("framework", ["lightning", "accelerate", "trainer"])
def test_framework_trains_on_aggnet_like_on_gloo(framework, tmp_path):
    pytest.importorskip(MODULES[framework], reason=f"{MODULES[framework]} is not installed (pip install "
                                                   f"'aggnet[frameworks]')")
    agg, gloo = _run(framework, "aggnet", tmp_path), _run(framework, "gloo", tmp_path)
    assert agg["group_backend"] == "aggnet" and gloo["group_backend"] == "gloo"
    # float32 through aggnet averages two ranks exactly as gloo does
    assert agg["weights"] == gloo["weights"]
    assert agg["losses"] == gloo["losses"]
    if framework == "lightning":
        assert agg["logged"] == gloo["logged"]
