"""The asynchronous pipeline in one process.

Runs every stage's passes in the order the distributed runner does
(:func:`aggnet.pipeline.schedule.stage_order`), handing activations and
gradients over in memory: each stage computes exactly what it computes
across processes, so the weights match the distributed run bit for bit
(the tests hold the two against each other) and experiments over modes,
depths and seeds run in seconds instead of processes.

Replicas (a data-parallel pipeline) run in lock step; each stage's
gradients are averaged over its copies before the update, as the
distributed run's aggnet all-reduce does (sum, then times 1/R).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from aggnet.pipeline.schedule import Op, stage_order
from aggnet.pipeline.stage import Stage


def average(flats: list[torch.Tensor]) -> torch.Tensor:
    """What an aggnet float32 average gives: the sum in rank order, times
    1/R (exact for two replicas whatever the order)."""
    total = flats[0].clone()
    for f in flats[1:]:
        total += f.to(total.device)
    return total * (1.0 / len(flats))


def run(stages: Sequence[Stage] | Sequence[Sequence[Stage]], batches, *,
        on_loss: Callable[[int, int, float], None] | None = None) -> list[list[float]]:
    """Train ``stages`` (stage k of one pipeline, or ``stages[k][r]`` of R
    replicas) on ``batches``: a sequence of (inputs, targets), or per
    replica a sequence of them. Returns each replica's per-batch losses;
    ``on_loss(replica, batch, loss)`` is called as each completes."""
    grid = [list(s) if isinstance(s, (list, tuple)) else [s] for s in stages]
    n, replicas = len(grid), len(grid[0])
    if any(len(row) != replicas for row in grid):
        raise ValueError("every stage needs the same number of replicas")
    data = [list(batches)] if replicas == 1 else [list(b) for b in batches]
    if len(data) != replicas:
        raise ValueError(f"{replicas} replicas need {replicas} sequences of batches, got {len(data)}")
    count = len(data[0])
    if any(len(d) != count for d in data):
        raise ValueError("every replica needs the same number of batches")
    mode = grid[0][0].mode
    orders = [stage_order(k, n, count, mode) for k in range(n)]
    nxt = [0] * n
    acts: dict = {}  # (stage, batch, replica) -> input of that stage's forward
    grads: dict = {}  # (stage, batch, replica) -> gradient into that stage's backward
    losses: list[list[float]] = [[] for _ in range(replicas)]
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for k in range(n):
            while nxt[k] < len(orders[k]):
                op: Op = orders[k][nxt[k]]
                i = op.batch
                if op.kind == "F":
                    if k > 0 and (k, i, 0) not in acts:
                        break
                    for r in range(replicas):
                        stage = grid[k][r]  # stages may sit on different devices
                        x = data[r][i][0] if k == 0 else acts.pop((k, i, r))
                        target = data[r][i][1].to(stage.device) if k == n - 1 else None
                        out = stage.forward(i, x.to(stage.device), target)
                        if k < n - 1:
                            acts[(k + 1, i, r)] = out
                        else:
                            losses[r].append(float(out))
                            if on_loss is not None:
                                on_loss(r, i, losses[r][-1])
                else:
                    if k < n - 1 and (k, i, 0) not in grads:
                        break
                    for r in range(replicas):
                        g = grads.pop((k, i, r)).to(grid[k][r].device) if k < n - 1 else None
                        g_in = grid[k][r].backward(i, g)
                        if k > 0:
                            grads[(k - 1, i, r)] = g_in
                    if replicas > 1:
                        mean = average([s.flat_gradients() for s in grid[k]])
                        for s in grid[k]:
                            s.set_flat_gradients(mean)
                    for s in grid[k]:
                        s.update()
                nxt[k] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocks")
    return losses
