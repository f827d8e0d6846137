"""Stale-gradient DDP through a real aggnet service: two ranks apply each
step's all-reduced gradients ``s`` steps late (with and without weight
prediction) and end bit-identical to each other and to the one-process
emulation the experiments run on."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="stale-gradient DDP needs PyTorch (pip install aggnet[torch])")

from harness import stale_workers as W  # noqa: E402
from harness.helpers import RunningService, free_port, run_workers  # noqa: E402

from aggnet.torch import AggnetState, StaleStep  # noqa: E402

STEPS = 20


@pytest.fixture(scope="module")
def service():
    s = RunningService("zmq+tcp", shards=2)
    yield s
    s.stop()


@pytest.mark.parametrize("staleness,predict", [(0, False), (1, False), (1, True), (2, True)],
                         ids=["sync", "s1", "s1-predicted", "s2-predicted"])
def test_stale_ddp_equals_its_emulation_and_ranks_stay_identical(service, staleness, predict):
    job = f"stale-{uuid.uuid4().hex[:8]}"
    results = run_workers("spawn://", 2, W.ddp_run, 2, free_port(), service.address, job, STEPS, staleness, predict,
                          timeout=240, start_method="spawn")
    ref = W.emulated(2, STEPS, staleness, predict)
    for rank, r in enumerate(results):
        for got, want in zip(r["params"], ref[rank], strict=True):
            np.testing.assert_array_equal(got, want)
        # the first s steps had nothing to apply yet
        assert r["updates"] == STEPS - staleness
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
@pytest.mark.parametrize("predict", [False, True], ids=["s2", "s2-predicted"])
def test_stale_ddp_on_the_device_keeps_its_ranks_identical_and_follows_its_emulation(service, predict):
    """CUDA buckets take the stale path without a blocking copy (pinned
    memory, results back on a stream of their own): the ranks still apply
    the same gradients at the same steps, bit for bit, and train as the
    CPU emulation does, within float32 rounding of the GPU's kernels."""
    job = f"stale-{uuid.uuid4().hex[:8]}"
    results = run_workers("spawn://", 2, W.ddp_run, 2, free_port(), service.address, job, STEPS, 2, predict, None,
                          "cuda", timeout=240, start_method="spawn")
    ref = W.emulated(2, STEPS, 2, predict)
    for rank, r in enumerate(results):
        assert r["updates"] == STEPS - 2
        for got, want in zip(r["params"], ref[rank], strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        np.testing.assert_array_equal(a, b)


def test_stale_int32_steps_carry_exponents_from_the_step_the_last_one_awaited(service):
    """The int32 codec carries a round's exponents from its key's last
    round, waiting for it if it is open: stale steps are keyed modulo
    s + 1, so each carries from step t - s - 1, which the last step
    awaited, and none waits for the round before it (with one key for all
    the steps would carry from t - 1)."""
    job = f"stale-{uuid.uuid4().hex[:8]}"
    results = run_workers("spawn://", 2, W.ddp_run, 2, free_port(), service.address, job, STEPS, 2, False, "int32",
                          timeout=240, start_method="spawn")
    for r in results:
        assert r["updates"] == STEPS - 2
        # the first round of each of the 3 keys agrees; a later one carries,
        # or agrees where carrying would have sent its key's last round
        # (one chunk here) again
        assert r["carried"] + r["unsteady"] == STEPS - 3 and r["unsteady"] <= 2
        assert r["awaited"] == 0, f"{r['awaited']} of {STEPS} steps waited for the step before theirs"
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        np.testing.assert_array_equal(a, b)


def _pushes_by_shard(service) -> list[int]:
    return [shard["counters"].get("pushes", 0) for shard in service.stats()["shards"]]


def test_stale_steps_spread_over_the_shards_by_their_key(service):
    """Step t's all-reduce is keyed t mod (s + 1), and its key places its
    chunks: with s = 1 on two shards the steps alternate between them (as
    the buffer-size agreements do, by round), whichever moment the
    client's queue thread sends a step at. A key read when the send ran,
    not when the step was taken, put most steps on one shard, and at a
    send that ran at another moment on each rank, two ranks' rounds on two
    shards, each waiting for the other rank."""
    before = _pushes_by_shard(service)
    job = f"stale-{uuid.uuid4().hex[:8]}"
    run_workers("spawn://", 2, W.ddp_run, 2, free_port(), service.address, job, STEPS, 1, False,
                timeout=240, start_method="spawn")
    pushes = [after - b for after, b in zip(_pushes_by_shard(service), before, strict=True)]
    # every rank pushes each step's one chunk and its buffer-size agreement
    assert sum(pushes) == 2 * 2 * STEPS
    assert pushes[0] == pushes[1], f"pushes by shard {pushes}: the steps' keys did not alternate"


def test_stale_and_synchronous_training_differ():
    # the comparison above is not vacuous: applying late changes the weights
    sync, late = W.emulated(2, STEPS, 0, False), W.emulated(2, STEPS, 1, False)
    assert any(not np.array_equal(a, b) for a, b in zip(sync[0], late[0]))


def test_misconfigured_staleness_is_refused_with_the_fix():
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="staleness must be an integer >= 0"):
            AggnetState("zmq+tcp://127.0.0.1:1", job="x", staleness=-1)
        with pytest.raises(ValueError, match="predict=True needs staleness >= 1"):
            AggnetState("zmq+tcp://127.0.0.1:1", job="x", predict=True)
        model = torch.nn.Linear(2, 2)
        with pytest.raises(ValueError, match=r"StaleStep needs AggnetState\(staleness=s\)"):
            StaleStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      AggnetState("zmq+tcp://127.0.0.1:1", job="x"))
    finally:
        dist.destroy_process_group()
