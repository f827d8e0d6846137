"""The DDP communication hook: training through aggnet computes what
single-process training computes on the same global batch (Parallax's
definition of correct synchronous data parallelism)."""

from __future__ import annotations


import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the DDP hook needs PyTorch (pip install aggnet[torch])")

from harness import ddp_workers as W  # noqa: E402
from aggnet import Client  # noqa: E402
from harness.helpers import RunningService, free_port, run_workers  # noqa: E402

STEPS = 20


@pytest.fixture(scope="module")
def service():
    svc = RunningService("shm", shards=2)
    yield svc
    svc.stop()


def ddp(world: int, mode: str, timeout: float = 120, **options):
    results = run_workers("spawn://", world, W.ddp_run, world, free_port(), mode, options,
                          timeout=timeout, start_method="spawn")
    return results


def rel_diff(a, b) -> float:
    return max(float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30)) for x, y in zip(a, b))


@pytest.mark.parametrize("world", [2, 3])
def test_float32_hook_matches_single_process_and_gloo(service, world):
    reference = W.single_process(world, STEPS)
    agg = ddp(world, "aggnet", address=service.address)
    gloo = ddp(world, "gloo")
    for r in agg:
        # every rank holds the same parameters
        assert rel_diff(r["params"][0], agg[0]["params"][0]) == 0.0
        assert r["calls"] == [STEPS] and r["delegated"] == [0]  # one bucket per step, through aggnet
    assert rel_diff(agg[0]["params"][0], reference) <= 1e-6
    assert rel_diff(agg[0]["params"][0], gloo[0]["params"][0]) <= 1e-6


def test_a_float64_model_trains_through_the_ddp_group_like_single_process(service):
    """aggnet's wire carries no float64: those buckets go to the DDP group's
    own all-reduce (as DDP's default hook would send them), and training
    goes on exactly."""
    world = 2
    reference = W.single_process(world, STEPS, dtype=torch.float64)
    agg = ddp(world, "aggnet", address=service.address, dtype="float64")
    for r in agg:
        assert r["params"][0][0].dtype == np.float64
        assert r["calls"] == [STEPS] and r["delegated"] == [STEPS]
        assert rel_diff(r["params"][0], reference) <= 1e-12


def test_a_float64_head_goes_to_the_ddp_group_while_the_float32_buckets_go_through_aggnet(service):
    """Two streams of collectives from one backward pass, each in bucket
    order on every rank: neither waits for the other."""
    world = 2
    reference = W.single_process(world, STEPS, float64_head=True)
    agg = ddp(world, "aggnet", address=service.address, float64_head=True)
    for r in agg:
        assert r["calls"] == [2 * STEPS] and r["delegated"] == [STEPS]
        assert rel_diff(r["params"][0], reference) <= 1e-6


def test_a_state_built_before_init_process_group_resolves_on_the_first_bucket(service):
    world = 2
    reference = W.single_process(world, STEPS)
    agg = ddp(world, "aggnet", address=service.address, state_before_init=True, models=2)
    for r in agg:
        assert r["calls"] == [STEPS, STEPS]
        # the ranks agreed each model's job through the store; two models, two jobs
        assert r["jobs"] == agg[0]["jobs"] and len(set(r["jobs"])) == 2
    assert rel_diff(agg[0]["params"][0], reference) <= 1e-6


@pytest.mark.parametrize(
    "options",
    [
        {"bucket_view": True},
        {"static_graph": True},
        {"unused": True},
        {"bucket_view": True, "static_graph": True, "bucket_mb": 0.01},  # several buckets
    ],
    ids=["bucket-view", "static-graph", "unused-params", "view+static+small-buckets"],
)
def test_ddp_options_train_like_single_process(service, options):
    world = 2
    reference = W.single_process(world, STEPS, unused=options.get("unused", False))
    agg = ddp(world, "aggnet", address=service.address, **options)
    assert rel_diff(agg[0]["params"][0], reference) <= 1e-6
    assert rel_diff(agg[1]["params"][0], reference) <= 1e-6


@pytest.mark.slow
def test_int32_codec_within_derived_bound(service):
    """Bound: with N workers, chunk exponent E (max |g| < 2**E) and
    shift s = 30 - E - ceil(log2 N), each worker's rounding is at most
    2**-s / 2, so the averaged gradient is off by at most
    eps_t = 2**-s / 2 <= max|g_t| * 2**(ceil(log2 N) - 30) per element.
    SGD with momentum mu and learning rate lr moves a parameter by
    lr * sum_k mu**(t-k) g_k, so after T steps the first-order error is at
    most lr * sum_t sum_{k<=t} mu**(t-k) eps_k. The test allows 10x that
    for the (second-order) change of later gradients, on top of twice the
    float32 path's own rounding difference from single-process training
    (measured in the same test)."""
    world = 3
    agg = ddp(world, "aggnet", address=service.address, codec="int32")
    f32 = ddp(world, "aggnet", address=service.address)
    reference = W.single_process(world, STEPS)
    mags = W.max_grad_magnitudes(world, STEPS)
    lr, mu = 0.05, 0.9
    eps = [m * 2.0 ** ((world - 1).bit_length() - 30) for m in mags]
    bound = lr * sum(sum(mu ** (t - k) * eps[k] for k in range(t + 1)) for t in range(STEPS))
    worst = max(float(np.abs(a - b).max()) for a, b in zip(agg[0]["params"][0], reference))
    float_noise = max(float(np.abs(a - b).max()) for a, b in zip(f32[0]["params"][0], reference))
    assert worst <= 10 * bound + 2 * float_noise, (worst, bound, float_noise)
    assert worst > 0  # quantization really happened
    for r in agg[1:]:
        assert rel_diff(r["params"][0], agg[0]["params"][0]) == 0.0


def test_global_norm_clipping_after_aggregation_matches_single_process(service):
    world = 2
    reference = W.single_process(world, STEPS, clip=0.05)
    unclipped = W.single_process(world, STEPS)
    agg = ddp(world, "aggnet", address=service.address, clip=0.05)
    assert rel_diff(agg[0]["params"][0], reference) <= 1e-6
    assert rel_diff(reference, unclipped) > 1e-3  # the clip was active


@pytest.mark.slow
def test_several_ddp_models_in_one_process_get_distinct_jobs(service):
    agg = ddp(2, "aggnet", address=service.address, models=2)
    gloo = ddp(2, "gloo", models=2)
    jobs = agg[0]["jobs"]
    assert len(set(jobs)) == 2 and agg[1]["jobs"] == jobs
    for m in range(2):
        assert rel_diff(agg[0]["params"][m], gloo[0]["params"][m]) <= 1e-6


def test_sparse_embedding_buckets_never_take_the_dense_path(service):
    world = 2
    reference = W.single_process(world, STEPS, sparse=True)
    agg = ddp(world, "aggnet", address=service.address, sparse=True)
    assert rel_diff(agg[0]["params"][0], reference) <= 1e-6
    # the dense bucket went through aggnet once per step; the sparse one did not
    assert agg[0]["calls"] == [STEPS]
    # and is reported as sparse, never as being measured for a route it cannot take
    routes = sorted(r["route"] for r in agg[0]["routes"][0].values())
    assert routes == ["dense", "sparse"], agg[0]["routes"]


def test_embedded_default_under_ddp():
    world = 2
    reference = W.single_process(world, 5)
    agg = ddp(world, "aggnet", steps=5)  # no address: rank 0 starts one
    assert rel_diff(agg[0]["params"][0], reference) <= 1e-6


@pytest.mark.parametrize("codec", [None, "int32"])
def test_nan_gradients_are_reported_with_bucket_and_rank(service, codec):
    res = run_workers("spawn://", 2, W.nan_run, 2, free_port(), service.address, codec, "raise",
                      timeout=120, start_method="spawn")
    (kind0, text0), (kind1, text1) = res
    assert kind1 == "error" and "rank 1" in text1 and "bucket 0" in text1 and "NaN/Inf" in text1, text1
    assert kind0 == "error" and "NaN/Inf" in text0 and "names it" in text0, text0


def test_nan_propagates_when_asked(service):
    res = run_workers("spawn://", 2, W.nan_run, 2, free_port(), service.address, "int32", "propagate",
                      timeout=120, start_method="spawn")
    assert res == [("ok", True), ("ok", True)]


def test_unreachable_aggregator_fails_at_the_first_bucket(tmp_path):
    address = f"shm://{tmp_path}/nothing.sock"
    res = run_workers("spawn://", 2, W.first_step_error, 2, free_port(), address, None, 1.5, timeout=120,
                      start_method="spawn")
    for text in res:
        assert "nothing.sock" in text and "aggnet serve --listen" in text, text


def test_world_size_mismatch_between_ddp_and_job_is_caught(service):
    # a third worker registers the job with world size 3 first
    holder = Client(service.address, job="shared-job", rank=2, world_size=3)
    try:
        res = run_workers("spawn://", 2, W.first_step_error, 2, free_port(), service.address, "shared-job",
                          timeout=120, start_method="spawn")
    finally:
        holder.close()
    for text in res:
        assert "registered with world size 3" in text and "world size 2" in text, text


def test_state_checks_its_settings():
    from aggnet.torch import AggnetState

    with pytest.raises(ValueError, match="codec must be one of .* got 'int8'"):
        AggnetState(codec="int8")
    with pytest.raises(ValueError, match="op must be one of \\('avg', 'sum'\\), got 'mean'"):
        AggnetState(op="mean")
    with pytest.raises(ValueError, match="on_nonfinite must be one of"):
        AggnetState(on_nonfinite="ignore")
    # built before init_process_group (as Lightning does): resolved on first
    # use, and first use without torch.distributed says what to call
    state = AggnetState()
    assert not state.resolved and state.rank is None
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized.*init_process_group"):
        state.client


def test_hook_is_a_plain_function_listed_in_all():
    import aggnet.torch as at

    assert at.__all__[:2] == ["AggnetState", "allreduce_hook"]
    assert callable(at.allreduce_hook) and at.allreduce_hook.__code__.co_argcount == 2
