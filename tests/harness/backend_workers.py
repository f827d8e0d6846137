"""Worker processes for the torch.distributed backend tests (imported by
spawned workers). Each worker runs the same collectives or the same
training twice in one process: on the default group, whose backend is
aggnet, and on a gloo group made with ``dist.new_group(backend="gloo")``,
so both see identical inputs."""

from __future__ import annotations

import dataclasses
import datetime
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from aggnet.torch.teardown import ends_process_group

from harness import ddp_workers as W

STEPS = 20


def init(rank: int, world: int, init_method: str, address: str | None, chunk_bytes: int | None = None,
         backend: str = "aggnet"):
    """Join the default group on the aggnet backend; returns a gloo group
    of the same ranks for reference."""
    torch.set_num_threads(1)
    os.environ.pop("AGGNET_ADDRESS", None)
    import aggnet.torch  # noqa: F401  (registers the backend)
    from aggnet.client.config import ClientConfig

    config = ClientConfig(address=address, chunk_bytes=chunk_bytes, timeout=30.0, connect_timeout=30.0)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, pg_options=config,
                            timeout=datetime.timedelta(seconds=60))
    return dist.new_group(backend="gloo")


def aggnet_stats():
    client = dist.group.WORLD._client
    return None if client is None else client.stats


def _ints(seed: int, rank: int, size: int, dtype=torch.float32, bound: int = 1000) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randint(-bound, bound, (size,), generator=g).to(dtype)


def collectives(rank: int, world: int, group) -> dict:
    """Every collective of the suite on ``group`` (None: the default
    group); integer-valued data, so that float sums are exact."""
    AVG, MAX, SUM = dist.ReduceOp.AVG, dist.ReduceOp.MAX, dist.ReduceOp.SUM
    out = {}
    n, m = 10007, 5003  # not multiples of the chunk size

    def all_reduce(name, t, op=SUM):
        dist.all_reduce(t, op=op, group=group)
        out[name] = t

    all_reduce("all_reduce_f32_sum", _ints(1, rank, n))
    all_reduce("all_reduce_f32_avg", _ints(2, rank, n), AVG)
    all_reduce("all_reduce_i32_sum", _ints(3, rank, n, torch.int32, 1 << 20))
    all_reduce("all_reduce_f16_sum", _ints(4, rank, n, torch.float16, 200))
    all_reduce("all_reduce_bf16_sum", _ints(5, rank, n, torch.bfloat16, 60))
    all_reduce("all_reduce_f16_avg", _ints(6, rank, n, torch.float16, 200), AVG)
    all_reduce("all_reduce_i64_sum", _ints(7, rank, n, torch.int64))  # gloo's
    all_reduce("all_reduce_f32_max", _ints(8, rank, n), MAX)  # gloo's
    all_reduce("all_reduce_f64_sum", _ints(9, rank, n, torch.float64))  # gloo's
    # a strided view: aggnet reduces it in place; gloo gets a contiguous
    # copy (it reads a strided tensor's storage as if it were contiguous)
    strided = _ints(10, rank, 2 * n).view(n, 2)
    if group is None:
        dist.all_reduce(strided[:, 1], group=group)
    else:
        column = strided[:, 1].contiguous()
        dist.all_reduce(column, group=group)
        strided[:, 1] = column
    out["all_reduce_strided"] = strided
    out["all_reduce_empty"] = torch.empty(0)
    dist.all_reduce(out["all_reduce_empty"], group=group)

    for name, op in (("sum", SUM), ("avg", AVG)):
        res = torch.empty(m)
        dist.reduce_scatter_tensor(res, _ints(11, rank, world * m), op=op, group=group)
        out[f"reduce_scatter_tensor_{name}"] = res
    res = torch.empty(m, dtype=torch.bfloat16)
    dist.reduce_scatter_single(res, _ints(12, rank, world * m, torch.bfloat16, 60), group=group)
    out["reduce_scatter_tensor_bf16"] = res
    res = torch.empty(m, dtype=torch.int64)
    dist.reduce_scatter_single(res, _ints(13, rank, world * m, torch.int64), group=group)  # gloo's
    out["reduce_scatter_tensor_i64"] = res
    res = torch.zeros(7, 3)
    if group is None:
        dist.reduce_scatter_single(res[:, 1], _ints(14, rank, world * 7), group=group)  # a strided output
    else:
        column = torch.empty(7)
        dist.reduce_scatter_single(column, _ints(14, rank, world * 7), group=group)
        res[:, 1] = column
    out["reduce_scatter_tensor_strided"] = res
    res = torch.empty(m)
    dist.reduce_scatter(res, [_ints(15 + r, rank, m) for r in range(world)], group=group)
    out["reduce_scatter_list"] = res

    # async: several in flight at once, waited on through their futures
    pending = [(_ints(30 + i, rank, n), torch.empty(m)) for i in range(3)]
    works = []
    for i, (a, r) in enumerate(pending):
        works.append(dist.all_reduce(a, group=group, async_op=True))
        works.append(dist.reduce_scatter_single(r, _ints(40 + i, rank, world * m), group=group, async_op=True))
    # an int64 reduce-scatter: gloo's all-reduce of a copy on the aggnet group
    async_i64 = torch.empty(m, dtype=torch.int64)
    works.append(dist.reduce_scatter_single(async_i64, _ints(45, rank, world * m, torch.int64), group=group,
                                            async_op=True))
    for w in works:
        if group is None:  # the aggnet group's works: their futures (gloo's reduce-scatter has none)
            w.get_future().wait()
            assert w.is_completed()
        w.wait()
    for i, (a, r) in enumerate(pending):
        out[f"async_all_reduce_{i}"], out[f"async_reduce_scatter_{i}"] = a, r
    out["async_reduce_scatter_i64"] = async_i64

    # what aggnet leaves to gloo
    res = torch.empty(world * m)
    dist.all_gather_single(res, _ints(50, rank, m), group=group)
    out["all_gather_single"] = res
    parts = [torch.empty(m) for _ in range(world)]
    dist.all_gather(parts, _ints(51, rank, m), group=group)
    out["all_gather"] = torch.cat(parts)
    t = _ints(52, rank, n)
    dist.broadcast(t, src=world - 1, group=group)
    out["broadcast"] = t
    t = _ints(53, rank, n)
    dist.reduce(t, dst=0, group=group)
    out["reduce"] = t if rank == 0 else torch.zeros(0)
    gathered = [torch.empty(m) for _ in range(world)] if rank == 0 else None
    dist.gather(_ints(54, rank, m), gathered, dst=0, group=group)
    out["gather"] = torch.cat(gathered) if rank == 0 else torch.zeros(0)
    t = torch.empty(m)
    dist.scatter(t, [_ints(55 + r, 0, m) for r in range(world)] if rank == 0 else None, src=0, group=group)
    out["scatter"] = t
    t = torch.empty(world * 3)
    dist.all_to_all_single(t, _ints(60, rank, world * 3), group=group)
    out["all_to_all_single"] = t
    t = _ints(61, rank, 9)
    got = torch.empty(9)
    peer_next, peer_prev = (rank + 1) % world, (rank - 1) % world
    ops = [dist.P2POp(dist.isend, t, peer_next, group), dist.P2POp(dist.irecv, got, peer_prev, group)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    out["send_recv"] = got
    dist.barrier(group=group)
    return {k: v.float().numpy().copy() if v.dtype == torch.bfloat16 else v.numpy().copy() for k, v in out.items()}


def unsupported(rank: int) -> dict:
    """What the aggnet group refuses, with its messages."""
    texts = {}
    for name, call in (
        ("avg_bool", lambda: dist.all_reduce(torch.ones(4, dtype=torch.bool), op=dist.ReduceOp.AVG)),
        ("avg_int16", lambda: dist.all_reduce(torch.ones(4, dtype=torch.int16), op=dist.ReduceOp.AVG)),
        ("premul_sum", lambda: dist.all_reduce(torch.ones(4), op=dist._make_nccl_premul_sum(0.5))),
        ("meta_device", lambda: dist.all_reduce(torch.empty(4, device="meta"))),
        ("avg_int32_reduce_scatter",
         lambda: dist.reduce_scatter_tensor(torch.empty(2, dtype=torch.int32), torch.ones(2 * dist.get_world_size(),
                                                                                          dtype=torch.int32),
                                            op=dist.ReduceOp.AVG)),
    ):
        try:
            call()
            texts[name] = ("no error", "")
        except Exception as exc:
            texts[name] = (type(exc).__name__, str(exc))
    return texts


class TinyTransformer(nn.Module):
    VOCAB, D, LAYERS, SEQ = 50, 32, 2, 12

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(self.VOCAB, self.D)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(self.D, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
            for _ in range(self.LAYERS))
        self.head = nn.Linear(self.D, self.VOCAB)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _fsdp_train(rank: int, world: int, mesh, device: str = "cpu", gather: bool = True) -> list[np.ndarray]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TinyTransformer().to(device)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randint(0, model.VOCAB, (4, model.SEQ), generator=g).to(device)
        y = torch.randint(0, model.VOCAB, (4, model.SEQ), generator=g).to(device)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x).reshape(-1, model.VOCAB), y.reshape(-1))
        loss.backward()
        opt.step()
    # the full parameters, gathered (by gloo, on either group)
    if not gather:  # this rank's shards
        return [p.to_local().detach().cpu().numpy().copy() for p in model.parameters()]
    return [p.full_tensor().detach().cpu().numpy().copy() for p in model.parameters()]


def _collectives_part(rank: int, world: int, gloo) -> dict:
    assert aggnet_stats() is None, "the aggnet client connects on the first aggnet collective, not at init"
    agg = collectives(rank, world, None)
    stats = aggnet_stats()
    ops = stats.allreduces
    # one reduce-scatter alone: what this rank received
    received = stats.bytes_received
    dist.reduce_scatter_single(torch.empty(4099), torch.ones(world * 4099))
    share_received = stats.bytes_received - received
    ref = collectives(rank, world, gloo)
    return {"aggnet": agg, "gloo": ref, "aggnet_ops": ops, "share_received": share_received,
            "refused": unsupported(rank), "integer_avg": integer_averages(rank)}


def integer_averages(rank: int) -> dict:
    """``AVG`` of integers as NCCL gives it (sum, then truncated division),
    on negative and positive values, synchronous and asynchronous."""
    out = {}
    for dtype in (torch.int64, torch.int32, torch.int8, torch.uint8):
        low = 0 if dtype == torch.uint8 else -50
        t = _ints(60, rank, 101, torch.int64, 50).clamp(min=low).to(dtype)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        out[str(dtype)] = t.numpy().copy()
    t = torch.full((5,), 7 + rank, dtype=torch.int64)
    work = dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True)
    work.wait()
    out["async"] = t.numpy().copy()
    return out


def _ddp_part(rank: int, world: int, gloo) -> dict:
    """The hook tests' model, trained with DDP and no comm hook, once on the
    aggnet group and once on the gloo group."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    params = {}
    before = aggnet_stats().allreduces
    for name, group in (("aggnet", None), ("gloo", gloo)):
        model = W.make_model(0)
        ddp = DDP(model, process_group=group)
        params[name] = W.train(model, STEPS, world, rank, False, None, ddp=ddp)
    return {"params": params, "aggnet_ops": aggnet_stats().allreduces - before}


def _fsdp_part(rank: int, world: int, gloo) -> dict:
    """A tiny transformer trained with FSDP2 on a mesh of the aggnet group,
    and again on a mesh of the gloo group."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    before = aggnet_stats().allreduces
    agg = _fsdp_train(rank, world, init_device_mesh("cpu", (world,)))
    ops = aggnet_stats().allreduces - before
    ref = _fsdp_train(rank, world, DeviceMesh.from_group(gloo, "cpu"))
    return {"aggnet": agg, "gloo": ref, "aggnet_ops": ops}


def _stall_part(rank: int, world: int, gloo) -> dict:
    """A group of its own (``new_group`` on the aggnet backend, a short
    timeout) where rank 0 all-reduces and the others never do: rank 0's
    collective must fail, naming who is missing, instead of waiting."""
    from aggnet.client.config import ClientConfig

    config = ClientConfig(address=dist.group.WORLD.config.address, timeout=2.0)
    group = dist.new_group(backend="aggnet", pg_options=config)
    t0 = time.monotonic()
    text = "no error"
    if rank == 0:
        try:
            dist.all_reduce(torch.ones(10), group=group)
        except Exception as exc:
            text = f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - t0
    dist.barrier(group=gloo)
    return {"error": text, "seconds": seconds}


def _monitored_part(rank: int, world: int, gloo) -> dict:
    """dist.monitored_barrier on aggnet groups (torch serves it to groups
    named gloo only): it passes when every rank comes, and names the rank
    that does not."""
    t0 = time.monotonic()
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=30), wait_all_ranks=True)
    passed = time.monotonic() - t0
    group = dist.new_group(backend="aggnet")
    text = "no error"
    t0 = time.monotonic()
    if rank == 0:
        try:
            dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=2))
        except Exception as exc:
            text = f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - t0
    dist.barrier(group=gloo)
    return {"passed_s": passed, "error": text, "seconds": seconds}


INT32_STEPS = 4


def _int32_part(rank: int, world: int, gloo) -> dict:
    """A group of its own under the int32 codec: a loop whose steps
    all-reduce two tensors of one size and one of another, then two of
    that size at once and a coalesced list of four; integer values, which
    the codec sums exactly, so aggnet's sums must be gloo's bits."""
    from aggnet.client.config import ClientConfig

    config = ClientConfig(address=dist.group.WORLD.config.address, codec="int32", chunk_bytes=4096, timeout=30.0)
    group = dist.new_group(backend="aggnet", pg_options=config)
    n, m = 10007, 5003
    got, want = [], []

    def both(make, run):
        for g, out in ((group, got), (gloo, want)):
            ts = make()
            run(ts, g)
            out.append([t.numpy().copy() for t in ts])

    for step in range(INT32_STEPS):
        both(lambda: [_ints(70 + step, rank, size) for size in (n, n, m)],
             lambda ts, g: [dist.all_reduce(t, group=g) for t in ts])
    stats = group._client.stats
    carried, awaited = stats.scales_carried, stats.scales_awaited
    both(lambda: [_ints(80, rank, n), _ints(81, rank, n)],
         lambda ts, g: [w.wait() for w in [dist.all_reduce(t, group=g, async_op=True) for t in ts]])
    pair_awaited = stats.scales_awaited - awaited
    both(lambda: [_ints(90 + i, rank, n) for i in range(4)], lambda ts, g: dist.all_reduce_coalesced(ts, group=g))
    all_carried, all_awaited = stats.scales_carried, stats.scales_awaited
    # the same loop through the staging a CUDA tensor takes (quantized
    # where the tensor is, handed to the client with its exponents)
    staged = dist.new_group(backend="aggnet", pg_options=config)
    staged.stage_cpu_tensors = True
    for step in range(INT32_STEPS):
        both(lambda: [_ints(70 + step, rank, size) for size in (n, n, m)],
             lambda ts, g: [dist.all_reduce(t, group=staged if g is group else g) for t in ts])
    staged_carried = staged._client.stats.scales_carried

    def scatters(aggnet_group) -> int:
        """A loop of reduce-scatters (FSDP2's gradients): the carried ones."""
        before = aggnet_group._client.stats.scales_carried
        for step in range(INT32_STEPS):
            for g, out in ((aggnet_group, got), (gloo, want)):
                share = torch.empty(m)
                dist.reduce_scatter_tensor(share, _ints(60 + step, rank, world * m), group=g)
                out.append([share.numpy().copy()])
        return aggnet_group._client.stats.scales_carried - before

    scatter_carried, staged_scatter_carried = scatters(group), scatters(staged)
    # FSDP2 on a mesh of the int32 group: its reduce-scatters carry
    from torch.distributed.device_mesh import DeviceMesh

    before = stats.scales_carried, stats.scales_unsteady, stats.chunks_sent_again
    fsdp = _fsdp_train(rank, world, DeviceMesh.from_group(group, "cpu"))
    fsdp_counts = [now - then for now, then in zip((stats.scales_carried, stats.scales_unsteady,
                                                    stats.chunks_sent_again), before)]
    # ranks that set AGGNET_PREDICT_SCALE differently: both key the rounds;
    # the first of each key (two of one size in a row take two) agrees on
    # both, the next of a key carries on one only
    mixed = dist.new_group(backend="aggnet", pg_options=dataclasses.replace(config, predict_scale=rank == 0))
    mixed_first = []
    for seed in (99, 98):
        first = _ints(seed, rank, n)
        dist.all_reduce(first, group=mixed)
        mixed_first.append([first.numpy(), (_ints(seed, 0, n) + _ints(seed, 1, n)).numpy()])
    t0 = time.monotonic()
    try:
        dist.all_reduce(_ints(97, rank, n), group=mixed)
        mismatch = "no error"
    except Exception as exc:
        mismatch = f"{type(exc).__name__}: {exc}"
    return {"got": got, "want": want, "loop_carried": carried, "loop_awaited": awaited,
            "pair_awaited": pair_awaited, "carried": all_carried, "awaited": all_awaited,
            "staged_carried": staged_carried, "scatter_carried": scatter_carried,
            "staged_scatter_carried": staged_scatter_carried, "fsdp": fsdp, "fsdp_counts": fsdp_counts,
            "mixed_first": mixed_first, "mismatch": mismatch,
            "mismatch_s": time.monotonic() - t0}


PARTS = {"collectives": _collectives_part, "ddp": _ddp_part, "fsdp": _fsdp_part, "stall": _stall_part,
         "monitored": _monitored_part, "int32": _int32_part}


@ends_process_group
def suite_run(rank: int, world: int, init_method: str, address: str | None, chunk_bytes: int | None,
              backend: str, parts: list[str]) -> dict:
    """One process group (``backend``: "aggnet" or "cpu:aggnet") running
    the named parts in order; each part's results under its name."""
    gloo = init(rank, world, init_method, address, chunk_bytes, backend)
    out = {"backend": dist.get_backend(), "job": dist.group.WORLD.job}
    for part in parts:
        out[part] = PARTS[part](rank, world, gloo)
    return out
