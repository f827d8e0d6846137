"""What a multi-rack emulation builds, decided once from a topology file.

A topology file names real machines and their addresses; an emulation
runs the same shape (racks, workers per rack, aggregator kinds, the root,
link rates) on addresses of its own. The plan is that translation: both
the namespace fabric (emulation.fabric) and the Mininet script
(emulation.mininet_topo, which runs under another interpreter and reads
the plan as JSON from ``python -m aggnet.emulation.fabric_plan``) build
from it, and the workers find their aggregators in the topology file the
plan writes with the emulated addresses.

Addresses: rack ``i`` is ``10.77.<i+1>.0/24``, its workers ``.1`` up, its
aggregator host ``.254`` (a P4 rack's switch ``.253``, MAC
``02:a6:6e:00:<i+1>:fe``); the spine routes between racks from ``.250``
of every rack and holds the root at ``10.77.0.1``. A P4 rack's fallback
is not emulated: its switch is always there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass

from aggnet.protocol.address import parse
from aggnet.protocol.topology import Aggregator, Topology, TopologyError, load

ROOT_IP = "10.77.0.1"
GATEWAY_HOST = 250
AGGREGATOR_HOST = 254
DEFAULT_MTU = 9000
#: a P4 rack's switch: BMv2 in the ToR's place, at this host number of the rack
SWITCH_HOST = 253
#: an emulated switch's slots per job where the file gives none (and a
#: single BMv2 rack's, emulation.rack_runs). BMv2 sums
#: about 1,000 packets a second: a worker's window of 128 slots (a real
#: switch's default) would queue there past the largest retransmission
#: timeout (limits.RTO_MAX), and every packet would go twice or more
BMV2_SLOTS = 16


class PlanError(ValueError):
    """A topology (or an override) the emulation cannot build; says why and what to change."""


def rack_subnet(index: int) -> str:
    return f"10.77.{index + 1}"


@dataclass(frozen=True)
class RackPlan:
    index: int
    name: str
    workers: int
    first_rank: int
    #: the file's aggregator, its address replaced by the emulated one
    aggregator: Aggregator

    @property
    def subnet(self) -> str:
        return rack_subnet(self.index)

    @property
    def gateway_ip(self) -> str:
        return f"{self.subnet}.{GATEWAY_HOST}"

    @property
    def aggregator_ip(self) -> str:
        return f"{self.subnet}.{AGGREGATOR_HOST}"

    def worker_ip(self, j: int) -> str:
        return f"{self.subnet}.{j + 1}"

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.workers)


@dataclass(frozen=True)
class Plan:
    racks: tuple
    #: None: one rack, nothing above it
    root: Aggregator | None
    job: str
    host_mbit: float | None
    uplink_mbit: float | None
    mtu: int
    source: str

    @property
    def world(self) -> int:
        return sum(r.workers for r in self.racks)

    @property
    def shape(self) -> str:
        sizes = {r.workers for r in self.racks}
        per = f"{sizes.pop()} workers" if len(sizes) == 1 else "workers " + "+".join(str(r.workers) for r in self.racks)
        return f"{len(self.racks)} rack(s) x {per}"

    def serve_args(self, rack: RackPlan | None) -> list[str]:
        """``aggnet serve`` arguments of a rack's aggregator (None: the
        root), past ``--listen ADDRESS``."""
        argv = (self.root.serve_argv() if rack is None
                else rack.aggregator.serve_argv(self.root, rack.index, len(self.racks)))
        return argv[3:]

    def topology_toml(self, names: "Names") -> str:
        """The topology with the emulated addresses and host names, for the
        workers (``Client(topology=...)``, ``AGGNET_TOPOLOGY``)."""
        q = json.dumps
        out = [f"# {self.source} as emulated: addresses and hosts of the emulation", f"job = {q(self.job)}", ""]
        links = {"host_mbit": self.host_mbit, "uplink_mbit": self.uplink_mbit, "mtu": self.mtu}
        out.append("[links]")
        out += [f"{k} = {v:g}" if isinstance(v, float) else f"{k} = {v}" for k, v in links.items() if v is not None]
        out += ["", "[hosts]"]
        for r in self.racks:
            out += [f"{q(names.worker(r.index, j))} = {{ ip = {q(r.worker_ip(j))} }}" for j in range(r.workers)]
        if self.root is not None:
            out += ["", "[root]", *_aggregator_lines(self.root, names.spine())]
        for r in self.racks:
            hosts = ", ".join(q(names.worker(r.index, j)) for j in range(r.workers))
            out += ["", "[[racks]]", f"name = {q(r.name)}", f"hosts = [{hosts}]", "[racks.aggregator]",
                    *_aggregator_lines(r.aggregator, names.aggregator(r.index))]
        return "\n".join(out) + "\n"

    def to_json(self, names: "Names") -> dict:
        """Everything another builder (Mininet) needs, spelled out."""
        return {
            "job": self.job, "world": self.world, "mtu": self.mtu,
            "host_mbit": self.host_mbit, "uplink_mbit": self.uplink_mbit,
            "root": None if self.root is None else {
                "host": names.spine(), "ip": ROOT_IP, "address": self.root.address, "kind": self.root.kind,
                "serve": self.serve_args(None)},
            "racks": [{
                "name": r.name, "subnet": r.subnet, "gateway": r.gateway_ip, "switch": names.tor(r.index),
                "aggregator": {"host": names.aggregator(r.index), "ip": r.aggregator_ip, "kind": r.aggregator.kind,
                               "address": r.aggregator.address, "serve": self.serve_args(r)},
                "workers": [{"host": names.worker(r.index, j), "ip": r.worker_ip(j), "rank": r.first_rank + j}
                            for j in range(r.workers)],
            } for r in self.racks],
            "topology": self.topology_toml(names),
        }


def _aggregator_lines(agg: Aggregator, host: str) -> list[str]:
    lines = [f"kind = {json.dumps(agg.kind)}", f"host = {json.dumps(host)}", f"address = {json.dumps(agg.address)}"]
    for key in ("shards", "pool", "elements", "slots", "uplink_port"):
        if getattr(agg, key) is not None:
            lines.append(f"{key} = {getattr(agg, key)}")
    if agg.kind == "p4":
        lines += [f"p4runtime = {json.dumps(agg.p4runtime)}", f"ports = {list(agg.ports)}",
                  f"switch_ip = {json.dumps(agg.switch_ip)}", f"switch_mac = {json.dumps(agg.switch_mac)}"]
    return lines


@dataclass(frozen=True)
class Names:
    """Host names of a builder: namespaces (``agf0-w1``) or Mininet nodes
    (``a0w1``), from one prefix."""

    prefix: str = "agf"
    style: str = "netns"  #: netns | mininet

    def worker(self, rack: int, j: int) -> str:
        return f"{self.prefix}{rack}-w{j}" if self.style == "netns" else f"{self.prefix}{rack}w{j}"

    def aggregator(self, rack: int) -> str:
        return f"{self.prefix}{rack}-agg" if self.style == "netns" else f"{self.prefix}{rack}agg"

    def tor(self, rack: int) -> str:
        return f"{self.prefix}{rack}-tor" if self.style == "netns" else f"{self.prefix}{rack}s"

    def spine(self) -> str:
        return f"{self.prefix}-spine" if self.style == "netns" else f"{self.prefix}spine"


def _moved(agg: Aggregator, ip: str) -> Aggregator:
    """``agg`` at ``ip``, on the port (and scheme) its file gave it."""
    a = parse(agg.address)
    return dataclasses.replace(agg, address=f"{a.scheme}://{ip}:{a.port}", host=None)


def switch_mac(index: int) -> str:
    """The MAC of rack ``index``'s P4 switch (its results come from it)."""
    return f"02:a6:6e:00:{index + 1:02x}:fe"


def _switch(agg: Aggregator, index: int, workers: int) -> Aggregator:
    """A P4 rack's switch as emulated: BMv2 in the ToR's namespace, its
    workers on ports 0..W-1 and the uplink on port W."""
    ip = f"{rack_subnet(index)}.{SWITCH_HOST}"
    return dataclasses.replace(_moved(agg, ip), p4runtime="127.0.0.1:9559", ports=tuple(range(workers)),
                               uplink_port=workers, switch_ip=ip, switch_mac=switch_mac(index), thrift_port=9090,
                               slots=agg.slots or BMV2_SLOTS)


def plan(topology, *, racks: int | None = None, workers: int | None = None, host_mbit: float | None = None,
         uplink_mbit: float | None = None, mtu: int | None = None) -> Plan:
    """The emulation of ``topology`` (a path or a loaded one). ``racks`` and
    ``workers`` replace its shape (rack ``i`` takes the aggregator of the
    file's rack ``i`` modulo their number); the rates replace [links]
    (0: unshaped)."""
    topo: Topology = load(topology)
    if racks is not None and not 1 <= racks <= 32:
        raise PlanError(f"--racks must be 1 to 32 (a root takes at most 32 racks), got {racks}")
    if workers is not None and not 1 <= workers <= 32:
        raise PlanError(f"--workers must be 1 to 32 per rack, got {workers}")
    n = len(topo.racks) if racks is None else racks
    if n > 1 and topo.root is None:
        raise PlanError(f"{topo.source} has one rack and no [root]; {n} racks need one: add a [root] table "
                        f"(kind = \"host-switch\")")
    out, rank = [], 0
    for i in range(n):
        src = topo.racks[i % len(topo.racks)]
        name = src.name if racks is None else f"rack{i}"
        w = src.members if workers is None else workers
        if w > 32:
            raise PlanError(f"rack {name!r} has {w} workers; an emulated rack holds at most 32")
        if src.aggregator.kind == "p4":
            agg = _switch(src.aggregator, i, w)
        else:
            agg = _moved(src.aggregator, rack_subnet(i) + f".{AGGREGATOR_HOST}")
        out.append(RackPlan(i, name, w, rank, agg))
        rank += w
    root = _moved(topo.root, ROOT_IP) if n > 1 else None
    links = topo.links

    def rate(override, value):
        chosen = value if override is None else override
        return float(chosen) if chosen else None

    return Plan(tuple(out), root, topo.job, rate(host_mbit, links.host_mbit), rate(uplink_mbit, links.uplink_mbit),
                mtu or links.mtu or DEFAULT_MTU, topo.source)


def main(argv=None) -> int:
    """Print a topology's emulation plan as JSON (the Mininet script,
    running under an interpreter without aggnet, reads it)."""
    p = argparse.ArgumentParser(prog="python -m aggnet.emulation.fabric_plan")
    p.add_argument("topology")
    p.add_argument("--racks", type=int, default=None)
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--host-mbit", type=float, default=None)
    p.add_argument("--uplink-mbit", type=float, default=None)
    p.add_argument("--mtu", type=int, default=None)
    p.add_argument("--prefix", default="a")
    p.add_argument("--style", choices=["netns", "mininet"], default="mininet")
    args = p.parse_args(argv)
    try:
        pl = plan(args.topology, racks=args.racks, workers=args.workers, host_mbit=args.host_mbit,
                  uplink_mbit=args.uplink_mbit, mtu=args.mtu)
    except (TopologyError, PlanError) as exc:
        print(f"aggnet emulation plan: {exc}", file=sys.stderr)
        return 2
    p4 = [r.name for r in pl.racks if r.aggregator.kind == "p4"]
    if p4:
        print(f"aggnet emulation plan: P4 racks ({', '.join(p4)}) are emulated in network namespaces (`aggnet "
              f"emulate --topology FILE`), not in Mininet", file=sys.stderr)
        return 2
    json.dump(pl.to_json(Names(args.prefix, args.style)), sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
