"""One rank of ``aggnet emulate --topology FILE bench-hybrid``: training
steps of a model with one placement, timed, in its namespace.

Systems: ``hybrid`` (a stage per rack, each stage's gradients through its
rack's aggregator: :class:`aggnet.parallel.HybridParallel`), ``aggnet``
(data parallelism, DDP with the aggnet hook through the racks and the
root) and ``gloo`` (data parallelism, DDP's own ring). Rank 0 profiles
the model and hands every rank the same cut. After the warm-up steps rank
0 prints ``timed`` and waits for a line on stdin, so that the caller reads
the uplink counters exactly where the timed steps begin; the last line is
JSON: the mean step time and this rank's place.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from aggnet.parallel import build_layout, cost, models
from aggnet.parallel.hybrid import HybridParallel
from aggnet.parallel.profile import profile
from aggnet.protocol import topology as topo
from aggnet.torch.teardown import ends_process_group

MODELS = {"narrow-cut": models.narrow_cut, "wide-activation": models.wide_activation}


@ends_process_group
def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("system", choices=["hybrid", "aggnet", "gloo"])
    p.add_argument("--model", choices=sorted(MODELS), required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master", required=True)
    p.add_argument("--topology", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--batch", type=int, required=True, help="global batch")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=args.rank, world_size=args.world)
    step, share_of = _build(args)
    for i in range(args.warmup):
        step(i)
    if args.rank == 0:
        print("timed", flush=True)
        sys.stdin.readline()
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(args.steps):
        step(args.warmup + i)
    dist.barrier()
    seconds = (time.perf_counter() - t0) / args.steps
    print(json.dumps({"rank": args.rank, "system": args.system, "step_s": seconds, **share_of}), flush=True)
    dist.barrier()
    return 0


def _batch(args, sample, out_shape, step: int):
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(args.batch, *sample.shape[1:], generator=g),
            torch.randn(args.batch, *out_shape, generator=g))


def _build(args):
    torch.manual_seed(0)
    model, sample = MODELS[args.model]()
    with torch.no_grad():
        out_shape = tuple(model(sample[:1]).shape[1:])
    loss_fn = nn.MSELoss()
    if args.system == "hybrid":
        t = topo.load(args.topology)
        layout = build_layout(t, len(t.racks), "stage-per-rack", job=args.job)
        replicas = layout.replicas
        # one profile, rank 0's, so that every rank cuts the model alike
        cut = [None]
        if args.rank == 0:
            result = cost.plan(profile(model, sample), t, batch=args.batch, micro_batches=args.micro_batches)
            cut[0] = next(a for a in result.alternatives if a.name == "hybrid stage-per-rack").stages
        dist.broadcast_object_list(cut, src=0)
        share = args.batch // replicas
        micro = torch.zeros(share // args.micro_batches, *sample.shape[1:])
        hp = HybridParallel(model, layout, cut[0], loss_fn=loss_fn, sample=micro,
                            micro_batches=args.micro_batches)
        opt = torch.optim.SGD(hp.parameters(), lr=0.01)

        def step(i: int) -> None:
            x, y = _batch(args, sample, out_shape, i)
            lo, hi = hp.replica * share, (hp.replica + 1) * share
            opt.zero_grad()
            hp.step(x[lo:hi] if hp.is_first else None, y[lo:hi] if hp.is_last else None)
            opt.step()

        return step, {"stage": hp.stage, "replica": hp.replica, "cut": [list(s) for s in cut[0]]}
    ddp = DistributedDataParallel(model)
    if args.system == "aggnet":
        from aggnet.torch.hook import AggnetState, allreduce_hook

        ddp.register_comm_hook(AggnetState(topology=args.topology, job=args.job, alpha_threshold=None),
                               allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    share = args.batch // args.world

    def step(i: int) -> None:
        x, y = _batch(args, sample, out_shape, i)
        lo, hi = args.rank * share, (args.rank + 1) * share
        opt.zero_grad()
        loss_fn(ddp(x[lo:hi]), y[lo:hi]).backward()
        opt.step()

    return step, {}


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
