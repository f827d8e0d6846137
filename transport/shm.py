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

import bisect
import itertools
import mmap
import os
import re
import secrets
import stat
import threading
import weakref

import numpy as np

from aggnet import pids
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


# -- a worker's buffers in shared memory -------------------------------------------
#
# The rings above cost a worker one copy of every chunk into its input
# slot. A buffer that already lies in shared memory (the pinned host
# buffers a GPU bucket is staged through, or an array from
# aggnet.shared_array) need not be copied: the worker names the buffer to
# each shard once per round (a SHARE message) and the shard reads the
# chunks where they lie, and writes the results there where the worker
# restores nothing (docs/protocol.md).

#: name prefix of the segments behind shared buffers: aggnet-buf-PID-N-RANDOM
SHARED_PREFIX = "aggnet-buf-"
_SHARED_NAME = re.compile(r"aggnet-buf-(\d{1,10})-\d{1,12}-[0-9a-f]{8}\Z")

_registry_lock = threading.Lock()
#: start address -> (end address, name, size, weakref of the mapping): the
#: shared buffers of this process, found by the address of an array
_registry: dict[int, tuple] = {}
_starts: list[int] = []  #: the registry's keys, sorted
_created = itertools.count()
_swept = False


class SharedBuffer:
    """A worker's shared buffer as a shard on the same host maps it, by the
    name a SHARE gave (the worker's side is the array :func:`shared_bytes`
    returns; its segment is removed once the last array over it is gone)."""

    def __init__(self, name: str, size: int, mapping: mmap.mmap):
        self.name = name
        self.size = size
        self._map = mapping
        self.array = np.frombuffer(mapping, np.uint8)

    @classmethod
    def open(cls, name: str, size: int) -> "SharedBuffer":
        """Map another process's shared buffer (a shard, which reads the
        chunks there and may write the results back); OSError or
        ValueError names what is wrong with it."""
        if not _SHARED_NAME.match(name):
            raise ValueError(f"{name!r} is not the name of an aggnet shared buffer ({SHARED_PREFIX}PID-N-HEX)")
        path = os.path.join(SHM_DIR, name)
        try:
            # never through a link: a shard writes results into what it opens
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            raise OSError(f"cannot open shared buffer {path}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"{path} is not a shared-memory file")
            if st.st_uid != os.geteuid():
                # the job's rings are this user's alone (mode 0600), so its
                # workers run as this user: a file of another is no worker's
                raise ValueError(f"shared buffer {path} belongs to uid {st.st_uid}, not to the aggregator's "
                                 f"{os.geteuid()}; run the workers as the aggregator's user")
            actual = st.st_size
            if actual < size:
                raise ValueError(f"shared buffer {path} is {actual} bytes, smaller than the {size} named")
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(name, size, mapping)

    def close(self) -> None:
        self.array = None
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with it


def shared_bytes(nbytes: int) -> np.ndarray | None:
    """``nbytes`` bytes (uint8) in a new shared-memory segment of this
    process, or None where /dev/shm cannot hold them (a container's small
    /dev/shm: the caller then uses private memory). The space is reserved
    up front: a full /dev/shm is a None here, not a SIGBUS at first touch."""
    global _swept
    if not _swept:
        _swept = True
        sweep_stale_shared()
    name = f"{SHARED_PREFIX}{os.getpid()}-{next(_created)}-{secrets.token_hex(4)}"
    path = os.path.join(SHM_DIR, name)
    size = max(nbytes, 1)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return None
    try:
        os.posix_fallocate(fd, 0, size)
        mapping = mmap.mmap(fd, size)
    except OSError:
        _unlink(path)
        return None
    finally:
        os.close(fd)
    array = np.frombuffer(mapping, np.uint8)
    start = array.ctypes.data
    with _registry_lock:
        _registry[start] = (start + size, name, size, weakref.ref(mapping))
        bisect.insort(_starts, start)
    # the segment goes when the mapping does (the last array over it);
    # a shard that mapped it keeps its own mapping until the job ends
    weakref.finalize(mapping, _forget, start, path, os.getpid())
    return array[:nbytes]


def shared_array(shape, dtype=np.float32) -> np.ndarray:
    """A new array (zeros) in shared memory of this process. All-reduced
    through an aggregator on the same host (an ``shm://`` address), its
    chunks are read by the aggregator where they lie: the worker copies
    nothing into the rings; and where the client restores nothing
    (``all_or_nothing=False``) the shards write the results into it too.
    Such a round that fails may still see its results land for a moment
    after: reuse the array once the client is closed. Elsewhere it is an
    ordinary array. Its memory is returned when the last view of it goes."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    raw = shared_bytes(count * dtype.itemsize)
    if raw is None:
        raise MemoryError(f"aggnet: {SHM_DIR} cannot hold {count * dtype.itemsize} more bytes; free space there "
                          f"(a container: give it a larger /dev/shm) or use an ordinary array")
    return raw.view(dtype).reshape(shape)


def _forget(start: int, path: str, creator: int) -> None:
    with _registry_lock:
        if _registry.pop(start, None) is not None:
            _starts.remove(start)
    if os.getpid() == creator:  # a forked child (a DataLoader worker) lets go of its copy, not of the segment
        _unlink(path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def find_shared(arr: np.ndarray) -> tuple[str, int, int] | None:
    """(segment name, its size, the byte offset of ``arr`` in it) when the
    C-contiguous host array ``arr`` lies in one of this process's shared
    buffers, else None."""
    if not _starts or arr.nbytes == 0:
        return None
    begin = arr.ctypes.data
    with _registry_lock:
        i = bisect.bisect_right(_starts, begin) - 1
        if i < 0:
            return None
        start = _starts[i]
        end, name, size, alive = _registry[start]
    if begin + arr.nbytes > end or alive() is None:
        return None
    return name, size, begin - start


def sweep_stale_shared() -> int:
    """Remove shared buffers left in /dev/shm by processes that are gone
    (a worker killed before it could remove its own); returns how many."""
    removed = 0
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    for name in names:
        m = _SHARED_NAME.match(name)
        if m is None:
            continue
        pid = int(m.group(1))
        if pid == os.getpid() or pids.alive(pid):
            continue
        _unlink(os.path.join(SHM_DIR, name))
        removed += 1
    return removed

