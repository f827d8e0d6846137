"""Who may join a job, decided the same way by both aggregator kinds.

A JOIN comes from anyone who can reach an aggregator's port. Before a
kind looks at what is its own (shared memory, a slice of the pool), the
same questions are asked in the same order with the same answers: is the
rank inside the world, does the job key sign it, is the name the one the
job id belongs to, does the world size agree with the job's. A refusal
is a ControlError (its code goes in the ERROR, its reason names the drop
counter); the worker maps the code to the same exception whichever kind
refused.

A member's JOIN is answered only once the job may run: for a rack under a
parent, once the parent took the job. Until then the answer waits as a
:class:`PendingJoin`, and the parent's verdict releases or refuses all of
them (:mod:`aggnet.hosts.parent`).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from aggnet.protocol.control import ControlError
from aggnet.protocol.keys import Keyring
from aggnet.protocol.wire import ErrorCode, Header


class Disagreement(ControlError):
    """A JOIN at odds with the job its members run: not only the sender is
    refused; every member that joined hears it too, at once, instead of
    waiting out a timeout for a worker that will never come."""

    def __init__(self, message: str, reason: str):
        super().__init__(ErrorCode.JOB_MISMATCH, message, reason)


def check_rank(h: Header, max_world: int | None = None) -> None:
    """The JOIN's rank lies inside its world (of at most ``max_world``)."""
    if max_world is not None and (not 1 <= h.world <= max_world or h.sender >= h.world):
        raise ControlError(ErrorCode.REFUSED, f"rank {h.sender} and world size {h.world}: an aggregator takes "
                                              f"1..{max_world} workers per job", "bad_join")
    if h.world < 1 or h.sender >= h.world:
        raise ControlError(ErrorCode.REFUSED, f"rank {h.sender} is outside world size {h.world}", "bad_join")


def admit(keyring: Keyring, h: Header, name: str, info: dict, peer, job=None,
          max_world: int | None = None) -> None:
    """Every check a JOIN passes before an aggregator kind looks at it:
    the rank, the job key's signature, and, for a job this aggregator
    holds (``job``, with ``name`` and ``world``), the name and world size."""
    check_rank(h, max_world)
    keyring.verify("JOIN", h.job_id, h.sender, h.world, name, info, peer)
    if job is None:
        return
    if job.name != name:
        raise ControlError(ErrorCode.JOB_MISMATCH, f"job id {h.job_id:08x} belongs to job {job.name!r}, not "
                                                   f"{name!r}; choose another job name", "job_name_clash")
    if job.world != h.world:
        raise Disagreement(f"job {name!r} is registered with world size {job.world} but rank {h.sender} joined "
                           f"with world size {h.world}; all workers must agree", "world_mismatch")


def data_address(info: dict, src: tuple) -> tuple:
    """Where a member's datagrams come from and its results go: the JOIN's
    own source, or the ``data`` address it names when it joins on another
    machine's behalf (a P4 switch's control plane joining the root for
    the switch). An open aggregator takes the word of whoever reaches it,
    as it does for any JOIN; a keyed one has already checked the job key
    signed the JOIN, ``data`` included."""
    text = info.get("data")
    if text is None:
        return src
    host, _, port = text.rpartition(":")
    try:
        ip = str(ipaddress.IPv4Address(host))
        number = int(port)
    except ValueError:
        number, ip = -1, None
    if ip is None or not 1 <= number <= 65535:
        raise ControlError(ErrorCode.MALFORMED, f"the JOIN's data address {text!r} is not IPv4:PORT, like "
                                                f"10.77.1.254:42606", "field_data")
    return ip, number


@dataclass
class PendingJoin:
    """A member's answer held until the parent takes the job: where it
    goes (a connection's peer, or a datagram source), and the JOIN_OK's
    header and payload."""

    member: object
    header: Header
    payload: bytes
