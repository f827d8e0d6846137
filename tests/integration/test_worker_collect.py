"""How an emulated run gathers its workers: the first worker to fail is
the one reported, at once, whatever its rank. A worker that died while
joining once left rank 0 waiting out its stall timeout, and the run then
reported rank 0's error (a rank that never contributed), a minute late
and naming a consequence instead of the cause."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from aggnet.emulation.netns import EmulationError
from aggnet.emulation.rack_runs import collect


def _worker(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_the_first_worker_to_fail_is_reported_at_once_and_the_others_killed():
    waiting = _worker("import time; time.sleep(120)")
    dying = _worker("import sys; print('the cause, in its own words', file=sys.stderr); sys.exit(3)")
    t0 = time.monotonic()
    with pytest.raises(EmulationError, match=r"rank 1\) failed first \(3\): the cause, in its own words"):
        collect([waiting, dying], 300, "test all-reduce")
    assert time.monotonic() - t0 < 30
    assert waiting.poll() is not None, "the rank still waiting was left running"


def test_workers_that_all_finish_give_their_last_lines_by_rank():
    procs = [_worker(f"import time; time.sleep({0.3 * (2 - r)}); print('noise'); print('{{\"rank\": {r}}}')")
             for r in range(3)]
    assert collect(procs, 60, "test all-reduce") == [{"rank": 0}, {"rank": 1}, {"rank": 2}]


def test_a_run_past_its_timeout_is_killed_and_says_so():
    procs = [_worker("import time; time.sleep(120)") for _ in range(2)]
    with pytest.raises(EmulationError, match="did not finish within 0.5s"):
        collect(procs, 0.5, "test all-reduce")
    assert all(p.poll() is not None for p in procs)


def test_a_worker_that_ends_without_its_result_is_named():
    waiting = _worker("import time; time.sleep(120)")
    silent = _worker("pass")
    with pytest.raises(EmulationError, match=r"rank 1\) ended without printing its result"):
        collect([waiting, silent], 60, "test all-reduce")
    assert waiting.poll() is not None
