"""A topology's aggregators as Ray actors: placed on their racks' nodes,
restarted by Ray when they die.

Each actor runs ``aggnet serve`` as a child that stops when the actor's
process is gone (``--parent-pid``), with ``--restart`` so a dead shard is
replaced inside the service. When the actor itself dies, Ray starts it
again on a node with the same label; on the same node it listens at the
same address, and the workers' all-reduces in flight resume there as they
do after a shard restart (docs/protocol.md, "a shard that restarts"). On
another node the address changes, and the workers learn it when Ray Train
restarts them (``FailureConfig``).
"""

from __future__ import annotations

import os
import time

from aggnet.protocol import topology as topo_mod
from aggnet.ray.placement import ROOT_LABEL, Role, missing_labels, on_node, roles, worker_topology

#: seconds an actor waits for its service (and for the port a previous
#: incarnation of it may still hold while it stops)
START_TIMEOUT = 120.0


class AggregatorActor:
    """One aggregator (made a Ray actor by :class:`Aggregators`)."""

    def __init__(self, role: str, listen: str, args: list[str], start_timeout: float = START_TIMEOUT):
        import ray

        from aggnet.errors import AggregatorUnreachable
        from aggnet.processes import ServiceProcess

        self.role = role
        self.listen = on_node(listen, ray.util.get_node_ip_address())
        self.node_id = ray.get_runtime_context().get_node_id()
        deadline = time.monotonic() + start_timeout
        while True:
            try:
                self._service = ServiceProcess(self.listen, parent_pid=os.getpid(), args=args,
                                               start_timeout=max(1.0, deadline - time.monotonic()))
                break
            except AggregatorUnreachable:
                # a previous incarnation's service stops once it sees its
                # actor gone, and frees the ports then
                if time.monotonic() >= deadline:
                    raise AggregatorUnreachable(
                        f"{role}: aggnet serve did not start at {self.listen} within {start_timeout:g}s; "
                        f"its log is in this actor's Ray log") from None
                time.sleep(0.5)

    def address(self) -> str:
        return self._service.address

    def where(self) -> dict:
        """Where it runs: node, address, the actor's and the service's pids."""
        return {"role": self.role, "node_id": self.node_id, "address": self._service.address,
                "pid": os.getpid(), "service_pid": self._service.pid, "alive": self._service.alive()}

    def stats(self, timeout: float = 5.0) -> dict:
        from aggnet.client.stats import query

        return query(self._service.address, timeout=timeout)

    def stop(self) -> int | None:
        return self._service.stop()


def require_ray():
    """Ray, or an error that says how to get it."""
    try:
        import ray
    except ImportError:
        raise ImportError("aggnet.ray needs Ray Train: pip install 'aggnet[ray]'") from None
    return ray


class Aggregators:
    """The aggregators of ``topology`` (a path, TOML text or a Topology)
    running as Ray actors on the connected Ray cluster.

    ``cpus_per_shard``: the logical CPUs each shard reserves (a shard keeps
    a core busy while it sums); ``max_restarts``: how often Ray restarts
    a dead aggregator (-1: always)."""

    def __init__(self, topology, *, cpus_per_shard: float = 1.0, max_restarts: int = -1,
                 start_timeout: float = START_TIMEOUT):
        ray = require_ray()
        if not ray.is_initialized():
            raise RuntimeError("aggnet.ray.Aggregators needs a Ray cluster: call ray.init() first")
        self.topology = topo_mod.load(topology)
        self.roles = roles(self.topology)
        live = [n for n in ray.nodes() if n.get("Alive")]
        missing = missing_labels(self.roles, [n.get("Labels") or {} for n in live])
        if missing:
            raise topo_mod.TopologyError(
                f"{self.topology.source}: no live Ray node is labeled {', '.join(missing)}; start each rack's "
                f"nodes with ray start --labels {missing[0]} (or Cluster.add_node(labels=...))")
        has_root_node = any((n.get("Labels") or {}).get(ROOT_LABEL) == "true" for n in live)
        self.actors: dict[str, object] = {}
        #: the roles whose service answered once
        self._serving: set[str] = set()
        addresses: dict[str, str] = {}
        try:
            for role in self.roles:
                self.actors[role.name] = self._start(role, addresses, cpus_per_shard, max_restarts, start_timeout,
                                                     has_root_node)
                try:
                    addresses[role.name] = ray.get(self.actors[role.name].address.remote(), timeout=start_timeout)
                    self._serving.add(role.name)
                except ray.exceptions.GetTimeoutError:
                    cpus = cpus_per_shard * (role.aggregator.shards or 1)
                    where = (f"a node labeled {role.selector}" if role.rack is not None or has_root_node
                             else "the driver's node")
                    raise TimeoutError(
                        f"{role.name}: no Ray node took its aggregator within {start_timeout:g}s; it asks for "
                        f"{cpus:g} CPU(s) on {where}: free them, or pass a smaller cpus_per_shard") from None
        except BaseException:
            self.stop()
            raise

    def _start(self, role: Role, addresses: dict, cpus_per_shard: float, max_restarts: int, start_timeout: float,
               has_root_node: bool):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        agg = role.aggregator
        parent = None
        if role.rack is not None and "root" in addresses:
            from dataclasses import replace

            parent = replace(self.topology.root, address=addresses["root"])
        argv = agg.serve_argv(parent, role.rack_index, len(self.topology.racks))
        # ["serve", "--listen", ADDRESS, *rest]: the actor listens on its node;
        # a service replaces a dead shard itself
        args = [*argv[3:], *(["--restart"] if agg.kind == "service" else [])]
        options = {"num_cpus": cpus_per_shard * (agg.shards or 1), "max_restarts": max_restarts,
                   "max_task_retries": -1 if max_restarts != 0 else 0}
        if role.rack is not None or has_root_node:
            options["label_selector"] = role.selector
        else:  # the root goes on the driver's node
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                ray.get_runtime_context().get_node_id(), soft=False)
        actor_cls = ray.remote(AggregatorActor)
        return actor_cls.options(**options).remote(role.name, agg.address, args, start_timeout)

    def addresses(self, timeout: float = START_TIMEOUT) -> dict[str, str]:
        """Each aggregator's address now (waiting for one Ray is restarting)."""
        import ray

        names = list(self.actors)
        return dict(zip(names, ray.get([self.actors[n].address.remote() for n in names], timeout=timeout)))

    def where(self, role: str, timeout: float = START_TIMEOUT) -> dict:
        import ray

        return ray.get(self._actor(role).where.remote(), timeout=timeout)

    def stats(self, role: str, timeout: float = START_TIMEOUT) -> dict:
        import ray

        return ray.get(self._actor(role).stats.remote(), timeout=timeout)

    def _actor(self, role: str):
        try:
            return self.actors[role]
        except KeyError:
            raise KeyError(f"no aggregator {role!r}; there are: {', '.join(self.actors)}") from None

    def worker_topology(self, worker_racks: list[str | None]) -> str:
        """The topology the training workers read, for workers on the racks
        ``worker_racks`` (one per rank)."""
        return worker_topology(self.topology, self.addresses(), worker_racks)

    def torch_config(self, **kwargs):
        """A Ray Train ``TorchConfig`` training through these aggregators."""
        from aggnet.ray.train import AggnetTorchConfig

        return AggnetTorchConfig(aggregators=self, **kwargs)

    def stop(self) -> None:
        """Stop every aggregator (their services first, then the actors)."""
        import ray

        for role, actor in self.actors.items():
            if role in self._serving:  # one never placed has nothing to stop
                try:
                    ray.get(actor.stop.remote(), timeout=30)
                except Exception:  # noqa: BLE001 - dead already, or Ray is going
                    pass
            ray.kill(actor, no_restart=True)
        self.actors = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


__all__ = ["Aggregators", "AggregatorActor", "START_TIMEOUT", "require_ray"]
