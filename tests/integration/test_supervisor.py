"""hosts/supervisor.py over real processes: start with ready reports, the
error that names a shard that cannot start, exits noticed with their
status, restarts within limits, stop by SIGTERM then SIGKILL, SIGINT
ignored, and shards that die with their parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from aggnet.hosts.supervisor import RestartLimit, ShardStartError, ShardSupervisor
from harness.helpers import process_gone as _gone


def _serving(index, report, should_stop, detail=""):
    """A shard that reports ``detail`` and serves until told to stop."""
    report.ready(f"{detail}{index}")
    while not should_stop():
        time.sleep(0.01)


def _refusing(index, report, should_stop):
    if index == 1:
        report.failed(f"shard {index} cannot bind its port")
        return
    _serving(index, report, should_stop)


def _exiting(index, report, should_stop):
    if index == 1:
        os._exit(3)
    _serving(index, report, should_stop)


def _silent(index, report, should_stop):
    while not should_stop():
        time.sleep(0.01)


def _gated(index, report, should_stop, gate=None):
    """Reports ready once ``gate`` (a path) exists: a successor that takes
    as long as the test says to import and bind."""
    while gate is not None and not os.path.exists(gate) and not should_stop():
        time.sleep(0.01)
    report.ready(str(index))
    while not should_stop():
        time.sleep(0.01)


def _deaf(index, report, should_stop):
    report.ready()
    while True:  # never looks at should_stop
        time.sleep(0.01)



def _await(condition, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not met within {timeout:g}s")
        time.sleep(0.02)


@pytest.fixture
def supervisors():
    """Stops every supervisor a test made, whatever the test did."""
    made = []
    yield made
    for s in made:
        s.stop()


def _make(supervisors, *args, **kw) -> ShardSupervisor:
    sup = ShardSupervisor(*args, **kw)
    supervisors.append(sup)
    return sup


def test_every_shard_reports_ready_and_stops_at_sigterm_with_status_0(supervisors):
    sup = _make(supervisors, _serving, 3, lambda i: ("addr-",))
    assert sup.start() == ["addr-0", "addr-1", "addr-2"]
    assert [s.index for s in sup] == [0, 1, 2] and all(s.alive() for s in sup)
    assert len({s.pid for s in sup}) == 3 and os.getpid() not in {s.pid for s in sup}
    assert sup.exited() == []
    sup.stop()
    assert [s.exitcode for s in sup] == [0, 0, 0]
    assert all(_gone(s.pid) for s in sup)


def test_numbering_can_start_past_zero(supervisors):
    sup = _make(supervisors, _serving, 2, first=1)
    assert sup.start() == ["1", "2"]


def test_a_shard_that_cannot_start_is_named_and_the_others_are_killed(supervisors):
    sup = _make(supervisors, _refusing, 3)
    with pytest.raises(ShardStartError, match=r"^shard 1 cannot bind its port$"):
        sup.start()
    assert all(not s.alive() for s in sup)


def test_a_shard_that_exits_while_starting_is_named_with_its_status(supervisors):
    sup = _make(supervisors, _exiting, 2, label="switch-mode shard")
    with pytest.raises(ShardStartError, match=r"^switch-mode shard 1 exited with status 3 while starting"):
        sup.start()
    assert all(not s.alive() for s in sup)


def test_a_shard_that_never_reports_times_out_by_name(supervisors):
    sup = _make(supervisors, _silent, 1, start_timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(ShardStartError, match=r"^shard 0 did not start within 0.5s$"):
        sup.start()
    assert time.monotonic() - t0 < 10
    assert not sup[0].alive()


def test_exits_are_noticed_with_their_status_and_restarted_within_limits(supervisors):
    asked = []

    def args(i):
        asked.append(i)
        return (f"gen{len(asked)}-",)

    sup = _make(supervisors, _serving, 2, args, restart_method="fork", max_restarts=1, restart_window=60)
    sup.start()
    first = sup[1].pid
    os.kill(first, signal.SIGKILL)
    _await(lambda: sup.exited(), what="the killed shard noticed")
    [dead] = sup.exited()
    assert dead.index == 1 and dead.exitcode == -signal.SIGKILL
    # the restarted shard starts with what args() says now
    assert sup.restart(dead) == "gen3-1"
    assert asked == [0, 1, 1] and sup[1].pid != first and sup[1].alive()
    assert sup.restarts == 1 and sup.exited() == []
    os.kill(sup[1].pid, signal.SIGKILL)
    _await(lambda: sup.exited(), what="the killed shard noticed")
    with pytest.raises(RestartLimit, match=r"^shard 1 died 2 times within 60s$"):
        sup.restart(sup[1])
    assert sup[0].alive()


def test_a_restart_started_without_waiting_is_collected_once_the_successor_reports(supervisors, tmp_path):
    gate = tmp_path / "gate"
    starts = []

    def args(i):
        starts.append(i)
        return (str(gate) if len(starts) > 1 else None,)

    sup = _make(supervisors, _gated, 1, args, restart_method="fork")
    sup.start()
    os.kill(sup[0].pid, signal.SIGKILL)
    _await(lambda: sup.exited(), what="the killed shard noticed")
    t0 = time.monotonic()
    sup.begin_restart(sup[0])
    assert time.monotonic() - t0 < 2.0  # returns while the successor waits at its gate
    assert sup.restarting() == [sup[0]] and sup.exited() == [] and sup.restarts == 1
    assert sup.finish_restart(sup[0], wait=0.2) is None  # still starting
    gate.touch()
    _await(lambda: sup.finish_restart(sup[0], wait=0.1) is not None, what="the successor collected")
    assert sup.restarting() == [] and sup[0].alive() and sup[0].detail == "0"


def test_a_successor_that_never_reports_fails_its_restart_by_name(supervisors, tmp_path):
    starts = []

    def args(i):
        starts.append(i)
        return (str(tmp_path / "never") if len(starts) > 1 else None,)

    sup = _make(supervisors, _gated, 1, args, restart_method="fork", start_timeout=0.5)
    sup.start()
    os.kill(sup[0].pid, signal.SIGKILL)
    _await(lambda: sup.exited(), what="the killed shard noticed")
    sup.begin_restart(sup[0])
    with pytest.raises(ShardStartError, match=r"^shard 0 did not start within 0.5s$"):
        _await(lambda: sup.finish_restart(sup[0], wait=0.1) is not None, what="the successor's start to fail")
    assert not sup[0].alive() and sup.restarting() == []


def test_a_restart_may_spawn_a_fresh_interpreter(supervisors):
    sup = _make(supervisors, _serving, 1, restart_method="spawn")
    sup.start()
    os.kill(sup[0].pid, signal.SIGKILL)
    _await(lambda: sup.exited(), what="the killed shard noticed")
    assert sup.restart(sup[0]) == "0"
    sup.stop()
    assert sup[0].exitcode == 0


def test_sigint_is_ignored_and_sigterm_stops(supervisors):
    sup = _make(supervisors, _serving, 1)
    sup.start()
    pid = sup[0].pid
    # both pending at once: SIGINT (2) is delivered first; had it been
    # handled, the shard would end by KeyboardInterrupt with status 1
    os.kill(pid, signal.SIGINT)
    os.kill(pid, signal.SIGTERM)
    _await(lambda: sup.exited(), what="the shard stopped")
    assert sup[0].exitcode == 0


def test_a_shard_that_ignores_sigterm_is_killed_at_the_deadline(supervisors):
    sup = _make(supervisors, _deaf, 1, stop_timeout=0.5)
    sup.start()
    t0 = time.monotonic()
    sup.stop()
    assert time.monotonic() - t0 < 5
    assert sup[0].exitcode == -signal.SIGKILL


def test_shards_die_with_their_parent():
    code = textwrap.dedent("""
        import os, sys, time
        sys.path[:0] = [sys.argv[1], os.path.dirname(sys.argv[1])]  # this test's folder, and tests/ for harness
        from test_supervisor import _serving
        from aggnet.hosts.supervisor import ShardSupervisor
        sup = ShardSupervisor(_serving, 2)
        sup.start()
        print(" ".join(str(s.pid) for s in sup), flush=True)
        time.sleep(60)
    """)
    parent = subprocess.Popen([sys.executable, "-c", code, os.path.dirname(__file__)], stdout=subprocess.PIPE,
                              text=True)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2
        parent.kill()
        parent.wait(10)
        _await(lambda: all(_gone(p) for p in pids), what="shards gone with their parent")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
        parent.stdout.close()
