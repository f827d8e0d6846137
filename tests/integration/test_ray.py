"""aggnet on a real Ray cluster on this machine (a head and two rack nodes,
each a process of its own, by examples/ray_train.py, which users run as it
is): the topology's aggregators run as actors on their racks' labeled
nodes, Ray Train trains through them to gloo's weights, and an aggregator
actor killed mid-training is restarted by Ray while the training goes on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray.train", reason="Ray is not installed (pip install 'aggnet[ray]')")

# a Ray cluster keeps both of this machine's cores busy for a minute: it
# runs in the system tests' lane (one at a time), never beside an
# emulation whose shaped links and timeouts it would disturb
pytestmark = pytest.mark.xdist_group("system")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples/ray_train.py"


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0")
    env.pop("AGGNET_ADDRESS", None)
    env.pop("RAY_ADDRESS", None)
    return env


@pytest.mark.timeout(700)
@pytest.mark.slow
def test_ray_train_through_aggregator_actors_matches_gloo_and_survives_an_actor_kill(tmp_path):
    out = tmp_path / "ray.json"
    r = subprocess.run([sys.executable, str(EXAMPLE), "--kill-at", "8", "--out", str(out)], capture_output=True,
                       text=True, timeout=600, env=_env(), cwd=tmp_path)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    got = json.loads(out.read_text())
    assert got["aggnet_backend"] == "aggnet" and got["gloo_backend"] == "gloo"
    assert got["workers"] == 4 and got["racks"] == 2
    assert got["max_weight_difference"] <= 1e-6, got
    # Ray restarted the killed actor, and only it, on its rack's node
    assert got["restarted"] == {"root": False, "rack rack0": True, "rack rack1": False}, got
    aggs = got["aggregators"]
    assert all(a["alive"] for a in aggs.values())
    assert len({aggs[role]["node_id"] for role in aggs}) == 3, "each aggregator on its own labeled node"


@pytest.mark.timeout(200)
@pytest.mark.slow
def test_aggregators_ray_cannot_place_are_refused_naming_the_label_or_the_cpus(tmp_path):
    one_rack = ('job = "r"\n[[racks]]\nname = "rack0"\nranks = "0"\n[racks.aggregator]\nkind = "service"\n'
                'address = "zmq+tcp://127.0.0.1:0"\nshards = 4\n')
    script = (
        "import ray, sys\n"
        "from aggnet.protocol.topology import TopologyError\n"
        "from aggnet.ray import Aggregators\n"
        "ray.init(num_cpus=2, include_dashboard=False, logging_level='ERROR', labels={'aggnet.io/rack': 'rack0'})\n"
        "try:\n"
        f"    Aggregators({str(ROOT / 'examples/topologies/service-racks.toml')!r})\n"
        "except TopologyError as exc:\n"
        "    print(exc)\n"
        "try:\n"
        f"    Aggregators({one_rack!r}, start_timeout=2)\n"
        "except TimeoutError as exc:\n"
        "    print(exc)\n"
        "    sys.exit(3)\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=150, env=_env(),
                       cwd=tmp_path)
    assert r.returncode == 3, (r.stdout + r.stderr)[-4000:]
    said = r.stdout.splitlines()  # Ray's scheduler prints tips of its own between
    assert any(line.endswith(": no live Ray node is labeled aggnet.io/rack=rack1; start each rack's nodes with ray "
                             "start --labels aggnet.io/rack=rack1 (or Cluster.add_node(labels=...))")
               for line in said), said
    # four shards ask four CPUs of a two-CPU node
    assert ("rack rack0: no Ray node took its aggregator within 2s; it asks for 4 CPU(s) on a node labeled "
            "{'aggnet.io/rack': 'rack0'}: free them, or pass a smaller cpus_per_shard") in said, said
