"""DDP training runs for the hook tests (imported by spawned workers)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from aggnet.torch.teardown import ends_process_group

FEATURES, CLASSES, PER_RANK = 32, 5, 8


class Net(nn.Module):
    def __init__(self, sparse: bool = False, unused: bool = False):
        super().__init__()
        self.sparse = sparse
        if sparse:
            self.embed = nn.Embedding(200, FEATURES, sparse=True)
        self.body = nn.Sequential(nn.Linear(FEATURES, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, CLASSES))
        if unused:
            self.unused = nn.Linear(FEATURES, 3)

    def forward(self, x):
        if self.sparse:
            x = self.embed(x).mean(1)
        return self.body(x)


def make_model(seed: int, sparse=False, unused=False) -> Net:
    torch.manual_seed(seed)
    return Net(sparse, unused)


def with_float64_head(model: Net) -> Net:
    """The model's last layer in float64 (inputs widened, outputs narrowed):
    DDP gives its gradients a bucket of their own."""
    head = model.body[-1].double()
    head.register_forward_pre_hook(lambda m, args: tuple(a.double() for a in args))
    head.register_forward_hook(lambda m, args, out: out.float())
    return model


def batch(step: int, n: int, sparse: bool):
    g = torch.Generator().manual_seed(1000 + step)
    if sparse:
        x = torch.randint(0, 200, (n, 4), generator=g)
    else:
        x = torch.randn(n, FEATURES, generator=g)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    return x, y


def optimizer(model, sparse: bool):
    # SGD's momentum does not take sparse gradients
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.0 if sparse else 0.9)


def train(model, steps: int, world: int, rank: int, sparse: bool, clip: float | None, ddp=None, device="cpu",
          on_step=None, dtype=torch.float32):
    opt = optimizer(model, sparse)
    net = ddp or model
    for step in range(steps):
        x, y = batch(step, PER_RANK * world, sparse)
        if ddp is not None:
            x, y = x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]
        x, y = x.to(device, dtype if x.is_floating_point() else x.dtype), y.to(device)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if on_step is not None:
            on_step(step)
    return [p.detach().cpu().numpy().copy() for p in model.parameters()]


def single_process(world: int, steps: int, sparse=False, unused=False, clip=None, device="cpu",
                   dtype=torch.float32, float64_head=False):
    torch.set_num_threads(1)
    model = make_model(0, sparse, unused).to(device, dtype)
    if float64_head:
        with_float64_head(model)
    return train(model, steps, world, 0, sparse, clip, device=device, dtype=dtype)


@ends_process_group
def ddp_run(rank: int, world: int, port: int, mode: str, options: dict):
    """Train with DDP; mode is 'gloo' (PyTorch's own all-reduce) or
    'aggnet'. Returns the final parameters (every model's, when several)."""
    torch.set_num_threads(1)
    os.environ.pop("AGGNET_ADDRESS", None)
    from aggnet.torch import AggnetState, allreduce_hook

    early = []
    if mode == "aggnet" and options.get("state_before_init"):
        # as Lightning builds DDPStrategy(ddp_comm_state=...) before the processes exist
        early = [AggnetState(options.get("address"), codec=options.get("codec"))
                 for _ in range(options.get("models", 1))]
        assert not any(s.resolved for s in early)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out = []
    states = []
    device = options.get("device", "cpu")
    dtype = getattr(torch, options.get("dtype", "float32"))
    allocations = []
    for m in range(options.get("models", 1)):
        model = make_model(m, options.get("sparse", False), options.get("unused", False)).to(device, dtype)
        if options.get("float64_head"):
            with_float64_head(model)
        ddp = DDP(model, gradient_as_bucket_view=options.get("bucket_view", False),
                  static_graph=options.get("static_graph", False),
                  find_unused_parameters=options.get("unused", False), bucket_cap_mb=options.get("bucket_mb", 25))
        if mode == "aggnet":
            state = early[m] if early else AggnetState(options.get("address"), codec=options.get("codec"),
                                                       topology=options.get("topology"),
                                                       staging=options.get("staging", True))
            states.append(state)
            ddp.register_comm_hook(state, allreduce_hook)

        def count(step, states=states):  # buffer allocations so far: pools, and CUDA's allocator
            # after step 1: DDP rebuilds its buckets once, after the first backward
            if step in (1, options.get("steps", 20) - 1):
                pools = {d: {k: v.allocations for k, v in p.items()} for s in states
                         for d, p in s.staging_stats().items()}
                segments = (torch.cuda.memory_stats().get("segment.all.allocated", 0)
                            if torch.device(device).type == "cuda" else 0)
                allocations.append({"pools": pools, "cuda_segments": segments})
        out.append(train(model, options.get("steps", 20), world, rank, options.get("sparse", False),
                         options.get("clip"), ddp=ddp, device=device, on_step=count, dtype=dtype))
    jobs = [s.job for s in states]
    stats = [s.stats()["total"].calls for s in states]
    delegated = [s.stats()["total"].delegated for s in states]
    routes = [{i: vars(r) for i, r in s.stats()["routes"].items()} for s in states]
    # chunks the aggregator read in place from the stager's shared memory
    shared = [s.client.stats.chunks_shared if s.resolved else 0 for s in states]
    # sparse buckets that went through the service's tables (not torch.distributed)
    sparse_tables = [sorted(n for n in getattr(s, "_sparse_tables", {}) if n.startswith("ddp-sparse-")) for s in states]
    for s in states:
        s.close()
    return {"params": out, "jobs": jobs, "calls": stats, "allocations": allocations, "routes": routes,
            "chunks_shared": shared, "sparse_tables": sparse_tables, "delegated": delegated}


def max_grad_magnitudes(world: int, steps: int):
    """max |averaged gradient| per step of the single-process run (for the
    int32 error bound)."""
    torch.set_num_threads(1)
    model = make_model(0)
    opt = optimizer(model, False)
    mags = []
    for step in range(steps):
        x, y = batch(step, PER_RANK * world, False)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        mags.append(max(float(p.grad.abs().max()) for p in model.parameters()))
        opt.step()
    return mags


@ends_process_group
def nan_run(rank: int, world: int, port: int, address: str, codec, on_nonfinite: str, device: str = "cpu",
            staging=True):
    """One step on ``device`` where rank 1's gradients are NaN; returns the error text."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from aggnet.torch import AggnetState, allreduce_hook

    model = make_model(0).to(device)
    ddp = DDP(model)
    state = AggnetState(address, codec=codec, on_nonfinite=on_nonfinite, staging=staging)
    ddp.register_comm_hook(state, allreduce_hook)
    x, y = batch(0, PER_RANK, False)
    if rank == 1:
        x[0, 0] = float("nan")
    try:
        nn.functional.cross_entropy(ddp(x.to(device)), y.to(device)).backward()
        result = "ok", bool(all(torch.isnan(p.grad).all() for p in model.parameters()))
    except Exception as exc:
        result = "error", str(exc)
    state.close()
    return result


@ends_process_group
def first_step_error(rank: int, world: int, port: int, address: str, job: str | None = None,
                     connect_timeout: float = 30.0):
    """One DDP step through aggnet; the error it raised, or "no error"."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from aggnet.client.config import ClientConfig
    from aggnet.torch import AggnetState, allreduce_hook

    ddp = DDP(make_model(0))
    state = AggnetState(address, job=job, config=ClientConfig(connect_timeout=connect_timeout))
    ddp.register_comm_hook(state, allreduce_hook)
    x, y = batch(0, PER_RANK, False)
    try:
        nn.functional.cross_entropy(ddp(x), y).backward()
    except Exception as exc:
        return str(exc)
    finally:
        state.close()
    return "no error"
