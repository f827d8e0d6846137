"""First-fit placement of jobs on a slot pool, shared by the aggregator
host's switch mode and the P4 control plane."""

from __future__ import annotations

import pytest

from aggnet.p4.control import InstalledJob, SwitchControl, SwitchControlError
from aggnet.protocol.limits import MAX_JOBS, P4_POOL
from aggnet.protocol.pool import Placement, SlotPool


def test_jobs_take_the_first_free_row_and_run():
    pool = SlotPool(100, 4)
    assert pool.place(30) == Placement(0, 0)
    assert pool.place(30) == Placement(1, 30)
    assert pool.place(50) is None  # 40 left
    assert pool.largest_free == 40
    assert pool.jobs == 2


def test_a_freed_run_is_reused_first_and_merges_with_its_neighbours():
    pool = SlotPool(100, 4)
    a, b, c = pool.place(20), pool.place(20), pool.place(20)
    pool.release(b.row, b.base, 20)
    assert pool.place(10) == Placement(b.row, 20)  # the gap, not the tail
    pool.release(b.row, 20, 10)
    pool.release(a.row, a.base, 20)
    pool.release(c.row, c.base, 20)
    assert pool.largest_free == 100  # one run again
    assert pool.place(100) == Placement(0, 0)


def test_no_free_row_takes_nothing():
    pool = SlotPool(100, 2)
    pool.place(1)
    pool.place(1)
    assert pool.place(1) is None
    assert pool.largest_free == 98 and pool.jobs == 2


def test_taking_a_run_in_use_or_outside_the_pool_is_refused():
    pool = SlotPool.holding(100, 4, [(0, 10, 20)])
    with pytest.raises(ValueError, match="not free"):
        pool.take(1, 25, 10)
    with pytest.raises(ValueError, match="not free"):
        pool.take(1, 95, 10)
    with pytest.raises(ValueError, match="row 0"):
        pool.take(0, 50, 10)
    pool.take(1, 30, 70)
    assert pool.place(10) == Placement(2, 0)
    assert pool.place(1) is None


def test_the_p4_control_plane_places_jobs_around_those_on_the_switch():
    existing = [InstalledJob("a", 1, row=0, base=0, slots=100, world=2),
                InstalledJob("b", 2, row=2, base=300, slots=100, world=2)]
    assert SwitchControl._place(existing, 200, None) == (1, 100)
    assert SwitchControl._place(existing, 201, None) == (1, 400)
    assert SwitchControl._place(existing, 10, 250) == (1, 250)
    with pytest.raises(SwitchControlError, match="base 350"):
        SwitchControl._place(existing, 10, 350)
    with pytest.raises(SwitchControlError, match="no free run"):
        SwitchControl._place(existing, P4_POOL - 199, None)
    full = [InstalledJob(str(r), r, row=r, base=r, slots=1, world=1) for r in range(MAX_JOBS)]
    with pytest.raises(SwitchControlError, match=f"{MAX_JOBS} jobs"):
        SwitchControl._place(full, 1, None)
