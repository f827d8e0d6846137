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
    """User + system CPU-seconds of process ``pid`` so far, in clock ticks
    (0 once gone)."""
    try:
        return _stat_ticks(f"/proc/{pid}/stat") / _TICK
    except (FileNotFoundError, ProcessLookupError):
        return 0.0


def _stat_ticks(path: str) -> int:
    """utime + stime, in clock ticks, of a /proc stat file."""
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # after the command: state is field 3, utime and stime fields 14 and 15
    return int(fields[11]) + int(fields[12])


def _thread_seconds(pid: int) -> dict[int, float]:
    """Each live thread's time on a CPU, to the nanosecond (schedstat)."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            continue  # a thread that just ended; a kernel without schedstat
    return out


class CpuReading:
    """CPU time of some processes at one moment; one reading minus an
    earlier one is the CPU-seconds between them. Per process, the larger of
    two measures: the clock ticks of /proc/PID/stat, which keep the time of
    threads that ended but round a few fast all-reduces to 0, and the
    nanoseconds of the threads alive at both readings."""

    def __init__(self, pids):
        self.ticks = {pid: cpu_seconds(pid) for pid in pids}
        self.threads = {pid: _thread_seconds(pid) for pid in pids}

    def __sub__(self, earlier: "CpuReading") -> float:
        total = 0.0
        for pid, ticks in self.ticks.items():
            before = earlier.threads.get(pid, {})
            precise = sum(t - before.get(tid, 0.0) for tid, t in self.threads[pid].items())
            total += max(ticks - earlier.ticks.get(pid, 0.0), precise)
        return total


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


def tree_cpu_seconds(pids: list[int]) -> CpuReading:
    """The CPU time of ``pids`` and every process under them (an aggregator
    service: its supervisor and its shards); subtract an earlier reading
    for the CPU-seconds in between."""
    seen = set()
    for pid in pids:
        seen.add(pid)
        seen.update(descendants(pid))
    return CpuReading(sorted(seen))


def per_gb(seconds: float, nbytes: int, times: int = 1) -> float:
    """CPU-seconds per GB of buffer, for ``times`` all-reduces of ``nbytes``."""
    return seconds / (nbytes * times / 1e9)
