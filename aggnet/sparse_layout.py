"""Where a sparse table's rows live and how they travel: the one definition
both ends (a worker's :mod:`aggnet.sparse_client` and a shard's
:mod:`aggnet.hosts.sparse`) use, so they can never disagree.

A table of ``rows`` rows is cut into ``partitions`` contiguous row ranges
of (nearly) equal size, as Parallax partitions a sparse variable; partition
``p`` lives on shard ``p % shards``. Contiguous ranges keep a checkpoint a
plain row-ordered array whatever the partition count, so a table saved with
one layout restores into another.

A row message (``SPARSE_PUSH``, ``SPARSE_PULL``, ``SPARSE_LOAD``,
``SPARSE_ROWS``) carries ``n`` rows in its payload: ``n`` little-endian
int64 global row indices, then (except in a pull) ``n x width``
little-endian float32 values. The header's ``count`` is the payload's
byte length (dtype ``NONE``) and ``ref`` is ``n``.
"""

from __future__ import annotations

import zlib

import numpy as np

INDEX_DTYPE = np.dtype("<i8")
ROW_DTYPE = np.dtype("<f4")
#: the largest table (rows) and row width the schema accepts
MAX_ROWS = 1 << 40
MAX_WIDTH = 1 << 16
MAX_PARTITIONS = 4096
#: rows per message when a whole table is read or written (checkpoints):
#: keeps each message near a few MiB whatever the width
BLOCK_BYTES = 4 << 20


def table_id(name: str) -> int:
    """A table's wire id (the header's ``index``): a stable 32-bit hash of
    its name; the shard keeps the name and refuses a clash."""
    return zlib.crc32(b"table:" + name.encode()) & 0xFFFFFFFF


def bounds(rows: int, partitions: int) -> np.ndarray:
    """Row starts of each partition, and ``rows`` at the end."""
    return np.array([p * rows // partitions for p in range(partitions + 1)], np.int64)


def shard_of(partition: int, shards: int) -> int:
    return partition % shards


def block_rows(width: int) -> int:
    return max(1, BLOCK_BYTES // (4 * width))


def pack_rows(indices: np.ndarray, rows: np.ndarray | None) -> bytes:
    """The payload of a row message."""
    head = np.ascontiguousarray(indices, INDEX_DTYPE).tobytes()
    if rows is None:
        return head
    return head + np.ascontiguousarray(rows, ROW_DTYPE).tobytes()


def unpack_rows(payload, n: int, width: int | None) -> tuple[np.ndarray, np.ndarray | None]:
    """(indices, rows) of a payload of ``n`` rows of ``width`` floats (or of
    indices alone, ``width`` None); raises ValueError on a length mismatch,
    naming the width the payload would have."""
    buf = memoryview(payload).cast("B")
    size = len(buf)
    want = n * INDEX_DTYPE.itemsize + (0 if width is None else n * width * ROW_DTYPE.itemsize)
    if size != want:
        if width is not None and n > 0 and size > n * INDEX_DTYPE.itemsize:
            seen = (size - n * INDEX_DTYPE.itemsize) / (n * ROW_DTYPE.itemsize)
            raise ValueError(f"{n} rows in {size} bytes are rows of {seen:g} floats; the table's rows are "
                             f"{width} floats ({want} bytes expected)")
        raise ValueError(f"{n} rows need {want} bytes, the payload has {size}")
    idx = np.frombuffer(buf, INDEX_DTYPE, n)
    if width is None:
        return idx, None
    rows = np.frombuffer(buf, ROW_DTYPE, n * width, n * INDEX_DTYPE.itemsize).reshape(n, width)
    return idx, rows


def combine(indices: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sum rows with the same index (sorted unique indices, their sums): a
    worker sends each row once, as Parallax aggregates locally first."""
    uniq, inverse = np.unique(indices, return_inverse=True)
    if uniq.size == indices.size:
        order = np.argsort(indices, kind="stable")
        return uniq, np.ascontiguousarray(rows[order], np.float32)
    out = np.zeros((uniq.size, rows.shape[1]), np.float32)
    np.add.at(out, inverse.reshape(-1), rows)
    return uniq, out
