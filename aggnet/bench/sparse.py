"""``aggnet bench-sparse``: an embedding table trained four ways in one run,
so that the parameter-server path is measured beside what it replaces.

The model is LM-like: an embedding of ``--rows`` x ``--width`` float32 rows
under a small dense head. Each worker's batch is B tokens drawn uniformly
from the vocabulary, B chosen so that the rows it touches, α·m, are the
fraction α asked for (Parallax's Table 6 sets α by the batch's tokens the
same way). N worker processes then time, one system at a time:

* ``aggnet-ps``: :class:`aggnet.torch.ShardedEmbedding` (PS mode): the table
  and its SGD live on an ``aggnet serve`` reached over ``shm://``; a step
  pulls its rows and pushes their gradients;
* ``aggnet-allreduce``: the table on every worker, its sparse gradient
  summed through an aggnet ``allreduce`` table (what the DDP hook does);
* ``gloo-sparse``: the same, through torch.distributed's sparse all-reduce
  on gloo;
* ``dense``: the same table as a dense parameter, its gradient all-reduced
  on gloo (what DDP does without ``sparse=True``).

The dense head is all-reduced on gloo in every system alike. A step's time
is the slowest worker's mean over ``--steps`` steps after ``--warmup``; each
worker first runs every system's warm-up once, so that the system timed
first does not also pay for the fresh process's start.

Bytes per worker and step (sent + received) are measured, not derived: for
aggnet, the sparse client's payload counters (row indices and values;
message headers left out); for gloo, the bytes the worker process wrote to
its sockets during the table's all-reduce (``wchar`` of /proc/self/io: gloo
writes with write/writev) times two, since every byte one worker sends
another receives and the mean received then equals the mean sent. Each is
printed beside its model, with the formula.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

from aggnet.bench.allreduce import _system_info, spawn_workers
from aggnet.progress import Progress

SYSTEMS = ("aggnet-ps", "aggnet-allreduce", "gloo-sparse", "dense")
#: systems run unless --systems says otherwise (all of them)
DEFAULT_SYSTEMS = ",".join(SYSTEMS)
INDEX_BYTES = 8
LR = 0.1
HEAD_CLASSES = 16


def add_arguments(p) -> None:
    p.add_argument("--rows", type=int, default=1_000_000, help="embedding rows m (default %(default)s)")
    p.add_argument("--width", type=int, default=128, help="floats per row (default %(default)s)")
    p.add_argument("--workers", default="2,4", help="worker counts N, comma-separated (default %(default)s)")
    p.add_argument("--alphas", default="0.1%,1%,5%",
                   help="fractions of the rows one worker's batch touches, e.g. 0.1%%,1%%,5%% or 0.01 "
                        "(default %(default)s)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per point (default %(default)s)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (default %(default)s)")
    p.add_argument("--systems", default=DEFAULT_SYSTEMS, help="systems to run (default %(default)s)")
    p.add_argument("--shards", type=int, default=None, help="aggregator shards (default: one per core)")
    p.add_argument("--seed", type=int, default=0, help="seed of the token draws (default %(default)s)")
    p.add_argument("--json", default=None, help="write the records to this file")


def parse_alpha(text: str) -> float:
    """``1%`` or ``0.01``: a fraction in (0, 1)."""
    t = text.strip()
    try:
        value = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise ValueError(f"cannot read alpha {text!r}: give a fraction like 0.01 or a percentage like 1%") from None
    if not 0 < value < 1:
        raise ValueError(f"alpha must lie between 0 and 1 (0% and 100%), got {text!r}")
    return value


def batch_tokens(rows: int, alpha: float) -> int:
    """Tokens B whose uniform draws touch α·m distinct rows on average:
    m(1 - (1 - 1/m)^B) = αm."""
    return max(1, round(math.log(1 - alpha) / math.log(1 - 1 / rows)))


def tokens(rows: int, alpha: float, rank: int, step: int, seed: int) -> np.ndarray:
    """Worker ``rank``'s batch of step ``step``; the parent draws the same
    ones again to know every worker's rows without asking them."""
    rng = np.random.default_rng([seed, int(alpha * 1e9), rank, step])
    return rng.integers(0, rows, batch_tokens(rows, alpha), dtype=np.int64)


def _wchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no wchar line; cannot count the bytes gloo sends")


class _Step:
    """One system's model on one worker; ``step`` trains one batch and
    returns the table's bytes (sent, received) where they are counted
    here (None: the parent reads them from the sparse client)."""

    def __init__(self, system: str, world: int, rows: int, width: int, weight, sc, name: str):
        import torch
        import torch.nn as nn

        self.system, self.world, self.width = system, world, width
        torch.manual_seed(1)
        self.head = nn.Linear(width, HEAD_CLASSES)
        self.sc = sc
        self.table = None
        if system == "aggnet-ps":
            from aggnet.torch import ShardedEmbedding

            self.emb = ShardedEmbedding(sc, name, rows, width, optimizer="sgd", op="avg", lr=LR,
                                        init={"kind": "normal", "scale": 1.0, "seed": 0})
        else:
            # the one weight every system of this worker shares: a second
            # copy of a 512 MB table per worker would not fit four workers
            self.emb = nn.Embedding(rows, width, sparse=system != "dense", _weight=weight)
            if system == "aggnet-allreduce":
                self.table = sc.table(name, rows, width, mode="allreduce", op="avg")

    def _head_allreduce(self) -> None:
        import torch
        import torch.distributed as dist

        grads = [p.grad for p in self.head.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= self.world
        i = 0
        for p, g in zip(self.head.parameters(), grads):
            p.data.add_(flat[i:i + g.numel()].view_as(g), alpha=-LR)
            i += g.numel()
            p.grad = None

    def step(self, batch: np.ndarray, timeout: float) -> tuple[int, int] | None:
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F

        x = torch.from_numpy(batch)
        logits = self.head(self.emb(x))
        F.cross_entropy(logits, x % HEAD_CLASSES).backward()
        self._head_allreduce()
        if self.system == "aggnet-ps":
            return None  # the backward pushed the rows; the next forward waits for them
        w = self.emb.weight
        grad, w.grad = w.grad, None
        if self.system == "dense":
            before = _wchar()
            dist.all_reduce(grad)
            sent = _wchar() - before
            w.data.add_(grad, alpha=-LR / self.world)
            return sent, sent
        grad = grad.coalesce()
        if self.system == "gloo-sparse":
            before = _wchar()
            dist.all_reduce(grad)
            sent = _wchar() - before
            w.data.index_add_(0, grad.indices()[0], grad.values(), alpha=-LR / self.world)
            return sent, sent
        uniq, rows = self.table.allreduce(grad.indices()[0].numpy(), grad.values().numpy()).result(timeout)
        w.data.index_add_(0, torch.from_numpy(uniq), torch.from_numpy(rows), alpha=-LR)
        return None

    def finish(self) -> None:
        if self.system == "aggnet-ps":
            self.emb.wait()

    def close(self) -> None:
        if self.system == "aggnet-ps":
            self.emb.close()
        elif self.table is not None:
            self.table.close()


def _worker(rank: int, world: int, cfg: dict, address: str, port: int, barrier) -> list:
    import datetime

    import torch
    import torch.distributed as dist

    from aggnet import Client
    from aggnet.client.sparse import SparseClient

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=cfg["timeout"]))
    client = Client(address, job=f"bench-sparse-{port}", rank=rank, world_size=world, timeout=cfg["timeout"])
    sc = SparseClient.of(client)
    needs_weight = any(s != "aggnet-ps" for s in cfg["systems"])
    weight = None
    if needs_weight:
        weight = torch.empty(cfg["rows"], cfg["width"])
        weight.normal_(generator=torch.Generator().manual_seed(0))
    # every system's warm-up once before any is timed: the system timed
    # first would otherwise also pay this fresh process's own start (a
    # heap growing to a step's sizes, first calls), which the systems
    # after it are spared; it made whichever system came first look up
    # to twice as slow at small alphas
    for system in cfg["systems"] if cfg["warmup"] else ():
        model = _Step(system, world, cfg["rows"], cfg["width"], weight, sc, f"bench-{system}-start")
        for s in range(cfg["warmup"]):
            model.step(tokens(cfg["rows"], cfg["alphas"][0], rank, s, cfg["seed"]), cfg["timeout"])
        model.finish()
        model.close()
        del model
    results = []
    for ai, alpha in enumerate(cfg["alphas"]):
        for system in cfg["systems"]:
            model = _Step(system, world, cfg["rows"], cfg["width"], weight, sc, f"bench-{system}-{ai}")
            for s in range(cfg["warmup"]):
                model.step(tokens(cfg["rows"], alpha, rank, s, cfg["seed"]), cfg["timeout"])
            model.finish()
            batches = [tokens(cfg["rows"], alpha, rank, cfg["warmup"] + s, cfg["seed"])
                       for s in range(cfg["steps"])]
            barrier.wait(cfg["timeout"])
            sent0, recv0 = sc.bytes_sent, sc.bytes_received
            sent = recv = 0
            t0 = time.perf_counter()
            for b in batches:
                moved = model.step(b, cfg["timeout"])
                if moved is not None:
                    sent += moved[0]
                    recv += moved[1]
            model.finish()
            elapsed = time.perf_counter() - t0
            if system.startswith("aggnet"):
                sent, recv = sc.bytes_sent - sent0, sc.bytes_received - recv0
            model.close()
            del model
            results.append({"system": system, "alpha_index": ai, "step_s": elapsed / cfg["steps"],
                            "sent": sent / cfg["steps"], "received": recv / cfg["steps"]})
    sc.close()
    client.close()
    dist.destroy_process_group()
    return results


def touched(cfg: dict, world: int, alpha: float) -> tuple[float, float, list[float]]:
    """(mean rows one worker touches per step, mean union of all workers'
    rows per step, mean rows per worker by rank) over the timed steps."""
    per_rank = [[] for _ in range(world)]
    union = []
    for s in range(cfg["warmup"], cfg["warmup"] + cfg["steps"]):
        sets = [np.unique(tokens(cfg["rows"], alpha, r, s, cfg["seed"])) for r in range(world)]
        for r, u in enumerate(sets):
            per_rank[r].append(u.size)
        union.append(np.unique(np.concatenate(sets)).size)
    by_rank = [statistics.mean(v) for v in per_rank]
    return statistics.mean(by_rank), statistics.mean(union), by_rank


#: each system's bytes per worker and step (sent + received), as printed;
#: m·α and m·u are rows, w bytes per row, N workers
FORMULAS = {
    "aggnet-ps": "αm(w+8) up (gradients) + 8αm up (pull) + αm(w+8) down (rows) = αm(2w+24)",
    "aggnet-allreduce": "αm(w+8) up + um(w+8) down",
    "gloo-sparse": "2αm(w+8)(N-1) (all-gather: each worker's rows to every other)",
    "dense": "4wm(N-1)/N (ring: 2wm(N-1)/N up and down)",
}
COLOCATED = "servers colocated with the workers (Parallax): 4αwm(N-1)/N in and out together"


def model_bytes(system: str, rows_one: float, rows_union: float, row_bytes: int, rows: int, world: int) -> float:
    """The model of FORMULAS for measured row counts (αm = ``rows_one``,
    um = ``rows_union``)."""
    r = row_bytes + INDEX_BYTES
    if system == "aggnet-ps":
        return rows_one * (2 * r + INDEX_BYTES)
    if system == "aggnet-allreduce":
        return rows_one * r + rows_union * r
    if system == "gloo-sparse":
        return 2 * rows_one * r * (world - 1)
    return 4 * row_bytes * rows * (world - 1) / world


def main(args) -> int:
    from aggnet.processes import ServiceProcess

    try:
        import torch.distributed  # noqa: F401  (the workers' gloo groups)
    except ImportError:
        print("aggnet bench-sparse needs torch (pip install aggnet[torch])", file=sys.stderr)
        return 2
    if not os.path.exists("/proc/self/io"):
        print("aggnet bench-sparse counts gloo's bytes from /proc/self/io, which this system lacks (Linux only)",
              file=sys.stderr)
        return 2
    try:
        worlds = [int(w) for w in args.workers.split(",")]
        alphas = [parse_alpha(a) for a in args.alphas.split(",")]
    except ValueError as exc:
        print(f"aggnet bench-sparse: {exc}", file=sys.stderr)
        return 2
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        print(f"aggnet bench-sparse: unknown system(s) {unknown}; choose from {', '.join(SYSTEMS)}", file=sys.stderr)
        return 2
    if args.rows < 2 or args.width < 1 or args.steps < 1 or args.warmup < 0 or min(worlds) < 2:
        print("aggnet bench-sparse: need --rows >= 2, --width >= 1, --steps >= 1, --warmup >= 0 and workers >= 2",
              file=sys.stderr)
        return 2
    row_bytes = 4 * args.width
    table_bytes = row_bytes * args.rows
    cfg = {"rows": args.rows, "width": args.width, "alphas": alphas, "systems": systems, "steps": args.steps,
           "warmup": args.warmup, "seed": args.seed, "timeout": 600.0, "run_timeout": 3600.0}
    print(f"aggnet bench-sparse: table {args.rows} x {args.width} float32 (w·m = {table_bytes / 2**20:.1f} MiB), "
          f"head {args.width} -> {HEAD_CLASSES}, SGD; workers {worlds}; alphas "
          f"{', '.join(f'{a:.3%}' for a in alphas)}; {args.warmup} warm-up + {args.steps} timed steps; "
          f"aggnet service on shm:// (a separate process: the servers-on-separate-hosts placement)")
    print("bytes per worker and step = sent + received; aggnet: the sparse client's payload counters; gloo: bytes "
          "written to sockets during the table's all-reduce (/proc/self/io wchar) x 2")
    records = []
    progress = Progress("aggnet bench-sparse", len(worlds))
    for world in worlds:
        run_dir = tempfile.mkdtemp(prefix="aggnet-bench-sparse-")
        service = ServiceProcess(f"shm://{run_dir}/shm.sock", args.shards)
        try:
            try:
                per_rank = spawn_workers(_worker, world, (cfg, service.address), cfg["run_timeout"],
                                         "aggnet bench-sparse", "; try fewer --rows, --steps or --alphas")
            except RuntimeError as exc:
                progress.close()
                print(exc, file=sys.stderr)
                return 1
        finally:
            service.stop()
            shutil.rmtree(run_dir, ignore_errors=True)  # the shm socket; the next N makes its own
        records += _records(cfg, world, per_rank, row_bytes)
        progress.step(f"{world} workers: {len(systems)} system(s) x {len(alphas)} alpha(s)")
    progress.close()
    ratios = _print(records, row_bytes)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"system_info": {**_system_info(), "loadavg": os.getloadavg()}, "records": records,
                       "ratios": ratios, "formulas": {**FORMULAS, "aggnet-ps colocated": COLOCATED}}, f, indent=1)
        print(f"wrote {len(records)} records to {args.json}")
    return 0


def _records(cfg: dict, world: int, per_rank: list, row_bytes: int) -> list[dict]:
    """One record per system and alpha at ``world`` workers: the slowest
    rank's step and the mean bytes per worker beside the model's."""
    rows = cfg["rows"]
    records = []
    for ai, alpha in enumerate(cfg["alphas"]):
        rows_one, rows_union, _ = touched(cfg, world, alpha)
        for system in cfg["systems"]:
            res = [next(x for x in per_rank[r] if x["system"] == system and x["alpha_index"] == ai)
                   for r in range(world)]
            sent = statistics.mean(x["sent"] for x in res)
            received = statistics.mean(x["received"] for x in res)
            model = model_bytes(system, rows_one, rows_union, row_bytes, rows, world)
            records.append({
                "system": system, "workers": world, "alpha": alpha, "alpha_measured": rows_one / rows,
                "union_measured": rows_union / rows, "tokens_per_worker": batch_tokens(rows, alpha),
                "rows": rows, "width": cfg["width"], "table_bytes": row_bytes * rows,
                "step_s": max(x["step_s"] for x in res), "step_s_by_rank": [x["step_s"] for x in res],
                "bytes_per_worker": sent + received, "sent_per_worker": sent, "received_per_worker": received,
                "model_bytes_per_worker": model, "model": FORMULAS[system],
                "bytes_counted_by": "sparse client payload counters" if system.startswith("aggnet")
                else "socket writes (/proc/self/io wchar) x 2",
                "colocated_model_bytes_per_worker": (4 * row_bytes * rows_one * (world - 1) / world
                                                     if system == "aggnet-ps" else None),
                "steps": cfg["steps"], "warmup": cfg["warmup"]})
    return records


def _mb(n: float) -> str:
    return f"{n / 1e6:10.3f}"


def _print(records: list[dict], row_bytes: int) -> list[dict]:
    print(f"w = {row_bytes} bytes per row, 8 per index; models (bytes per worker and step, sent + received):")
    for system, text in FORMULAS.items():
        print(f"  {system:>16}: {text}")
    print(f"  {'aggnet-ps':>16}, {COLOCATED}")
    print(f"{'N':>2} {'alpha':>7} {'α meas':>7} {'system':>16} {'step ms':>9} {'MB/worker':>10} {'model MB':>10} "
          f"{'meas/model':>10} {'colocated MB':>12}")
    for r in records:
        colo = r["colocated_model_bytes_per_worker"]
        print(f"{r['workers']:>2} {r['alpha']:7.3%} {r['alpha_measured']:7.3%} {r['system']:>16} "
              f"{r['step_s'] * 1e3:9.1f} {_mb(r['bytes_per_worker'])} {_mb(r['model_bytes_per_worker'])} "
              f"{r['bytes_per_worker'] / r['model_bytes_per_worker']:10.3f} "
              f"{_mb(colo) if colo is not None else '':>12}")
    step = {(r["workers"], r["alpha"], r["system"]): r["step_s"] for r in records}
    ratios = []
    for world, alpha in sorted({(r["workers"], r["alpha"]) for r in records}):
        ps = step.get((world, alpha, "aggnet-ps"))
        if ps is None:
            continue
        entry = {"workers": world, "alpha": alpha}
        parts = []
        for other, target in (("dense", ">= 5"), ("gloo-sparse", "> 1"), ("aggnet-allreduce", None)):
            if (world, alpha, other) in step:
                entry[f"{other}_over_ps"] = step[(world, alpha, other)] / ps
                parts.append(f"{other}/ps {entry[f'{other}_over_ps']:.2f}" + (f" (target {target})" if target else ""))
        ratios.append(entry)
        print(f"N={world} alpha={alpha:.3%}: step time " + "; ".join(parts))
    return ratios
