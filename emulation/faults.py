"""Faults on an emulated fabric (``emulation.fabric``), injected while
training or all-reduces run: a worker's cable pulled for a while, a burst
of loss on a rack's spine link, an aggregator shard killed. Each undoes
itself (the cable goes back in, the burst ends, ``aggnet serve --restart``
starts a successor) and says what it did and what the kernel or the
aggregator counted, so a chaos run can show every fault in its report.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field

from aggnet.emulation.fabric import Fabric
from aggnet.emulation.netns import EmulationError, sh


@dataclass
class Fault:
    """One injected fault: what, when (monotonic), for how long, and what
    was counted while it lasted."""

    what: str
    at: float
    seconds: float
    counted: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"what": self.what, "at": self.at, "seconds": round(self.seconds, 3), "counted": self.counted}


def _hold(seconds: float, stop: threading.Event | None) -> None:
    if stop is None:
        time.sleep(seconds)
    else:
        stop.wait(seconds)


def pull_cable(fabric: Fabric, rank: int, seconds: float, stop: threading.Event | None = None) -> Fault:
    """Worker ``rank``'s cable out of its ToR for ``seconds``: the ToR's end
    of its veth goes down, so the worker sees no carrier and keeps its
    addresses and routes, as with a real cable; then it goes back in."""
    _, rack, host = fabric.workers[rank]
    carrier = f"/sys/class/net/{host.dev}/carrier_changes"
    before = int(sh("cat", carrier, ns=host.name).stdout)
    t0 = time.monotonic()
    sh("ip", "link", "set", host.port, "down", ns=rack.tor)
    try:
        _hold(seconds, stop)
    finally:
        sh("ip", "link", "set", host.port, "up", ns=rack.tor)
    held = time.monotonic() - t0
    return Fault(f"worker {rank}'s link down", t0, held,
                 {"carrier_changes": int(sh("cat", carrier, ns=host.name).stdout) - before})


def loss_burst(fabric: Fabric, rack: int, drop: float, seconds: float, stop: threading.Event | None = None) -> Fault:
    """Random loss of ``drop`` of every packet (the service's TCP, switch
    mode's datagrams, gloo's ring alike) both ways on rack ``rack``'s link
    to the spine, for ``seconds``: a flapping optic, a congested spine."""
    if not 0 < drop < 1:
        raise ValueError(f"drop must be a fraction between 0 and 1, got {drop}")
    dev = fabric.uplink(rack)
    # what crosses racks is forwarded; what goes to the root on the spine is the spine's own
    rules = [("FORWARD", "-i"), ("FORWARD", "-o"), ("INPUT", "-i"), ("OUTPUT", "-o")]
    match = ["-m", "statistic", "--mode", "random", "--probability", f"{drop:.6f}", "-j", "DROP"]
    t0 = time.monotonic()
    added = []
    try:
        for chain, way in rules:
            sh("iptables", "-I", chain, "1", way, dev, *match, ns=fabric.spine)
            added.append((chain, way))
        _hold(seconds, stop)
    finally:
        dropped = _dropped(fabric, dev)
        for chain, way in added:
            sh("iptables", "-D", chain, way, dev, *match, ns=fabric.spine, check=False)
    return Fault(f"{drop:.0%} loss on rack {rack}'s spine link", t0, time.monotonic() - t0,
                 {"packets_dropped": dropped})


def _dropped(fabric: Fabric, dev: str) -> int:
    """Packets the statistic rules on ``dev`` dropped so far."""
    out = sh("iptables", "-L", "-v", "-n", "-x", ns=fabric.spine, check=False).stdout
    total = 0
    for line in out.splitlines():
        parts = line.split()
        if len(parts) > 7 and parts[2] == "DROP" and "statistic" in line and dev in parts[5:7]:
            total += int(parts[0])
    return total


def kill_shard(fabric: Fabric, rack: int | None, shard: int, timeout: float = 60.0) -> Fault:
    """SIGKILL shard ``shard`` of rack ``rack``'s aggregator (None: the
    root), started with ``--restart``, and wait until its successor serves."""
    what = "root" if rack is None else f"rack {rack}"
    stats = fabric.stats(rack)
    shards = stats.get("shards") or []
    if shard >= len(shards) or shards[shard] is None or stats.get("restarts") is None:
        raise EmulationError(f"the {what} aggregator has no restartable shard {shard} (a service started with "
                             f"--restart has; switch mode restarts none)")
    pid, restarts = shards[shard]["pid"], stats["restarts"]
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    deadline = t0 + timeout
    while time.monotonic() < deadline:
        s = fabric.stats(rack)
        if s["restarts"] > restarts and s["shards"][shard] is not None and s["shards"][shard]["pid"] != pid:
            return Fault(f"{what} shard {shard} killed", t0, time.monotonic() - t0,
                         {"pid": pid, "successor": s["shards"][shard]["pid"], "restarts": s["restarts"]})
        time.sleep(0.1)
    raise EmulationError(f"{what} shard {shard} (pid {pid}) was killed and no successor served within {timeout:g}s")


__all__ = ["Fault", "pull_cable", "loss_burst", "kill_shard"]
