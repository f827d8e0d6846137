"""What runs across emulated racks: all-reduces through the rack
aggregators and the root beside gloo's ring over the same fabric, and the
DDP demo. ``aggnet emulate --topology FILE ...`` calls these.

Workers are the one-rack emulation's (``aggnet.emulation.worker``,
``aggnet.demo``), one per namespace; aggnet's find their rack's aggregator
in the topology file the fabric wrote, gloo's meet at rank 0 and reach
other racks through the spine.
"""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import sys
import uuid

from aggnet.emulation.fabric import Fabric
from aggnet.emulation.netns import EmulationError
from aggnet.emulation.rack_runs import collect, follow_demo

GLOO_PORT = 29500
DEMO_PORT = 29501


def _env(extra: dict | None = None) -> dict:
    # AGGNET_ADDRESS from the caller's shell would override the topology
    return {"AGGNET_ADDRESS": "", "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1", **(extra or {})}


def run_system(fabric: Fabric, system: str, nbytes: int, reps: int = 1, *, dtype: str = "float32",
               timeout: float = 1800, progress: bool = False, floors: list[str] | None = None) -> dict:
    """One all-reduce system on every worker of every rack; the time per
    repetition (slowest worker), each worker's checksums (and, for int32,
    whether its result is the exact sum) and the bytes every rack's uplink
    moved per all-reduce, each way. ``progress``: rank 0 prints a line per
    repetition as it goes. ``floors``: for the floor, each rack's
    (:func:`start_floors`)."""
    from aggnet.bench.cpu import per_gb

    world = len(fabric.workers)
    job = f"fabric-{uuid.uuid4().hex[:8]}"
    with fabric.switch_jobs(job) if system == "aggnet" else contextlib.nullcontext():
        before = fabric.uplink_counters()
        outs = _run_workers(fabric, system, nbytes, reps, job, dtype, timeout, progress, floors)
        after = fabric.uplink_counters()
    times = [max(o["times"][i] for o in outs) for i in range(reps)]
    uplinks = [{k: (a[k] - b[k]) / reps for k in a} for a, b in zip(after, before)]
    return {"system": system, "racks": len(fabric.racks), "workers": world, "bytes": nbytes, "times": times,
            "median_s": statistics.median(times), "checksums": [o["checksums"] for o in outs],
            "exact": [o["exact"] for o in outs], "uplinks": uplinks,
            "cross_rack_bytes": {"up": sum(u["up"] for u in uplinks), "down": sum(u["down"] for u in uplinks)},
            "client_stats": [o["stats"] for o in outs],
            "worker_cpu_s_per_gb": per_gb(sum(o["cpu_s"] for o in outs) / world, nbytes, reps)}


def _run_workers(fabric: Fabric, system: str, nbytes: int, reps: int, job: str, dtype: str, timeout: float,
                 progress: bool, floors: list[str] | None) -> list[dict]:
    workers = fabric.workers
    world = len(workers)
    master = f"{workers[0][2].ip}:{GLOO_PORT}"
    env = _env({"AGGNET_TIMEOUT": "120"})
    procs = []
    for rank, rack, h in workers:
        cmd = [sys.executable, "-m", "aggnet.emulation.worker", system, "--rank", str(rank), "--world", str(world),
               "--bytes", str(nbytes), "--reps", str(reps), "--master", master, "--job", job, "--dtype", dtype]
        if system in ("aggnet", "floor"):
            cmd += ["--topology", fabric.topology_path]
        if system == "floor":  # a rack's floor sums its own workers, then the root sums the racks
            local = [x[0] for x in workers if x[1] is rack]
            cmd += ["--floor", floors[fabric.racks.index(rack)], "--floor-rank", str(local.index(rank)),
                    "--floor-world", str(len(local))]
        shown = progress and rank == 0
        procs.append(rack.popen(h, cmd + (["--progress"] if shown else []), env=env, stdout=subprocess.PIPE,
                                stderr=None if shown else subprocess.PIPE, text=True))
    return collect(procs, timeout, f"{system} all-reduce across racks")


@contextlib.contextmanager
def start_floors(fabric: Fabric, shards: int | None = None):
    """The floor across racks (aggnet/bench/floor.py): a floor on the spine
    as the root, one on every rack's aggregator host under it, plain TCP
    sockets moving what aggnet's racks move; yields each rack's address."""
    from aggnet.emulation.fabric_plan import ROOT_IP
    from aggnet.emulation.rack_runs import FloorProcess

    if any(rack.aggregator is None for rack in fabric.racks):
        raise EmulationError("the floor needs every rack's aggregator host (a p4 rack has none)")
    started = []
    try:
        racks = len(fabric.racks)
        root = None
        if racks > 1:
            root = FloorProcess(fabric.spine, ROOT_IP, racks, shards)
            started.append(root)
        for i, rack in enumerate(fabric.racks):
            started.append(FloorProcess(rack.aggregator.name, rack.aggregator.ip, len(rack.workers), shards,
                                        parent=root, rack=i, racks=racks))
        yield [f.address for f in started[-racks:]]
    finally:
        for f in reversed(started):
            f.stop()


def run_demo(fabric: Fabric, epochs: int, codec: str, timeout: float = 1800, extra: list[str] = (),
             on_line=None) -> list[str]:
    """The DDP demo, one worker per namespace across the racks (torchrun's
    environment, gloo rendezvous at rank 0, the aggnet hook placed by the
    topology file); returns rank 0's output lines, each handed to
    ``on_line`` as it is printed."""
    if fabric.switches:
        # a switch's job is installed before its workers join: name it
        job = f"demo-{uuid.uuid4().hex[:8]}"
        with fabric.switch_jobs(job):
            return _run_demo(fabric, epochs, codec, timeout, [*extra, "--job", job], on_line)
    return _run_demo(fabric, epochs, codec, timeout, extra, on_line)


def _run_demo(fabric: Fabric, epochs: int, codec: str, timeout: float, extra, on_line) -> list[str]:
    workers = fabric.workers
    world = len(workers)
    procs = []
    for rank, rack, h in workers:
        env = _env({"AGGNET_TOPOLOGY": fabric.topology_path, "AGGNET_TIMEOUT": "300", "RANK": str(rank),
                    "LOCAL_RANK": "0", "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": "1",
                    "MASTER_ADDR": workers[0][2].ip, "MASTER_PORT": str(DEMO_PORT)})
        cmd = [sys.executable, "-m", "aggnet.demo", "--epochs", str(epochs), "--codec", codec, *extra]
        procs.append(rack.popen(h, cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return follow_demo(procs, timeout, on_line, "across the racks")
