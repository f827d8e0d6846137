"""The asynchronous pipeline across processes computes exactly what the
one-process emulator computes, in every mode, for 2 and 4 stages, with a
data-parallel stage's gradients averaged through a real aggnet service,
and with the backward reusing the forward's graph or another optimizer."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="pipelining needs PyTorch (pip install aggnet[torch])")

from harness import pipeline_workers as W  # noqa: E402
from harness.helpers import RunningService, free_port, run_workers  # noqa: E402

from aggnet.pipeline import MODES  # noqa: E402

STEPS = 50


def _run(world: int, stages: int, modes, address=None, job="pipe", backward="recompute", optimizer="sgd",
         device="cpu"):
    return run_workers("spawn://", world, W.pipeline_run, world, free_port(), stages, list(modes), STEPS, address,
                       job, backward, optimizer, device, timeout=240, start_method="spawn")


def _assert_identical(results, stages, mode, replicas=1, rtol=0.0, **kw):
    """Every rank's weights and losses are the emulator's (bit for bit, or
    within ``rtol``); returns the emulator's weights."""
    ref, losses = W.emulated(stages, mode, STEPS, replicas, **kw)
    for r in results:
        want = ref[r["stage"]][r["replica"]]
        for got, expected in zip(r["params"][mode], want, strict=True):
            np.testing.assert_allclose(got, expected, rtol=rtol, atol=rtol / 10,
                                       err_msg=f"{mode}: stage {r['stage']} replica {r['replica']}")
        if r["stage"] == stages - 1:
            np.testing.assert_allclose(r["losses"][mode], losses[r["replica"]], rtol=rtol)
    return ref


@pytest.mark.parametrize("stages", [2, 4])
def test_distributed_pipeline_equals_the_emulator_in_every_mode(stages):
    results = _run(stages, stages, MODES)
    for mode in MODES:
        _assert_identical(results, stages, mode)


@pytest.mark.slow
def test_a_replicated_stage_averages_its_gradients_through_aggnet():
    service = RunningService("zmq+tcp", shards=1)
    try:
        results = _run(4, 2, ["sync", "spectrain"], service.address, job="pipe-dp")
        pushes = sum(s["counters"].get("pushes", 0) for s in service.stats()["shards"])
    finally:
        service.stop()
    for mode in ("sync", "spectrain"):
        _assert_identical(results, 2, mode, replicas=2)
        assert all(r["waits"][mode]["reduce"] > 0 for r in results)
    # every update of every stage went through the service: 2 modes x 2
    # stages x STEPS all-reduces, each pushed by both replicas
    assert pushes >= 2 * 2 * STEPS * 2
    # two replicas of two stages: the copies of each stage hold the same weights
    for k in range(2):
        a, b = [r["params"]["spectrain"] for r in results if r["stage"] == k]
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x, y)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
@pytest.mark.slow
def test_stages_on_the_gpu_equal_the_emulator_on_the_gpu_and_follow_the_cpu():
    # two replicas of two stages sharing one GPU: passes on the device,
    # activations, gradients and the replicas' average through host memory
    service = RunningService("zmq+tcp", shards=1)
    try:
        results = _run(4, 2, ["sync", "spectrain"], service.address, job="pipe-gpu", device="cuda")
    finally:
        service.stop()
    for mode in ("sync", "spectrain"):
        # the same kernels in other processes: equal unless the device
        # library picks another algorithm for one of them
        on_gpu = _assert_identical(results, 2, mode, replicas=2, rtol=1e-5, device="cuda")
        # the device rounds its sums its own way, which 50 updates carry
        # on: close to the CPU's weights, far closer than another mode's
        on_cpu, _ = W.emulated(2, mode, STEPS, 2)
        for k in range(2):
            for got, want in zip(on_gpu[k][0], on_cpu[k][0], strict=True):
                np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4, err_msg=f"{mode}: stage {k}")


@pytest.mark.parametrize("backward,optimizer", [("reuse", "sgd"), ("recompute", "adam")])
@pytest.mark.slow
def test_reused_graphs_and_other_optimizers_stay_identical_to_the_emulator(backward, optimizer):
    results = _run(2, 2, ["spectrain"], backward=backward, optimizer=optimizer)
    _assert_identical(results, 2, "spectrain", backward=backward, optimizer=optimizer)


def test_a_stage_whose_neighbour_is_gone_fails_naming_it_within_its_timeout():
    rank0, _ = run_workers("spawn://", 2, W.pipeline_with_a_dead_stage, 2, free_port(), 5.0, timeout=120,
                           start_method="spawn")
    # a send that fails, or a receive that waits out its timeout: either way the peer and batch are named
    assert "rank 1" in rank0 and "batch 0" in rank0 and "is that rank alive" in rank0, rank0
    assert float(rank0.rsplit("(", 1)[1].rstrip("s)")) < 30
