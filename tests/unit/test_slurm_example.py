"""examples/slurm/train.sbatch is a script bash can run (no Slurm here to
run it whole): it parses, starts aggregators with aggnet up by node name,
and trains only once the top aggregator answered."""

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "examples/slurm/train.sbatch"


def test_the_slurm_example_parses_and_waits_for_its_aggregators():
    r = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    text = SCRIPT.read_text()
    up, wait, train = text.index("aggnet up"), text.index("aggnet stats"), text.index("torchrun")
    assert up < wait < train
    assert '--host \\"\\$(hostname -s)\\"' in text  # each node starts what the topology places on it
