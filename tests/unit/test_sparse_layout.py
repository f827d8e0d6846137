"""Row messages and row sums of sparse tables (aggnet.protocol.sparse_layout): the
same bits as a plain loop that adds each index's rows in input order, which
is what makes a shard's sums identical on every worker and every run."""

import numpy as np
import pytest

from aggnet.protocol import sparse_layout


def reference(indices, rows):
    """Sorted unique indices and, for each, its rows added one after another
    in input order (the first row as it is)."""
    uniq = np.unique(indices)
    out = np.zeros((uniq.size, rows.shape[1]), np.float32)
    seen = np.zeros(uniq.size, bool)
    for k, p in enumerate(np.searchsorted(uniq, indices)):
        out[p] = out[p] + rows[k] if seen[p] else rows[k]
        seen[p] = True
    return uniq, out


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def random_rows(rng, n, width):
    # magnitudes far apart: any change in the order of additions shows
    scale = (10.0 ** rng.integers(-6, 7, (n, 1))).astype(np.float32)
    return (rng.standard_normal((n, width)).astype(np.float32) * scale).astype(np.float32)


def random_parts(rng, count, width, *, unique):
    parts = []
    for _ in range(count):
        idx = rng.integers(0, 50, int(rng.integers(0, 60)))
        if unique:
            idx = np.unique(idx)
        parts.append((idx.astype(np.int64), random_rows(rng, idx.size, width)))
    return parts


@pytest.mark.parametrize("seed", range(20))
def test_combine_adds_each_index_in_input_order(seed):
    rng = np.random.default_rng(seed)
    width = int(rng.integers(1, 9))
    idx = rng.integers(0, 40, int(rng.integers(1, 300))).astype(np.int64)
    rows = random_rows(rng, idx.size, width)
    uniq, sums = sparse_layout.combine(idx, rows)
    want_idx, want = reference(idx, rows)
    assert np.array_equal(uniq, want_idx)
    assert same_bits(sums, want)
    # the values np.add.at gives, which adds in the same order
    at = np.zeros_like(want)
    np.add.at(at, np.searchsorted(want_idx, idx), rows)
    assert np.array_equal(sums, at)


def test_combine_of_long_runs_keeps_the_order():
    rng = np.random.default_rng(7)
    idx = np.concatenate([np.full(500, 3), np.full(200, 9), rng.integers(0, 20, 100)]).astype(np.int64)
    rng.shuffle(idx)
    rows = random_rows(rng, idx.size, 4)
    uniq, sums = sparse_layout.combine(idx, rows)
    want_idx, want = reference(idx, rows)
    assert np.array_equal(uniq, want_idx) and same_bits(sums, want)


def test_combine_sums_in_rank_order_not_in_pairs():
    # float32: (1e8 + -1e8) + 1 = 1, but 1e8 + (-1e8 + 1) = 0 and a pairwise
    # sum of four rows would give another answer again
    idx = np.array([5, 5, 5, 5], np.int64)
    rows = np.array([[1e8], [-1e8], [1.0], [0.5]], np.float32)
    _, sums = sparse_layout.combine(idx, rows)
    assert sums[0, 0] == np.float32(1.5)
    # ranks' contributions concatenated in rank order: the same bits as
    # adding rank by rank
    parts = [(np.array([2, 5]), np.array([[1.0], [1e8]], np.float32)),
             (np.array([5]), np.array([[-1e8]], np.float32)),
             (np.array([1, 5]), np.array([[3.0], [1.0]], np.float32))]
    uniq, sums, _ = sparse_layout.combine_parts(parts, 1)
    assert uniq.tolist() == [1, 2, 5]
    assert sums[:, 0].tolist() == [3.0, 1.0, 1.0]


def test_combine_of_nothing_and_of_sorted_unique_rows():
    uniq, sums = sparse_layout.combine(np.empty(0, np.int64), np.empty((0, 3), np.float32))
    assert uniq.shape == (0,) and sums.shape == (0, 3)
    idx = np.array([1, 4, 9], np.int64)
    rows = np.arange(6, dtype=np.float32).reshape(3, 2)
    uniq, sums = sparse_layout.combine(idx, rows)
    assert np.array_equal(uniq, idx) and np.array_equal(sums, rows)
    assert not np.shares_memory(sums, rows)  # a copy unless asked otherwise
    uniq, sums = sparse_layout.combine(idx, rows, copy=False)
    assert np.array_equal(sums, rows)


@pytest.mark.parametrize("unique", [True, False])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("seed", range(15))
def test_combine_parts_gives_the_bits_of_combine_over_the_concatenation(seed, packed, unique):
    rng = np.random.default_rng(seed)
    width = int(rng.integers(1, 6))
    parts = random_parts(rng, int(rng.integers(1, 6)), width, unique=unique)
    idx = np.concatenate([i for i, _ in parts])
    rows = np.concatenate([v for _, v in parts])
    want_idx, want = reference(idx, rows) if idx.size else (idx, rows)
    uniq, sums, payload = sparse_layout.combine_parts(parts, width, packed=packed)
    assert np.array_equal(uniq, want_idx) and same_bits(sums, want)
    if packed:
        got_idx, got_rows = sparse_layout.unpack_rows(payload, want_idx.size, width)
        assert np.array_equal(got_idx, want_idx) and same_bits(got_rows, want)
    else:
        assert payload is None


def test_combine_parts_of_empty_parts():
    parts = [(np.empty(0, np.int64), np.empty((0, 2), np.float32))] * 3
    uniq, sums, payload = sparse_layout.combine_parts(parts, 2, packed=True)
    assert uniq.size == 0 and sums.shape == (0, 2) and len(payload) == 0


def test_pack_rows_is_indices_then_rows_little_endian():
    idx = np.array([3, 1, 7], np.int32)  # any integer type goes as int64
    rows = np.arange(12, dtype=np.float64).reshape(3, 4)[:, ::-1]  # not contiguous, not float32
    payload = sparse_layout.pack_rows(idx, rows)
    want = np.asarray(idx, "<i8").tobytes() + np.ascontiguousarray(rows, "<f4").tobytes()
    assert bytes(payload) == want and len(payload) == len(want)
    got_idx, got_rows = sparse_layout.unpack_rows(payload, 3, 4)
    assert np.array_equal(got_idx, idx) and np.array_equal(got_rows, rows.astype(np.float32))
    assert bytes(sparse_layout.pack_rows(idx, None)) == np.asarray(idx, "<i8").tobytes()
    empty = sparse_layout.pack_rows(np.empty(0, np.int64), np.empty((0, 4), np.float32))
    assert len(empty) == 0 and not empty


def test_row_payload_views_fill_the_message():
    payload, idx, rows = sparse_layout.row_payload(2, 3)
    idx[:] = [10, 20]
    rows[...] = [[1, 2, 3], [4, 5, 6]]
    got_idx, got_rows = sparse_layout.unpack_rows(payload, 2, 3)
    assert got_idx.tolist() == [10, 20] and got_rows.tolist() == [[1, 2, 3], [4, 5, 6]]
    with pytest.raises(ValueError, match="rows of 3 floats"):
        sparse_layout.unpack_rows(payload, 2, 5)
