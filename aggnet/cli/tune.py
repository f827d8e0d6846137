"""``aggnet tune``: pick a sparse table's partition count with Parallax's
cost model (aggnet.client.partitions) over push/pull rounds measured on a
running service, or one it starts; prints the samples, the fit and the
chosen P."""

from __future__ import annotations

import argparse
import math
import sys
import tempfile

from aggnet.client.partitions import tune

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=None,
                   help="a running service (its control endpoint); default: start one here for the run")
    p.add_argument("--shards", type=int, default=2, help="shards of the service started here (no --address)")
    p.add_argument("--workers", type=int, default=2, help="workers pushing and pulling together (threads here)")
    p.add_argument("--rows", type=int, default=100_000, help="rows of the table")
    p.add_argument("--width", type=int, default=64, help="floats per row")
    p.add_argument("--alpha", type=float, default=0.01, help="fraction of the rows each worker touches per step")
    p.add_argument("--steps", type=int, default=10, help="steps timed per partition count")
    p.add_argument("--start", type=int, default=None, help="first P (default: the service's shard count)")
    p.add_argument("--max-partitions", type=int, default=None, help="largest P tried")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to connect, and for each push or pull")


def main(args) -> int:
    if not 0 < args.alpha <= 1:
        print(f"aggnet tune: --alpha must be in (0, 1], got {args.alpha}", file=sys.stderr)
        return 2
    if args.workers < 1 or args.steps < 1 or args.rows < 1 or args.width < 1:
        print("aggnet tune: --workers, --steps, --rows and --width must be at least 1", file=sys.stderr)
        return 2
    service = None
    try:
        address = args.address
        if address is None:
            from aggnet.processes import ServiceProcess

            service = ServiceProcess(f"zmq+ipc://{tempfile.mkdtemp(prefix='aggnet-tune-')}/s.sock", args.shards,
                                     start_timeout=30)
            address = service.address
        p, samples, f = tune(address, workers=args.workers, rows=args.rows, width=args.width, alpha=args.alpha,
                             steps=args.steps, start=args.start, max_partitions=args.max_partitions,
                             timeout=args.timeout,
                             log=lambda s: print(s, flush=True))
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"aggnet tune: {exc}", file=sys.stderr)
        return 1
    finally:
        if service is not None:
            service.stop()
    print("samples (P: ms per step): " + ", ".join(f"{q}: {samples[q] * 1e3:.3f}" for q in sorted(samples)))
    if f is None:
        print(f"too few samples for a fit; fastest sampled P = {p}")
    else:
        print(f"fit: theta0 = {f.theta0:.6g} s, theta1 = {f.theta1:.6g} s, theta2 = {f.theta2:.6g} s")
        print(f"     {f}")
        if f.theta1 > 0 and f.theta2 > 0:
            print(f"     unconstrained minimum at P = sqrt(theta1/theta2) = {math.sqrt(f.theta1 / f.theta2):.2f}")
    print(f"partitions: {p}")
    return 0
