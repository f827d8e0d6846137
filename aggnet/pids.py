"""Whether a process is still there, for the files aggnet names after the
process that made them (a service's pointer, a worker's shared buffers):
one check for every layer that finds such a file left behind."""

from __future__ import annotations

import os


def alive(pid) -> bool:
    """Whether process ``pid`` exists (one of another user counts); False
    for anything that is not a process id."""
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError, TypeError, OverflowError):
        return False
    except PermissionError:
        return True
    return True


def memory(pid="self") -> dict:
    """Resident bytes of process ``pid`` now and at its peak
    (``rss_bytes``, ``peak_rss_bytes``); {} where it is gone, a zombie, or
    the system keeps no /proc."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    out["rss_bytes"] = int(line.split()[1]) << 10
                elif line.startswith("VmHWM:"):
                    out["peak_rss_bytes"] = int(line.split()[1]) << 10
    except OSError:
        return {}
    return out
