"""Ray Train through aggnet aggregators that run as Ray actors, against
the same training on gloo.

    python examples/ray_train.py                      # a local cluster: a head and two rack nodes
    python examples/ray_train.py --kill-at 8          # rack0's aggregator actor is killed at step 8
    python examples/ray_train.py --address auto --topology racks.toml   # an existing cluster

Without ``--address`` it starts a Ray cluster on this machine, each node a
process of its own: a head labeled ``aggnet.io/root=true`` and one node per
rack labeled ``aggnet.io/rack=NAME``. The topology's aggregators start as
actors on those nodes (:class:`aggnet.ray.Aggregators`), and one
``TorchTrainer`` run with ``AggnetTorchConfig`` trains a small model through
them (the process group Ray Train made) and again through a gloo group of
the same workers.
``--kill-at N`` has rank 0 kill rack0's aggregator actor at step N; Ray
restarts it and the step's all-reduce finishes on the new one. Prints (or
writes, with ``--out``) the two models' largest weight difference, their
training times and where the aggregators ran.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time

STEPS = 16


def _free_port_block(count: int) -> int:
    """A port P with P..P+count-1 free now (a service's control endpoint and
    its shards)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count >= 65536:
            continue
        held = []
        try:
            for port in range(base, base + count):
                for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
                    t = socket.socket(socket.AF_INET, kind)
                    held.append(t)
                    t.bind(("0.0.0.0", port))
        except OSError:
            continue
        finally:
            for t in held:
                t.close()
        return base
    raise RuntimeError("no block of free ports")


def local_topology(racks: int, shards: int, kind: str = "service", per_rack: int = 2) -> str:
    """Racks of ``kind`` (the sharded service, or host-switch: the switch
    protocol on a host) under a root of the same kind, each at ports of its
    own (the nodes of a local cluster share one IP)."""
    ports = [_free_port_block(shards + 1) for _ in range(racks + 1)]
    scheme = "zmq+tcp" if kind == "service" else "udp"
    lines = ['job = "ray-example"', "", "[root]", f'kind = "{kind}"',
             f'address = "{scheme}://127.0.0.1:{ports[0]}"', f"shards = {shards}", ""]
    for r in range(racks):
        first = r * per_rack
        lines += ["[[racks]]", f'name = "rack{r}"', f'ranks = "{first}-{first + per_rack - 1}"',
                  "[racks.aggregator]", f'kind = "{kind}"', f'address = "{scheme}://127.0.0.1:{ports[r + 1]}"',
                  f"shards = {shards}", ""]
    return "\n".join(lines)


def train_loop(config: dict) -> None:
    """Each Ray Train worker trains the same small model twice, a few SGD
    steps each under DDP: through the process group Ray Train made (the
    aggnet backend), and through a gloo group of the same ranks."""
    import ray
    import ray.train
    import ray.train.torch
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    rank = ray.train.get_context().get_world_rank()
    gloo = dist.new_group(backend="gloo")
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(64, 32, generator=g)
    y = torch.randn(64, 4, generator=g)
    out = {}
    for name in ("gloo", "aggnet"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))
        if name == "aggnet":
            model = ray.train.torch.prepare_model(model)  # DDP on the group Ray Train made
        else:
            model = DistributedDataParallel(model, process_group=gloo)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        began = time.perf_counter()
        for step in range(config["steps"]):
            if name == "aggnet" and step == config.get("kill_at") and rank == 0:
                # what a crash of the aggregator's process does: Ray restarts it
                ray.kill(config["kill"], no_restart=False)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        out[name] = {"weights": [p.detach().reshape(-1).tolist() for p in model.parameters()],
                     "seconds": time.perf_counter() - began,
                     "backend": dist.get_backend(gloo if name == "gloo" else None)}
    if rank == 0:
        with open(config["out"], "w") as f:
            json.dump(out, f)


def _fit(config, torch_config, workers: list[str], storage: str) -> dict:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from aggnet.ray import RACK_LABEL

    out = os.path.join(storage, "weights.json")
    scaling = ScalingConfig(num_workers=len(workers), resources_per_worker={"CPU": 1},
                            label_selector=[{RACK_LABEL: rack} for rack in workers])
    TorchTrainer(train_loop, train_loop_config={**config, "out": out}, torch_config=torch_config,
                 scaling_config=scaling, run_config=RunConfig(name="aggnet-example", storage_path=storage)).fit()
    with open(out) as f:
        return json.load(f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", default=None, help="an existing Ray cluster (default: start one on this machine)")
    p.add_argument("--topology", default=None, help="a topology file (default: two service racks under a root)")
    p.add_argument("--racks", type=int, default=2, help="racks of the local cluster (default %(default)s)")
    p.add_argument("--workers-per-rack", type=int, default=2, help="training workers on each rack's node "
                   "(default %(default)s)")
    p.add_argument("--shards", type=int, default=1, help="shards of each local aggregator (default %(default)s)")
    p.add_argument("--kind", choices=["service", "host-switch"], default="service",
                   help="the local aggregators' kind (default %(default)s; the switch protocol does not resume "
                        "an all-reduce across a restart, so --kill-at fails its step there)")
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--kill-at", type=int, default=None, help="rank 0 kills rack0's aggregator actor at this step")
    p.add_argument("--out", default=None, help="write the summary as JSON here")
    args = p.parse_args(argv)

    import ray

    from aggnet.ray import RACK_LABEL, ROOT_LABEL, Aggregators

    cluster = None
    began = time.perf_counter()
    if args.address is None:
        from ray.cluster_utils import Cluster

        # the head runs Ray Train's controller and the root; each rack node
        # its workers and its aggregator
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 2, "labels": {ROOT_LABEL: "true"}, "include_dashboard": False})
        for r in range(args.racks):
            cluster.add_node(num_cpus=args.workers_per_rack + args.shards, labels={RACK_LABEL: f"rack{r}"})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    else:
        ray.init(address=args.address, logging_level="ERROR", log_to_driver=False)
    topology = args.topology or local_topology(args.racks, args.shards, args.kind, args.workers_per_rack)
    started = time.perf_counter()
    try:
        with Aggregators(topology) as aggs, tempfile.TemporaryDirectory(prefix="aggnet-ray-") as storage:
            ready = time.perf_counter()
            print(f"ray cluster and aggregators up in {ready - began:.1f}s "
                  f"(aggregators {ready - started:.1f}s)", flush=True)
            before = {role: aggs.where(role) for role in aggs.actors}
            workers = [r.name for r in aggs.topology.racks for _ in range(args.workers_per_rack)]
            config = {"steps": args.steps}
            if args.kill_at is not None:
                config.update(kill_at=args.kill_at, kill=aggs.actors[f"rack {aggs.topology.racks[0].name}"])
            got = _fit(config, aggs.torch_config(), workers, storage)
            agg, gloo = got["aggnet"], got["gloo"]
            after = {role: aggs.where(role) for role in aggs.actors}
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
    diff = max(abs(a - b) for pa, pb in zip(agg["weights"], gloo["weights"]) for a, b in zip(pa, pb))
    summary = {
        "steps": args.steps, "workers": len(workers), "racks": len(aggs.topology.racks),
        "max_weight_difference": diff, "aggnet_backend": agg["backend"], "gloo_backend": gloo["backend"],
        "aggnet_seconds": agg["seconds"], "gloo_seconds": gloo["seconds"], "kill_at": args.kill_at,
        "restarted": {role: before[role]["pid"] != after[role]["pid"] for role in before},
        "aggregators": after,
    }
    print(f"{len(workers)} workers, {args.steps} steps: aggnet {agg['seconds']:.2f}s, gloo {gloo['seconds']:.2f}s; "
          f"largest weight difference {diff:.3g}; restarted: "
          f"{[role for role, r in summary['restarted'].items() if r] or 'none'}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
