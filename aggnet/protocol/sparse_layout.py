"""Where a sparse table's rows live and how they travel: the one definition
both ends (a worker's :mod:`aggnet.client.sparse` and a shard's
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


def row_payload(n: int, width: int | None):
    """An unfilled row message of ``n`` rows (``width`` None: indices
    alone) and views of its indices and rows: (payload, indices, rows).
    Filling the views in place builds a message with one allocation and one
    pass over the rows, where joining ``tobytes()`` copies them twice more;
    the payload (a memoryview of memory of its own) can go out zero-copy."""
    head = n * INDEX_DTYPE.itemsize
    buf = np.empty(head + (0 if width is None else n * width * ROW_DTYPE.itemsize), np.uint8)
    idx = buf[:head].view(INDEX_DTYPE)
    rows = None if width is None else buf[head:].view(ROW_DTYPE).reshape(n, width)
    return memoryview(buf), idx, rows


def pack_rows(indices: np.ndarray, rows: np.ndarray | None) -> memoryview:
    """The payload of a row message."""
    indices = np.asarray(indices).reshape(-1)
    if rows is not None:
        rows = np.asarray(rows)
        if rows.ndim != 2:
            rows = rows.reshape(indices.size, -1 if indices.size else 0)
    payload, idx, out = row_payload(indices.size, None if rows is None else rows.shape[1])
    idx[:] = indices
    if rows is not None:
        out[...] = rows
    return payload


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


def _strictly_increasing(indices: np.ndarray) -> bool:
    return indices.size < 2 or bool((indices[1:] > indices[:-1]).all())


def _runs(indices: np.ndarray):
    """The stable order of ``indices``, the indices in that order, whether
    each sorted position starts a run of equal indices, and the runs'
    starts."""
    order = np.argsort(indices, kind="stable")
    ordered = indices[order]
    first = np.empty(indices.size, bool)
    first[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    return order, ordered, first, np.flatnonzero(first)


def _add_runs(out: np.ndarray, rows: np.ndarray, order: np.ndarray, starts: np.ndarray) -> None:
    """Add the second, third, ... row of each run of ``order`` (runs begin
    at ``starts``) to ``out``, which holds each run's first row: one row
    after another, ((r0 + r1) + r2) + ..., so a sum's bits follow the input
    order. np.add.reduceat is no substitute: over axis 0 it does not add a
    run's rows in order once a run has three or more."""
    lengths = np.diff(starts, append=order.size)
    runs = np.flatnonzero(lengths > 1)
    k = 1
    while runs.size:
        if runs.size <= 8 and int(lengths[runs].max()) - k > 64:
            # a few long runs (one index pushed many times): a row-by-row
            # pass over each beats a numpy call per row
            for j in runs:
                tail = rows.take(order[starts[j] + k:starts[j] + lengths[j]], axis=0)
                tail[0] += out[j]
                out[j] = np.add.accumulate(tail, axis=0)[-1]
            return
        out[runs] += rows.take(order[starts[runs] + k], axis=0)
        k += 1
        runs = runs[lengths[runs] > k]


def combine(indices: np.ndarray, rows: np.ndarray, copy: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Sum rows with the same index (sorted unique indices, their sums): a
    worker sends each row once, as Parallax aggregates locally first.

    The rows of one index are added one after another in input order, so
    rows concatenated in rank order sum in rank order (a host's leader
    relies on it): the sort is stable, which keeps equal indices in input
    order. Sorted unique input (what a worker usually has) costs one check
    and one copy, or none with ``copy=False``, which may hand back the
    inputs themselves."""
    indices = np.asarray(indices).reshape(-1)
    rows = np.ascontiguousarray(rows, np.float32)
    if _strictly_increasing(indices):
        return (indices.copy(), rows.copy()) if copy else (indices, rows)
    order, ordered, _, starts = _runs(indices)
    out = rows.take(order[starts], axis=0)
    if starts.size < indices.size:
        _add_runs(out, rows, order, starts)
    return ordered[starts], out


def combine_parts(parts: list, width: int, packed: bool = False):
    """:func:`combine` of ``parts`` ((indices, rows) pairs, e.g. the
    contributions of a round in rank order) as if concatenated, without
    concatenating their rows: (indices, sums, payload). With ``packed`` the
    result is built inside a row message (``payload``, ready to send; None
    otherwise).

    Where every part is sorted and unique (workers combine their rows
    first), each part's rows go straight to their places in the result,
    one pass per part: a row whose index an earlier part also holds gets
    the earlier parts' sum plus its own, so every sum is still added in
    part order and has the bits :func:`combine` gives."""
    parts = [(np.asarray(i).reshape(-1), v) for i, v in parts]
    if not all(_strictly_increasing(i) for i, _ in parts):
        uniq, sums = combine(np.concatenate([i for i, _ in parts]),
                             np.concatenate([v for _, v in parts]).reshape(-1, width), copy=False)
        if not packed:
            return uniq, sums, None
        payload, idx, rows = row_payload(uniq.size, width)
        idx[:] = uniq
        rows[...] = sums
        return idx, rows, payload
    everything = np.concatenate([i for i, _ in parts])
    order, ordered, first, starts = _runs(everything)
    if packed:
        payload, uniq, out = row_payload(starts.size, width)
        uniq[:] = ordered[starts]
    else:
        payload, uniq, out = None, ordered[starts], np.empty((starts.size, width), np.float32)
    # where each row lands in the result, and whether an earlier part
    # already put a row there
    where = np.empty(everything.size, np.intp)
    where[order] = np.cumsum(first) - 1
    earlier = np.empty(everything.size, bool)
    np.logical_not(first, out=first)
    earlier[order] = first
    at = 0
    for i, v in parts:
        dest, seen = where[at:at + i.size], earlier[at:at + i.size]
        at += i.size
        v = v.reshape(i.size, width)
        if seen.any():
            again = dest[seen]
            acc = out[again]  # the earlier parts' sums of those rows
            acc += v[seen]
            out[dest] = v
            out[again] = acc
        else:
            out[dest] = v
    return uniq, out, payload
