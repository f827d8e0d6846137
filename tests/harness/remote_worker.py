"""One worker of a job, run as its own process in a network namespace (a
host of its own): all-reduces rank-dependent values through the aggregator
at argv[1] and prints the sum it got, or the error, on one line."""

from __future__ import annotations

import sys

import numpy as np

from aggnet import AggnetError, Client


def main(address: str, job: str, rank: int, world: int, size: int, connect_timeout: float) -> int:
    values = np.arange(size, dtype=np.float32) * (rank + 1)
    try:
        with Client(address, job=job, rank=rank, world_size=world, connect_timeout=connect_timeout,
                    timeout=30) as client:
            client.allreduce(values, op="sum").result(60)
    except AggnetError as exc:
        print(f"error {type(exc).__name__}: {exc}", flush=True)
        return 1
    print(f"sum {float(values.astype(np.float64).sum())!r}", flush=True)
    return 0


if __name__ == "__main__":
    a = sys.argv[1:]
    sys.exit(main(a[0], a[1], int(a[2]), int(a[3]), int(a[4]), float(a[5])))
