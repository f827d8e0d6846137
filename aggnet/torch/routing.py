"""Routing by α: a dense bucket whose 2-D gradients are mostly zero rows
travels as rows.

An ``nn.Embedding`` without ``sparse=True`` gets a dense gradient that is
zero except at the rows of the batch. Parallax sends such variables to a
parameter server when the fraction α of rows a worker touches is small,
and all-reduces them otherwise. Here, for each dense float32 bucket:

* over its first ``alpha_steps`` calls the bucket goes dense while each
  rank measures, per 2-D parameter of the bucket, the fraction of its
  gradient rows that are non-zero;
* then every rank all-reduces a tiny vector holding its own mean α per
  parameter in its own slot, so each rank sees every rank's α and takes
  the same MAX: the decision is identical everywhere, and logged once;
* a parameter whose α is below ``alpha_threshold`` travels from then on as
  its non-zero rows through a sparse table in all-reduce mode (the table
  returns the union of every worker's rows, summed or averaged), scattered
  back into the dense bucket with zeros elsewhere; the rest of the bucket
  is all-reduced dense through aggnet as one buffer.

The result is the dense all-reduce's: rows that are zero on every worker
are zero in the sum. The rest of a rows-routed bucket travels in float32
(the rows do, too), with one extra element counting non-finite values so
that every rank learns when some rank's gradients were not finite.
If DDP rebuilds its buckets (after the first step) a bucket whose
parameters changed is measured again.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numba
import numpy as np
import torch

from aggnet import kernels
from aggnet.errors import AggnetError, NonFiniteError
from aggnet.torch.futures import torch_future, when_all

log = logging.getLogger("aggnet.torch")
_CPU_KERNELS = kernels.load("cpu")

#: keys of the α agreement all-reduces, clear of DDP bucket indices
_AGREE_KEY = 1 << 20


@dataclass
class RouteStats:
    """How a bucket travels: ``route`` is "measuring", "rows", "dense" or
    "sparse" (a sparse gradient's bucket);
    ``alpha`` the bucket's agreed α (non-zero rows over rows of its 2-D
    parameters, the MAX over ranks of each one's mean over the measured
    steps); ``params`` per 2-D parameter: shape, α, route; ``why`` when a
    bucket cannot travel as rows, or went back to dense because rows were
    measured slower."""
    route: str = "measuring"
    alpha: float | None = None
    params: list = field(default_factory=list)
    why: str | None = None
    #: a step's all-reduce of the bucket, dense and as rows (fastest of the
    #: measured steps, slowest rank), once rows were tried
    dense_ms: float | None = None
    rows_ms: float | None = None


class _Bucket:
    def __init__(self, signature):
        self.signature = signature
        self.seen = 0
        self.local = np.zeros(len(signature), np.float64)
        self.rows: list[bool] | None = None  # per 2-D parameter, once agreed
        self.previous: str | None = None  # the route of the bucket's last call, while timing
        self.dense_s: list[float] = []
        self.rows_s: list[float] = []
        self.checked = False  # rows timed against dense, and agreed


@numba.njit(cache=True, nogil=True)
def _nonzero_row_indices(a: np.ndarray) -> np.ndarray:
    rows, width = a.shape
    out = np.empty(rows, np.int64)
    k = 0
    for r in range(rows):
        for c in range(width):
            if a[r, c] != 0:  # NaN too: it is not zero
                out[k] = r
                k += 1
                break
    return out[:k]


def _nonzero_rows(g: torch.Tensor) -> np.ndarray:
    """Indices of ``g``'s rows that hold a non-zero value: one pass that
    stops at a row's first non-zero, no temporary as large as ``g``
    (``(g != 0).any(1)`` took twice as long on a 1 M-row table)."""
    return _nonzero_row_indices(g.detach().numpy())


def _views(buf: torch.Tensor, bucket) -> list[tuple[int, torch.Tensor]]:
    """(offset in ``buf``, 2-D gradient view) of the bucket's 2-D parameters."""
    base, size = buf.data_ptr(), buf.element_size()
    out = []
    for g in bucket.gradients():
        if g.dim() == 2 and g.is_contiguous() and g.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr():
            out.append(((g.data_ptr() - base) // size, g))
    return out


def route(state, index: int, buf: torch.Tensor, bucket):
    """A future of the bucket's all-reduce when it travels as rows; None
    when the caller's dense path takes it (measuring, or decided dense)."""
    if buf.dtype != torch.float32 or buf.device.type != "cpu":
        return None
    views = _views(buf, bucket)
    stats = state.routes.setdefault(index, RouteStats())
    if not views:
        stats.route, stats.why = "dense", "no 2-D parameters"
        return None
    signature = tuple((off, tuple(g.shape)) for off, g in views)
    rb = state._route_buckets.get(index)
    if rb is None or rb.signature != signature:  # new, or DDP rebuilt its buckets
        rb = state._route_buckets[index] = _Bucket(signature)
        state.routes[index] = stats = RouteStats()
    last = state.buckets.get(index)
    if rb.previous is not None and last is not None:  # how long the last call took, by its route
        (rb.rows_s if rb.previous == "rows" else rb.dense_s).append(last.last_seconds)
    rb.previous = None
    if rb.rows is None:
        rb.local += [_nonzero_rows(g).size / g.shape[0] for _, g in views]
        rb.seen += 1
        if rb.seen >= state.alpha_steps:
            _agree(state, index, rb, views, stats)
        rb.previous = "dense"
        return None
    if any(rb.rows) and not rb.checked and len(rb.rows_s) >= state.alpha_steps:
        _check_speed(state, index, rb, stats)
    if not any(rb.rows):
        return None
    rb.previous = None if rb.checked else "rows"
    return _rows_allreduce(state, index, buf, views, rb)


def mark_sparse(state, index: int) -> None:
    """A sparse bucket's route: it is rows by nature. DDP rebuilds its
    buckets after the first step, and an index measured dense before may
    be a sparse bucket's after, so whatever was recorded under it goes."""
    state._route_buckets.pop(index, None)
    stats = state.routes.get(index)
    if stats is None or stats.route != "sparse":
        state.routes[index] = RouteStats(route="sparse", why="a sparse gradient: its rows, through the sparse path")


def _check_speed(state, index: int, rb: _Bucket, stats: RouteStats) -> None:
    """Rows where they are faster only: after as many steps as rows as α
    was measured over, every rank's fastest step each way, MAX over ranks
    (the slowest rank sets a step); slower as rows, the bucket goes back to
    dense on every rank at the same step."""
    world = state.world_size
    vec = np.zeros(world * 2, np.float32)
    vec[state.rank * 2:state.rank * 2 + 2] = [min(rb.dense_s, default=0.0), min(rb.rows_s)]
    client = state.client
    state._order.call(lambda: client.allreduce(vec, op="sum", codec=None, key=2 * _AGREE_KEY + index)).result(
        state.config.timeout + 5)
    dense, rows = (float(v) for v in vec.reshape(world, 2).max(axis=0))
    rb.checked = True
    stats.dense_ms, stats.rows_ms = dense * 1e3, rows * 1e3
    if rows > dense:
        rb.rows = [False] * len(rb.rows)
        stats.route = "dense"
        stats.why = (f"as rows a step took {rows * 1e3:.1f} ms against {dense * 1e3:.1f} ms dense: back to dense")
        for p in stats.params:
            p["route"] = "dense"
    log.info("aggnet DDP hook: bucket %d as rows %.1f ms a step, dense %.1f ms: it travels %s", index, rows * 1e3,
             dense * 1e3, stats.route)


def _agree(state, index: int, rb: _Bucket, views, stats: RouteStats) -> None:
    """Every rank's α per parameter, MAX over ranks: one decision for all."""
    from aggnet.torch import sparse

    n, world = len(views), state.world_size
    vec = np.zeros(world * n, np.float32)
    vec[state.rank * n:(state.rank + 1) * n] = rb.local / rb.seen
    timeout = state.config.timeout + 5
    client = state.client
    state._order.call(lambda: client.allreduce(vec, op="sum", codec=None, key=_AGREE_KEY + index)).result(timeout)
    alphas = vec.reshape(world, n).max(axis=0)
    rows = [int(g.shape[0]) for _, g in views]
    rb.rows = [bool(a < state.alpha_threshold) for a in alphas]
    if any(rb.rows):
        try:
            sparse._client_of(state)
        except ValueError as exc:  # a switch, or a hierarchy of racks: the same on every rank
            rb.rows = [False] * n
            stats.why = str(exc)
    stats.alpha = float(np.dot(alphas, rows) / sum(rows))
    stats.route = "rows" if any(rb.rows) else "dense"
    stats.params = [{"shape": tuple(g.shape), "alpha": float(a), "route": "rows" if r else "dense"}
                    for (_, g), a, r in zip(views, alphas, rb.rows)]
    log.info("aggnet DDP hook: bucket %d travels %s (alpha %.4g over %d step(s), threshold %g; per 2-D parameter: "
             "%s)%s", index, stats.route, stats.alpha, rb.seen, state.alpha_threshold,
             ", ".join(f"{p['shape']} {p['alpha']:.4g} {p['route']}" for p in stats.params),
             f"; {stats.why}" if stats.why else "")


def _rows_allreduce(state, index: int, buf: torch.Tensor, views, rb: _Bucket) -> torch.futures.Future:
    from aggnet.torch import sparse
    from aggnet.torch.hook import BucketStats

    t0 = time.perf_counter()
    sc = sparse._client_of(state)
    routed = sorted((off, g) for (off, g), r in zip(views, rb.rows) if r)
    # the rest of the bucket: the gaps between the routed parameters
    segments, pos = [], 0
    for off, g in routed:
        if off > pos:
            segments.append((pos, off))
        pos = off + g.numel()
    if pos < buf.numel():
        segments.append((pos, buf.numel()))
    flat = buf.detach()
    # the tables refuse NaN/Inf rows: never send them (one pass, no temporary)
    finite = _CPU_KERNELS.block_stats(flat.numpy())[1] == 0
    rest = np.empty(sum(b - a for a, b in segments) + 1, np.float32)
    at = 0
    for a, b in segments:
        rest[at:at + b - a] = flat[a:b].numpy()
        at += b - a
    rest[-1] = 0.0 if finite else 1.0  # every rank learns whether some rank's bucket was not finite
    if not finite:
        rest[:-1] = 0.0
    futures, sent = [], rest.nbytes
    for off, g in routed:
        rows, width = int(g.shape[0]), int(g.shape[1])
        name = f"ddp-rows-{index}-{off}-{rows}x{width}-{state.op}"
        table = state._sparse_tables.get(name)
        if table is None:
            table = state._sparse_tables[name] = sc.table(name, rows, width, mode="allreduce", op=state.op)
        if finite:
            idx = _nonzero_rows(g)
            vals = g.detach().numpy()[idx]
        else:  # still take part in the round, with nothing
            idx, vals = np.empty(0, np.int64), np.empty((0, width), np.float32)
        sent += idx.size * (8 + 4 * width)
        futures.append(table.allreduce(idx, vals))
    client = state.client
    futures.append(state._order.call(lambda: client.allreduce(rest, op=state.op, codec=None, key=index)))
    stats = state.buckets.setdefault(index, BucketStats())

    def value(_all) -> torch.Tensor:
        try:
            results = [f.result() for f in futures]
        except AggnetError as exc:
            raise type(exc)(f"aggnet DDP hook, bucket {index} (as rows) on rank {state.rank}: {exc}") from None
        if results[-1][-1] != 0:
            if state.check_finite and state.on_nonfinite == "raise":
                whose = (f"rank {state.rank}'s gradients" if not finite else
                         "another rank's gradients (that rank's error names it)")
                raise NonFiniteError(f"aggnet DDP hook: bucket {index} holds NaN/Inf: {whose} were not finite; "
                                     f"check the loss and inputs, or use AggnetState(on_nonfinite='propagate') "
                                     f"with AMP's GradScaler")
            buf.fill_(float("nan"))
        else:
            for (off, g), (idx, vals) in zip(routed, results[:-1]):
                # the result's rows are the union of every worker's, so they
                # cover every row that is not zero here: the rest stay zero
                # and need no pass of their own
                if idx.size:
                    g[torch.from_numpy(idx)] = torch.from_numpy(vals)
            got, at = results[-1], 0
            for a, b in segments:
                flat[a:b].copy_(torch.from_numpy(got[at:at + b - a]))
                at += b - a
        stats.calls += 1
        stats.elements += buf.numel()
        stats.wire_bytes += sent
        stats.last_seconds = time.perf_counter() - t0
        stats.seconds += stats.last_seconds
        return buf

    # every table's rows and the rest of the bucket: the bucket is done when all are
    return torch_future(when_all(futures), value)
