"""One worker of an emulated rack: ``python -m aggnet.emulation.worker``.

Runs inside a worker's namespace, all-reduces a buffer through aggnet (the
address in AGGNET_ADDRESS, or its rack's aggregator in ``--topology``),
through torch.distributed gloo, or through the floor (a parameter server
in plain TCP sockets on the aggregator host, aggnet/bench/floor.py), and
prints one JSON line: times per
repetition, this process's CPU-seconds over them (every thread), a
checksum of the result, and the client's counters. With
``--dtype int32`` every worker also rebuilds every rank's data and says
whether the result is bit-identical to their sum.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np


def _data(rank: int, n: int, dtype: str = "float32") -> np.ndarray:
    rng = np.random.default_rng(rank)
    if dtype == "int32":
        # room for 1024 workers' sum in an int32
        return rng.integers(-(1 << 20), 1 << 20, n, dtype=np.int32)
    return rng.standard_normal(n).astype(np.float32)


def _expected(world: int, n: int) -> np.ndarray:
    total = np.zeros(n, np.int64)
    for r in range(world):
        total += _data(r, n, "int32")
    return total.astype(np.int32)


def _barrier_aggnet(client) -> None:
    client.allreduce(np.zeros(1, np.int32)).result(300)


def _repeat(reps: int, fresh, barrier, reduce, as_numpy, expected, progress) -> tuple:
    """Each repetition: a fresh copy of the input, a barrier, the timed
    all-reduce (its seconds and this process's CPU-seconds), the result's
    checksum and, with ``expected``, whether it is that exact sum."""
    from aggnet.bench.cpu import own_cpu_seconds

    times, sums, cpu, exact = [], [], 0.0, None
    for _ in range(reps):
        x = fresh()
        barrier()
        c0, t0 = own_cpu_seconds(), time.perf_counter()
        reduce(x)
        times.append(time.perf_counter() - t0)
        cpu += own_cpu_seconds() - c0
        result = as_numpy(x)
        sums.append(float(np.sum(result, dtype=np.float64)))
        if expected is not None:
            exact = bool(np.array_equal(result, expected)) and exact is not False
        if progress is not None:
            progress.step(f"{times[-1]:.3f} s")
    return times, cpu, sums, exact


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("system", choices=["aggnet", "gloo", "floor"])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--bytes", type=int, required=True)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--master", default="10.77.0.1:29500", help="gloo rendezvous (rank 0's address)")
    p.add_argument("--job", default="rack")
    p.add_argument("--topology", default=None, help="aggnet: find this rank's rack aggregator in this file; floor: "
                                                    "cut the chunks aggnet's workers cut under its links")
    p.add_argument("--dtype", choices=["float32", "int32"], default="float32",
                   help="int32: check the result bit for bit against the sum")
    p.add_argument("--floor", default=None, help="floor: its shards, HOST:PORT,PORT... (aggnet/bench/floor.py)")
    p.add_argument("--floor-rank", type=int, default=None,
                   help="floor: this worker's place among its floor's workers (default --rank; across racks, its "
                        "place in its rack)")
    p.add_argument("--floor-world", type=int, default=None, help="floor: its floor's workers (default --world)")
    p.add_argument("--progress", action="store_true", help="a line per repetition on standard error")
    args = p.parse_args(argv)
    from contextlib import nullcontext

    from aggnet.progress import Progress

    shown = Progress(f"  {args.system} all-reduce", args.reps, bar=False) if args.progress else nullcontext()

    n = args.bytes // 4
    # drawn once: 8 M normal floats take a tenth of a second, and every
    # repetition's input is the same anyway
    data = _data(args.rank, n, args.dtype)
    expected = _expected(args.world, n) if args.dtype == "int32" else None
    stats = {}
    if args.system == "aggnet":
        from aggnet import Client

        where = ({"topology": args.topology} if args.topology else {"world_size": args.world})
        with Client(job=args.job, rank=args.rank, **where) as c, shown as progress:
            times, cpu, sums, exact = _repeat(args.reps, data.copy, lambda: _barrier_aggnet(c),
                                              lambda x: c.allreduce(x).result(3600), lambda x: x, expected, progress)
            stats = dict(c.stats.__dict__)
            for name in ("io", "elements", "slots"):  # the switch path's batching and packet size
                if hasattr(c, name):
                    stats[name] = getattr(c, name)
    elif args.system == "floor":
        from aggnet.bench.floor import FloorClient, aggnet_chunk_bytes, parse_address

        host, ports = parse_address(args.floor)
        place = args.rank if args.floor_rank is None else args.floor_rank
        peers = args.world if args.floor_world is None else args.floor_world
        uplink_mbit = None
        if args.topology:  # racks under a root: the chunks aggnet's workers cut for its uplinks
            from aggnet.protocol import topology

            uplink_mbit = topology.load(args.topology).root_uplink_mbit
        client = FloorClient(ports, place, peers, aggnet_chunk_bytes(uplink_mbit), host)
        try:
            with shown as progress:
                # the barrier: a one-value all-reduce ends once every worker sent
                times, cpu, sums, exact = _repeat(args.reps, data.copy,
                                                  lambda: client.allreduce(np.zeros(1, np.int32)), client.allreduce,
                                                  lambda x: x, expected, progress)
        finally:
            client.close()
    else:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=args.rank, world_size=args.world)
        with shown as progress:
            times, cpu, sums, exact = _repeat(args.reps, lambda: torch.from_numpy(data.copy()), dist.barrier,
                                              dist.all_reduce, lambda t: t.numpy(), expected, progress)
        dist.destroy_process_group()
    print(json.dumps({"rank": args.rank, "times": times, "cpu_s": cpu, "checksums": sums, "stats": stats,
                      "exact": exact, "pid": os.getpid()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
