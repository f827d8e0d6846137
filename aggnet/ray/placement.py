"""Where a topology's aggregators go on a Ray cluster, and the topology the
training workers then read.

Ray, not the topology, decides which machine runs which training worker,
so under Ray the topology keeps what it says of the aggregators (kinds,
ports, shards, the root above the racks) and drops what it says of ranks:
a rack is the set of Ray nodes labeled ``aggnet.io/rack=NAME``
(``ray start --labels aggnet.io/rack=rack0``), its aggregator runs on one
of them, and its members are the training workers Ray placed there. The
root runs on a node labeled ``aggnet.io/root=true``, or on the driver's
node where none is. Each aggregator listens at its topology address with
the host replaced by its node's IP, since only Ray knows the node.

Nothing here imports Ray: the actors (:mod:`aggnet.ray.actors`) and the
Ray Train backend (:mod:`aggnet.ray.train`) call it with what Ray told them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from aggnet.protocol.address import parse
from aggnet.protocol.topology import Aggregator, Topology, TopologyError, loads

#: the node label naming the rack a Ray node is in
RACK_LABEL = "aggnet.io/rack"
#: the node label (value "true") of the node the root aggregator goes on
ROOT_LABEL = "aggnet.io/root"


@dataclass(frozen=True)
class Role:
    """One aggregator to run as an actor."""

    name: str  #: "root", "rack NAME" or "fallback NAME"
    aggregator: Aggregator
    rack: str | None  #: the rack's name (None: the root)
    rack_index: int = 0

    @property
    def selector(self) -> dict:
        """The Ray label selector of the node it runs on."""
        if self.rack is None:
            return {ROOT_LABEL: "true"}
        return {RACK_LABEL: self.rack}


def roles(topo: Topology) -> list[Role]:
    """The topology's aggregators in start order (the root first: the racks
    are told its address), refusing what is not a process."""
    out = []
    if topo.root is not None and len(topo.racks) > 1:
        _runnable(topo.root, "the root")
        out.append(Role("root", topo.root, None))
    for rack in topo.racks:
        _runnable(rack.aggregator, f"rack {rack.name!r}")
        out.append(Role(f"rack {rack.name}", rack.aggregator, rack.name, rack.index))
        if rack.fallback is not None:
            _runnable(rack.fallback, f"the fallback of rack {rack.name!r}")
            out.append(Role(f"fallback {rack.name}", rack.fallback, rack.name, rack.index))
    return out


def _runnable(agg: Aggregator, what: str) -> None:
    if agg.kind == "p4":
        raise TopologyError(f"{agg.where}: {what} is a P4 switch, which is not a Ray actor; install its jobs with "
                            f"'aggnet switch' and run only host aggregators under Ray")
    a = parse(agg.address)
    if a.is_local_only:
        raise TopologyError(f"{agg.where}: {what} listens at {agg.address}, which only its own machine reaches; "
                            f"give it a tcp, zmq+tcp, ucx or udp address")


def on_node(address: str, ip: str) -> str:
    """``address`` with its host replaced by the node's ``ip``."""
    a = parse(address)
    return str(replace(a, host=ip))


def missing_labels(needed: list[Role], nodes: list[dict]) -> list[str]:
    """The rack labels no live node carries, as ``ray start --labels``
    arguments (``nodes``: each node's labels)."""
    have = {(k, v) for labels in nodes for k, v in labels.items()}
    out = []
    for role in needed:
        if role.rack is not None and (RACK_LABEL, role.rack) not in have:
            out.append(f"{RACK_LABEL}={role.rack}")
    return sorted(set(out))


def worker_topology(topo: Topology, addresses: dict[str, str], worker_racks: list[str | None]) -> str:
    """The topology text the training workers read (``AGGNET_TOPOLOGY``):
    each rack's ranks are the workers Ray placed on its nodes
    (``worker_racks[rank]``), each aggregator at the address its actor
    listens at (``addresses``, by role name)."""
    names = [r.name for r in topo.racks]
    for rank, rack in enumerate(worker_racks):
        if rack is None:
            raise TopologyError(f"Ray placed training worker {rank} on a node without the {RACK_LABEL} label; label "
                                f"every node that runs training workers (ray start --labels {RACK_LABEL}=NAME) or "
                                f"keep workers off the others (ScalingConfig(label_selector=...))")
        if rack not in names:
            raise TopologyError(f"Ray placed training worker {rank} on a node of rack {rack!r}, which "
                                f"{topo.source} does not have (racks: {', '.join(names)}); add the rack or relabel "
                                f"the node")
    lines = [f"job = {_q(topo.job)}", ""]
    if topo.root is not None and len(topo.racks) > 1:
        lines += ["[root]", *_aggregator_lines(topo.root, addresses["root"]), ""]
    for rack in topo.racks:
        ranks = [rank for rank, name in enumerate(worker_racks) if name == rack.name]
        if not ranks:
            raise TopologyError(f"rack {rack.name!r} has no training worker: its aggregator would wait for it "
                                f"forever; place workers on the nodes labeled {RACK_LABEL}={rack.name} or drop the "
                                f"rack from {topo.source}")
        lines += ["[[racks]]", f"name = {_q(rack.name)}", f"ranks = {_q(','.join(map(str, ranks)))}",
                  "[racks.aggregator]", *_aggregator_lines(rack.aggregator, addresses[f"rack {rack.name}"])]
        if rack.fallback is not None:
            lines += ["[racks.fallback]", *_aggregator_lines(rack.fallback, addresses[f"fallback {rack.name}"])]
        lines.append("")
    text = "\n".join(lines)
    loads(text, f"the Ray workers' topology from {topo.source}")  # fails here, not in every worker
    return text


def _aggregator_lines(agg: Aggregator, address: str) -> list[str]:
    lines = [f"kind = {_q(agg.kind)}", f"address = {_q(address)}"]
    for name in ("shards", "pool", "elements", "slots"):
        value = getattr(agg, name)
        if value is not None:
            lines.append(f"{name} = {int(value)}")
    return lines


def _q(text: str) -> str:
    # a TOML basic string is a JSON string for everything a name holds
    return json.dumps(str(text))


__all__ = ["RACK_LABEL", "ROOT_LABEL", "Role", "roles", "on_node", "missing_labels", "worker_topology"]
