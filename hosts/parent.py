"""A rack's link to the parent that reduces across racks, as both
aggregator kinds keep it.

A rack's aggregator joins each job at the parent on its members' behalf
(as rack ``rack_id`` of ``racks``). Until the parent takes the job, no
partial of the rack could complete, so the members' JOIN answers wait
(:class:`~aggnet.hosts.admission.PendingJoin`); the JOIN goes to the
parent again every RETRY_INTERVAL while unanswered; the parent's verdict
releases every held answer or turns each into a refusal that names the
parent. A parent that restarts forgets the job: the rack joins again,
and members that rejoin meanwhile wait for that answer.

What carries the messages differs (ZeroMQ to a root service's shard in
hosts/uplink.py, a datagram to a switch-mode parent in hosts/switch.py);
the standing of each job and the resend schedule are these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from aggnet.hosts.admission import PendingJoin

#: seconds between JOINs (and HELLOs) while the parent has not answered
RETRY_INTERVAL = 0.5


@dataclass
class Standing:
    """One job's standing at the parent, as its rack sees it."""

    #: the parent took the job (always, for an aggregator without parent)
    ready: bool = True
    #: members' JOIN answers held until the parent's verdict
    pending: list[PendingJoin] = field(default_factory=list)

    def hold(self, join: PendingJoin) -> None:
        """Keep a member's answer; one that asks again replaces its last."""
        self.pending = [p for p in self.pending if p.member != join.member] + [join]

    def accepted(self) -> list[PendingJoin]:
        """The parent took the job: the held answers go out now."""
        self.ready = True
        return self._take()

    def refused(self) -> list[PendingJoin]:
        """The parent refused the job: each held member is told so."""
        return self._take()

    def lost(self) -> None:
        """The parent forgot the job (it restarted): join it again."""
        self.ready = False

    def _take(self) -> list[PendingJoin]:
        held, self.pending = self.pending, []
        return held


def whole_here(h, info: dict) -> bool:
    """Whether a JOIN's job is whole at this aggregator: its payload names
    the job's world and that is the members joining here. Such a job (a
    model-parallel stage's data-parallel group inside one rack) completes
    at the rack and never goes to the parent, which would wait for racks
    that are not in it."""
    return info.get("world") == h.world


def refusal(parent: str, job: str, rack_id: int, text: str) -> str:
    """What a member hears when the parent refused its rack's job."""
    return f"the parent aggregator {parent} refused job {job!r} from rack {rack_id}: {text}"


class Joins:
    """The JOINs a rack still owes the parent, resent until answered:
    ``send(job_id)`` sends one (how is the caller's)."""

    def __init__(self, send: Callable[[int], None], interval: float = RETRY_INTERVAL):
        self._send = send
        self._interval = interval
        self._due: dict[int, float] = {}  #: job id -> when to send its JOIN again

    def want(self, job_id: int, now: float) -> None:
        """Ask the parent to take ``job_id`` (now, unless asked just now)."""
        if now >= self._due.get(job_id, 0.0):
            self._due[job_id] = now + self._interval
            self._send(job_id)

    def answered(self, job_id: int) -> None:
        self._due.pop(job_id, None)

    def tick(self, now: float, every: bool = False) -> None:
        """Send again every JOIN whose answer is overdue (``every``: all of
        them, as when the parent has just been found)."""
        for job_id, due in list(self._due.items()):
            if every or now >= due:
                self._due[job_id] = now + self._interval
                self._send(job_id)

    def __contains__(self, job_id: int) -> bool:
        return job_id in self._due
