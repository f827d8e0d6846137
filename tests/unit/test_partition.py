"""The partitioner's cut is the best one: brute force over every cut of
random chains agrees, for both objectives, with and without a memory
bound; and it answers a 100-layer, 64-stage chain fast."""

import itertools
import time

import numpy as np
import pytest

from aggnet.parallel.partition import PartitionError, evaluate, partition


def _all_cuts(n: int, k: int):
    for cuts in itertools.combinations(range(1, n), k - 1):
        edges = (0, *cuts, n)
        yield tuple(zip(edges[:-1], edges[1:]))


def _brute(compute, transfer, k, objective, memory=None, limit=None):
    best = np.inf
    for bounds in _all_cuts(len(compute), k):
        if limit is not None and any(sum(memory[a:b]) > limit for a, b in bounds):
            continue
        best = min(best, evaluate(compute, transfer, bounds, objective))
    return best


@pytest.mark.parametrize("objective", ["sum", "max"])
def test_the_cut_is_as_good_as_the_best_of_all_cuts(objective):
    rng = np.random.default_rng(7)
    for trial in range(150):
        n = int(rng.integers(1, 10))
        k = int(rng.integers(1, n + 1))
        compute = rng.exponential(1.0, n)
        transfer = rng.exponential(1.0, n) * rng.choice([0.01, 1, 10])
        part = partition(compute, transfer, k, objective=objective)
        assert len(part.stages) == k and all(a < b for a, b in part.stages)
        assert part.stages[0][0] == 0 and part.stages[-1][1] == n
        assert all(part.stages[i][1] == part.stages[i + 1][0] for i in range(k - 1))
        want = _brute(compute, transfer, k, objective)
        assert part.cost == pytest.approx(want, rel=1e-12, abs=1e-12), (trial, n, k)
        assert evaluate(compute, transfer, part.stages, objective) == pytest.approx(part.cost, rel=1e-12)


@pytest.mark.parametrize("objective", ["sum", "max"])
def test_a_memory_bound_is_kept_and_still_optimal(objective):
    rng = np.random.default_rng(11)
    checked = 0
    for _ in range(200):
        n = int(rng.integers(2, 9))
        k = int(rng.integers(2, n + 1))
        compute, transfer = rng.exponential(1.0, n), rng.exponential(1.0, n)
        memory = rng.integers(1, 10, n).astype(float)
        limit = float(rng.integers(int(memory.max()), int(memory.sum()) + 1))
        want = _brute(compute, transfer, k, objective, memory, limit)
        if not np.isfinite(want):
            with pytest.raises(PartitionError, match="smallest limit that fits"):
                partition(compute, transfer, k, objective=objective, memory=memory, memory_limit=limit)
            continue
        part = partition(compute, transfer, k, objective=objective, memory=memory, memory_limit=limit)
        assert max(part.stage_memory) <= limit
        assert part.cost == pytest.approx(want, rel=1e-12)
        checked += 1
    assert checked > 50


def test_the_cut_falls_where_little_crosses():
    # one narrow layer output among wide ones: with the paper's sum
    # objective (compute is the same whatever the cut) the cut goes there
    compute = np.ones(8)
    transfer = np.full(8, 100.0)
    transfer[4] = 0.5
    part = partition(compute, transfer, 2, objective="sum")
    assert part.cuts == (4,)


def test_bad_requests_say_what_would_work():
    with pytest.raises(PartitionError, match="give 1 to 3 stages"):
        partition([1, 1, 1], [1, 1, 1], 4)
    with pytest.raises(ValueError, match="one per layer"):
        partition([1, 1, 1], [1, 1], 2)
    with pytest.raises(ValueError, match="objective"):
        partition([1, 1], [1, 1], 2, objective="min")
    with pytest.raises(ValueError, match="finite and non-negative"):
        partition([1, float("nan")], [1, 1], 2)


def test_a_hundred_layers_in_sixty_four_stages_is_fast():
    rng = np.random.default_rng(3)
    compute, transfer = rng.exponential(1.0, 100), rng.exponential(1.0, 100)
    t0 = time.perf_counter()
    for objective in ("sum", "max"):
        part = partition(compute, transfer, 64, objective=objective, memory=rng.random(100), memory_limit=5.0)
        assert len(part.stages) == 64
    assert time.perf_counter() - t0 < 5.0
