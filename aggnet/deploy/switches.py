"""A topology's job on its P4 switches, for ``aggnet up`` and ``down``.

A switch is a shared device: ``up`` adds the job where it is missing and
never touches one already there, ``down`` removes only what ``up``
recorded. A switch whose control plane does not answer is not an error of
the run: the rack's workers go to its fallback, so the run says so and
goes on. The pipeline itself (and ordinary forwarding) is the switch's
own set-up (``aggnet switch load``), not the job's. Under a root, the
control plane joins the job at the root for the switch too
(aggnet/p4/parent.py); a root that does not take it leaves the job off
the switch, and a run of ``up`` with the job already there joins again
(a restarted root forgot it).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from dataclasses import dataclass

from aggnet.protocol.address import parse
from aggnet.protocol.topology import Rack, Topology

#: the P4 switch's own address when the topology names none
DEFAULT_SWITCH_MAC = "02:a6:6e:00:00:fe"
DEFAULT_SLOTS = 128


@dataclass
class Outcome:
    state: str  #: for the summary table
    detail: str = ""  #: one line for the user, if any
    record: dict | None = None  #: what ``down`` needs to remove the job
    failed: bool = False  #: the topology file must change


def _fallback_text(rack: Rack) -> str:
    if rack.fallback is None:
        return f"rack {rack.name!r} has no fallback: its workers cannot run until the switch is back"
    return f"the workers of rack {rack.name!r} will use its fallback {rack.fallback.address}"


def _reachable(p4runtime: str, timeout: float) -> str | None:
    """None when something accepts connections at ``p4runtime``, else why
    not; a dead switch is found here rather than in gRPC's retries."""
    host, port = p4runtime.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout).close()
    except OSError as exc:
        return str(exc.strerror or exc) if not isinstance(exc, TimeoutError) else f"no answer within {timeout:g}s"
    return None


def _ip_of(address: str) -> str:
    host = parse(address).host
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        return socket.gethostbyname(host)


def members_and_uplink(topo: Topology, rack: Rack):
    """(members, uplink) of the rack's job, or raise ValueError naming what
    the topology file lacks."""
    from aggnet.p4.control import Member, Uplink

    agg = rack.aggregator
    if any(h is None for h in rack.hosts):
        raise ValueError(f"rack {rack.name!r} lists ranks, not hosts: a P4 switch admits workers by address, so "
                         f"list its hosts (hosts = [...]) with their ip and mac under [hosts]")
    if len(agg.ports) != rack.members:
        raise ValueError(f"rack {rack.name!r}: give its switch's ports = [...], one per worker in rank order")
    members = []
    for host, port in zip(rack.hosts, agg.ports):
        info = topo.hosts.get(host, {})
        if not info.get("ip") or not info.get("mac"):
            raise ValueError(f"the switch of rack {rack.name!r} needs host {host!r}'s address: add "
                             f"{host} = {{ ip = \"...\", mac = \"...\" }} under [hosts]")
        members.append(Member(info["ip"], info["mac"], port))
    uplink = None
    parent = topo.parent_of(rack)
    if parent is not None:
        if agg.uplink_port is None:
            raise ValueError(f"rack {rack.name!r}: its switch needs uplink_port = N, the port toward the root")
        try:
            parent_ip = _ip_of(parent.address)
        except OSError as exc:
            raise ValueError(f"cannot resolve the root's address {parent.address}: {exc}") from None
        info = topo.hosts.get(parent.host or "", {})
        mac = info.get("mac") or next((i.get("mac") for i in topo.hosts.values() if i.get("ip") == parent_ip), None)
        if not mac:
            name = parent.host or "root"
            raise ValueError(f"the switch of rack {rack.name!r} sends to the root at {parent_ip} and needs its MAC "
                             f"(or its router's): add {name} = {{ ip = \"{parent_ip}\", mac = \"...\" }} under "
                             f"[hosts]")
        uplink = Uplink(parent_ip, mac, agg.uplink_port, rack.index)
    return members, uplink


def _at_parent(topo: Topology, rack: Rack):
    """How the control plane joins the rack's job at its root for the
    switch (None without a root); raises ValueError naming what is wrong."""
    from aggnet.p4.parent import RackAtParent

    parent = topo.parent_of(rack)
    if parent is None:
        return None
    agg = rack.aggregator
    at = RackAtParent(parent.address, rack.index, len(topo.racks), agg.switch_ip or _ip_of(agg.address))
    at.check()
    return at


def _control(rack: Rack):
    from aggnet.p4.control import SwitchControl

    agg = rack.aggregator
    return SwitchControl(agg.p4runtime, agg.device_id, switch_ip=agg.switch_ip or _ip_of(agg.address),
                         switch_mac=agg.switch_mac or DEFAULT_SWITCH_MAC, thrift_port=agg.thrift_port,
                         thrift_host=agg.p4runtime.rsplit(":", 1)[0])


def _quiet_grpc():
    """p4runtime-shell logs its gRPC failures as CRITICAL on the root
    logger; the one line ``up`` prints says it better."""
    root = logging.getLogger()
    old = root.level
    root.setLevel(logging.CRITICAL + 1)
    return root, old


def _have_shell() -> bool:
    try:
        import p4runtime_sh.shell  # noqa: F401
    except ImportError:
        return False
    return True


def install(topo: Topology, rack: Rack, *, dry_run: bool = False, timeout: float = 5.0) -> Outcome:
    """Install the topology's job on the rack's switch unless it is there."""
    from aggnet.protocol.wire import job_id_of

    agg = rack.aggregator
    try:
        members, uplink = members_and_uplink(topo, rack)
        at_parent = _at_parent(topo, rack)
    except ValueError as exc:
        return Outcome("not installed: the topology lacks what the switch needs",
                       f"{exc}; until then {_fallback_text(rack)}", failed=True)
    if dry_run:
        return Outcome(f"would install on the switch at {agg.p4runtime}")
    if not _have_shell():
        return Outcome("not installed: no p4runtime-shell",
                       f"the switch's control plane needs p4runtime-shell (pip install 'aggnet[p4]'): the job is "
                       f"not installed on {agg.p4runtime}; {_fallback_text(rack)}")
    why = _reachable(agg.p4runtime, timeout)
    if why is not None:
        return Outcome("switch unreachable", f"the switch of rack {rack.name!r} does not answer at {agg.p4runtime} "
                                             f"({why}); {_fallback_text(rack)}")
    from aggnet.p4.control import SwitchControlError

    from aggnet.p4.parent import ParentJoinError, job_key_from_env, join_parent

    record = {"p4runtime": agg.p4runtime, "device_id": agg.device_id, "thrift_port": agg.thrift_port,
              "job": topo.job}
    slots = agg.slots or DEFAULT_SLOTS
    root, level = _quiet_grpc()
    ctl = _control(rack)
    try:
        ctl.connect()
        if any(j.job_id == job_id_of(topo.job) for j in ctl.jobs()):
            if at_parent is not None:
                # again: a root that restarted forgot the job (joining twice is harmless)
                join_parent(topo.job, at_parent, slots, key=job_key_from_env())
            return Outcome("already installed on switch")
        job = ctl.install_job(topo.job, members, slots, uplink=uplink)
        up = f", uplink to {uplink.parent_ip} as rack {uplink.rack_id}" if uplink else ""
        if at_parent is not None:
            try:
                join_parent(topo.job, at_parent, slots, key=job_key_from_env())
            except ParentJoinError:
                ctl.remove_job(topo.job)  # a job the root lacks cannot complete: all or nothing
                raise
            up += f", joined at the root {at_parent.parent}"
        return Outcome("installed on switch", f"job {topo.job!r} installed on {agg.p4runtime}: slots {job.base}.."
                                              f"{job.base + job.slots - 1}, {job.world} members{up}", record=record)
    except ParentJoinError as exc:
        return Outcome("not installed: the root did not take the job", f"{exc}; {_fallback_text(rack)}",
                       failed=rack.fallback is None)
    except (SwitchControlError, OSError, ValueError) as exc:
        return Outcome("switch unreachable", f"the switch of rack {rack.name!r} at {agg.p4runtime} did not take the "
                                             f"job ({exc}; a switch without the aggnet pipeline needs `aggnet switch "
                                             f"--grpc {agg.p4runtime} load`); {_fallback_text(rack)}")
    finally:
        ctl.close()
        root.setLevel(level)


def remove(record: dict, timeout: float = 5.0) -> str:
    """Remove a job ``up`` installed; returns what happened, in words."""
    from aggnet.protocol.wire import job_id_of

    addr, job = record["p4runtime"], record["job"]
    by_hand = f"run `aggnet switch --grpc {addr} --device-id {record['device_id']} remove-job {job}` once it is back"
    if not _have_shell():
        return f"left on the switch at {addr}: no p4runtime-shell (pip install 'aggnet[p4]'); {by_hand}"
    why = _reachable(addr, timeout)
    if why is not None:
        return f"left on the switch at {addr}: it does not answer ({why}); {by_hand}"
    from aggnet.p4.control import SwitchControl, SwitchControlError

    root, level = _quiet_grpc()
    ctl = SwitchControl(addr, record["device_id"], thrift_port=record["thrift_port"],
                        thrift_host=addr.rsplit(":", 1)[0])
    try:
        ctl.connect()
        if not any(j.job_id == job_id_of(job) for j in ctl.jobs()):
            return f"job {job!r} was no longer on the switch at {addr}"
        ctl.remove_job(job)
        return f"job {job!r} removed from the switch at {addr}"
    except (SwitchControlError, OSError) as exc:
        return f"left on the switch at {addr}: {exc}; {by_hand}"
    finally:
        ctl.close()
        root.setLevel(level)
