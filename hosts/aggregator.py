"""What every aggregator kind offers the code that runs it.

``aggnet serve`` and the metrics exporter see an aggregator through this
interface only: where it serves, a loop that serves until told to stop,
counters in one shape, and close. Each kind (the sharded service in
hosts/service.py, the switch-mode aggregator in hosts/switch.py) keeps its
own wire STATS reply, which tools and people read; ``stats()`` is the same
numbers in the one shape below, so the exporter needs no knowledge of a
kind beyond the names of its counters.

``stats()`` returns::

    {"kind": "service" | "switch",   # whose counter names these are
     "totals": {counter: n},         # aggregator-wide, of the shards that answered
     "jobs": {name: part_job},       # tables kept outside any shard
     "histograms": {name: hist},     # per-bucket counts: {"bounds", "counts", "sum"}
     "pool": {"slots": n | None, "used": n | None, "buffers": n | None},
     "shards": [part | None],        # shards that answer on their own; None: not in time
     "restarts": n | None}           # shard processes restarted; None: never restarted

    part = {"counters": {counter: n}, "jobs": {name: part_job},
            "histograms": {name: hist}, "pool": {"slots", "used", "buffers"},
            "memory": {name: bytes}}  # the shard process's, and its listener's budgets
    part_job = {"members": n, "open_slots": n | None, "counters": {counter: n}}

The aggregator-wide ``jobs``, ``histograms`` and ``pool`` are one more
part. A reader sums the parts: a job's counters and open slots over the
shards that hold it, its members as the largest count (each shard knows
all members), histograms bucket by bucket, pool figures where known. ``shards`` is empty where one read sees
every shard (the switch's shards share memory); a reader may stand in a
silent shard's last part for it, so its counters do not drop and read as a
reset.
"""

from __future__ import annotations

import abc
from typing import Callable, ClassVar

#: seconds an idle aggregator loop (a shard, a control endpoint) waits for a
#: message before it looks whether to stop: a stop takes at most this, and
#: an idle loop wakes 20 times a second
STOP_POLL = 0.05


class Aggregator(abc.ABC):
    """One aggregator of any kind, as ``aggnet serve`` runs it."""

    #: names the counters of ``stats()`` (the exporter maps each kind's names)
    kind: ClassVar[str]
    #: how logs name the aggregator ("aggnet service")
    title: ClassVar[str]
    #: where workers reach it; str() gives the URL
    address: object
    #: seconds without jobs after which the aggregator stops by itself (None:
    #: never). Such an aggregator serves jobs, not the process that started
    #: it, so it weighs that process's exit itself (hosts/service.py).
    until_idle: float | None = None

    @property
    @abc.abstractmethod
    def shard_count(self) -> int:
        """Shards serving (processes, or threads in tests)."""

    @abc.abstractmethod
    def serve(self, should_stop: Callable[[], bool], started: Callable[[], None] | None = None) -> None:
        """Serve until ``should_stop()`` (asked a few times a second, so it
        must be cheap) or until a shard is lost beyond repair; the shards
        are stopped when it returns. ``started`` runs once every shard
        serves: a thread started earlier would be copied into shards made
        by fork, and launchers wait for what it prints."""

    @abc.abstractmethod
    def stats(self) -> dict:
        """Counters in the shape of this module's docstring."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the shards and release every socket; twice is harmless."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["Aggregator"]
