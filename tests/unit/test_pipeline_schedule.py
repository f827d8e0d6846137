"""The asynchronous pipeline's order of passes, and the version
differences SpecTrain predicts over, counted on the schedule's timeline."""

from __future__ import annotations

import pytest

from aggnet.pipeline.schedule import MODES, Op, paper_versions, stage_order, timeline, version_differences


@pytest.mark.parametrize("stages", range(1, 9))
def test_counted_version_differences_equal_the_papers_formulas_when_passes_take_equal_time(stages):
    assert version_differences(stages) == [paper_versions(k, stages) for k in range(stages)]


def test_the_papers_worked_example_for_four_stages():
    assert [paper_versions(k, 4) for k in range(4)] == [(3, 0), (2, 0), (2, 1), (1, 1)]


def test_a_slower_backward_changes_the_counts():
    # a backward twice as long as a forward: a batch's gradient takes longer
    # to travel down, and the later stages are updated more in the meantime
    slow = version_differences(4, forward=1.0, backward=2.0)
    assert slow != version_differences(4)
    assert slow[3][1] > paper_versions(3, 4)[1]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stages", [1, 2, 4, 5])
def test_every_stage_runs_each_batch_once_each_way_forward_first(mode, stages):
    batches = 9
    for k in range(stages):
        order = stage_order(k, stages, batches, mode)
        assert sorted(order, key=lambda o: (o.kind, o.batch)) == (
            [Op("B", i) for i in range(batches)] + [Op("F", i) for i in range(batches)])
        in_flight = peak = 0
        for op in order:
            in_flight += 1 if op.kind == "F" else -1
            peak = max(peak, in_flight)
            assert in_flight >= 0
        # 1F1B keeps N - k batches in flight at stage k; sync keeps one
        assert peak == (1 if mode == "sync" else min(stages - k, batches))


def test_sync_completes_each_batch_before_the_next_starts_anywhere():
    t = timeline(4, 5, "sync")
    for i in range(4):
        assert t[(0, Op("B", i))][1] <= min(t[(k, Op("F", i + 1))][0] for k in range(4))


def test_the_asynchronous_schedule_keeps_the_first_stage_busy_in_steady_state():
    t = timeline(4, 40, "spectrain")
    busy = sorted(v for (k, _), v in t.items() if k == 0)
    middle = busy[20:60]
    assert all(b[0] == a[1] for a, b in zip(middle, middle[1:]))


def test_bad_arguments_say_what_is_allowed():
    with pytest.raises(ValueError, match="mode must be one of"):
        stage_order(0, 2, 3, "pipedream")
    with pytest.raises(ValueError, match=r"stage must be in \[0, 2\)"):
        stage_order(2, 2, 3)
    with pytest.raises(ValueError, match="durations must be positive"):
        version_differences(2, backward=0)
