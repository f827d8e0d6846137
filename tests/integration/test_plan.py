"""``aggnet plan``: the model's layers profiled here, the placements
weighed by what they put on the uplinks, the pick explained; fast on a
long chain; a bad model spec is one line."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="aggnet plan profiles torch models")

from aggnet.parallel import cost  # noqa: E402
from aggnet.parallel.profile import LayerProfile, Profile  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TWO_RACKS = str(ROOT / "examples/topologies/two-racks.toml")


def _plan(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "aggnet", "plan", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_a_narrow_cut_goes_to_a_stage_per_rack_and_wide_activations_to_data_parallelism(tmp_path):
    out = _plan("--topology", TWO_RACKS, "--model", "aggnet.parallel.models:narrow_cut", "--json",
                str(tmp_path / "narrow.json"))
    assert out.returncode == 0, out.stderr
    assert "pick: hybrid stage-per-rack" in out.stdout
    assert "gradients aggregated in rack0, nothing to the root" in out.stdout
    narrow = json.loads((tmp_path / "narrow.json").read_text())
    alts = {a["name"]: a for a in narrow["alternatives"]}
    # the cut falls at the 32-wide bottleneck
    cut_after = alts["hybrid stage-per-rack"]["stages"][0][1] - 1
    assert narrow["layers"][cut_after]["out_bytes_per_sample"] == 32 * 4
    out = _plan("--topology", TWO_RACKS, "--model", "aggnet.parallel.models:wide_activation", "--json",
                str(tmp_path / "wide.json"))
    assert out.returncode == 0, out.stderr
    wide = json.loads((tmp_path / "wide.json").read_text())
    assert wide["pick"] in ("aggnet racks", "gloo ring")
    assert f"pick: {wide['pick']}" in out.stdout


def test_a_hundred_layers_and_thirty_two_stages_plan_in_under_five_seconds(tmp_path):
    # one rack of 32 ranks (the most a rack takes): one replica's 32 stages;
    # the cut of 64 stages alone is timed in tests/unit/test_partition.py
    lines = ['job = "long"', "[links]", "host_mbit = 400", "uplink_mbit = 100", "[[racks]]", 'name = "r0"',
             'ranks = "0-31"', 'aggregator = { kind = "service", address = "zmq+tcp://127.0.0.1:43001" }']
    topology = tmp_path / "32.toml"
    topology.write_text("\n".join(lines) + "\n")
    t0 = time.monotonic()
    out = _plan("--topology", str(topology), "--model", "aggnet.parallel.models:chain", "--stages", "32",
                "--json", str(tmp_path / "p.json"))
    wall = time.monotonic() - t0
    assert out.returncode == 0, out.stderr
    plan = json.loads((tmp_path / "p.json").read_text())
    hybrid = next(a for a in plan["alternatives"] if a["name"] == "hybrid pipeline-in-rack")
    assert hybrid["feasible"] and len(hybrid["stages"]) == 32
    # what planning costs a core (the profile and the cut, past torch's
    # import): a loaded machine stretches the wall clock, not this
    assert plan["cpu_seconds"] < 5.0, plan
    assert wall < 5.0 + 10.0  # and the interpreter's own start on a loaded machine


@pytest.mark.parametrize("model, says", [
    ("nomodule", "module:factory"),
    ("aggnet.parallel.models:nothing", "has no attribute"),
])
def test_a_bad_model_is_one_line_naming_it(model, says):
    out = _plan("--topology", TWO_RACKS, "--model", model)
    assert out.returncode == 2
    assert says in out.stderr and "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_layers_are_timed_on_the_device_asked_for_or_the_plan_says_in_one_line_why_not(tmp_path):
    import torch

    args = ("--topology", TWO_RACKS, "--model", "aggnet.parallel.models:narrow_cut", "--json", str(tmp_path / "p.json"))
    out = _plan(*args, "--device", "cuda")
    if torch.cuda.is_available():
        assert out.returncode == 0, out.stderr
        assert json.loads((tmp_path / "p.json").read_text())["device"] == "cuda"
    else:
        assert out.returncode == 2 and "no CUDA GPU" in out.stderr and "--device cpu" in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    out = _plan(*args, "--device", "tpu7")
    assert out.returncode == 2 and "'tpu7' is not a device" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_uplink_bytes_follow_each_system_s_traffic():
    # two layers of known sizes: 1000 B of parameters, 100 B a sample at the cut
    prof = Profile((LayerProfile("a", 1e-6, 100, 600, 0), LayerProfile("b", 1e-6, 4, 400, 0)), 8, "cpu")
    links = cost.Links(400, 100, 9000)
    result = cost.plan(prof, TWO_RACKS, batch=64, links=links)
    alts = {a.name: a for a in result.alternatives}
    tcp, udp = cost.framing("tcp", 9000), cost.framing("udp", 9000)
    n = 8
    msg = cost.GLOO_MESSAGE_BYTES
    assert alts["gloo ring"].uplinks == [(2 * (n - 1) / n * 1000 * tcp + 2 * (n - 1) * msg,) * 2] * 2
    # one packet of 2048 values (8282 bytes on the wire) primes its slot
    # and one agrees the exponent, beside the gradient's own packets
    assert alts["aggnet racks"].uplinks == [(1000 * udp + 2 * 8282,) * 2] * 2
    # the activations of the whole batch forward, their gradients back
    # (one message per replica each way: 4 replicas of a stage per rack)
    assert alts["hybrid stage-per-rack"].uplinks == [(64 * 100 * tcp + 4 * msg,) * 2] * 2
    # each stage a job of its own
    assert alts["hybrid pipeline-in-rack"].uplinks == [(1000 * udp + 4 * 8282,) * 2] * 2


def test_ddp_buckets_close_at_one_mebibyte_then_twenty_five():
    MiB = 1 << 20
    assert cost.ddp_buckets([600, 400]) == [1000]
    assert cost.ddp_buckets([2 * MiB, 30 * MiB, 1024]) == [30 * MiB + 1024, 2 * MiB]
