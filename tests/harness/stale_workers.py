"""Workers of stale-gradient DDP through aggnet, and the one-process
emulation they must equal bit for bit."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from aggnet.torch import AggnetState, StaleStep, allreduce_hook
from aggnet.torch import stale
from aggnet.torch.teardown import ends_process_group

LR = 0.05


def make_model() -> nn.Sequential:
    torch.manual_seed(11)
    return nn.Sequential(nn.Linear(10, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


def make_optimizer(model) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, dampening=0.9)


def batches(rank: int, steps: int) -> list:
    g = torch.Generator().manual_seed(300 + rank)
    return [(torch.randn(16, 10, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(steps)]


def emulated(world: int, steps: int, staleness: int, predict: bool) -> list:
    models = [make_model() for _ in range(world)]
    opts = [make_optimizer(m) for m in models]
    stale.emulate(models, opts, [batches(r, steps) for r in range(world)], nn.functional.cross_entropy,
                  staleness=staleness, predict=predict)
    return [[p.detach().numpy().copy() for p in m.parameters()] for m in models]


@ends_process_group
def ddp_run(rank: int, world: int, port: int, address: str, job: str, steps: int, staleness: int,
            predict: bool, codec: str | None = None, device: str = "cpu") -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model = make_model().to(device)
    # small buckets: several per step, rebuilt after the first step
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.01)
    state = AggnetState(address, job=job, staleness=staleness, predict=predict, codec=codec or "float32")
    ddp.register_comm_hook(state, allreduce_hook)
    opt = make_optimizer(ddp)
    if staleness:
        step = StaleStep(ddp, opt, state)
        for x, y in batches(rank, steps):
            with step.step():
                nn.functional.cross_entropy(ddp(x.to(device)), y.to(device)).backward()
        step.finish()
        updates = step.updates
    else:
        for x, y in batches(rank, steps):
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x.to(device)), y.to(device)).backward()
            opt.step()
        updates = steps
    calls = state.stale_queue.step if staleness else None
    s = state.client.stats
    carried, awaited, unsteady, again = s.scales_carried, s.scales_awaited, s.scales_unsteady, s.chunks_sent_again
    state.close()
    dist.barrier()
    return {"params": [p.detach().cpu().numpy().copy() for p in model.parameters()], "updates": updates,
            "steps_seen": calls, "carried": carried, "awaited": awaited, "unsteady": unsteady, "again": again}
