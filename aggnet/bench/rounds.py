"""Rounds of a benchmark: every system once per round, the order rotated.

On a shared machine the speed of everything drifts by tens of percent
within minutes, so a ratio of two systems measured minutes apart says as
much about the drift as about the systems. ``--rounds N`` runs each system
N times, alternating, and gives each round's ratios: systems measured
next to each other share the drift, and the spread of the per-round
ratios says what a ratio is worth on this machine.
"""

from __future__ import annotations

import statistics
from typing import Callable

#: record fields that are per all-reduce or per GB: a round's value stands
#: for the same thing in every round, so rounds are averaged
_AVERAGED = ("worker_cpu_s_per_gb", "aggregator_cpu_s_per_gb")


def order(systems: list[str], round_index: int) -> list[str]:
    """The systems in the order round ``round_index`` runs them: each
    starts a round in turn, so no system always runs right after another."""
    k = round_index % len(systems)
    return systems[k:] + systems[:k]


def label(round_index: int, rounds: int) -> str:
    """What a progress line adds for round ``round_index`` of ``rounds``
    (nothing when there is one)."""
    return f", round {round_index + 1}/{rounds}" if rounds > 1 else ""


def run_rounds(systems: list[str], run_one: Callable[[str], dict], rounds: int,
               on_run: Callable[[int, str], None] | None = None) -> tuple[list[dict], list[dict]]:
    """Run every system ``rounds`` times; returns one merged record per
    system (in ``systems``' order) and each round's median seconds by
    system. ``on_run(round, system)`` follows each run (progress)."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    by_system: dict[str, list[dict]] = {s: [] for s in systems}
    per_round = []
    for r in range(rounds):
        medians = {}
        for s in order(systems, r):
            rec = run_one(s)
            by_system[s].append(rec)
            medians[s] = rec["median_s"]
            if on_run is not None:
                on_run(r, s)
        per_round.append({s: medians[s] for s in systems})
    return [merge(by_system[s]) for s in systems], per_round


def merge(records: list[dict]) -> dict:
    """One system's records of several rounds as one: every repetition's
    time, the median over all of them, per-all-reduce bytes and CPU per GB
    averaged over the rounds, every checksum, exact only where every round
    was; the client's counters of the first round."""
    if len(records) == 1:
        return dict(records[0], round_medians=[records[0]["median_s"]])
    first = records[0]
    out = dict(first)
    out["times"] = [t for r in records for t in r["times"]]
    out["median_s"] = statistics.median(out["times"])
    out["round_medians"] = [r["median_s"] for r in records]
    for key in ("min_s", "max_s"):
        if key in first:
            out[key] = (min if key == "min_s" else max)(r[key] for r in records)
    if "reps" in first:
        out["reps"] = sum(r["reps"] for r in records)
    for key in _AVERAGED:
        if key in first:
            values = [r.get(key) for r in records]
            out[key] = None if any(v is None for v in values) else sum(values) / len(values)
    if "checksums" in first:
        out["checksums"] = [sum((r["checksums"][w] for r in records), []) for w in range(len(first["checksums"]))]
    if "per_worker" in first:
        out["per_worker"] = {h: {k: sum(r["per_worker"][h][k] for r in records) / len(records) for k in c}
                             for h, c in first["per_worker"].items()}
    if "uplinks" in first:
        out["uplinks"] = [{k: sum(r["uplinks"][i][k] for r in records) / len(records) for k in u}
                          for i, u in enumerate(first["uplinks"])]
    if "exact" in first:
        out["exact"] = [None if any(r["exact"][w] is None for r in records) else all(r["exact"][w] for r in records)
                        for w in range(len(first["exact"]))]
    if "cross_rack_bytes" in first:
        out["cross_rack_bytes"] = {k: sum(r["cross_rack_bytes"][k] for r in records) / len(records)
                                   for k in first["cross_rack_bytes"]}
    return out


def ratios(per_round: list[dict], pairs: list[tuple[str, str]]) -> dict[str, list[float]]:
    """``"a/b"``: each round's median time of a over b's, for each pair
    both of whose systems ran."""
    out = {}
    for a, b in pairs:
        if per_round and a in per_round[0] and b in per_round[0]:
            out[f"{a}/{b}"] = [r[a] / r[b] for r in per_round]
    return out


def ratio_lines(per_round: list[dict], pairs: list[tuple[str, str]]) -> list[str]:
    """A line per pair: each round's ratio, their median and range."""
    if len(per_round) < 2:
        return []
    lines = []
    for name, values in ratios(per_round, pairs).items():
        each = ", ".join(f"{v:.3f}" for v in values)
        lines.append(f"time {name} by round: {each}; median {statistics.median(values):.3f}, "
                     f"range {min(values):.3f}-{max(values):.3f}")
    return lines
