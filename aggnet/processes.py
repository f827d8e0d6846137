"""Process lifetimes: children that must not outlive their parent."""

from __future__ import annotations

import logging
import signal

log = logging.getLogger("aggnet")


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies,
    whatever way it dies (PR_SET_PDEATHSIG): a shard or a benchmark helper
    must never outlive the process that started it."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, int(sig), 0, 0, 0)
    except Exception as exc:  # not Linux: the parent's own shutdown covers it
        log.debug("no parent-death signal: %s", exc)
