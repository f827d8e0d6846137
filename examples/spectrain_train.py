"""Asynchronous pipelined training with SpecTrain's weight prediction,
one stage per process, under torchrun:

    .venv/bin/torchrun --nproc-per-node 4 examples/spectrain_train.py --stages 4
    .venv/bin/torchrun --nproc-per-node 4 examples/spectrain_train.py --stages 2   # 2 replicas of 2 stages

Ranks are laid out replica by replica (a replica's stages on consecutive
ranks). With more ranks than stages, each stage's copies average their
gradients through aggnet before every update (one aggnet job per stage;
``AGGNET_ADDRESS``, or an embedded aggregator on this machine). Every
rank builds the whole model from one seed and keeps its stage; the last
stage of each replica prints its loss. ``--mode sync`` gives the same
weights as single-process training; ``--check`` reruns the same training
in one process (aggnet.pipeline.emulate) and confirms the weights match
bit for bit.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn

from aggnet.pipeline import MODES, AggnetReducer, Stage, StageRunner, emulate


def blocks(depth: int = 8, width: int = 128):
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(32, width), nn.ReLU())]
    layers += [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth - 2)]
    for block in layers:  # He initialisation: a deep ReLU chain keeps its signal
        nn.init.kaiming_normal_(block[0].weight, nonlinearity="relu")
    return layers + [nn.Linear(width, 10)]


def data(replica: int, steps: int):
    g = torch.Generator().manual_seed(100 + replica)
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(7))
    out = []
    for _ in range(steps):
        x = torch.randn(64, 32, generator=g)
        out.append((x, (x @ teacher).argmax(1)))
    return out


def make_stage(k: int, stages: int, mode: str, lr: float, device: torch.device) -> Stage:
    per = 8 // stages
    module = nn.Sequential(*blocks()[k * per:(k + 1) * per]).to(device)
    opt = torch.optim.SGD(module.parameters(), lr=lr, momentum=0.9, dampening=0.9)
    return Stage(module, opt, index=k, stages=stages, mode=mode, loss_fn=nn.functional.cross_entropy)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stages", type=int, default=4, choices=[1, 2, 4, 8])
    p.add_argument("--mode", default="spectrain", choices=MODES)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--check", action="store_true", help="compare with the one-process emulator at the end")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where each stage runs (cuda: the GPU of the rank's LOCAL_RANK)")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.stages:
        raise SystemExit(f"{world} ranks do not divide into pipelines of {args.stages} stages")
    replicas = world // args.stages
    replica, k = divmod(rank, args.stages)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    stage = make_stage(k, args.stages, args.mode, args.lr, device)
    reducer = (AggnetReducer(job=f"spectrain-example-stage{k}", rank=replica, world_size=replicas)
               if replicas > 1 else None)
    runner = StageRunner(stage, [replica * args.stages + j for j in range(args.stages)], reducer=reducer)
    losses = runner.run(data(replica, args.steps))
    if losses:
        for i in range(0, len(losses), 50):
            print(f"replica {replica}: batches {i}-{i + 49} loss {sum(losses[i:i + 50]) / len(losses[i:i + 50]):.4f}")
    if args.check:
        grid = [[make_stage(j, args.stages, args.mode, args.lr, device) for _ in range(replicas)]
                for j in range(args.stages)]
        emulate(grid, data(0, args.steps) if replicas == 1 else [data(r, args.steps) for r in range(replicas)])
        same = all(torch.equal(a, b) for a, b in zip(stage.params, grid[k][replica].params))
        print(f"rank {rank} (stage {k}, replica {replica}): weights {'equal' if same else 'DIFFER from'} "
              f"the one-process emulator's")
    if reducer is not None:
        reducer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
