"""Training runs for the sparse-table tests (imported by spawned workers):
an embedding of a small vocabulary (every batch repeats rows, within a
worker and across workers) under a linear head."""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from aggnet.torch.teardown import ends_process_group

VOCAB, DIM, CLASSES, PER_RANK, BAG = 30, 8, 5, 6, 4
LR = 0.1
#: torch optimizer of the embedding for each server-side optimizer
HYPER = {"sgd": {"lr": LR}, "momentum": {"lr": LR, "momentum": 0.9}, "adagrad": {"lr": LR},
         "adam": {"lr": 0.05}}


def batch(step: int, n: int, cover: bool = False):
    """Step ``step``'s global batch of ``n`` bags; ``cover``: every row of
    the vocabulary appears in it (lazy momentum then equals torch's)."""
    g = torch.Generator().manual_seed(7000 + step)
    if cover:
        x = (torch.arange(n * BAG) % VOCAB)[torch.randperm(n * BAG, generator=g)].reshape(n, BAG)
    else:
        x = torch.randint(0, VOCAB, (n, BAG), generator=g)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    return x, y


class Net(nn.Module):
    def __init__(self, embed: nn.Module):
        super().__init__()
        self.embed = embed
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x):
        return self.head(self.embed(x).mean(1))


def initial(seed: int = 0):
    torch.manual_seed(seed)
    return nn.Embedding(VOCAB, DIM).weight.detach().clone(), nn.Linear(DIM, CLASSES).state_dict()


def _torch_optimizer(name: str, params, sparse: bool):
    h = HYPER[name]
    if name == "sgd":
        return torch.optim.SGD(params, lr=h["lr"])
    if name == "momentum":
        return torch.optim.SGD(params, lr=h["lr"], momentum=h["momentum"])
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=h["lr"])
    return torch.optim.SparseAdam(params, lr=h["lr"]) if sparse else torch.optim.Adam(params, lr=h["lr"])


def single_process(world: int, steps: int, embed_opt: str, head_opt: str = "sgd", cover: bool = False):
    """Reference: one process, the global batch, torch's own optimizers
    (the embedding sparse, except for momentum, which torch only has
    dense: with every row in every batch the two agree)."""
    torch.set_num_threads(1)
    weight, head = initial()
    sparse = embed_opt != "momentum"
    emb = nn.Embedding(VOCAB, DIM, sparse=sparse)
    emb.weight.data.copy_(weight)
    model = Net(emb)
    model.head.load_state_dict(head)
    opts = [_torch_optimizer(embed_opt, [emb.weight], sparse),
            _torch_optimizer(head_opt, model.head.parameters(), False)]
    for step in range(steps):
        x, y = batch(step, PER_RANK * world, cover)
        for o in opts:
            o.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        for o in opts:
            o.step()
    return emb.weight.detach().numpy().copy(), [p.detach().numpy().copy() for p in model.head.parameters()]


def _init(rank: int, world: int, port: int):
    torch.set_num_threads(1)
    os.environ.pop("AGGNET_ADDRESS", None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


@ends_process_group
def hook_run(rank: int, world: int, port: int, address: str, opt: str, steps: int, hosts: int = 0):
    """DDP with the aggnet hook: the same model trained twice, sparse
    buckets through aggnet's tables and through torch.distributed.
    ``hosts``: the workers play that many hosts, as torchrun describes
    them, and combine their rows per host."""
    if hosts:
        local = world // hosts
        os.environ.update(LOCAL_RANK=str(rank % local), LOCAL_WORLD_SIZE=str(local), GROUP_RANK=str(rank // local))
    _init(rank, world, port)
    from aggnet.torch import AggnetState, allreduce_hook

    out = {}
    for path in ("aggnet", "torch"):
        weight, head = initial()
        emb = nn.Embedding(VOCAB, DIM, sparse=True)
        emb.weight.data.copy_(weight)
        model = Net(emb)
        model.head.load_state_dict(head)
        ddp = DDP(model)
        state = AggnetState(address, sparse=path)
        ddp.register_comm_hook(state, allreduce_hook)
        o = _torch_optimizer(opt, model.parameters(), True)
        for step in range(steps):
            x, y = batch(step, PER_RANK * world)
            x, y = x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]
            o.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            o.step()
        sc = getattr(state, "_sparse_client", None)
        out[path] = {"embed": emb.weight.detach().numpy().copy(),
                     "head": [p.detach().numpy().copy() for p in model.head.parameters()],
                     "dense_calls": state.stats()["total"].calls,
                     "sparse_bytes": None if sc is None else (sc.bytes_sent, sc.bytes_received),
                     "bytes_local": None if sc is None else sc.bytes_local}
        state.close()
    return out


def _ps_model(client, opt: str, name: str, partitions=3):
    from aggnet.torch import ShardedEmbedding

    h = {k: v for k, v in HYPER[opt].items()}
    emb = ShardedEmbedding(client, name, VOCAB, DIM, optimizer=opt, op="avg", partitions=partitions,
                           tune_alpha=0.2, tune_steps=3, **h)
    return emb, Net(emb)


def _train_ps(rank, world, model, emb, ddp, first: int, last: int, cover: bool):
    head_opt = torch.optim.SGD(model.head.parameters(), lr=LR)
    for step in range(first, last):
        x, y = batch(step, PER_RANK * world, cover)
        x, y = x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]
        head_opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        head_opt.step()
    emb.wait()


@ends_process_group
def ps_run(rank: int, world: int, port: int, address: str, opts: list, steps: int, partitions=3):
    """PS mode: ShardedEmbedding (table and optimizer on the service), the
    head all-reduced by DDP; one model per server-side optimizer."""
    _init(rank, world, port)
    from aggnet import Client

    out = {}
    with Client(address, job="ps-run", rank=rank, world_size=world) as client:
        for opt in opts:
            weight, head = initial()
            emb, model = _ps_model(client, opt, f"emb-{opt}", partitions)
            if rank == 0:
                emb.copy_weight_(weight)
            dist.barrier()
            model.head.load_state_dict(head)
            ddp = DDP(model)
            _train_ps(rank, world, model, emb, ddp, 0, steps, cover=opt == "momentum")
            out[opt] = {"embed": emb.weight_rows(np.arange(VOCAB)).numpy(),
                        "head": [p.detach().numpy().copy() for p in model.head.parameters()],
                        "partitions": emb.table.partitions, "tuning": emb.tuning}
            dist.barrier()
            emb.close()
    return out


@ends_process_group
def checkpoint_run(rank: int, world: int, port: int, address: str, phase: str, ckpt: str, steps: int):
    """``phase`` "save": train ``steps``, checkpoint, train ``steps`` more;
    "restore" (a new service): restore the checkpoint, train ``steps``."""
    _init(rank, world, port)
    from aggnet import Client

    with Client(address, job="ckpt-run", rank=rank, world_size=world) as client:
        emb, model = _ps_model(client, "adam", "emb-ckpt")
        if phase == "save":
            weight, head = initial()
            if rank == 0:
                emb.copy_weight_(weight)
            model.head.load_state_dict(head)
            dist.barrier()
            ddp = DDP(model)
            _train_ps(rank, world, model, emb, ddp, 0, steps, False)
            if rank == 0:
                emb.save(os.path.join(ckpt, "table"))
                torch.save(model.head.state_dict(), os.path.join(ckpt, "head.pt"))
            dist.barrier()
            first = steps
        else:
            if rank == 0:
                emb.load(os.path.join(ckpt, "table"))
            dist.barrier()
            emb.resume(os.path.join(ckpt, "table"))
            model.head.load_state_dict(torch.load(os.path.join(ckpt, "head.pt")))
            ddp = DDP(model)
            first = steps
        _train_ps(rank, world, model, emb, ddp, first, first + steps, False)
        result = {"embed": emb.weight_rows(np.arange(VOCAB)).numpy(),
                  "head": [p.detach().numpy().copy() for p in model.head.parameters()]}
        dist.barrier()
        emb.close()
    return result
