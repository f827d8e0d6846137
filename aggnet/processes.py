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


#: glibc's mallopt parameters
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_large_buffers(mmap_below: int = 64 << 20, trim_above: int = 256 << 20) -> None:
    """Let glibc reuse a shard's large buffers instead of mapping each one
    afresh: a sparse round allocates tens of MB for its rows and frees them
    again, and a fresh mapping costs a page fault per 4 KiB, which at
    α = 5% of a large table took more time than the arithmetic. Blocks
    under ``mmap_below`` come from the heap; up to ``trim_above`` freed
    bytes stay with the process for the next round. Elsewhere than glibc,
    nothing changes."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        if not hasattr(libc, "mallopt"):
            return
        libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_below))
        libc.mallopt(_M_TRIM_THRESHOLD, int(trim_above))
    except Exception as exc:  # not glibc
        log.debug("malloc left as it is: %s", exc)
