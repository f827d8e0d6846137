"""``aggnet plan``: how to place a model on a topology's racks.

Profiles the model's layers here, cuts it for each hybrid placement, and
prints every alternative's cross-rack bytes and predicted step time beside
data parallelism (gloo's ring, aggnet's racks), with the pick and why."""

from __future__ import annotations

import importlib
import json
import sys
import time

from aggnet.client.config import parse_size
from aggnet.protocol.topology import TopologyError


def add_arguments(p) -> None:
    p.add_argument("--topology", required=True, help="topology file: racks, ranks, [links] rates")
    p.add_argument("--model", required=True,
                   help="module:factory returning an nn.Sequential, or (model, sample batch); "
                        "e.g. aggnet.parallel.models:narrow_cut")
    p.add_argument("--stages", type=int, default=None, help="pipeline stages (default: one per rack)")
    p.add_argument("--batch", type=int, default=None, help="global batch (default: 16 per rank)")
    p.add_argument("--micro-batches", type=int, default=1, help="micro-batches per replica and step (1: the paper's)")
    p.add_argument("--input-shape", default=None,
                   help="one sample's shape, comma-separated, when the factory returns only the model")
    p.add_argument("--host-mbit", type=float, default=None, help="worker link rate (default: the file's [links])")
    p.add_argument("--uplink-mbit", type=float, default=None, help="rack uplink rate (default: the file's [links])")
    p.add_argument("--mtu", type=int, default=None, help="the links' MTU (default: the topology's, else 9000)")
    p.add_argument("--memory-limit", default=None, help="most memory a stage may hold, e.g. 2GiB")
    p.add_argument("--device", default="cpu",
                   help="where to time the layers: cpu (default), cuda or cuda:N, the devices the stages will run on")
    p.add_argument("--json", default=None, help="also write the plan here")


def main(args) -> int:
    t0 = time.perf_counter()
    try:
        return _run(args, t0)
    except (TopologyError, ValueError, TypeError) as exc:
        print(f"aggnet plan: {exc}", file=sys.stderr)
        return 2


def _run(args, t0: float) -> int:
    from aggnet.parallel import cost
    from aggnet.parallel.profile import profile
    from aggnet.protocol import topology as topo

    cpu0 = time.process_time()  # what planning costs, past the interpreter's imports
    t = topo.load(args.topology)
    model, sample = _model(args.model, args.input_shape)
    links = cost.links_of(t, args.host_mbit, args.uplink_mbit, args.mtu)
    batch = args.batch or 16 * t.world
    device = _device(args.device)
    prof = profile(model.to(device), sample.to(device))
    memory = parse_size(args.memory_limit) if args.memory_limit else None
    result = cost.plan(prof, t, batch=batch, stages=args.stages, micro_batches=args.micro_batches, links=links,
                       memory_limit=memory)
    took = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    for line in _report(t, prof, result):
        print(line)
    print(f"(planned in {took:.2f}s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_as_json(t, prof, result, took, cpu), f, indent=2)
    return 0


def _device(name: str):
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a device torch knows: give cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: torch sees no CUDA GPU here (torch {torch.__version__}); time the layers "
                         f"on the machine the stages will run on, or give --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return device


def _model(spec: str, input_shape: str | None):
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--model takes module:factory (e.g. aggnet.parallel.models:narrow_cut), got {spec!r}")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--model {spec}: {exc}") from None
    made = factory()
    if isinstance(made, tuple):
        return made
    if not input_shape:
        raise ValueError(f"--model {spec} returned only a model: give --input-shape (one sample's shape, e.g. 784 "
                         f"or 3,32,32)")
    import torch

    shape = tuple(int(v) for v in input_shape.split(","))
    return made, torch.randn(16, *shape)


def _report(t, prof, result) -> list[str]:
    links = result.links
    lines = [f"topology {t.source}: {len(t.racks)} rack(s) of {[r.members for r in t.racks]} ranks; host links "
             f"{links.host_mbit:g} Mbit/s, uplinks {links.uplink_mbit:g} Mbit/s, MTU {links.mtu}",
             f"model: {len(prof.layers)} layers, {_bytes(prof.param_bytes)} of parameters; global batch "
             f"{result.batch}, {result.micro_batches} micro-batch(es), {result.stages} stage(s)",
             ""]
    header = f"{'alternative':<26} {'step (ms)':>10} {'compute':>9} {'network':>9} {'uplink bytes/step':>18}  cuts"
    lines += [header, "-" * len(header)]
    for a in result.alternatives:
        if not a.feasible:
            lines.append(f"{a.name:<26} {'-':>10} {'':>9} {'':>9} {'':>18}  not possible: {a.why}")
            continue
        cuts = ", ".join(f"after {prof.layers[e - 1].name} ({_bytes(prof.layers[e - 1].out_bytes_per_sample)}"
                         f"/sample)" for _, e in a.stages[:-1]) or "-"
        mark = "  <- pick" if a is result.pick else ""
        lines.append(f"{a.name:<26} {a.step_seconds * 1e3:>10.1f} {a.compute_seconds * 1e3:>9.1f} "
                     f"{a.comm_seconds * 1e3:>9.1f} {_bytes(a.cross_rack_bytes):>18}  {cuts}{mark}")
    lines += ["", f"pick: {result.pick.name}: {result.reason}"]
    if result.pick.layout is not None:
        lines += ["  " + s for s in result.pick.layout.describe()]
    return lines


def _as_json(t, prof, result, took: float, cpu: float) -> dict:
    return {
        "topology": t.source, "racks": len(t.racks), "world": t.world, "batch": result.batch, "device": prof.device,
        "micro_batches": result.micro_batches, "stages": result.stages,
        "links": {"host_mbit": result.links.host_mbit, "uplink_mbit": result.links.uplink_mbit,
                  "mtu": result.links.mtu},
        "layers": [{"name": layer.name, "seconds_per_sample": layer.seconds_per_sample,
                    "out_bytes_per_sample": layer.out_bytes_per_sample, "param_bytes": layer.param_bytes}
                   for layer in prof.layers],
        "alternatives": [{"name": a.name, "feasible": a.feasible, "why": a.why, "step_seconds": a.step_seconds
                          if a.feasible else None, "compute_seconds": a.compute_seconds,
                          "comm_seconds": a.comm_seconds, "uplinks": a.uplinks,
                          "cross_rack_bytes": a.cross_rack_bytes, "stages": list(a.stages)}
                         for a in result.alternatives],
        "pick": result.pick.name, "reason": result.reason, "seconds": took, "cpu_seconds": cpu,
    }


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"
