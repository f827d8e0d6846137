"""Hybrid training under torchrun: a stage of the model per rack, each
stage's copies all-reduced through their rack's aggregator.

    ./dev aggnet up examples/topologies/one-machine-service.toml
    .venv/bin/torchrun --nproc-per-node 4 examples/hybrid_train.py \\
        --topology examples/topologies/one-machine-service.toml
    ./dev aggnet down examples/topologies/one-machine-service.toml

Rank 0 profiles the model and picks the cut (the same one ``aggnet plan``
prints); every rank builds the whole model from one seed and keeps its
stage; the last stage of each replica prints its loss.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn

from aggnet.parallel import HybridParallel, build_layout, cost, models, profile
from aggnet.protocol import topology as topo


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--topology", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=64, help="global batch")
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--placement", default="stage-per-rack", choices=["stage-per-rack", "pipeline-in-rack"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where each stage runs (cuda: the GPU of the rank's LOCAL_RANK)")
    args = p.parse_args()
    dist.init_process_group("gloo")
    t = topo.load(args.topology)
    torch.manual_seed(0)
    model, sample = models.narrow_cut()
    layout = build_layout(t, len(t.racks), args.placement)
    cut = [None]
    if dist.get_rank() == 0:
        links = cost.Links(t.links.host_mbit or 10_000, t.links.uplink_mbit or 10_000)
        result = cost.plan(profile(model, sample), t, batch=args.batch, micro_batches=args.micro_batches, links=links)
        cut[0] = next(a for a in result.alternatives if a.name == f"hybrid {args.placement}").stages
        print(f"stages (first layer, end): {cut[0]}")
        for line in layout.describe():
            print(line)
    dist.broadcast_object_list(cut, src=0)
    share = args.batch // layout.replicas
    micro = torch.zeros(share // args.micro_batches, *sample.shape[1:])
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    hp = HybridParallel(model, layout, cut[0], loss_fn=nn.MSELoss(), sample=micro, micro_batches=args.micro_batches,
                        schedule="1f1b", device=device)
    opt = torch.optim.SGD(hp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(sample.shape[1], 10, generator=g) / sample.shape[1] ** 0.5
    for step in range(args.steps):
        x = torch.randn(args.batch, sample.shape[1], generator=g)
        y = torch.tanh(x @ teacher)
        lo, hi = hp.replica * share, (hp.replica + 1) * share
        opt.zero_grad()
        losses = hp.step(x[lo:hi] if hp.is_first else None, y[lo:hi] if hp.is_last else None)
        opt.step()
        if hp.is_last and hp.replica == 0:
            print(f"step {step}: loss {sum(float(v.detach()) for v in losses) / len(losses):.4f}", flush=True)
    hp.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
