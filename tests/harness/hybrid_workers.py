"""Workers of a hybrid (pipeline stages x data-parallel groups) run, and
the single-process training they must equal."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from aggnet.parallel import HybridParallel, build_layout
from aggnet.torch.teardown import ends_process_group

LR = 0.1
BATCH = 16  # the global batch


def make_model() -> nn.Sequential:
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4), nn.Tanh(), nn.Linear(4, 32), nn.Tanh(),
                         nn.Linear(32, 3))


#: the stages of the model above for 2 and 4 stages
BOUNDS = {2: ((0, 4), (4, 7)), 4: ((0, 2), (2, 4), (4, 6), (6, 7))}


def batch(step: int):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 3, generator=g)


def single_process(steps: int) -> list:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loss_fn = nn.MSELoss()
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return [p.detach().numpy().copy() for p in model.parameters()]


@ends_process_group
def hybrid_run(rank: int, world: int, port: int, topology: str, placement: str, stages: int, steps: int,
               micro_batches: int, gradients: str, job: str, schedule: str = "gpipe", device: str = "cpu",
               hook_options: dict | None = None) -> dict:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        layout = build_layout(topology, stages, placement, job=job)
        replicas = layout.replicas
        share = BATCH // replicas
        model = make_model()
        x0, _ = batch(0)
        hp = HybridParallel(model, layout, BOUNDS[stages], loss_fn=nn.MSELoss(), sample=x0[: share // micro_batches],
                            micro_batches=micro_batches, gradients=gradients, schedule=schedule, device=device,
                            hook_options=hook_options)
        opt = torch.optim.SGD(hp.parameters(), lr=LR)
        losses = []
        for step in range(steps):
            x, y = batch(step)
            lo, hi = hp.replica * share, (hp.replica + 1) * share
            opt.zero_grad()
            out = hp.step(x[lo:hi] if hp.is_first else None, y[lo:hi] if hp.is_last else None)
            losses.append([float(v.detach()) for v in out])
            devices = {str(p.device) for p in hp.module.parameters()} | {str(v.device) for v in out}
            opt.step()
        calls = hp.state.stats()["total"].calls if hp.state is not None else 0
        job_info = hp.job
        result = {"stage": hp.stage, "replica": hp.replica, "losses": losses, "hook_calls": calls,
                  "devices": sorted(devices),
                  # buckets staged, per device (the stager's pinned buffers, used again each step)
                  "staged": {d: s["pinned"].allocations + s["pinned"].reuses
                             for d, s in (hp.state.staging_stats() if hp.state is not None else {}).items()},
                  "params": [p.detach().cpu().numpy().copy() for p in hp.module.parameters()],
                  "group": {"name": job_info.name, "address": job_info.address, "members": job_info.members,
                            "world": job_info.world, "crosses_racks": job_info.crosses_racks}}
        hp.close()
        return result
    finally:
        # every rank done with its groups before any tears them down
        dist.barrier()
