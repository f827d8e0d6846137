"""What runs in an emulated rack: all-reduces through the aggregator (host
in switch mode, or BMv2 in the ToR's place) beside gloo's ring over the
same links, and the DDP demo. ``aggnet emulate ...`` calls these."""

from __future__ import annotations

import json
import logging
import os
import queue
import select
import statistics
import subprocess
import sys
import threading
import time
import uuid

from aggnet.processes import ServiceProcess
from aggnet.protocol.limits import SWITCH_PORT

from aggnet.emulation.fabric_plan import BMV2_SLOTS
from aggnet.emulation.netns import EmulationError, Rack
from aggnet.emulation.nsprocess import popen_in, service_launcher

log = logging.getLogger("aggnet.emulation")


def start_aggregator(rack: Rack, elements: int | None = None, pool: int = 4096,
                     shards: int | None = None) -> ServiceProcess:
    """The aggregator host in switch mode. Without ``elements`` jobs get
    the host's default K, bounded by what the rack's MTU fits."""
    if rack.aggregator is None:
        raise EmulationError("this rack has no aggregator host")
    args = ["--mode", "switch", "--pool", str(pool)]
    if elements is not None:
        args += ["--elements", str(elements)]
    if shards is not None:
        args += ["--shards", str(shards)]
    return ServiceProcess(f"udp://{rack.aggregator.ip}:{SWITCH_PORT}", launch=service_launcher(rack.aggregator.name),
                          args=args)


class FloorProcess:
    """The floor's shards on an emulated host (aggnet/bench/floor.py): the
    same bytes through the same links as the aggregator, summed by plain
    sockets and numpy, for what any parameter server pays here. Under a
    ``parent`` (a root's FloorProcess) its sums go up as rack ``rack`` of
    ``racks``."""

    def __init__(self, ns: str, ip: str, world: int, shards: int | None = None, *,
                 parent: "FloorProcess | None" = None, rack: int = 0, racks: int = 1, timeout: float = 60.0):
        cmd = [sys.executable, "-m", "aggnet.bench.floor", "--world", str(world),
               "--shards", str(shards or os.cpu_count() or 1), "--host", ip]
        if parent is not None:
            cmd += ["--parent", parent.address, "--rack", str(rack), "--racks", str(racks)]
        self.process = popen_in(ns, cmd, None, stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True)
        self.pid = self.process.pid
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        line = self.process.stdout.readline() if ready else ""
        if not line.startswith("floor serving "):
            self.stop()
            raise EmulationError(f"the floor on {ns} did not start within {timeout:g}s")
        self.address = line.split()[2]

    @classmethod
    def in_rack(cls, rack: Rack, shards: int | None = None) -> "FloorProcess":
        if rack.aggregator is None:
            raise EmulationError("the floor needs the rack's aggregator host (not --switch bmv2)")
        return cls(rack.aggregator.name, rack.aggregator.ip, len(rack.workers), shards)

    def stop(self) -> None:
        """Its standard input's end stops it and its shards."""
        try:
            self.process.stdin.close()
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


def aggregator_address(rack: Rack) -> str:
    return f"udp://{rack.aggregator.ip}:{SWITCH_PORT}"


def collect(procs: list, timeout: float, what: str) -> list[dict]:
    """The JSON line each worker printed last, by rank. The first worker
    to fail, in time, is the one reported, at once, and the others are
    killed: a worker that died while joining leaves the others waiting out
    their stall timeout, and their errors (a rank that never contributed)
    are consequences that name nothing of the cause. A run past
    ``timeout`` kills them all and says so."""
    finished: queue.Queue = queue.Queue()

    def reap(rank: int, p) -> None:
        try:
            out, err = p.communicate()
        except (OSError, ValueError) as exc:  # its pipes closed under it: it is being killed
            out, err = "", str(exc)
        finished.put((rank, out, err))

    readers = [threading.Thread(target=reap, args=(i, p), name=f"aggnet-collect-{i}", daemon=True)
               for i, p in enumerate(procs)]
    for t in readers:
        t.start()

    def kill_all() -> None:
        for q in procs:
            if q.poll() is None:
                q.kill()
        for t in readers:
            t.join(10)

    outs: list = [None] * len(procs)
    deadline = time.monotonic() + timeout
    for _ in procs:
        try:
            rank, out, err = finished.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            kill_all()
            raise EmulationError(f"the {what} in the rack did not finish within {timeout:g}s") from None
        p = procs[rank]
        if p.returncode != 0:
            kill_all()
            said = err.strip()[-2000:] if err else "its error is above"
            raise EmulationError(f"a {what} worker (rank {rank}) failed first ({p.returncode}): {said}")
        lines = (out or "").strip().splitlines()
        if not lines:
            kill_all()
            raise EmulationError(f"a {what} worker (rank {rank}) ended without printing its result")
        outs[rank] = json.loads(lines[-1])
    return outs


def run_system(rack: Rack, system: str, nbytes: int, reps: int, *, address: str | None = None,
               elements: int | None = None, slots: int | None = None, timeout: float = 1800,
               switch: "RackSwitch | None" = None, aggregator_pids: list | None = None,
               progress: bool = False) -> dict:
    """Run one all-reduce system on every worker of the rack; return the
    per-repetition time (slowest worker), the results' checksums, the
    bytes each worker's interface moved per all-reduce, and CPU-seconds per
    GB of buffer: each worker's over its timed all-reduces (averaged), and
    the aggregator's (``aggregator_pids`` and their children) over the
    whole run, joins and barriers included. ``progress``: rank 0 prints a
    line per repetition as it goes."""
    from aggnet.bench.cpu import per_gb, tree_cpu_seconds

    world = len(rack.workers)
    if switch is not None:
        address = switch.address
        slots = slots or BMV2_SLOTS
    env = {"AGGNET_ADDRESS": address or aggregator_address(rack), "AGGNET_TIMEOUT": "120",
           "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}
    if elements is not None:
        env["AGGNET_ELEMENTS"] = str(elements)
    if slots is not None:
        env["AGGNET_SLOTS"] = str(slots)
    job = f"rack-{uuid.uuid4().hex[:8]}"
    if switch is not None and system == "aggnet":
        switch.install(job, slots)
    before = rack.counters()
    agg0 = tree_cpu_seconds(aggregator_pids) if aggregator_pids and system != "gloo" else None
    procs = []
    for rank, h in enumerate(rack.workers):
        cmd = [sys.executable, "-m", "aggnet.emulation.worker", system, "--rank", str(rank), "--world", str(world),
               "--bytes", str(nbytes), "--reps", str(reps), "--master", f"{rack.workers[0].ip}:29500",
               "--job", job] + (["--floor", address] if system == "floor" else [])
        shown = progress and rank == 0
        procs.append(rack.popen(h, cmd + (["--progress"] if shown else []), env=env, stdout=subprocess.PIPE,
                                stderr=None if shown else subprocess.PIPE, text=True))
    outs = collect(procs, timeout, f"{system} all-reduce")
    agg_cpu = tree_cpu_seconds(aggregator_pids) - agg0 if agg0 is not None else None
    after = rack.counters()
    if switch is not None and system == "aggnet":
        switch.remove(job)
    times = [max(o["times"][i] for o in outs) for i in range(reps)]
    per_worker = {h: {k: (after[h][k] - before[h][k]) / reps for k in after[h]} for h in after}
    return {"system": system, "workers": world, "bytes": nbytes, "times": times,
            "median_s": statistics.median(times), "checksums": [o["checksums"] for o in outs],
            "per_worker": per_worker, "client_stats": [o["stats"] for o in outs],
            "worker_cpu_s_per_gb": per_gb(sum(o["cpu_s"] for o in outs) / world, nbytes, reps),
            "aggregator_cpu_s_per_gb": None if agg_cpu is None else per_gb(agg_cpu, nbytes, reps)}


def run_ddp_bench(rack: Rack, steps: int, width: int, systems: str = "gloo,aggnet-int32",
                  address: str | None = None, timeout: float = 3600, switch: "RackSwitch | None" = None,
                  batch: int = 8) -> list[dict]:
    """``aggnet bench-ddp``'s workers, one per namespace: DDP step time with
    the aggnet hook beside gloo's all-reduce over the rack's links."""
    from aggnet.bench.ddp import summarize

    world = len(rack.workers)
    if switch is not None:
        # each DDP model agrees a fresh job name over its process group; a
        # P4 switch serves only jobs its control plane installed beforehand
        raise EmulationError("bench-ddp runs against the aggregator host (--switch host); on BMv2, whose "
                             "software pipeline moves a few thousand packets/s, use `aggnet emulate demo`")
    procs = []
    for rank, h in enumerate(rack.workers):
        env = {"AGGNET_ADDRESS": address or aggregator_address(rack), "AGGNET_TIMEOUT": "300",
               "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "aggnet.bench.ddp", "--rank", str(rank), "--world", str(world),
               "--master", f"{rack.workers[0].ip}:29502", "--steps", str(steps), "--width", str(width),
               "--systems", systems, "--batch", str(batch)]
        # rank 0's progress (a line per system) reaches the user as it happens
        procs.append(rack.popen(h, cmd, env=env, stdout=subprocess.PIPE, text=True,
                                stderr=None if rank == 0 else subprocess.PIPE))
    recs = collect(procs, timeout, "DDP benchmark")
    got = [(rec["rank"], rec["parameters"], rec["times"], rec.get("cpu", {})) for rec in recs]
    names = [s.strip() for s in systems.split(",") if s.strip()]
    records = summarize(got, names, steps, world, batch)
    for r in records:  # each worker's client counters (retransmissions, packets) for that system
        r["client_stats"] = [rec.get("client", {}).get(r["system"]) for rec in recs]
    return records


def run_demo(rack: Rack, epochs: int, codec: str, address: str | None = None, timeout: float = 1800,
             switch: "RackSwitch | None" = None, extra: list[str] = (), on_line=None) -> list[str]:
    """The DDP demo with one worker per namespace (torchrun's environment,
    gloo rendezvous at worker 0); returns rank 0's output lines, each
    handed to ``on_line`` as it is printed (an epoch at a time)."""
    world = len(rack.workers)
    if switch is not None:
        address = switch.address
        # the demo's DDP model asks for aggnet's job name over the process
        # group; on a switch the job must exist first: name it
        extra = [*extra, "--job", "rack-demo"]
        switch.install("rack-demo", BMV2_SLOTS)
    procs = []
    for rank, h in enumerate(rack.workers):
        env = {"AGGNET_ADDRESS": address or aggregator_address(rack), "RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(world),
               "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": rack.workers[0].ip, "MASTER_PORT": "29501",
               "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}
        if switch is not None:
            env["AGGNET_SLOTS"] = str(BMV2_SLOTS)
        cmd = [sys.executable, "-m", "aggnet.demo", "--epochs", str(epochs), "--codec", codec, *extra]
        procs.append(rack.popen(h, cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    lines = follow_demo(procs, timeout, on_line, "in the rack")
    if switch is not None:
        switch.remove("rack-demo")
    return lines


def follow_demo(procs: list, timeout: float, on_line, where: str) -> list[str]:
    """Wait for the demo's workers (rank 0 first in ``procs``), handing
    rank 0's lines to ``on_line`` as they come; returns them. A worker that
    fails or a run past ``timeout`` stops them all, with the worker's
    output in the error."""
    lines: list[str] = []

    def pump() -> None:
        for line in procs[0].stdout:
            lines.append(line.rstrip("\n"))
            if on_line is not None:
                on_line(lines[-1])

    reader = threading.Thread(target=pump, name="demo-rank0-output", daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout
    for rank, p in enumerate(procs):
        try:
            if rank == 0:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
                reader.join(10)
                out = "\n".join(lines)
            else:
                out, _ = p.communicate(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise EmulationError(f"the DDP demo {where} did not finish within {timeout:g}s; rerun with fewer "
                                 f"--epochs or a larger timeout") from None
        if p.returncode != 0:
            for q in procs:
                q.kill()
            raise EmulationError(f"DDP demo worker of rank {rank} failed ({p.returncode}):\n{out[-3000:]}")
    return lines


# -- BMv2 in the ToR's place ----------------------------------------------------------

SWITCH_IP = "10.77.0.253"
SWITCH_MAC = "02:a6:6e:00:00:fe"


class RackSwitch:
    """BMv2 running the aggnet program on the ToR's ports, configured
    through the control plane CLI inside the ToR's namespace."""

    def __init__(self, rack: Rack):
        from aggnet.emulation.bmv2 import Bmv2Switch

        if rack.bridge:
            raise EmulationError("build the rack with bridge=False to put BMv2 in the ToR's place")
        self.rack = rack
        self.switch = Bmv2Switch({i: h.port for i, h in enumerate(rack.hosts)}, netns=rack.tor)
        self.address = f"udp://{SWITCH_IP}:{SWITCH_PORT}"
        try:
            self.ctl("load")
            for i, h in enumerate(rack.hosts):
                self.ctl("add-host", rack.mac(h), str(i))
                # nothing answers ARP for the switch's own address
                rack.run(h, ["ip", "neigh", "replace", SWITCH_IP, "lladdr", SWITCH_MAC, "dev", h.dev, "nud",
                             "permanent"])
            self.ctl("flood", ",".join(str(i) for i in range(len(rack.hosts))))
        except BaseException:
            self.stop()
            raise

    def ctl(self, *args: str) -> str:
        cmd = [sys.executable, "-m", "aggnet", "switch", "--switch-ip", SWITCH_IP, "--switch-mac", SWITCH_MAC, *args]
        r = self.rack.run(self.rack.tor, cmd, timeout=120, check=False)
        if r.returncode != 0:
            raise EmulationError(f"aggnet switch {' '.join(args)} failed: {r.stderr.strip()[-1500:]}")
        return r.stdout

    def install(self, job: str, slots: int = 128) -> None:
        members = [f"{h.ip},{self.rack.mac(h)},{i}" for i, h in enumerate(self.rack.workers)]
        self.ctl("add-job", job, "--slots", str(slots), *[x for m in members for x in ("--member", m)])

    def remove(self, job: str) -> None:
        self.ctl("remove-job", job)

    def counters(self) -> dict:
        return json.loads(self.ctl("counters"))

    def stop(self) -> None:
        self.switch.stop()
