"""The floor ``aggnet bench`` sets beside aggnet: a plain-socket parameter
server whose sums must be right, or the ratios it prints mean nothing."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest

from aggnet.bench.floor import FloorClient, start_shards

WORLD = 3
SHARDS = 2
CHUNK = 64 * 1024


def _worker(rank: int, ports: list, out) -> None:
    client = FloorClient(ports, rank, WORLD, CHUNK)
    try:
        got = []
        # a size that is no multiple of the chunk, twice (the second round
        # sums the first's result), then float32 and a one-element buffer
        x = np.arange(100_003, dtype=np.int32) * (rank + 1)
        client.allreduce(x)
        got.append(x.copy())
        client.allreduce(x)
        got.append(x.copy())
        f = np.full(70_000, rank + 0.5, np.float32)
        client.allreduce(f)
        got.append(f.copy())
        one = np.array([rank], np.int32)
        client.allreduce(one)
        got.append(one.copy())
        out.put((rank, got))
    finally:
        client.close()


def test_floor_sums_every_chunk_of_every_round_into_each_workers_buffer():
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    shards, ports = start_shards(ctx, WORLD, SHARDS)
    workers = [ctx.Process(target=_worker, args=(r, ports, out), daemon=True) for r in range(WORLD)]
    for p in workers:
        p.start()
    results = dict(out.get(timeout=60) for _ in workers)
    for p in workers + shards:
        p.join(10)
    # the shards end once their workers close
    assert all(p.exitcode == 0 for p in workers + shards), [p.exitcode for p in workers + shards]
    ranks = sum(r + 1 for r in range(WORLD))
    base = np.arange(100_003, dtype=np.int32)
    want = [base * ranks, base * ranks * WORLD, np.full(70_000, sum(r + 0.5 for r in range(WORLD)), np.float32),
            np.array([sum(range(WORLD))], np.int32)]
    for rank in range(WORLD):
        for got, expected in zip(results[rank], want):
            assert got.dtype == expected.dtype
            assert np.array_equal(got, expected), rank


def test_a_floor_worker_whose_shard_dies_is_told_not_left_waiting():
    ctx = mp.get_context("fork")
    (shard,), ports = start_shards(ctx, 2, 1)
    client = FloorClient(ports, 0, 2, CHUNK)
    try:
        shard.kill()
        shard.join(10)
        with pytest.raises(RuntimeError, match="floor all-reduce failed"):
            client.allreduce(np.ones(10, np.float32))
    finally:
        client.close()


def _rack_worker(rank: int, world: int, ports: list, out) -> None:
    client = FloorClient(ports, rank, world, CHUNK)
    try:
        x = np.arange(50_001, dtype=np.int32) + 1000 * rank
        client.allreduce(x)
        out.put((rank, x))
    finally:
        client.close()


def test_rack_floors_under_a_root_floor_hand_every_worker_the_sum_over_all_racks():
    ctx = mp.get_context("fork")
    racks, per_rack = 2, 2
    out = ctx.Queue()
    procs, root = start_shards(ctx, racks, SHARDS)
    workers = []
    for r in range(racks):
        shards, ports = start_shards(ctx, per_rack, SHARDS, parents=[("127.0.0.1", port) for port in root], rack=r,
                                     racks=racks)
        procs += shards
        # rank k within its rack
        workers += [ctx.Process(target=_rack_worker, args=(k, per_rack, ports, out), daemon=True)
                    for k in range(per_rack)]
    for p in workers:
        p.start()
    got = [out.get(timeout=60)[1] for _ in workers]
    for p in workers + procs:
        p.join(10)
    assert all(p.exitcode == 0 for p in workers + procs), [p.exitcode for p in workers + procs]
    base = np.arange(50_001, dtype=np.int32)
    want = racks * sum(base + 1000 * k for k in range(per_rack))
    for x in got:
        assert np.array_equal(x, want)
