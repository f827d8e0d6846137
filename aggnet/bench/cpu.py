"""CPU-seconds of the processes a benchmark runs, read from the processes
themselves: host cycles per byte decide whether aggnet helps a cluster
whose links are faster than its hosts, so every benchmark sets them beside
the peer's (gloo's workers, in the same run)."""

from __future__ import annotations

import os
import time

_TICK = os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """User + system CPU-seconds of this process, every thread of it (a
    client's I/O thread, gloo's threads) included, to the nanosecond: the
    clock-tick counts of os.times() read 0 for a few fast all-reduces."""
    return time.process_time()


def cpu_seconds(pid: int) -> float:
    """User + system CPU-seconds of process ``pid`` so far (0 once gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    # after the command: state is field 3, utime and stime fields 14 and 15
    return (int(fields[11]) + int(fields[12])) / _TICK


def descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (shard processes), from the parent ids
    in /proc/*/stat: no psutil needed."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return sorted(out)


def tree_cpu_seconds(pids: list[int]) -> float:
    """CPU-seconds of ``pids`` and every process under them (an aggregator
    service: its supervisor and its shards)."""
    seen = set()
    for pid in pids:
        seen.add(pid)
        seen.update(descendants(pid))
    return sum(cpu_seconds(p) for p in seen)


def per_gb(seconds: float, nbytes: int, times: int = 1) -> float:
    """CPU-seconds per GB of buffer, for ``times`` all-reduces of ``nbytes``."""
    return seconds / (nbytes * times / 1e9)
