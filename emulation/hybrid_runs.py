"""``aggnet emulate --topology FILE bench-hybrid``: training steps across
emulated racks with a stage per rack (hybrid), beside data parallelism
through the racks' aggregators and beside gloo's ring, each system's
step time and the bytes it put on the uplinks, beside what
:mod:`aggnet.parallel.cost` predicted for them and which it would pick."""

from __future__ import annotations

import select
import subprocess
import sys
import time
import uuid

from aggnet.parallel import cost, profile
from aggnet.parallel.profile import Profile

from aggnet.emulation.fabric import Fabric
from aggnet.emulation.fabric_runs import _env
from aggnet.emulation.netns import EmulationError
from aggnet.emulation.rack_runs import collect

#: system -> the cost model's name for it
SYSTEMS = {"hybrid": "hybrid stage-per-rack", "aggnet": "aggnet racks", "gloo": "gloo ring"}
BASE_PORT = 29610


def predict(model: str, fabric: Fabric, batch: int, micro_batches: int) -> tuple[Profile, cost.PlanResult]:
    """The cost model's view of this fabric and model, from a profile
    taken here (outside the namespaces, on the same machine) on one
    thread, as each worker computes: with torch's default of a thread per
    core, a busy machine's waiting threads spin and their CPU time
    inflated the profile until the plan picked data parallelism."""
    import torch

    from aggnet.emulation.hybrid_worker import MODELS

    m, sample = MODELS[model]()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        prof = profile(m, sample)
    finally:
        torch.set_num_threads(threads)
    p = fabric.plan
    links = cost.Links(p.host_mbit or 1e5, p.uplink_mbit or 1e5, p.mtu)
    return prof, cost.plan(prof, fabric.topology_path, batch=batch, micro_batches=micro_batches, links=links)


def run(fabric: Fabric, system: str, model: str, batch: int, steps: int, *, warmup: int = 2, micro_batches: int = 1,
        port: int = BASE_PORT, timeout: float = 900) -> dict:
    """One system's timed steps on every worker; the step time (slowest
    rank) and the wire bytes per step on each uplink."""
    workers = fabric.workers
    world = len(workers)
    master = f"{workers[0][2].ip}:{port}"
    job = f"hyb-{uuid.uuid4().hex[:8]}"
    procs = []
    for rank, rack, h in workers:
        cmd = [sys.executable, "-m", "aggnet.emulation.hybrid_worker", system, "--model", model, "--rank", str(rank),
               "--world", str(world), "--master", master, "--topology", fabric.topology_path, "--job", job,
               "--batch", str(batch), "--steps", str(steps), "--warmup", str(warmup),
               "--micro-batches", str(micro_batches)]
        procs.append(rack.popen(h, cmd, env=_env({"AGGNET_TIMEOUT": "300"}), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, stdin=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                                text=True))
    try:
        _await_line(procs, "timed", timeout, f"{system} warm-up")
        before = fabric.uplink_counters()
        procs[0].stdin.write("go\n")
        procs[0].stdin.flush()
    except BaseException:
        for p in procs:
            p.kill()
        raise
    outs = collect(procs, timeout, f"{system} training step")
    after = fabric.uplink_counters()
    uplinks = [((a["up"] - b["up"]) / steps, (a["down"] - b["down"]) / steps) for a, b in zip(after, before)]
    return {"system": system, "model": model, "batch": batch, "steps": steps, "world": world,
            "step_s": max(o["step_s"] for o in outs), "uplinks": uplinks,
            "cross_rack_bytes": sum(u for u, _ in uplinks),
            "cut": next((o["cut"] for o in outs if "cut" in o), None)}


def _await_line(procs: list, want: str, timeout: float, what: str) -> None:
    """Wait for rank 0 to print ``want``; a worker that dies first is
    reported with its error."""
    deadline = time.monotonic() + timeout
    out = procs[0].stdout
    while time.monotonic() < deadline:
        for rank, p in enumerate(procs):
            if p.poll() is not None and p.returncode != 0:
                raise EmulationError(f"rank {rank} failed during the {what} ({p.returncode}): "
                                     f"{p.stderr.read().strip()[-2000:]}")
        ready, _, _ = select.select([out], [], [], 0.5)
        if ready:
            line = out.readline()
            if line.strip() == want:
                return
            if not line:
                raise EmulationError(f"rank 0 ended during the {what}: {procs[0].stderr.read().strip()[-2000:]}")
    raise EmulationError(f"the {what} did not finish within {timeout:g}s; rerun with a smaller --batch")
