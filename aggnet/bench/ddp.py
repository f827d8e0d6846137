"""``aggnet bench-ddp``: DDP step time of a communication-bound model with
the aggnet hook (float32 and int32) beside PyTorch's default gloo
all-reduce, in one run.

The model is an MLP with tens of millions of parameters trained on small
batches, so a step is dominated by gradient aggregation. The same worker
processes time every system in turn on the same model and data; a step's
time is the slowest worker's.

Systems: ``gloo``; ``aggnet-CODEC`` (the hook; ``aggnet-CODEC-staged``
with CPU buckets taken through the GPU path's staging, to weigh its host
side without a GPU); ``aggnet-CODEC-staleS``
and ``aggnet-CODEC-staleS-predict`` (stale-gradient data parallelism,
:mod:`aggnet.torch.stale`: the all-reduce hides behind the next S steps);
``backend-CODEC`` (DDP without a hook, over a process group of the
``aggnet`` backend: what ``init_process_group("aggnet")`` gives);
and the two halves of a step alone, to weigh them against: ``compute``
(forward, backward and update without DDP) and ``comm-CODEC`` (one aggnet
all-reduce of the model's gradient size, nothing else; ``comm-CODEC-buckets``
in DDP's two buckets, a first of 1 MiB and the rest; ``comm-CODEC-pipelined``
the same with each step waiting for the previous step's buckets, the way
a stale step queues them).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from contextlib import nullcontext

from aggnet.bench.allreduce import WorkerFailed, spawn_workers
from aggnet.bench.args import at_least_one, count_list
from aggnet.bench.cpu import own_cpu_seconds
from aggnet.progress import Progress
from aggnet.processes import DDP_WORKER_PRELOAD


def add_arguments(p) -> None:
    p.add_argument("--workers", type=count_list, default="2,4", help="worker counts (default %(default)s)")
    p.add_argument("--width", type=at_least_one, default=4096,
                   help="hidden width; parameters ~ 2*width*1024 + width**2")
    p.add_argument("--batch", type=at_least_one, default=8, help="batch per worker (default %(default)s)")
    p.add_argument("--steps", type=at_least_one, default=10, help="timed steps per system (default %(default)s)")
    p.add_argument("--systems", default="gloo,aggnet-float32,aggnet-int32",
                   help="what to time, comma-separated: gloo, aggnet-CODEC[-staleS[-predict]], compute, "
                        "comm-CODEC[-buckets|-pipelined]; aggnet-CODEC-rings stages GPU buckets through private "
                        "pinned memory copied through the shm rings (share_buffers=False); aggnet-CODEC-staged takes "
                        "CPU buckets through everything a GPU bucket goes through (staging='always'), to weigh "
                        "the staging's host side without a GPU; backend-CODEC is DDP without a hook over the aggnet "
                        "backend (default %(default)s)")
    p.add_argument("--address", default=None, help="aggregator (default: embedded local aggregator)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the model trains (cuda: every worker on GPU 0 unless CUDA_VISIBLE_DEVICES "
                        "differs; aggnet-CODEC-sync is the hook without staging)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the records here")


_CODEC_NAMES = ("float32", "int32", "fp16", "bf16")


def check_system(name: str) -> str:
    """A system name the worker knows, or a one-line error listing them."""
    parts = name.split("-")
    ok = (name in ("gloo", "compute")
          or (parts[0] == "aggnet" and len(parts) >= 2 and parts[1] in _CODEC_NAMES
              and (len(parts) == 2 or parts[2:] in (["sync"], ["rings"], ["staged"])
                   or (parts[2].startswith("stale") and parts[2][5:].isdigit() and int(parts[2][5:]) > 0
                                       and parts[3:] in ([], ["predict"]))))
          or (parts[0] == "backend" and len(parts) == 2 and parts[1] in _CODEC_NAMES)
          or (parts[0] == "comm" and len(parts) in (2, 3) and parts[1] in _CODEC_NAMES
              and parts[2:] in ([], ["buckets"], ["pipelined"])))
    if not ok:
        raise SystemExit(f"aggnet bench-ddp: unknown system {name!r}; use gloo, compute, aggnet-CODEC, "
                         f"aggnet-CODEC-sync, aggnet-CODEC-rings, aggnet-CODEC-staged, aggnet-CODEC-staleS[-predict], "
                         f"backend-CODEC, comm-CODEC[-buckets|-pipelined] with CODEC one of {', '.join(_CODEC_NAMES)}")
    return name


class _CommOnly:
    """The all-reduces of a DDP step without the model ("comm-..."
    systems): one of all the gradients, or DDP's two buckets waited in the
    step ("buckets") or a step later ("pipelined")."""

    def __init__(self, client, parts: list, params: int):
        import numpy as np

        self.client, self.parts = client, parts
        self.codec = None if parts[1] == "float32" else parts[1]
        self.grad = np.zeros(params, dtype=np.float32)
        first = min(params, (1 << 20) // 4)
        self.buckets = [np.ones(first, np.float32), np.ones(params - first, np.float32)]
        self.in_flight = None

    def step(self) -> None:
        if len(self.parts) == 2:  # one all-reduce of all the gradients
            self.grad.fill(1.0)
            self.client.allreduce(self.grad, op="avg", codec=self.codec).result()
            return
        futures = [self.client.allreduce(b, op="avg", codec=self.codec) for b in self.buckets]
        # "buckets": waited in the step, as synchronous DDP does;
        # "pipelined": the previous step's waited, as a stale step does
        waited, self.in_flight = ((futures, None) if self.parts[2] == "buckets" else (self.in_flight, futures))
        for f in waited or ():
            f.result()

    def finish(self) -> None:
        for f in self.in_flight or ():
            f.result()


def _time_system(system: str, model, x, y, args, rank: int, world: int, port) -> tuple[list, float, dict | None]:
    """Steps of one system after a warm-up: their times, this worker's
    CPU-seconds over them, and the aggnet client's counters where one ran."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from aggnet.torch import AggnetState, StaleStep, allreduce_hook

    parts = system.split("-")
    state = stale = comm = group = None
    if system == "compute":
        ddp = model  # the same step without DDP: no communication at all
    elif parts[0] == "backend":
        import aggnet.torch  # noqa: F401  (registers the backend)
        from aggnet.client.config import ClientConfig

        group = dist.new_group(backend="aggnet", pg_options=ClientConfig.from_env(address=args.address,
                                                                                  codec=parts[1]))
        ddp = DDP(model, process_group=group)
    elif parts[0] == "comm":
        from aggnet.client.base import Client

        client = Client(args.address, job=f"bench-{system}-{port}", rank=rank, world_size=world)
        comm = _CommOnly(client, parts, sum(p.numel() for p in model.parameters()))
        ddp = None
    else:
        ddp = DDP(model)
    if system.startswith("aggnet"):
        from aggnet.client.config import ClientConfig

        staleness = int(parts[2][len("stale"):]) if len(parts) > 2 and parts[2].startswith("stale") else 0
        state = AggnetState(args.address, codec=parts[1], staleness=staleness, predict="predict" in parts,
                            staging="always" if "staged" in parts else "sync" not in parts,
                            config=ClientConfig.from_env(share_buffers=False) if "rings" in parts else None)
        ddp.register_comm_hook(state, allreduce_hook)
    opt = torch.optim.SGD((ddp or model).parameters(), lr=1e-4, momentum=0.9)
    if state is not None and state.staleness:
        stale = StaleStep(ddp, opt, state)
    times = []
    # one barrier, then steps back to back as training runs them: a
    # barrier per step would queue behind a stale all-reduce still on
    # the link, and hide the overlap the stale systems are there for
    dist.barrier()
    t0 = time.perf_counter()
    for step in range(args.steps + 3):
        if comm is not None:
            comm.step()
        elif stale is not None:
            with stale.step():
                nn.functional.mse_loss(ddp(x), y).backward()
        else:
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        if x.is_cuda:  # the step is done when the device is
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        if step >= 3:  # warm-up: connections, first-touch, JIT
            times.append(t1 - t0)
        else:
            cpu0 = own_cpu_seconds()
        t0 = t1
    if stale is not None:
        stale.finish()
    if comm is not None:
        comm.finish()
    cpu = own_cpu_seconds() - cpu0
    used = comm.client if comm is not None else (state._client if state is not None else
                                                 group._client if group is not None else None)
    stats = None
    if used is not None:
        cs = used.stats
        stats = {"allreduces": cs.allreduces, "packets": cs.chunks_sent, "retransmissions": cs.retransmissions,
                 "seconds": cs.seconds}
    if state is not None:
        state.close()
    if comm is not None:
        comm.client.close()
    if group is not None:
        dist.destroy_process_group(group)
    return times, cpu, stats


def _spawned(rank: int, world: int, args, systems: list, port: int, barrier) -> tuple:
    """One worker of this machine's (:func:`aggnet.bench.allreduce.spawn_workers`)."""
    params, results, cpu, _ = _measure(rank, world, port, args, systems)
    return rank, params, results, cpu


def _worker(rank: int, world: int, port, args, systems: list) -> None:
    """One DDP worker where its peers run elsewhere (an emulated rack's
    namespaces): its result as one JSON line."""
    params, results, cpu, client_stats = _measure(rank, world, port, args, systems)
    print(json.dumps({"rank": rank, "parameters": params, "times": results, "cpu": cpu, "client": client_stats}),
          flush=True)


def _measure(rank: int, world: int, port, args, systems: list) -> tuple:
    """One DDP worker timing every system; ``port`` is a local port or a
    rendezvous ``host:port`` (one worker per namespace)."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    torch.set_num_threads(1)
    master = port if isinstance(port, str) else f"127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=f"tcp://{master}", rank=rank, world_size=world)
    torch.manual_seed(0)
    w = args.width
    model = nn.Sequential(nn.Linear(1024, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, 1024))
    params = sum(p.numel() for p in model.parameters())
    device = getattr(args, "device", "cpu")
    model = model.to(device)
    x = torch.randn(args.batch, 1024, device=device)
    y = torch.randn(args.batch, 1024, device=device)
    results, cpu, client_stats = {}, {}, {}
    # rank 0 shows it, on standard error (a rack's workers print JSON on standard output)
    with Progress("aggnet bench-ddp", len(systems)) if rank == 0 else nullcontext() as progress:
        for system in systems:
            results[system], cpu[system], stats = _time_system(system, model, x, y, args, rank, world, port)
            if stats is not None:
                client_stats[system] = stats
            if progress is not None:
                progress.step(f"{system}: {args.steps} steps")
    dist.destroy_process_group()
    return params, results, cpu, client_stats


def worker_main(argv=None) -> int:
    """``python -m aggnet.bench.ddp --rank R --world N --master HOST:PORT``:
    one worker of the benchmark where its peers run elsewhere (an emulated
    rack's namespaces); the aggregator comes from ``AGGNET_ADDRESS``."""
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master", required=True)
    args = p.parse_args(argv)
    systems = [check_system(s.strip()) for s in args.systems.split(",") if s.strip()]
    _worker(args.rank, args.world, args.master, args, systems)
    return 0


def summarize(got: list, systems: list, steps: int, world: int, batch: int) -> list[dict]:
    """Per-system records: a step takes as long as its slowest worker; a
    worker's CPU-seconds per step (user + system, every thread: compute
    and communication) are averaged over workers."""
    records = []
    for system in systems:
        per_step = [max(g[2][system][i] for g in got) for i in range(steps)]
        r = {"system": system, "workers": world, "parameters": got[0][1], "batch": batch,
             "median_s": statistics.median(per_step), "min_s": min(per_step), "max_s": max(per_step),
             "steps": steps}
        cpus = [g[3][system] for g in got if len(g) > 3 and system in g[3]]
        if cpus:
            r["worker_cpu_s_per_step"] = sum(cpus) / len(cpus) / steps
        records.append(r)
    return records


def main(args) -> int:
    import torch

    systems = [check_system(s.strip()) for s in args.systems.split(",") if s.strip()]
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("aggnet bench-ddp: --device cuda needs a CUDA GPU and torch's CUDA build; this machine "
                         "has neither (use --device cpu)")
    records = []
    for world in [int(w) for w in args.workers.split(",")]:
        os.environ.setdefault("AGGNET_TIMEOUT", "120")  # before the fork server starts: it keeps this environment
        try:
            # a worker that fails stops the run at once, in one line (a dead
            # one was waited for an hour)
            got = spawn_workers(_spawned, world, (args, systems), 3600, "aggnet bench-ddp",
                                preload=DDP_WORKER_PRELOAD)
        except WorkerFailed as exc:
            print(exc, file=sys.stderr)
            return 1
        records += summarize([got[r] for r in range(world)], systems, args.steps, world, args.batch)
    print(f"{'N':>2} {'system':>15} {'params':>11} {'step ms (median)':>17} {'min':>7} {'max':>7} {'gloo/this':>9} "
          f"{'cpu s/step':>10}")
    for r in records:
        gloo = next((g["median_s"] for g in records if g["system"] == "gloo" and g["workers"] == r["workers"]), None)
        ratio = f"{gloo / r['median_s']:9.2f}" if gloo else f"{'':>9}"
        cpu = f"{r['worker_cpu_s_per_step']:10.3f}" if "worker_cpu_s_per_step" in r else ""
        print(f"{r['workers']:>2} {r['system']:>15} {r['parameters']:>11,} {r['median_s'] * 1e3:17.1f} "
              f"{r['min_s'] * 1e3:7.1f} {r['max_s'] * 1e3:7.1f} {ratio} {cpu}")
    print("cpu s/step: a worker's CPU-seconds per step (user + system, every thread: compute and communication)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
        print(f"wrote {len(records)} records to {args.json}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(worker_main())
