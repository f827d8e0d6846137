"""Workers of an asynchronous pipeline run, and the one-process emulator
run they must equal bit for bit."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from aggnet.pipeline import AggnetReducer, Stage, StageRunner, emulate
from aggnet.torch.teardown import ends_process_group

LR = 0.05
#: the model's layers held by each stage, for 2 and 4 stages
BOUNDS = {2: ((0, 4), (4, 8)), 4: ((0, 2), (2, 4), (4, 6), (6, 8))}


def make_model() -> nn.Sequential:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(6, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(),
                         nn.Linear(24, 16), nn.Linear(16, 3))


def batches(count: int, replica: int = 0, size: int = 8) -> list:
    g = torch.Generator().manual_seed(900 + replica)
    return [(torch.randn(size, 6, generator=g), torch.randint(0, 3, (size,), generator=g)) for _ in range(count)]


def make_stage(k: int, stages: int, mode: str, backward: str = "recompute", optimizer: str = "sgd",
               device: str = "cpu") -> Stage:
    a, b = BOUNDS[stages][k]
    module = make_model()[a:b].to(device)
    if optimizer == "adam":
        opt = torch.optim.Adam(module.parameters(), lr=LR / 10)
    else:
        opt = torch.optim.SGD(module.parameters(), lr=LR, momentum=0.9, dampening=0.9)
    return Stage(module, opt, index=k, stages=stages, mode=mode, loss_fn=nn.functional.cross_entropy,
                 backward=backward)


def params(stage: Stage) -> list:
    return [p.detach().cpu().numpy().copy() for p in stage.params]


def emulated(stages: int, mode: str, steps: int, replicas: int = 1, backward: str = "recompute",
             optimizer: str = "sgd", device: str = "cpu") -> list:
    """Per stage (per replica), the weights after ``steps`` batches."""
    grid = [[make_stage(k, stages, mode, backward, optimizer, device) for _ in range(replicas)]
            for k in range(stages)]
    data = batches(steps) if replicas == 1 else [batches(steps, r) for r in range(replicas)]
    losses = emulate(grid, data)
    return [[params(s) for s in row] for row in grid], losses


@ends_process_group
def pipeline_run(rank: int, world: int, port: int, stages: int, modes: list, steps: int, address: str | None = None,
                 job: str = "pipe", backward: str = "recompute", optimizer: str = "sgd", device: str = "cpu") -> dict:
    """Rank ``rank`` of ``world // stages`` replicas of a ``stages``-stage
    pipeline (a replica's stages on consecutive ranks); every mode of
    ``modes`` in turn."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    replica, k = divmod(rank, stages)
    replicas = world // stages
    ranks = [replica * stages + j for j in range(stages)]
    out = {"stage": k, "replica": replica, "params": {}, "losses": {}, "waits": {}}
    for mode in modes:
        stage = make_stage(k, stages, mode, backward, optimizer, device)
        reducer = None
        if replicas > 1:
            reducer = AggnetReducer(address, job=f"{job}-{mode}-stage{k}", rank=replica, world_size=replicas)
        runner = StageRunner(stage, ranks, reducer=reducer, timeout=60)
        out["losses"][mode] = runner.run(batches(steps, replica))
        out["params"][mode] = params(stage)
        out["waits"][mode] = dict(runner.wait_seconds)
        if reducer is not None:
            reducer.close()
        dist.barrier()
    return out


def pipeline_with_a_dead_stage(rank: int, world: int, port: int, timeout: float) -> str:
    """Rank 1 (the last stage) leaves at once; rank 0 runs its stage and
    returns the error it gets."""
    import time

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    if rank == 1:
        return "gone"  # exits without destroying the group: the process ends
    runner = StageRunner(make_stage(0, 2, "spectrain"), [0, 1], timeout=timeout)
    t0 = time.monotonic()
    try:
        runner.run(batches(10))
    except Exception as exc:  # noqa: BLE001 - the test reads what the user would see
        return f"{type(exc).__name__}: {exc} ({time.monotonic() - t0:.1f}s)"
    return "no error"
