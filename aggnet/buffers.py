"""Reusable byte buffers for payloads and accumulators.

A buffer handed to a zero-copy transport, or viewed by a slot still being
summed, stays referenced until the bytes have left or the slot is done; the
pool hands a buffer out again only when nothing but the pool refers to it
(CPython's reference count says so exactly). Nobody gives buffers back: a
buffer is free the moment its last user lets go of it, so steady-state
aggregation allocates nothing.
"""

from __future__ import annotations

import sys

import numpy as np

#: references the pool's own bookkeeping holds while it looks at a buffer:
#: the list, the loop variable, getrefcount's argument
_BASELINE = 3


class BufferPool:
    """``allocator(nbytes)`` makes a buffer (default: a NumPy byte array;
    CuPy's for device memory)."""

    def __init__(self, capacity: int = 0, max_buffers: int = 1024, allocator=None):
        self.capacity = capacity
        self.max_buffers = max_buffers
        self._allocate = allocator or (lambda n: np.empty(n, np.uint8))
        self._buffers: list[np.ndarray] = []
        self.allocated = 0

    def take(self, nbytes: int) -> np.ndarray:
        """A buffer of at least ``nbytes`` that nobody else uses."""
        if nbytes > self.capacity:
            # larger chunks than before (a client with a larger chunk
            # size): start over at the new size
            self.capacity = nbytes
            self._buffers = []
        for buf in self._buffers:
            if sys.getrefcount(buf) <= _BASELINE:
                return buf
        buf = self._allocate(self.capacity)
        self.allocated += 1
        if len(self._buffers) < self.max_buffers:
            self._buffers.append(buf)
        return buf
