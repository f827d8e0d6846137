"""Routing by α under the DDP hook: an embedding without sparse=True whose
gradient is mostly zero rows travels as rows through a sparse table, the
rest of its bucket dense; training equals single-process training on the
global batch and the dense route, and a bucket of high α stays dense."""

from __future__ import annotations


import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the DDP hook needs PyTorch (pip install aggnet[torch])")

from harness import routing_workers as W  # noqa: E402
from harness.helpers import RunningService, free_port, run_workers  # noqa: E402

STEPS = 20
SMALL_ALPHA, LARGE_ALPHA = 400, 12  # vocabularies: α ≤ 24/400 per rank, and α near 1


@pytest.fixture(scope="module")
def service():
    svc = RunningService("zmq+ipc", shards=2)
    yield svc
    svc.stop()


def rel_diff(a, b) -> float:
    return max(float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30)) for x, y in zip(a, b))


def agreed_alpha(world: int, vocab: int, first: int) -> float:
    """MAX over ranks of each rank's mean α over 3 measured steps."""
    return float(W.local_alphas(world, first + 3, vocab)[first:].mean(axis=0).max())


def test_embedding_rows_route_equals_single_process_and_dense_route(service):
    world = 2
    cases = [(SMALL_ALPHA, 0.1), (SMALL_ALPHA, None), (LARGE_ALPHA, 0.1), (SMALL_ALPHA, 0.1, 5)]
    res = run_workers("spawn://", world, W.run, world, free_port(), service.address, cases, STEPS,
                      timeout=150, start_method="spawn")
    rows, dense, high, nan = ([r[k] for r in res] for k in range(4))
    ref_small = W.single_process(world, STEPS, SMALL_ALPHA)
    ref_large = W.single_process(world, STEPS, LARGE_ALPHA)
    for r in range(world):
        assert rel_diff(rows[r]["params"], rows[0]["params"]) == 0.0  # the same bits on every rank
        assert rel_diff(rows[r]["params"], ref_small) <= 1e-6
        assert rel_diff(rows[r]["params"], dense[r]["params"]) <= 1e-6
        assert rel_diff(high[r]["params"], ref_large) <= 1e-6
    moved = rel_diff(ref_small, W.single_process(world, 0, SMALL_ALPHA))
    assert moved > 1e-3  # training really changed the parameters

    # the embedding travelled as rows, the head's weight dense, in one
    # bucket; after 3 steps as rows, timed against the 3 dense ones, it
    # stays rows only where rows were faster, on every rank alike
    (route,) = rows[0]["routes"].values()
    embed, head = sorted(route["params"], key=lambda p: -p["shape"][0])
    assert route["rows_ms"] > 0 and route["dense_ms"] > 0
    if route["rows_ms"] <= route["dense_ms"]:
        assert route["route"] == "rows" and embed["route"] == "rows" and route["why"] is None, route
    else:
        assert route["route"] == "dense" and embed["route"] == "dense", route
        assert route["why"].startswith(f"as rows a step took {route['rows_ms']:.1f} ms against"), route
    assert embed["shape"] == (SMALL_ALPHA, W.DIM)
    assert head["shape"] == (W.CLASSES, W.DIM) and head["route"] == "dense" and head["alpha"] == 1.0
    # measured over 3 steps (from step 0, or from step 1 after DDP rebuilt its buckets), MAX over ranks
    assert any(abs(embed["alpha"] - agreed_alpha(world, SMALL_ALPHA, first)) < 1e-6 for first in (0, 1)), embed
    assert embed["alpha"] < 0.1 and 0 < route["alpha"] < 0.1
    assert all(r["routes"] == rows[0]["routes"] for r in rows)  # one decision on every rank
    assert rows[0]["rows_bytes"] > 0 and rows[0]["calls"] == STEPS

    # no routing: no rows, no routes; high α: measured, stays dense
    assert dense[0]["routes"] == {} and dense[0]["rows_bytes"] == 0
    (route,) = high[0]["routes"].values()
    assert route["route"] == "dense" and route["alpha"] > 0.5
    assert high[0]["rows_bytes"] == 0

    # NaN in rank 1's rows-routed bucket: each rank fails the step, saying whose gradients
    assert "rank 1's gradients were not finite" in nan[1]["error"], nan[1]["error"]
    assert "another rank's gradients" in nan[0]["error"], nan[0]["error"]


@pytest.mark.slow
def test_three_workers_rows_route_equals_single_process(service):
    world = 3
    res = run_workers("spawn://", world, W.run, world, free_port(), service.address, [(SMALL_ALPHA, 0.1)], STEPS,
                      timeout=150, start_method="spawn")
    ref = W.single_process(world, STEPS, SMALL_ALPHA)
    for r in res:
        (route,) = r[0]["routes"].values()
        assert route["route"] == ("rows" if route["rows_ms"] <= route["dense_ms"] else "dense"), route
        assert r[0]["routes"] == res[0][0]["routes"]  # one decision on every rank
        assert r[0]["rows_bytes"] > 0  # rows were tried
        assert rel_diff(r[0]["params"], ref) <= 1e-6
        assert rel_diff(r[0]["params"], res[0][0]["params"]) == 0.0


def test_alpha_settings_are_checked():
    import torch.distributed as dist

    from aggnet.torch import AggnetState

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match=r"alpha_threshold must be in \(0, 1\]"):
            AggnetState("zmq+ipc:///nowhere", alpha_threshold=0)
        with pytest.raises(ValueError, match=r"alpha_steps must be an integer >= 1"):
            AggnetState("zmq+ipc:///nowhere", alpha_steps=0)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_large_table_of_few_moving_rows_stays_rows_where_they_are_faster(service):
    """A million-row embedding of which a step moves a few dozen rows:
    the dense all-reduce moves 32 MB a step, the rows route a few KB and
    one pass over the gradient; rows are measured faster and kept."""
    world, steps, vocab = 2, 8, 1_000_000
    res = run_workers("spawn://", world, W.run, world, free_port(), service.address, [(vocab, 0.1)], steps,
                      timeout=150, start_method="spawn")
    ref = W.single_process(world, steps, vocab)
    for r in res:
        (route,) = r[0]["routes"].values()
        assert route["route"] == "rows" and route["rows_ms"] < route["dense_ms"], route
        assert rel_diff(r[0]["params"], ref) <= 1e-6
