"""Shared-memory payloads for workers on the aggregator's host.

Over ``shm://`` addresses, messages still travel over a Unix socket, but
their payloads do not: each (job, shard) has one shared segment that the
shard creates at JOIN and every worker maps once for the job's life
(registration once, no per-chunk setup). A worker writes chunk ``seq`` into
its input ring slot ``seq % window``; the shard sums the workers' input slots
straight into result slot ``seq % (2 * window)``, from which every worker
copies its result out. Only the 48-byte header crosses the socket; the
data is written once and read once, and with small rings it stays in cache.

Why no acknowledgements are needed: every worker sends a shard its chunks in
the same order (``seq``) and keeps at most ``window`` of them unanswered. A
worker sends ``seq + window`` only after the result of ``seq`` arrived, so
its input slot is free; and a first contribution to ``seq + 2*window`` needs
the result of ``seq + window``, which needs every worker's contribution to
``seq + window``, which each worker sent only after copying out the result
of ``seq``: so result slot ``seq % (2*window)`` is never overwritten while
someone still reads it. A reduce-scatter's chunk is read by its owner
alone; the other workers get an empty RESULT, which frees their window the
same way (docs/protocol.md).

::

    segment = [ inputs: world x window slots | results: 2*window slots ]
              slot_bytes each, page aligned
"""

from __future__ import annotations

import mmap
import os

import numpy as np

from aggnet.protocol.control import slot_size

SHM_DIR = "/dev/shm"


class Segment:
    """A job's shared rings on one shard (created by the shard, mapped by
    each worker)."""

    def __init__(self, name: str, world: int, window: int, chunk_bytes: int, create: bool):
        if "/" in name or not name:
            raise ValueError(f"bad shared-memory segment name {name!r}")
        self.name = name
        self.path = os.path.join(SHM_DIR, name)
        self.world = world
        self.window = window
        self.results = 2 * window
        self.chunk_bytes = chunk_bytes
        self.slot_bytes = slot_size(chunk_bytes)
        self.size = (world * window + self.results) * self.slot_bytes
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(self.path, flags, 0o600)
        except OSError as exc:
            raise OSError(f"cannot {'create' if create else 'open'} shared memory {self.path}: {exc}") from None
        try:
            if create:
                os.ftruncate(fd, self.size)
            elif os.fstat(fd).st_size != self.size:
                raise OSError(f"shared memory {self.path} is {os.fstat(fd).st_size} bytes, expected {self.size}")
            self._map = mmap.mmap(fd, self.size)
        except (OSError, ValueError, OverflowError) as exc:
            if create:  # a refused segment leaves no file behind
                self.unlink()
            if isinstance(exc, OSError):
                raise
            raise OSError(f"cannot map {self.size} bytes of shared memory at {self.path}: {exc}") from None
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._map, np.uint8)
        self._owner = create

    def describe(self) -> dict:
        return {"name": self.name, "world": self.world, "window": self.window, "chunk_bytes": self.chunk_bytes}

    @classmethod
    def open(cls, info: dict) -> "Segment":
        return cls(info["name"], int(info["world"]), int(info["window"]), int(info["chunk_bytes"]), create=False)

    def input_slot(self, rank: int, seq: int) -> np.ndarray:
        start = (rank * self.window + seq % self.window) * self.slot_bytes
        return self.array[start:start + self.chunk_bytes]

    def result_slot(self, seq: int) -> np.ndarray:
        start = (self.world * self.window + seq % self.results) * self.slot_bytes
        return self.array[start:start + self.chunk_bytes]

    def close(self) -> None:
        """Unmap (and, for the creator, remove) the segment. Views handed out
        earlier must be gone; a mapping still in use is left to the GC."""
        self.array = None
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with it
        if self._owner:
            self.unlink()

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
