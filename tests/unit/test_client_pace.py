"""The switch client's per-batch bookkeeping kernels (kernels/datagrams.py
note_sends, look_at_results), on arrays in memory, beside the numpy
expressions they replace: a wrong timer or a wrong run of slots would show
end to end only as stray retransmissions or packets sent to the wrong
shard."""

from __future__ import annotations

import numpy as np
import pytest

from aggnet.kernels import datagrams as dg

S = 64


def _pace(rng, sharded: bool):
    busy = rng.random(S) < 0.5
    dest = (np.arange(S) // 16 if sharded else np.zeros(S, np.int64)).astype(np.int64) + 1000
    return dg.Pace(rng.random(S), rng.random(S), rng.random(S) < 0.5, rng.random(S) < 0.5,
                   rng.integers(0, 100, S), rng.integers(0, 100, S), busy, dest, np.zeros(S + 1, np.int64))


def _copy(p):
    return dg.Pace(*(a.copy() if isinstance(a, np.ndarray) else a for a in p))


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("fresh", [False, True])
def test_note_sends_sets_the_timers_and_cuts_the_runs_numpy_would(seed, sharded, fresh):
    rng = np.random.default_rng(seed)
    pace = _pace(rng, sharded)
    want = _copy(pace)
    # runs of consecutive slots, some broken, in any order
    start = int(rng.integers(0, S - 20))
    slots = np.arange(start, start + int(rng.integers(1, 20)), dtype=np.int64)
    if seed % 3 == 0:
        slots = rng.permutation(slots)
    n, now, base_rto, seen = slots.size, 123.5, 0.25, 77
    runs = dg.note_sends(pace, slots, n, now, fresh, base_rto, seen, sharded)
    if fresh:
        want.rto[slots] = base_rto
        want.first_try[slots] = True
        want.fast_done[slots] = False
        want.results_at_send[slots] = seen
        want.older_at_send[slots] = int(np.count_nonzero(want.busy))
    want.sent_at[slots] = now
    for name in ("sent_at", "rto", "first_try", "fast_done", "results_at_send", "older_at_send"):
        assert np.array_equal(getattr(pace, name), getattr(want, name)), name
    breaks = slots[1:] != slots[:-1] + 1
    if sharded:
        dests = want.slot_dest[slots]
        breaks |= dests[1:] != dests[:-1]
    ends = [*(np.flatnonzero(breaks) + 1).tolist(), n]
    assert pace.runs[:runs].tolist() == ends


@pytest.mark.parametrize("seed", range(20))
def test_look_at_results_samples_the_middle_clean_result_and_finds_one_request(seed):
    rng = np.random.default_rng(seed)
    pace = _pace(rng, False)
    rid = rng.integers(0, 2, S) if seed % 2 else np.full(S, 5, np.int64)
    res_slot = rng.permutation(S).astype(np.int64)
    m = int(rng.integers(1, 12))
    sent, one = dg.look_at_results(pace, rid, res_slot, m, float("nan"))
    slots = res_slot[:m]
    clean = slots[pace.first_try[slots]]
    if clean.size:
        assert sent == pace.sent_at[clean[clean.size // 2]]
    else:
        assert sent != sent
    rids = rid[slots]
    if (rids == rids[0]).all():
        assert one == rids[0]
    else:
        assert one != one
