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
#: the list and getrefcount's argument
_BASELINE_INDEXED = 2


class BufferPool:
    """``allocator(nbytes)`` makes a buffer (default: a NumPy byte array;
    CuPy's for device memory)."""

    def __init__(self, capacity: int = 0, max_buffers: int = 1024, allocator=None):
        self.capacity = capacity
        self.max_buffers = max_buffers
        self._allocate = allocator or (lambda n: np.empty(n, np.uint8))
        self._buffers: list[np.ndarray] = []
        #: where the next look starts: just past the buffer handed out last.
        #: Buffers come free in about the order they were taken (a round's
        #: chunks, a window's slots), so the one there is usually free; a
        #: look from the front would pass every buffer still in use, each
        #: time (quadratic in the buffers a round holds)
        self._next = 0
        self.allocated = 0

    def take(self, nbytes: int) -> np.ndarray:
        """A buffer of at least ``nbytes`` that nobody else uses."""
        if nbytes > self.capacity:
            # larger chunks than before (a client with a larger chunk
            # size): start over at the new size
            self.capacity = nbytes
            self._buffers = []
            self._next = 0
        buffers = self._buffers
        n = len(buffers)
        start = self._next if self._next < n else 0
        for i in range(start, start + n):
            at = i if i < n else i - n
            if sys.getrefcount(buffers[at]) <= _BASELINE_INDEXED:
                self._next = at + 1
                return buffers[at]
        buf = self._allocate(self.capacity)
        self.allocated += 1
        if n < self.max_buffers:
            buffers.append(buf)
            self._next = n + 1
        return buf
