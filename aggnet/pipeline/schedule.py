"""The order each pipeline stage runs its passes in, and how many weight
updates a batch misses on its way.

Asynchronous pipelining (PipeDream's one-forward-one-backward without a
flush) keeps every stage busy: stage k of N starts with N - k forwards,
then alternates one backward (followed by its weight update) and one
forward. A batch therefore meets weights that other batches keep
changing: between its forward at stage k and the moment it completes (its
backward at stage 0), stage k is updated ``s`` times by other batches.
SpecTrain predicts the weights ``s`` updates ahead; this module says what
``s`` is.

With a backward as long as a forward the counts are the paper's formulas
(:func:`paper_versions`); with other ratios they differ, so
:func:`version_differences` counts them on a simulated timeline of the
schedule itself (:func:`timeline`), which is also what the tests check
the formulas against.

``sync`` orders every stage forward-backward batch by batch: a batch
completes before the next one starts anywhere, which is single-process
training cut into stages (GPipe with one micro-batch and a flush per
batch).
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("sync", "vanilla", "stash", "spectrain")


@dataclass(frozen=True)
class Op:
    """One pass of one batch at one stage: ``"F"`` (forward) or ``"B"``
    (backward, then the stage's weight update)."""

    kind: str
    batch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.batch}"


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return mode


def stage_order(stage: int, stages: int, batches: int, mode: str = "spectrain") -> list[Op]:
    """The passes stage ``stage`` of ``stages`` runs, in order, for
    ``batches`` batches."""
    check_mode(mode)
    if not 0 <= stage < stages:
        raise ValueError(f"stage must be in [0, {stages}), got {stage}")
    if mode == "sync":
        return [Op(kind, i) for i in range(batches) for kind in "FB"]
    warm = min(stages - stage, batches)
    order = [Op("F", i) for i in range(warm)]
    for i in range(batches):
        order.append(Op("B", i))
        if i + warm < batches:
            order.append(Op("F", i + warm))
    return order


def paper_versions(stage: int, stages: int) -> tuple[int, int]:
    """SpecTrain's version differences (forward, backward) at ``stage``
    (0 first) of ``stages``: ⌊k/2⌋ + N - k - 1 and ⌊k/2⌋."""
    return stage // 2 + stages - stage - 1, stage // 2


def timeline(stages: int, batches: int, mode: str = "spectrain", forward: float = 1.0,
             backward: float = 1.0) -> dict:
    """(stage, Op) -> (start, end): every stage runs its passes in
    :func:`stage_order`, each as soon as the stage is free and its input
    has arrived (sends take no time)."""
    orders = [stage_order(k, stages, batches, mode) for k in range(stages)]
    done: dict = {}
    free = [0.0] * stages
    nxt = [0] * stages
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for k in range(stages):
            while nxt[k] < len(orders[k]):
                op = orders[k][nxt[k]]
                if op.kind == "F":
                    dep = (k - 1, Op("F", op.batch)) if k > 0 else None
                else:
                    dep = (k + 1, Op("B", op.batch)) if k < stages - 1 else (k, Op("F", op.batch))
                if dep is not None and dep not in done:
                    break
                start = max(free[k], done[dep][1] if dep is not None else 0.0)
                end = start + (forward if op.kind == "F" else backward)
                done[(k, op)] = (start, end)
                free[k] = end
                nxt[k] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # cannot happen for the orders above; a guard against a wrong one
            raise RuntimeError("pipeline schedule deadlocks")
    return done


def version_differences(stages: int, forward: float = 1.0, backward: float = 1.0) -> list[tuple[int, int]]:
    """Per stage, (forward s, backward s): the updates of that stage by other
    batches between a steady-state batch's pass there and its completion,
    counted on the schedule's timeline for these pass durations."""
    if forward <= 0 or backward <= 0:
        raise ValueError(f"pass durations must be positive, got forward={forward!r} backward={backward!r}")
    batches = 6 * stages + 4
    t = timeline(stages, batches, "spectrain", forward, backward)
    out = []
    for k in range(stages):
        counts = []
        for i in range(2 * stages, batches - 2 * stages):
            complete = t[(0, Op("B", i))][1]
            updates = [t[(k, Op("B", j))][1] for j in range(batches) if j != i]
            f_end = t[(k, Op("F", i))][1]
            b_end = t[(k, Op("B", i))][1]
            counts.append((sum(f_end < u <= complete for u in updates),
                           sum(b_end < u <= complete for u in updates)))
        # steady state repeats with a period; the most common count stands for it
        out.append(max(set(counts), key=counts.count))
    return out
