"""``aggnet demo``: all-reduce through an embedded local aggregator.

Two worker processes all-reduce float32 buffers of a few sizes with every
codec through the aggregator that rank 0 starts, check each result against
the exact sum, and print what they did and how fast.
"""

from __future__ import annotations

import multiprocessing
import time
import uuid

import numpy as np


def add_arguments(p) -> None:
    p.add_argument("--workers", type=int, default=2, help="worker processes (default %(default)s)")
    p.add_argument("--address", default=None, help="aggregator address (default: embedded local aggregator)")


def _worker(rank: int, world: int, job: str, address, out) -> None:
    from aggnet import Client

    with Client(address, job=job, rank=rank, world_size=world) as client:
        lines = []
        for mib in (1, 16, 64):
            n = mib * (1 << 18)
            for codec in (None, "int32", "bf16"):
                x = np.full(n, rank + 1, np.float32)
                client.allreduce(x, codec=codec).result(60)  # warm-up
                x[:] = rank + 1
                t0 = time.perf_counter()
                client.allreduce(x, codec=codec).result(60)
                dt = time.perf_counter() - t0
                ok = bool(np.all(x == world * (world + 1) / 2))
                lines.append((mib, codec or "float32", dt, ok))
        out.put((rank, client.address, lines))


def main(args) -> int:
    world = args.workers
    job = f"demo-{uuid.uuid4().hex[:8]}"
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, job, args.address, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict((r, (a, lines)) for r, a, lines in (out.get(timeout=300) for _ in procs))
    for p in procs:
        p.join(30)
    address, lines = results[0]
    print(f"aggnet demo: {world} workers all-reduced through {address}")
    print(f"{'size':>8} {'codec':>8} {'time ms':>9} {'GB/s':>7}  exact")
    for mib, codec, dt, ok in lines:
        print(f"{mib:>5}MiB {codec:>8} {dt * 1e3:9.1f} {mib * 2**20 / dt / 1e9:7.2f}  {'yes' if ok else 'NO'}")
    return 0 if all(ok for _, _, _, ok in lines) else 1
