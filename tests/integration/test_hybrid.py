"""Hybrid training (pipeline stages, each stage's copies all-reduced
through aggnet) computes what single-process training computes on the
same global batch, for both placements over two racks of aggregators; in
the paper's placement no gradient reaches the root.

Every aggregator is a real ``aggnet serve`` process on loopback (a
service root and two service racks), every rank a process of its own,
the pipeline torch's own over gloo."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="hybrid training needs PyTorch (pip install aggnet[torch])")

from harness import hybrid_workers as W  # noqa: E402
from harness.helpers import free_port, run_workers  # noqa: E402
from harness.racks import Racks  # noqa: E402

from aggnet.client import stats as stats_cli  # noqa: E402

STEPS = 5


@pytest.fixture(scope="module", params=[2, 4], ids=["2x2-ranks", "2x4-ranks"])
def racks(request):
    r = Racks("service", shards=1, per_rack=request.param)
    yield r
    r.stop()


def _reference_by_stage(bounds) -> list:
    """The single-process parameters, split as the stages hold them."""
    ref = W.single_process(STEPS)
    per_layer = [len(list(layer.parameters())) for layer in W.make_model()]
    out, i = [], 0
    for a, b in bounds:
        n = sum(per_layer[a:b])
        out.append(ref[i:i + n])
        i += n
    return out


def _run(racks, placement: str, stages: int, micro_batches: int = 1, gradients: str = "aggnet",
         schedule: str = "gpipe", device: str = "cpu", hook_options: dict | None = None):
    job = f"hyb-{uuid.uuid4().hex[:8]}"
    return run_workers("spawn://", racks.world, W.hybrid_run, racks.world, free_port(), racks.topology, placement,
                       stages, STEPS, micro_batches, gradients, job, schedule, device, hook_options, timeout=240,
                       start_method="spawn")


def _root_pushes(racks) -> int:
    """Partials the root has summed, over all its shards and jobs."""
    return sum(s["counters"].get("pushes", 0) for s in stats_cli.query(racks.root.address)["shards"])


def _check_equal(results, stages: int, rtol: float = 1e-5):
    ref = _reference_by_stage(W.BOUNDS[stages])
    for r in results:
        for got, want in zip(r["params"], ref[r["stage"]], strict=True):
            np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol / 10)


@pytest.mark.slow
def test_stage_per_rack_trains_like_one_process_and_keeps_gradients_in_the_rack(racks):
    # 4 ranks: two micro-batches a step (GPipe); 8 ranks: the paper's one
    micro_batches = 2 if racks.world == 4 else 1
    before = _root_pushes(racks)
    results = _run(racks, "stage-per-rack", 2, micro_batches)
    _check_equal(results, 2)
    for r in results:
        g = r["group"]
        assert not g["crosses_racks"] and g["members"] == g["world"] == racks.world // 2
        # every step's gradients went through aggnet; with micro-batches
        # DDP's unused-parameter search (hybrid.py) all-reduces the first
        # step's first micro-batch too, which the sum makes no difference to
        assert r["hook_calls"] == STEPS + (micro_batches > 1)
    # each stage's job completed in its rack: nothing reached the root
    assert _root_pushes(racks) == before
    last = [r for r in results if r["stage"] == 1]
    assert all(len(r["losses"][0]) == micro_batches for r in last)


@pytest.mark.slow
def test_pipeline_in_rack_trains_like_one_process_through_the_root(racks):
    # 4 ranks: two stages in each rack, 1F1B over two micro-batches;
    # 8 ranks: four stages in each rack, four micro-batches
    stages, micro_batches = (2, 2) if racks.world == 4 else (4, 4)
    before = _root_pushes(racks)
    results = _run(racks, "pipeline-in-rack", stages, micro_batches, schedule="1f1b")
    _check_equal(results, stages)
    names = {r["group"]["name"] for r in results}
    assert len(names) == stages  # one aggnet job per stage
    for r in results:
        assert r["group"]["crosses_racks"] and r["group"]["members"] == racks.world // (2 * stages)
    # each step, each stage: one partial per rack and chunk (plus the size agreement)
    assert _root_pushes(racks) - before >= stages * 2 * STEPS


@pytest.mark.parametrize("racks", [2], indirect=True, ids=["2x2-ranks"])
@pytest.mark.slow
def test_gloo_gradients_give_the_same_training(racks):
    _check_equal(_run(racks, "stage-per-rack", 2, 1, gradients="gloo"), 2)


@pytest.mark.parametrize("racks", [2], indirect=True, ids=["2x2-ranks"])
@pytest.mark.slow
def test_stage_groups_through_the_device_staging_train_like_one_process(racks):
    # the path a GPU stage's gradients take (the stager's hand-over thread,
    # its futures, DDP's micro-batches under no_sync), run on CPU stages
    results = _run(racks, "stage-per-rack", 2, 2, schedule="1f1b", hook_options={"staging": "always"})
    _check_equal(results, 2)
    for r in results:
        assert r["hook_calls"] == STEPS + 1
        assert r["staged"].get("cpu", 0) >= STEPS, r["staged"]  # every bucket through the stager


@pytest.mark.parametrize("racks", [2], indirect=True, ids=["2x2-ranks"])
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
@pytest.mark.slow
def test_stages_on_the_gpu_train_like_one_process(racks):
    # four ranks sharing one GPU: each stage's layers and gradients on the
    # device, activations across the cut through host memory, the stage
    # groups' gradients staged by the hook; 1F1B over two micro-batches
    results = _run(racks, "stage-per-rack", 2, 2, schedule="1f1b", device="cuda")
    for r in results:
        assert r["devices"] == ["cuda:0"], r["devices"]
        assert r["hook_calls"] == STEPS + 1
        assert r["staged"].get("cuda:0", 0) >= STEPS, r["staged"]
    # the device's sums round differently from the CPU's reference
    _check_equal(results, 2, rtol=1e-4)


_ONE_RANK = """
import sys, json, torch, torch.distributed as dist, torch.nn as nn
from aggnet.parallel import HybridParallel, build_layout
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
layout = build_layout(sys.argv[1], 1, "stage-per-rack")
said = []
for gradients, options in json.loads(sys.argv[3]):
    try:
        HybridParallel(nn.Sequential(nn.Linear(2, 2)), layout, ((0, 1),), loss_fn=nn.MSELoss(),
                       sample=torch.zeros(2, 2), gradients=gradients, hook_options=options)
        said.append("built")
    except ValueError as exc:
        said.append(str(exc))
dist.destroy_process_group()
print(json.dumps(said))
"""


def test_hook_options_no_hook_takes_or_the_layout_sets_are_refused_in_one_line(tmp_path):
    import json
    import subprocess
    import sys

    (tmp_path / "one.toml").write_text('job = "one"\n[[racks]]\nname = "rack0"\nranks = "0"\n[racks.aggregator]\n'
                                       'kind = "service"\naddress = "zmq+tcp://127.0.0.1:1"\nshards = 1\n')
    cases = [["gloo", {"staging": "always"}], ["aggnet", {"job": "mine", "staging": "always"}],
             ["aggnet", {"staging": "always"}]]
    r = subprocess.run([sys.executable, "-c", _ONE_RANK, str(tmp_path / "one.toml"), str(tmp_path / "store"),
                        json.dumps(cases)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    gloo, layout_s, fine = json.loads(r.stdout.strip().splitlines()[-1])
    assert "gradients='gloo' uses none" in gloo
    assert "HybridParallel sets job itself" in layout_s
    assert fine == "built"
