"""A P4 rack's job at its parent, joined by the control plane.

A rack's host aggregator joins the root by itself before its members'
partial sums can complete there (aggnet/hosts/parent.py). A P4 switch
sends no JOIN: the control plane that installs the job on the switch
joins the root on the switch's behalf, as rack ``rack_id`` of ``racks``,
naming the switch's data address (``data`` in the JOIN), so the root
takes the switch's partials from that address and sends its finals there.

The switch sends every partial to UDP port SWITCH_PORT of the parent,
with the slot index its workers used (relative to the job's slice, at
the rack and at the root alike); so the root must give the job the
switch's number of slots, at 64 values a packet, all on that one port.
The root's answer is checked for each, so a mismatch is a one-line error
at install time instead of a job whose partials are dropped.

A root that restarts forgets its jobs; a host rack notices and joins
again, a switch cannot. ``keep_joined`` (``aggnet switch join-parent
--keep``) joins again on a timer, so the switch's partials, which its
workers' retransmissions make it resend, find the job at the new root.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import select
import socket
import threading
import time
from dataclasses import dataclass

from aggnet.protocol import keys, wire
from aggnet.protocol.keys import parse_key
from aggnet.protocol.address import parse
from aggnet.protocol.limits import DEFAULT_ELEMENTS, MAX_WORKERS, SWITCH_PORT
from aggnet.protocol.messages import JoinOk
from aggnet.protocol.wire import HEADER_SIZE, Header, MsgType, job_id_of

log = logging.getLogger("aggnet.p4.parent")

#: seconds between JOINs while the root has not answered
RESEND = 0.5
#: seconds of a root's silence before a keeper says it lost the job (it
#: sends the JOIN every RESEND meanwhile: a root back sooner is joined at once)
LOST_AFTER = 5.0


class ParentJoinError(RuntimeError):
    """The root refused the rack's job, or did not answer; says which."""


@dataclass(frozen=True)
class RackAtParent:
    """What joining a rack's job at its parent needs."""

    parent: str  #: udp://IP:SWITCH_PORT of the root
    rack_id: int  #: this rack's worker bit at the root
    racks: int  #: the root's world: racks under it
    switch_ip: str  #: where the switch's partials come from and finals go

    def check(self) -> tuple[str, int]:
        """The parent's (ip, port); raises ValueError naming a bad value."""
        try:
            a = parse(self.parent)
        except ValueError as exc:
            raise ValueError(f"the parent {self.parent!r}: {exc}") from None
        if a.scheme != "udp":
            raise ValueError(f"the parent of a P4 rack is a switch-mode aggregator at udp://IP:{SWITCH_PORT}, not "
                             f"{self.parent}")
        if a.port != SWITCH_PORT:
            raise ValueError(f"the switch sends its partial sums to UDP port {SWITCH_PORT} of the parent; start the "
                             f"root on udp://{a.host}:{SWITCH_PORT}, not port {a.port}")
        if not 1 <= self.racks <= MAX_WORKERS:
            raise ValueError(f"racks {self.racks!r}: a root takes 1..{MAX_WORKERS} racks")
        if not isinstance(self.rack_id, int) or not 0 <= self.rack_id < self.racks:
            raise ValueError(f"rack id {self.rack_id!r} is not in 0..{self.racks - 1}")
        try:
            ipaddress.IPv4Address(self.switch_ip)
        except ValueError:
            raise ValueError(f"the switch's address {self.switch_ip!r} is not IPv4") from None
        try:
            return socket.gethostbyname(a.host), a.port
        except OSError as exc:
            raise ValueError(f"cannot resolve the parent {self.parent}: {exc}") from None


def job_key_from_env() -> bytes | None:
    """The job key a keyed root wants, from AGGNET_JOB_KEY as a worker's."""
    text = os.environ.get("AGGNET_JOB_KEY")
    return parse_key(text, "AGGNET_JOB_KEY") if text else None


def join_parent(job: str, rack: RackAtParent, slots: int, *, key: bytes | None = None,
                timeout: float = 10.0, stop: threading.Event | None = None) -> JoinOk | None:
    """JOIN ``job`` at the parent for the switch, resent every RESEND
    seconds until answered; the root's JOIN_OK, checked against what the
    switch sends (None when ``stop`` was set first). Joining again is
    harmless (the root keeps the member)."""
    parent = rack.check()
    h = Header(MsgType.JOIN, job_id=job_id_of(job), sender=rack.rack_id, world=rack.racks)
    info = {"name": job, "slots": slots, "elements": DEFAULT_ELEMENTS, "data": f"{rack.switch_ip}:{SWITCH_PORT}"}
    if key is not None:
        info["auth"] = keys.sign(key, "JOIN", h.job_id, h.sender, h.world, info)
    payload = wire.json_payload(info)
    packet = h.pack_for(payload) + payload
    where = f"the parent {rack.parent}"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        deadline = time.monotonic() + timeout
        next_send = 0.0
        while True:
            now = time.monotonic()
            if stop is not None and stop.is_set():
                return None
            if now >= deadline:
                raise ParentJoinError(f"{where} did not answer rack {rack.rack_id}'s JOIN for job {job!r} within "
                                      f"{timeout:g}s; start it (`aggnet serve --mode switch --listen "
                                      f"{rack.parent}`) or check the route to {parent[0]}")
            if now >= next_send:
                try:
                    sock.sendto(packet, parent)
                except OSError as exc:
                    raise ParentJoinError(f"cannot send to {where}: {exc.strerror or exc}") from None
                next_send = now + RESEND
            ready, _, _ = select.select([sock], [], [], max(0.0, min(next_send, deadline) - now))
            if not ready:
                continue
            try:
                data, src = sock.recvfrom(65536)
                reply = wire.unpack_header(data)
            except (OSError, wire.WireError):
                continue  # a refused port (ICMP) or a stray datagram: the next JOIN may pass
            if src != parent or reply.job_id != h.job_id:
                continue
            if reply.msg_type == MsgType.ERROR:
                _, text = wire.parse_error(memoryview(data)[HEADER_SIZE:])
                raise ParentJoinError(f"{where} refused rack {rack.rack_id}'s job {job!r}: {text}")
            if reply.msg_type == MsgType.JOIN_OK:
                return _checked(JoinOk.from_header(reply), job, slots, where)


def _checked(ok: JoinOk, job: str, slots: int, where: str) -> JoinOk:
    if ok.elements != DEFAULT_ELEMENTS or ok.slots != slots:
        raise ParentJoinError(f"{where} gave job {job!r} {ok.slots} slots of {ok.elements} values; the switch "
                              f"uses {slots} of {DEFAULT_ELEMENTS}: install the job with the root's slots, or run "
                              f"the root with --elements {DEFAULT_ELEMENTS}")
    if ok.shard_slots and ok.base + ok.slots > ok.shard_slots:
        raise ParentJoinError(f"{where} placed job {job!r} on several shard ports (slots {ok.base}.."
                              f"{ok.base + ok.slots - 1}, {ok.shard_slots} a port); the switch sends to port "
                              f"{SWITCH_PORT} only: run the root with --shards 1")
    return ok


def keep_joined(job: str, rack: RackAtParent, slots: int, *, key: bytes | None = None, every: float = 2.0,
                stop: threading.Event | None = None, say=log.info, joined=None) -> None:
    """Join ``job`` at the parent every ``every`` seconds until ``stop``
    is set: a root that restarted forgot the job, and the switch's
    partials are dropped there until it is joined again; joining a root
    that still holds it changes nothing. A root that is not there yet is
    waited for. ``say`` hears each change of standing (lost, taken again),
    one line each; ``joined`` gets each JoinOk."""
    rack.check()  # a wrong value is an error at once, not a line every few seconds
    stop = stop or threading.Event()
    lost: str | None = None
    while not stop.is_set():
        try:
            ok = join_parent(job, rack, slots, key=key, timeout=max(every, LOST_AFTER), stop=stop)
        except ParentJoinError as exc:
            if lost is None:
                say(f"rack {rack.rack_id}'s job {job!r}: {exc}; asking again until it answers")
            lost = str(exc)
        else:
            if ok is None:  # stopped while joining
                return
            if lost is not None:
                say(f"rack {rack.rack_id}'s job {job!r}: {rack.parent} took it again")
            lost = None
            if joined is not None:
                joined(ok)
        stop.wait(every)
