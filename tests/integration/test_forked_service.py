"""``aggnet serve`` forked from the fork server (aggnet.processes.forked) behaves as
the exec'd command does for whoever started it: it serves, it leads a
process group of its own with its shards in it, SIGTERM stops it with
status 0 and a kill reads as the signal; a detached one outlives the
process that started it without holding that process's exit up."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np

from aggnet import Client
from aggnet.processes.forked import ForkedPopen
from aggnet.processes import ServiceProcess
from harness.helpers import child_pids, process_gone


def _address() -> str:
    return f"zmq+ipc://{tempfile.mkdtemp(prefix='aggnet-fs-')}/s.sock"


def _sum_of_two(address: str) -> list:
    def run(rank):
        with Client(address, job=f"forked-{os.getpid()}", rank=rank, world_size=2, connect_timeout=30) as c:
            buf = np.full(1000, rank + 1, np.int32)
            c.allreduce(buf).result(timeout=60)
            return buf
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return list(pool.map(run, range(2)))


def _started(pid: int) -> int | None:
    """When ``pid`` started (clock ticks after boot), None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _wait_gone(pids, timeout: float = 30.0) -> bool:
    """Whether every one of ``pids`` ends within ``timeout``. A pid taken
    again meanwhile (by a process or thread started later: pid_max may be
    32768 on a busy machine) counts as gone."""
    born = {p: _started(p) for p in pids}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(process_gone(p) or _started(p) != born[p] for p in pids):
            return True
        time.sleep(0.05)
    return False


def _states(pids) -> dict:
    """What /proc says of each process still there (state, parent, command
    line): what a failure needs to be explained."""
    out = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{pid}/wchan") as f:
                wchan = f.read()
            out[pid] = {"state": fields[0], "ppid": int(fields[1]), "started": int(fields[19]), "wchan": wchan,
                        "cmd": cmd[:200]}
        except OSError:
            out[pid] = "gone"
    return out


def test_a_forked_service_serves_leads_its_group_and_stops_with_status_0():
    # the suite's process keeps a fork server (conftest.py)
    svc = ServiceProcess(_address(), shards=2, parent_pid=os.getpid())
    try:
        assert isinstance(svc.process, ForkedPopen)
        assert os.getsid(svc.pid) == svc.pid and os.getpgid(svc.pid) == svc.pid
        with open(f"/proc/{svc.pid}/comm") as f:
            assert f.read().strip() == "aggnet serve"  # what top and pgrep show
        shards = child_pids(svc.pid)
        assert len(shards) == 2 and all(os.getpgid(p) == svc.pid for p in shards), shards
        assert all((b == 3).all() for b in _sum_of_two(svc.address))
    finally:
        code = svc.stop()
    assert code == 0
    assert _wait_gone(shards), "a shard outlived its service"


def test_a_forked_childs_status_reads_the_same_from_every_thread():
    """Emulated workers came back with status 255 now and then (taken for
    children whose fork server had died), though each had returned 0:
    multiprocessing polls every child it started whenever another thread
    starts one (``aggnet stats`` during a chaos run), and its poll reads
    the child's status from a pipe without a lock, so the second of two
    readers found the pipe at its end. Polled from a second thread all
    the while, every child here reads as what it returned."""
    import multiprocessing
    import threading

    codes = []
    for i in range(12):
        argv = ["platform"] if i % 2 == 0 else ["json.tool", "/nonexistent"]  # 0, and 2 from a usage error
        p = ForkedPopen([sys.executable, "-m", *argv], preload=(), stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL)
        waiter = threading.Thread(target=p.wait, daemon=True)
        waiter.start()
        while waiter.is_alive():
            multiprocessing.active_children()  # what starting another child does first
            p.poll()
        codes.append(p.returncode)
    assert codes == [0, 2] * 6


def test_a_killed_forked_service_reads_as_the_signal_and_takes_its_shards():
    svc = ServiceProcess(_address(), shards=2)
    shards = child_pids(svc.pid)
    os.kill(svc.pid, signal.SIGKILL)
    assert svc.process.wait(timeout=30) == -signal.SIGKILL
    assert not svc.alive() and svc.stop() == -signal.SIGKILL
    assert _wait_gone(shards), f"a shard outlived its killed service: {_states(shards)}"


def test_with_exec_children_set_the_service_is_a_fresh_interpreter(monkeypatch):
    monkeypatch.setenv("AGGNET_EXEC_CHILDREN", "1")
    with ServiceProcess(_address(), shards=1) as svc:
        assert type(svc.process) is subprocess.Popen
        assert all((b == 3).all() for b in _sum_of_two(svc.address))


STARTER = textwrap.dedent("""
    import sys
    from aggnet.processes import NUMPY_WORKER_PRELOAD, ServiceProcess, fork_server

    if __name__ == "__main__":
        fork_server(NUMPY_WORKER_PRELOAD)
        svc = ServiceProcess(sys.argv[1], shards=1)
        print(type(svc.process).__name__, svc.pid, flush=True)
        svc.detach()
""")


def test_a_detached_forked_service_does_not_hold_up_its_starters_exit(tmp_path):
    script = tmp_path / "starter.py"
    script.write_text(STARTER)
    # the service keeps the starter's stderr, as an exec'd one would: a file
    # here, since a pipe would stay open as long as the service runs
    with open(tmp_path / "stderr", "w") as err:
        starter = subprocess.run([sys.executable, str(script), _address()], stdout=subprocess.PIPE, stderr=err,
                                 text=True, timeout=60)
    assert starter.returncode == 0, (tmp_path / "stderr").read_text()
    kind, pid = starter.stdout.split()
    assert kind == "ForkedPopen"
    try:
        assert not process_gone(int(pid)), "the detached service stopped with its starter"
    finally:
        os.killpg(int(pid), signal.SIGKILL)


KEPT_TO_THE_END = textwrap.dedent("""
    import builtins, sys
    from aggnet.processes import NUMPY_WORKER_PRELOAD, ServiceProcess, fork_server

    if __name__ == "__main__":
        fork_server(NUMPY_WORKER_PRELOAD)
        svc = ServiceProcess(sys.argv[1], shards=1)
        print(svc.pid, flush=True)
        svc.detach()
        # held by what the interpreter clears last (a test framework's
        # registry, a module torn down late): collected with imports gone
        builtins.kept_to_the_end = svc.process
""")


def test_a_forked_child_still_held_at_exit_leaves_no_traceback(tmp_path):
    """Popen.__del__ polls a child still running when the starter exits;
    multiprocessing's poll would import, and at that point the interpreter
    can import nothing ("Exception ignored ... ImportError" on stderr)."""
    script = tmp_path / "starter.py"
    script.write_text(KEPT_TO_THE_END)
    with open(tmp_path / "stderr", "w") as err:
        starter = subprocess.run([sys.executable, str(script), _address()], stdout=subprocess.PIPE, stderr=err,
                                 text=True, timeout=60)
    said = (tmp_path / "stderr").read_text()
    try:
        assert starter.returncode == 0, said
        assert "Traceback" not in said and "Exception ignored" not in said, said
    finally:
        os.killpg(int(starter.stdout.split()[0]), signal.SIGKILL)
