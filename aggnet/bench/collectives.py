"""``aggnet bench --collective reduce_scatter``: the torch.distributed
backend beside gloo and beside aggnet's own client, in one run.

N worker processes join two process groups on the same ranks: the default
one on the ``aggnet`` backend, whose aggregator is an ``aggnet serve`` on
``shm://`` (the kind the embedded default starts), and a gloo group. For
every size they time, one system at a time, the two that a ratio compares
in turns (AB, BA, ...: drift on a shared machine then falls on both):

* ``reduce_scatter_tensor`` of S bytes per rank on gloo and on aggnet
  (each rank sends S and, through aggnet, receives only its S/N share);
* ``all_reduce`` of S bytes on aggnet through the backend, and
  ``Client.allreduce`` of the same buffer on the same service: what the
  process-group layer costs;
* ``all_reduce`` on gloo, for context;
* with host memory, ``reduce_scatter_tensor`` through the staging a CUDA
  tensor takes (a second aggnet group with ``stage_cpu_tensors``): the
  host's share of a GPU's reduce-scatter, whose share the shards write
  where it was staged.

``--codec int32`` sends aggnet's float32 quantized (``AGGNET_CODEC``; on
the GPU, quantized there), gloo's as it is. With host memory its staged
form runs the device's quantizer (torch operations) on the CPU, one
thread: that times this code on a CPU, not what a GPU does.
``--memory cuda`` puts the tensors on the GPU: gloo's and aggnet's (the
backend stages them) reduce-scatters and all-reduces of CUDA tensors,
each timed until its result is on the device; the client's all-reduce
stays on host memory.

A repetition's time is the slowest rank's; the table shows medians, a
worker's CPU-seconds per GB (its mean over ranks, every thread) and the
aggregator's (read by rank 0 around each call), and the two ratios the
backend answers to: aggnet reduce-scatter / gloo reduce-scatter and
backend all-reduce / client all-reduce.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from aggnet.client.config import format_size, parse_size

from aggnet.bench.allreduce import _system_info, spawn_workers
from aggnet.bench.cpu import CpuReading, descendants, own_cpu_seconds, per_gb


def _turns(barrier, fns: dict, reps: int, aggregator: list | None = None) -> dict:
    """Each of ``fns`` (name -> call) ``reps`` times, in turns (AB, BA,
    AB, ...: drift on a shared machine then falls on all alike) after a
    warm-up of each: {name: {"times", "cpu_s", "aggregator_cpu_s"}}, the
    CPU-seconds of this process (every thread) and, where ``aggregator``
    names the service's processes, theirs, over that name's calls."""
    for f in fns.values():
        f()
    out = {name: {"times": [], "cpu_s": 0.0, "aggregator_cpu_s": 0.0 if aggregator else None} for name in fns}
    names = list(fns)
    for i in range(reps):
        for name in names if i % 2 == 0 else names[::-1]:
            barrier.wait(120)
            agg0 = CpuReading(aggregator) if aggregator else None
            cpu0 = own_cpu_seconds()
            t0 = time.perf_counter()
            fns[name]()
            out[name]["times"].append(time.perf_counter() - t0)
            out[name]["cpu_s"] += own_cpu_seconds() - cpu0
            if agg0 is not None:
                out[name]["aggregator_cpu_s"] += CpuReading(aggregator) - agg0
    return out


#: what each worker times, in this order
SYSTEMS = ("gloo reduce_scatter", "aggnet reduce_scatter", "aggnet all_reduce", "client all_reduce",
           "gloo all_reduce")
#: host memory only: CPU tensors through the staging a CUDA tensor takes
#: (the backend's stage_cpu_tensors): the host's share of a GPU's
#: reduce-scatter, its shares received in place over shm://
STAGED = "aggnet reduce_scatter staged"


def systems(memory: str) -> tuple:
    return SYSTEMS + ((STAGED,) if memory == "host" else ())


def _worker(rank: int, world: int, sizes: list[int], reps: int, address: str, memory: str, codec: str,
            service_pid: int, port: int, barrier) -> list:
    import datetime

    import torch
    import torch.distributed as dist

    import aggnet.torch  # noqa: F401  (registers the backend)
    from aggnet import Client
    from aggnet.client.config import ClientConfig

    torch.set_num_threads(1)
    device = torch.device("cuda" if memory == "cuda" else "cpu")
    # AGGNET_* settings apply (AGGNET_PREDICT_SCALE=0: int32 agrees every round)
    config = ClientConfig.from_env(address=address, timeout=300.0, codec=codec)
    dist.init_process_group("aggnet", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            pg_options=config, timeout=datetime.timedelta(seconds=600))
    gloo = dist.new_group(backend="gloo")
    staged = None
    if memory == "host":
        staged = dist.new_group(backend="aggnet", pg_options=config)
        staged.stage_cpu_tensors = True
    client = Client(address, job=f"bench-client-{port}", rank=rank, world_size=world, config=config)

    def done(f):
        """``f``, until its result is on the device (gloo's CUDA work may
        only have queued it on a stream)."""
        def run():
            f()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        return run

    # rank 0 reads the service's CPU time around each call: its supervisor
    # and shards, found once
    aggregator = [service_pid, *descendants(service_pid)] if rank == 0 else None
    results = []
    try:
        for nbytes in sizes:
            n = nbytes // 4 // world * world
            inp = torch.full((n,), float(rank + 1), device=device)
            share = torch.empty(n // world, device=device)
            want = world * (world + 1) / 2
            times = _turns(barrier, {"gloo reduce_scatter": done(lambda: dist.reduce_scatter_single(share, inp,
                                                                                                   group=gloo)),
                                     "aggnet reduce_scatter": done(lambda: dist.reduce_scatter_single(share, inp))},
                           reps, aggregator)
            if float(share[0]) != want or float(share[-1]) != want:
                raise AssertionError(f"rank {rank}: aggnet reduce_scatter gave {share[0]} .. {share[-1]}, want {want}")
            if staged is not None:
                share.zero_()
                times.update(_turns(barrier, {STAGED: lambda: dist.reduce_scatter_single(share, inp, group=staged)},
                                    reps, aggregator))
                if float(share[0]) != want or float(share[-1]) != want:
                    raise AssertionError(f"rank {rank}: staged reduce_scatter gave {share[0]} .. {share[-1]}")
            # averages of ones: the values stay 1, exactly, as a gradient's
            # scale stays from one step to the next (the client's buffer is
            # host memory either way). Under int32 the backend carries its
            # exponents from an earlier call of the size (its own keys), so
            # the client's all-reduce goes under a key too: the ratio is
            # what the process-group layer costs, not carrying against agreeing
            buf = torch.ones(n, device=device)
            arr = np.ones(n, np.float32)
            wire, key = (None, None) if codec == "float32" else (codec, 0)
            times.update(_turns(barrier, {
                "aggnet all_reduce": done(lambda: dist.all_reduce(buf, op=dist.ReduceOp.AVG)),
                "client all_reduce": lambda: client.allreduce(arr, op="avg", codec=wire, key=key).result(600)},
                reps, aggregator))
            for got, name in ((buf.cpu().numpy(), "backend"), (arr, "client")):
                if float(got[0]) != 1.0 or float(got[-1]) != 1.0:
                    raise AssertionError(f"rank {rank}: {name} all_reduce gave {got[0]} .. {got[-1]}, want 1.0")
            buf = torch.ones(n, device=device)
            times.update(_turns(barrier, {"gloo all_reduce": done(lambda: dist.all_reduce(buf, group=gloo))}, reps,
                                aggregator))
            results.append(times)
    finally:
        client.close()
        dist.destroy_process_group()
    return results


def main(args) -> int:
    from aggnet.processes import ServiceProcess

    try:
        import torch.distributed  # noqa: F401
    except ImportError:
        print("aggnet bench --collective reduce_scatter needs torch (pip install aggnet[torch])", file=sys.stderr)
        return 2
    memory = getattr(args, "memory", "host")
    codec = getattr(args, "codec", "float32")
    if memory == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("aggnet bench --collective reduce_scatter --memory cuda needs a CUDA GPU that torch sees; leave "
                  "--memory out", file=sys.stderr)
            return 2
    worlds = [int(w) for w in args.workers.split(",")]
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    records = []
    for world in worlds:
        # one service per world size, as `aggnet bench` does; its socket's
        # folder goes with it
        with tempfile.TemporaryDirectory(prefix="aggnet-bench-") as run_dir:
            service = ServiceProcess(f"shm://{run_dir}/shm.sock", args.shards)
            try:
                per_rank = spawn_workers(_worker, world,
                                         (sizes, args.reps, service.address, memory, codec, service.pid), 3600,
                                         "aggnet bench --collective reduce_scatter")
            finally:
                service.stop()
        for i, nbytes in enumerate(sizes):
            for system in systems(memory):
                got = [per_rank[r][i][system] for r in range(world)]
                slowest = [max(g["times"][k] for g in got) for k in range(args.reps)]
                record = {"system": system, "workers": world, "bytes": nbytes, "transport": "shm",
                          "dtype": "float32", "codec": codec, "memory": memory, "median_s": statistics.median(slowest),
                          "min_s": min(slowest), "max_s": max(slowest), "reps": args.reps,
                          # a worker's mean, and the aggregator's (0 for gloo's: its shards idle)
                          "worker_cpu_s_per_gb": per_gb(statistics.mean(g["cpu_s"] for g in got), nbytes, args.reps),
                          "aggregator_cpu_s_per_gb": per_gb(got[0]["aggregator_cpu_s"], nbytes, args.reps)}
                records.append(record)
    ratios = _print(records)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"system_info": {**_system_info(), "loadavg": os.getloadavg()}, "records": records,
                       "ratios": ratios}, f, indent=1)
        print(f"wrote {len(records)} records to {args.json}")
    return 0


def _print(records: list[dict]) -> list[dict]:
    print(f"{'N':>2} {'size':>7} {'system':>28} {'median ms':>10} {'min ms':>8} {'max ms':>8} {'cpu s/GB':>9} "
          f"{'agg s/GB':>9}")
    for r in records:
        print(f"{r['workers']:>2} {format_size(r['bytes']):>7} {r['system']:>28} {r['median_s'] * 1e3:10.1f} "
              f"{r['min_s'] * 1e3:8.1f} {r['max_s'] * 1e3:8.1f} {r['worker_cpu_s_per_gb']:9.2f} "
              f"{r['aggregator_cpu_s_per_gb']:9.2f}")
    median = {(r["workers"], r["bytes"], r["system"]): r["median_s"] for r in records}
    ratios = []
    for world, nbytes in sorted({(r["workers"], r["bytes"]) for r in records}):
        def m(system):
            return median[(world, nbytes, system)]
        rs = m("aggnet reduce_scatter") / m("gloo reduce_scatter")
        ar = m("aggnet all_reduce") / m("client all_reduce")
        ratio = {"workers": world, "bytes": nbytes, "reduce_scatter_aggnet_over_gloo": rs,
                 "all_reduce_backend_over_client": ar}
        line = (f"N={world} {format_size(nbytes)}: reduce_scatter aggnet/gloo {rs:.2f} (target <= 0.7); "
                f"all_reduce backend/client {ar:.2f} (target <= 1.10)")
        if (world, nbytes, STAGED) in median:
            ratio["staged_reduce_scatter_over_gloo"] = m(STAGED) / m("gloo reduce_scatter")
            line += f"; staged reduce_scatter/gloo {ratio['staged_reduce_scatter_over_gloo']:.2f}"
        ratios.append(ratio)
        print(line)
    return ratios
