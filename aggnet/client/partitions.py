"""How many partitions a sparse table gets: Parallax's cost model.

More partitions spread a table's rows over more shards and messages (the
work per partition shrinks, ~1/P) but every round then costs a message per
partition (~P). Parallax (EuroSys'19, section 5) samples the iteration time
at P = the number of machines, doubles P until the time gets worse, halves
it until the time gets worse, fits

    iter_time(P) = θ0 + θ1 / P + θ2 · P

to the samples by least squares and takes the P that minimizes the fit.
:func:`search` and :func:`fit` do that over any ``measure(P) -> seconds``;
``aggnet tune`` measures real push/pull rounds of a sparse table on a
running service (or one it starts), prints the samples, the fit and the
chosen P.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable

import numpy as np

from aggnet.protocol import sparse_layout

__all__ = ["Fit", "fit", "search", "choose", "tune", "tune_table"]


@dataclass(frozen=True)
class Fit:
    """iter_time(P) = theta0 + theta1 / P + theta2 * P, in seconds."""
    theta0: float
    theta1: float
    theta2: float

    def predict(self, p) -> np.ndarray:
        p = np.asarray(p, np.float64)
        return self.theta0 + self.theta1 / p + self.theta2 * p

    def best(self, lo: int, hi: int) -> int:
        """The integer P in [lo, hi] the fit predicts fastest (the smallest
        of equals). Beyond the sampled range the model is an extrapolation,
        so callers pass the range they sampled."""
        ps = np.arange(lo, hi + 1)
        return int(ps[np.argmin(self.predict(ps))])

    def __str__(self) -> str:
        return f"iter_time(P) = {self.theta0:.6g} + {self.theta1:.6g}/P + {self.theta2:.6g}*P  (seconds)"


def fit(samples: dict[int, float]) -> Fit:
    """Least-squares θ of the cost model over ``{P: seconds}``; needs three
    distinct P (the model has three unknowns)."""
    if len(samples) < 3:
        raise ValueError(f"fitting θ0 + θ1/P + θ2·P needs samples at 3 or more partition counts, got "
                         f"{sorted(samples)}; widen the search (a larger --max-partitions)")
    ps = np.array(sorted(samples), np.float64)
    t = np.array([samples[int(p)] for p in ps], np.float64)
    a = np.stack([np.ones_like(ps), 1.0 / ps, ps], axis=1)
    theta, *_ = np.linalg.lstsq(a, t, rcond=None)
    return Fit(*(float(x) for x in theta))


def search(measure: Callable[[int], float], start: int, *, lo: int = 1, hi: int = sparse_layout.MAX_PARTITIONS,
           log: Callable[[str], None] | None = None) -> dict[int, float]:
    """Parallax's sampling: ``measure`` at ``start``, then at 2P, 4P...
    while the time improves (the first slower one is kept as a sample),
    then at P/2, P/4... from ``start`` likewise; all within [lo, hi].
    Returns {P: seconds} in the order measured."""
    if not lo <= start <= hi:
        raise ValueError(f"the search starts at P={start}, outside [{lo}, {hi}]")
    samples: dict[int, float] = {}

    def sample(p: int) -> float:
        samples[p] = float(measure(p))
        if log:
            log(f"P={p:<5d} {samples[p] * 1e3:9.3f} ms")
        return samples[p]

    best = sample(start)
    p = start
    while p * 2 <= hi:
        t = sample(p * 2)
        if t >= best:
            break
        best, p = t, p * 2
    best, p = samples[start], start
    while p // 2 >= lo:
        t = sample(p // 2)
        if t >= best:
            break
        best, p = t, p // 2
    return samples


def choose(samples: dict[int, float]) -> tuple[int, Fit | None]:
    """(P, fit): the fit's minimum over the sampled range; with fewer than
    three samples (the range allowed no more) the fastest sample, no fit."""
    if len(samples) < 3:
        return min(samples, key=lambda p: (samples[p], p)), None
    f = fit(samples)
    return f.best(min(samples), max(samples)), f


# -- measuring a sparse table on a service ------------------------------------------------

def table_step_time(sparse_clients: list, rows: int, width: int, alpha: float, steps: int, warmup: int = 1,
                    timeout: float = 60.0) -> Callable[[int], float]:
    """A ``measure(P)``: seconds per training step of a ``ps`` table of
    ``rows x width`` cut into P partitions, each worker (one sparse client
    each, every rank of the job) pushing the gradient rows of ``alpha *
    rows`` random indices and pulling the next step's rows, as
    :class:`~aggnet.torch.ShardedEmbedding` does. The mean over ``steps``
    after ``warmup`` steps, timed on rank 0."""
    tag = uuid.uuid4().hex[:8]
    touched = max(1, int(round(alpha * rows)))

    def measure(p: int) -> float:
        name = f"tune-{tag}-p{p}"
        tables = [sc.table(name, rows, width, mode="ps", optimizer="sgd", op="avg", partitions=p, lr=1e-3,
                           init={"kind": "zeros"}) for sc in sparse_clients]
        barrier = threading.Barrier(len(tables), timeout=timeout)
        elapsed: list[float] = []
        errors: list[BaseException] = []

        def worker(rank: int, table) -> None:
            try:
                rng = np.random.default_rng(rank)
                grads = rng.standard_normal((touched, width)).astype(np.float32) * 1e-3
                for step in range(warmup + steps):
                    if step == warmup:
                        barrier.wait()
                        t0 = time.perf_counter()
                    idx = rng.choice(rows, touched, replace=False)
                    table.push(idx, grads).result(timeout)
                    table.pull(rng.choice(rows, touched, replace=False)).result(timeout)
                if rank == 0:
                    elapsed.append((time.perf_counter() - t0) / steps)
            except BaseException as exc:  # reported below, with the partition count
                errors.append(exc)
                barrier.abort()

        threads = [threading.Thread(target=worker, args=(r, t), daemon=True) for r, t in enumerate(tables)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout * (warmup + steps + 1))
        for t in tables:
            t.close()
        if errors or not elapsed:
            why = errors[0] if errors else f"the workers did not finish within {timeout * (warmup + steps + 1):g}s"
            raise RuntimeError(f"measuring a {rows} x {width} table at P={p} failed: {why}")
        return elapsed[0]

    return measure


def agreed_step_time(sc, name: str, rows: int, width: int, alpha: float, steps: int, warmup: int = 1,
                     seed: int = 0) -> Callable[[int], float]:
    """A ``measure(P)`` that every rank of a job calls together, each with
    its own sparse client (a training job at its start): each rank times
    ``steps`` push-and-pull steps of a scratch ``ps`` table cut into P
    partitions, and the ranks agree on the slowest rank's time (a step is
    as slow as its slowest worker), so every rank's search takes the same
    branches and ends at the same P."""
    touched = max(1, int(round(alpha * rows)))
    votes = sc.table(f"{name}-votes", sc.world_size, 1, mode="allreduce", partitions=1)

    def measure(p: int) -> float:
        table = sc.table(f"{name}-p{p}", rows, width, mode="ps", optimizer="sgd", op="avg", partitions=p, lr=1e-3,
                         init={"kind": "zeros"})
        wait = sc.timeout + 5
        try:
            rng = np.random.default_rng([seed, sc.rank, p])
            grads = rng.standard_normal((touched, width)).astype(np.float32) * 1e-3
            for step in range(warmup + steps):
                if step == warmup:
                    t0 = time.perf_counter()
                table.push(rng.choice(rows, touched, replace=False), grads).result(wait)
                table.pull(rng.choice(rows, touched, replace=False)).result(wait)
            mine = (time.perf_counter() - t0) / steps
        finally:
            table.close()
        _, every = votes.allreduce([sc.rank], np.array([[mine]], np.float32)).result(wait)
        return float(every.max())

    measure.close = votes.close  # type: ignore[attr-defined]
    return measure


def tune_table(sc, name: str, rows: int, width: int, alpha: float, *, steps: int = 5,
               max_partitions: int | None = None, log: Callable[[str], None] | None = None) -> tuple[int, dict, Fit | None]:
    """Parallax's search and fit for a table of ``rows x width`` from
    inside a job: every rank calls it at once with its sparse client
    (:class:`~aggnet.torch.ShardedEmbedding` does with
    ``partitions="auto"``); every rank gets the same (P, samples, fit)."""
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha (the fraction of the table's rows one worker's batch touches) must be in (0, 1], "
                         f"got {alpha}")
    hi = min(rows, sparse_layout.MAX_PARTITIONS, max_partitions or sparse_layout.MAX_PARTITIONS)
    measure = agreed_step_time(sc, f"{name}-tune", rows, width, alpha, steps)
    try:
        samples = search(measure, min(hi, len(sc.shards)), hi=hi, log=log)
    finally:
        measure.close()
    p, f = choose(samples)
    return p, samples, f


def tune(address: str, *, workers: int, rows: int, width: int, alpha: float, steps: int, start: int | None = None,
         max_partitions: int | None = None, timeout: float = 30.0,
         log: Callable[[str], None] | None = None) -> tuple[int, dict, Fit | None]:
    """Run the search against the service at ``address`` with ``workers``
    sparse clients of one job: (chosen P, samples, fit). ``timeout``
    bounds the connection and each push or pull."""
    from aggnet.client.base import Client
    from aggnet.client.config import ClientConfig
    from aggnet.client.sparse import SparseClient

    job = f"tune-{uuid.uuid4().hex[:8]}"
    clients: list = [None] * workers
    errors: list[BaseException] = []

    def join(rank: int) -> None:  # every rank's HELLO must be in for the job to start
        try:
            config = ClientConfig(connect_timeout=timeout, timeout=timeout)
            clients[rank] = Client(address, job=job, rank=rank, world_size=workers, config=config)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(r,), daemon=True) for r in range(workers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout + 10)
    sparse = []
    try:
        if errors or any(c is None for c in clients):
            raise RuntimeError(f"cannot connect {workers} workers to {address}: "
                               f"{errors[0] if errors else f'no answer within {timeout + 10:g}s'}")
        sparse = [SparseClient.of(c) for c in clients]
        shards = len(sparse[0].shards)
        hi = min(rows, sparse_layout.MAX_PARTITIONS, max_partitions or sparse_layout.MAX_PARTITIONS)
        first = min(hi, start or shards)
        if log:
            log(f"service {address}: {shards} shard(s); table {rows} x {width}, alpha {alpha:g}, {workers} "
                f"worker(s), {steps} step(s) per sample; the search starts at P={first}")
        samples = search(table_step_time(sparse, rows, width, alpha, steps, timeout=timeout), first, hi=hi, log=log)
        p, f = choose(samples)
        return p, samples, f
    finally:
        for s in sparse:
            s.close()
        for c in clients:
            if c is not None:
                c.close()
