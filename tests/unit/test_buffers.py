"""The payload pool: a buffer is handed out again only once nobody else
holds it, and rounds that hold many buffers at once reuse them."""

from __future__ import annotations

import numpy as np

from aggnet.buffers import BufferPool


def test_a_held_buffer_is_never_handed_out_again():
    pool = BufferPool()
    held = [pool.take(64) for _ in range(50)]
    ids = {id(b) for b in held}
    assert len(ids) == 50
    more = pool.take(64)
    assert id(more) not in ids


def test_rounds_that_hold_every_buffer_reuse_them_all():
    """A round keeps each of its chunks' buffers until it completes, as the
    client's saves do; the next round takes the same buffers, in order."""
    pool = BufferPool(max_buffers=4096)
    first = [pool.take(1024) for _ in range(1500)]
    assert pool.allocated == 1500
    order = [id(b) for b in first]
    del first
    for _ in range(3):
        again = [pool.take(1024) for _ in range(1500)]
        assert [id(b) for b in again] == order
        del again
    assert pool.allocated == 1500


def test_buffers_freed_out_of_order_are_found():
    pool = BufferPool()
    held = [pool.take(16) for _ in range(10)]
    freed = {id(held[i]) for i in (7, 2)}
    del held[7], held[2]
    got = [pool.take(16), pool.take(16)]
    assert {id(b) for b in got} == freed
    assert pool.allocated == 10
    third = pool.take(16)  # nothing free: a new one
    assert pool.allocated == 11 and all(third is not b for b in held)


def test_a_view_of_a_buffer_keeps_it_taken():
    pool = BufferPool()
    buf = pool.take(32)
    view = buf[:8].view(np.int32)
    buf_id = id(buf)
    del buf
    assert id(pool.take(32)) != buf_id
    del view
    assert id(pool.take(32)) == buf_id


def test_a_larger_size_starts_over_and_beyond_the_cap_buffers_are_not_kept():
    pool = BufferPool(max_buffers=4)
    small = pool.take(16)
    assert small.nbytes == 16
    big = [pool.take(64) for _ in range(6)]
    assert all(b.nbytes == 64 for b in big)
    assert len({id(b) for b in big}) == 6
    del big
    kept = [pool.take(64) for _ in range(6)]
    assert pool.allocated == 1 + 6 + 2  # four kept and reused, two made again
    assert all(b.nbytes == 64 for b in kept)
