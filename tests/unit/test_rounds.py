"""Rounds of a benchmark: the systems alternate, each round's ratios are
kept, and a system's rounds merge into one record."""

from __future__ import annotations

import pytest

from aggnet.bench import rounds


def _record(system: str, times: list[float], cpu: float, agg: float | None = None, sums=None) -> dict:
    return {"system": system, "times": times, "median_s": sorted(times)[len(times) // 2], "worker_cpu_s_per_gb": cpu,
            "aggregator_cpu_s_per_gb": agg, "checksums": sums or [[1.5] * len(times), [1.5] * len(times)],
            "per_worker": {"w0": {"tx_bytes": 100.0 * cpu}, "w1": {"tx_bytes": 200.0 * cpu}},
            "client_stats": [{"round": cpu}]}


def test_each_round_starts_with_the_next_system():
    systems = ["aggnet", "gloo", "floor"]
    assert [rounds.order(systems, r) for r in range(4)] == [
        ["aggnet", "gloo", "floor"], ["gloo", "floor", "aggnet"], ["floor", "aggnet", "gloo"],
        ["aggnet", "gloo", "floor"]]


def test_run_rounds_runs_every_system_each_round_and_keeps_each_rounds_medians():
    ran, seen = [], []
    speed = {"a": 1.0, "b": 2.0}

    def run_one(s):
        ran.append(s)
        k = len(ran)
        return _record(s, [speed[s] * k, speed[s] * k], cpu=float(k))

    merged, per_round = rounds.run_rounds(["a", "b"], run_one, 3, lambda r, s: seen.append((r, s)))
    assert ran == ["a", "b", "b", "a", "a", "b"]
    assert seen == [(0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b")]
    assert per_round == [{"a": 1.0, "b": 4.0}, {"a": 4.0, "b": 6.0}, {"a": 5.0, "b": 12.0}]
    a, b = merged
    assert a["system"] == "a" and b["system"] == "b"
    assert a["times"] == [1.0, 1.0, 4.0, 4.0, 5.0, 5.0] and a["median_s"] == 4.0
    assert a["round_medians"] == [1.0, 4.0, 5.0]
    assert a["worker_cpu_s_per_gb"] == pytest.approx((1 + 4 + 5) / 3)
    assert a["per_worker"]["w1"]["tx_bytes"] == pytest.approx(200.0 * 10 / 3)
    assert a["client_stats"] == [{"round": 1.0}]  # the first round's counters
    assert len(a["checksums"][0]) == 6


def test_merge_keeps_unknown_aggregator_cpu_unknown_and_exact_only_where_every_round_was():
    one = dict(_record("x", [1.0], 1.0, agg=2.0), exact=[True, True], uplinks=[{"up": 10.0}],
               cross_rack_bytes={"up": 10.0})
    two = dict(_record("x", [3.0], 1.0, agg=None), exact=[True, False], uplinks=[{"up": 30.0}],
               cross_rack_bytes={"up": 30.0})
    m = rounds.merge([one, two])
    assert m["aggregator_cpu_s_per_gb"] is None
    assert m["exact"] == [True, False]
    assert m["uplinks"] == [{"up": 20.0}] and m["cross_rack_bytes"] == {"up": 20.0}
    assert m["median_s"] == 2.0
    single = rounds.merge([one])
    assert single["round_medians"] == [1.0] and single["times"] == [1.0]


def test_ratio_lines_give_each_rounds_ratio_for_pairs_that_ran():
    per_round = [{"aggnet": 1.0, "gloo": 2.0}, {"aggnet": 3.0, "gloo": 2.0}, {"aggnet": 2.0, "gloo": 2.0}]
    lines = rounds.ratio_lines(per_round, [("aggnet", "gloo"), ("aggnet", "floor")])
    assert lines == ["time aggnet/gloo by round: 0.500, 1.500, 1.000; median 1.000, range 0.500-1.500"]
    assert rounds.ratio_lines(per_round[:1], [("aggnet", "gloo")]) == []  # one round: the table says it


def test_no_rounds_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        rounds.run_rounds(["a"], lambda s: _record(s, [1.0], 1.0), 0)
