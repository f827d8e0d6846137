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
