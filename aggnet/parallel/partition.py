"""Cutting a chain of layers into pipeline stages, exactly.

The hybrid placement sends only activations (and their gradients) across
the slow links, so where the model is cut decides what crosses them. The
cut is chosen by dynamic programming over the layer chain, not by a
solver: for L layers and K stages it is O(K * L^2), vectorised over the
start of the last stage, which answers a 100-layer, 64-stage model in
milliseconds and is exact (a brute force over every cut agrees: the tests
check it).

Two objectives, one per way of running the stages:

* ``"sum"`` (the UNIST paper's: one batch, no pipelining): the time of a
  step is every stage's compute plus every cut's transfer, one after the
  other: ``sum(compute) + sum over cuts of transfer``;
* ``"max"`` (a pipelined schedule, GPipe or 1F1B over many micro-batches):
  the slowest stage sets the pace, a stage's time being its compute plus
  the transfers of the cuts on both of its sides:
  ``max over stages of (compute + transfer in + transfer out)``.

A stage's memory (its layers' ``memory``) must fit ``memory_limit`` when
one is given; a chain that cannot fit raises :class:`PartitionError` naming
the smallest limit that would.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

OBJECTIVES = ("sum", "max")


class PartitionError(ValueError):
    """No cut of the chain meets the request; the message says what would."""


@dataclass(frozen=True)
class Partition:
    """The stages of a cut chain."""

    #: (first layer, one past the last layer) of each stage
    stages: tuple
    #: the objective's value for this cut (seconds)
    cost: float
    objective: str
    #: each stage's compute plus the transfers it waits on (seconds)
    stage_costs: tuple
    #: each stage's memory (bytes)
    stage_memory: tuple

    @property
    def cuts(self) -> tuple:
        """The layer after which each cut falls (``stages[k][1] - 1``)."""
        return tuple(end - 1 for _, end in self.stages[:-1])


def partition(compute, cut_transfer, stages: int, *, objective: str = "max", memory=None,
              memory_limit: float | None = None) -> Partition:
    """The best cut of a chain into ``stages`` non-empty contiguous stages.

    ``compute[i]``: layer i's forward and backward time; ``cut_transfer[i]``:
    the time to move layer i's output forward and its gradient back (the
    last layer's is unused); ``memory[i]``: what layer i holds on its
    stage (parameters, their gradients and optimizer state, saved
    activations)."""
    compute = _vector(compute, "compute")
    n = compute.size
    transfer = _vector(cut_transfer, "cut_transfer", n)
    mem = np.zeros(n) if memory is None else _vector(memory, "memory", n)
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if not isinstance(stages, int) or not 1 <= stages <= n:
        raise PartitionError(f"cannot cut {n} layers into {stages!r} stages: give 1 to {n} stages "
                             f"(every stage holds at least one layer)")
    if memory_limit is not None and memory_limit <= 0:
        raise ValueError(f"memory_limit must be positive bytes, got {memory_limit!r}")
    pc = np.concatenate(([0.0], np.cumsum(compute)))
    pm = np.concatenate(([0.0], np.cumsum(mem)))
    # t_in[i]: the transfer at a stage's start i (the cut after layer i-1)
    t_in = np.concatenate(([0.0], transfer[:-1]))
    limit = np.inf if memory_limit is None else float(memory_limit)
    best, choice = _solve(pc, pm, t_in, stages, n, objective, limit)
    if not np.isfinite(best[stages, n]):
        raise PartitionError(_no_fit(mem, stages, memory_limit))
    bounds = []
    j = n
    for k in range(stages, 0, -1):
        i = int(choice[k, j])
        bounds.append((i, j))
        j = i
    bounds.reverse()
    stage_costs = tuple(float(pc[b] - pc[a] + t_in[a] + (t_in[b] if b < n else 0.0)) for a, b in bounds)
    return Partition(tuple(bounds), float(best[stages, n]), objective, stage_costs,
                     tuple(float(pm[b] - pm[a]) for a, b in bounds))


def _solve(pc, pm, t_in, stages, n, objective, limit):
    """best[k, j]: the objective for layers [0, j) in k stages; choice[k, j]:
    where the last of those stages starts."""
    best = np.full((stages + 1, n + 1), np.inf)
    choice = np.zeros((stages + 1, n + 1), dtype=np.int64)
    best[0, 0] = 0.0
    t_out = np.concatenate((t_in[1:], [0.0]))  # t_out[j-1]: the cut after layer j-1, when j < n
    for k in range(1, stages + 1):
        # the k-th stage ends at j and starts at i in [k-1, j-1]; the
        # stages after it need n - j layers at least stages - k of them
        for j in range(k, n - (stages - k) + 1):
            starts = np.arange(k - 1, j)
            fits = pm[j] - pm[starts] <= limit
            own = pc[j] - pc[starts]
            if objective == "sum":
                cand = best[k - 1, starts] + own + t_in[starts]
            else:
                after = t_out[j - 1] if j < n else 0.0
                cand = np.maximum(best[k - 1, starts], own + t_in[starts] + after)
            cand = np.where(fits, cand, np.inf)
            at = int(np.argmin(cand))
            best[k, j] = cand[at]
            choice[k, j] = starts[at]
    return best, choice


def evaluate(compute, cut_transfer, bounds, objective: str = "max") -> float:
    """The objective of a given cut (for brute force and for reports)."""
    compute = _vector(compute, "compute")
    transfer = _vector(cut_transfer, "cut_transfer", compute.size)
    n = compute.size
    costs = []
    for a, b in bounds:
        own = float(compute[a:b].sum())
        t_in = float(transfer[a - 1]) if a > 0 else 0.0
        t_out = float(transfer[b - 1]) if b < n else 0.0
        costs.append((own, t_in, t_out))
    if objective == "sum":
        return sum(own + t_in for own, t_in, _ in costs)
    return max(own + t_in + t_out for own, t_in, t_out in costs)


def _no_fit(mem, stages: int, limit) -> str:
    """The smallest memory limit that admits ``stages`` stages (the largest
    layer at least), for the message."""
    lo, hi = float(mem.max()), float(mem.sum())
    for _ in range(60):  # bisect on the limit: a greedy fill decides each
        mid = (lo + hi) / 2
        if _greedy_stages(mem, mid) <= stages:
            hi = mid
        else:
            lo = mid
    return (f"the layers do not fit {stages} stages of at most {_fmt_bytes(limit)} each: the smallest limit "
            f"that fits is about {_fmt_bytes(hi)}; raise the memory limit or use more stages")


def _greedy_stages(mem, limit: float) -> int:
    count, used = 1, 0.0
    for m in mem:
        if used + m > limit:
            count, used = count + 1, 0.0
        used += m
    return count


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} GiB"


def _vector(values, name: str, n: int | None = None) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64).ravel()
    if v.size == 0:
        raise ValueError(f"{name} is empty: profile at least one layer")
    if n is not None and v.size != n:
        raise ValueError(f"{name} has {v.size} values for {n} layers; give one per layer")
    if not np.all(np.isfinite(v)) or np.any(v < 0):
        raise ValueError(f"{name} must be finite and non-negative; got {v[~np.isfinite(v) | (v < 0)][:3]}")
    return v
