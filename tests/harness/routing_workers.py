"""Training runs for the routing-by-α tests (imported by spawned workers):
an ``nn.Embedding`` without ``sparse=True`` (a dense gradient of mostly
zero rows) under a linear head, in one DDP bucket."""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from aggnet.torch.teardown import ends_process_group

DIM, CLASSES, PER_RANK, BAG = 8, 5, 6, 4
LR, MOMENTUM = 0.1, 0.9


def batch(step: int, n: int, vocab: int):
    g = torch.Generator().manual_seed(9000 + step)
    return torch.randint(0, vocab, (n, BAG), generator=g), torch.randint(0, CLASSES, (n,), generator=g)


class Net(nn.Module):
    def __init__(self, vocab: int):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, DIM)  # sparse=False: a dense gradient
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x):
        return self.head(self.embed(x).mean(1))


def _params(model) -> list:
    return [p.detach().numpy().copy() for p in model.parameters()]


def single_process(world: int, steps: int, vocab: int) -> list:
    torch.set_num_threads(1)
    model = Net(vocab)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(steps):
        x, y = batch(step, PER_RANK * world, vocab)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return _params(model)


def local_alphas(world: int, steps: int, vocab: int) -> np.ndarray:
    """[step, rank]: the fraction of the embedding's rows rank's batch touches."""
    out = np.zeros((steps, world))
    for step in range(steps):
        x, _ = batch(step, PER_RANK * world, vocab)
        for r in range(world):
            out[step, r] = np.unique(x[r * PER_RANK:(r + 1) * PER_RANK].numpy()).size / vocab
    return out


@ends_process_group
def run(rank: int, world: int, port: int, address: str, cases: list, steps: int):
    """Train each case ``(vocab, alpha_threshold[, nan_step])`` with DDP and
    the aggnet hook; returns per case the parameters and the hook's routing
    stats. At ``nan_step`` rank 1's embedding turns NaN: the case ends with
    the error each rank got."""
    torch.set_num_threads(1)
    os.environ.pop("AGGNET_ADDRESS", None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from aggnet.torch import AggnetState, allreduce_hook

    out = []
    for vocab, threshold, *nan_step in cases:
        model = Net(vocab)
        ddp = DDP(model)
        state = AggnetState(address, alpha_threshold=threshold, alpha_steps=3)
        ddp.register_comm_hook(state, allreduce_hook)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        error = None
        for step in range(steps):
            if nan_step and step == nan_step[0]:
                if rank == 1:
                    with torch.no_grad():
                        model.embed.weight.fill_(float("nan"))
                x, y = batch(step, PER_RANK, vocab)
                try:
                    nn.functional.cross_entropy(ddp(x), y).backward()
                except Exception as exc:
                    error = str(exc)
                break
            x, y = batch(step, PER_RANK * world, vocab)
            x, y = x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
        stats = state.stats()
        sc = getattr(state, "_sparse_client", None)
        out.append({"params": _params(model), "error": error,
                    "routes": {i: vars(r) for i, r in stats["routes"].items()},
                    "calls": stats["total"].calls,
                    "rows_bytes": 0 if sc is None else sc.bytes_sent})
        state.close()
    return out
