"""A datagram path has no connection whose closing says a worker died: a
host in switch mode hears its members' heartbeats instead, and tells the
others at once when one stops (docs/protocol.md "A worker that dies")."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest

from aggnet import Client
from aggnet.errors import AggregationTimeout

_RANK_1 = """
import sys, time
import numpy as np
from aggnet import Client
c = Client(sys.argv[1], job=sys.argv[2], rank=1, world_size=2, timeout=60)
c.allreduce(np.ones(1000, np.float32)).result(timeout=60)
print("summed", flush=True)
sys.stdin.readline()
time.sleep(float(sys.argv[3]))  # busy elsewhere (an evaluation), or nothing
try:
    out = c.allreduce(np.ones(1000, np.float32)).result(timeout=30)
    print("summed again", float(out[0]), flush=True)
except Exception as exc:
    print(type(exc).__name__, exc, flush=True)
c.close()
"""


def _rank_1(address: str, job: str, idle_s: float = 0.0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _RANK_1, address, job, str(idle_s)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def test_a_paused_worker_is_dropped_and_told_so_when_it_wakes(service_factory):
    """SIGSTOP is a hung host as the aggregator sees it: its heartbeats stop.
    The survivor's all-reduce fails within the lapse (3 s) and two seconds
    naming it; the paused worker, woken, hears that it is no longer a
    member instead of waiting for its own timeout."""
    svc = service_factory("udp")  # its own: a shared one counts other tests' killed workers
    job = f"paused-{uuid.uuid4().hex[:6]}"
    other = _rank_1(svc.address, job)
    try:
        with Client(svc.address, job=job, rank=0, world_size=2, timeout=60) as c:
            c.allreduce(np.ones(1000, np.float32)).result(timeout=60)
            assert other.stdout.readline().strip() == "summed"
            os.kill(other.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            pending = c.allreduce(np.ones(200_000, np.float32))
            with pytest.raises(AggregationTimeout, match=r"rank 1 of job .* sent no heartbeat .* for 3\.\ds"):
                pending.result(timeout=60)
            assert time.monotonic() - t0 < 5
            os.kill(other.pid, signal.SIGCONT)
            other.stdin.write("go\n")
            other.stdin.flush()
            woke = other.stdout.readline()
            assert woke.startswith("AggregationError") and "no longer counts this worker as a member" in woke, woke
    finally:
        if other.poll() is None:
            os.kill(other.pid, signal.SIGCONT)
            other.kill()
        other.wait(10)
    totals = svc.new_counts()
    assert totals["members_disconnected"] == 1 and totals["heartbeats_of_non_members"] >= 1


def test_a_worker_that_is_only_slow_to_call_stays_a_member(service_factory):
    """Heartbeats come from a thread of their own: a worker that calls its
    next all-reduce seconds later (longer than the lapse) is alive, and the round
    completes."""
    svc = service_factory("udp")  # its own: a shared one counts other tests' killed workers
    job = f"slow-{uuid.uuid4().hex[:6]}"
    other = _rank_1(svc.address, job, idle_s=4.0)
    try:
        with Client(svc.address, job=job, rank=0, world_size=2, timeout=60) as c:
            c.allreduce(np.ones(1000, np.float32)).result(timeout=60)
            assert other.stdout.readline().strip() == "summed"
            other.stdin.write("go\n")
            other.stdin.flush()
            out = c.allreduce(np.ones(1000, np.float32)).result(timeout=30)
            assert out[0] == 2.0
            assert other.stdout.readline().split() == ["summed", "again", "2.0"]
    finally:
        other.kill()
        other.wait(10)
    assert svc.new_counts()["members_disconnected"] == 0


_BOTH_RANKS = """
import sys, threading, time
import numpy as np
from aggnet import Client
clients = [Client(sys.argv[1], job=sys.argv[2], rank=r, world_size=2, timeout=30) for r in range(2)]
for p in [c.allreduce(np.ones(1000, np.float32)) for c in clients]:
    p.result(timeout=30)
print("summed", flush=True)
sys.stdin.readline()
t0 = time.monotonic()
said = []
for r, p in enumerate([c.allreduce(np.ones(1000, np.float32)) for c in clients]):
    try:
        p.result(timeout=30)
        said.append(f"rank {r} summed")
    except Exception as exc:
        said.append(f"rank {r} {type(exc).__name__} after {time.monotonic() - t0:.1f}s: {exc}")
print("\\n".join(said), flush=True)
for c in clients:
    c.close()
"""


def test_workers_whose_whole_job_lapsed_are_told_when_they_wake(service_factory):
    """Every member paused (one host with both ranks stopped, or cut off):
    the host drops them all and with the last one the job. Woken, the rank
    that heard no ERROR (the first to lapse) learns from its next heartbeat
    that it is no longer a member, at once, instead of waiting out its
    timeout."""
    svc = service_factory("udp")  # its own: a shared one counts other tests' killed workers
    job = f"all-paused-{uuid.uuid4().hex[:6]}"
    ranks = subprocess.Popen([sys.executable, "-c", _BOTH_RANKS, svc.address, job], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert ranks.stdout.readline().strip() == "summed"
        os.kill(ranks.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while svc.new_counts()["members_disconnected"] < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(ranks.pid, signal.SIGCONT)
        ranks.stdin.write("go\n")
        ranks.stdin.flush()
        said = [ranks.stdout.readline().strip() for _ in range(2)]
    finally:
        if ranks.poll() is None:
            os.kill(ranks.pid, signal.SIGCONT)
            ranks.kill()
        ranks.wait(10)
    assert svc.new_counts()["members_disconnected"] == 2
    # the host drops one rank first, and tells the other, still a member
    # then, which rank went; that one learns from its own heartbeat.
    # Which lapses first is the host's timing (both were stopped at once)
    first = 0 if "no longer counts this worker" in said[0] else 1
    other = 1 - first
    assert said[first].startswith(f"rank {first} AggregationError after") and \
        "no longer counts this worker" in said[first], said
    assert said[other].startswith(f"rank {other} AggregationTimeout after") and f"rank {first} of job" in said[other], \
        said
    assert all(float(line.split(" after ")[1].split("s:")[0]) < 5 for line in said), said


_TWO_RANKS = """
import sys
import numpy as np
from aggnet import Client
clients = [Client(sys.argv[1], job=sys.argv[2], rank=r, world_size=2, timeout=30) for r in range(2)]
print("lapse", *[c.heartbeat_lapse for c in clients], flush=True)
for _ in range(2):
    pending = [c.allreduce(np.full(1000, r + 1.0, np.float32)) for r, c in enumerate(clients)]
    print("sums", *[float(p.result(timeout=20)[0]) for p in pending], flush=True)
for c in clients:
    c.close()
"""


def test_the_aggregators_own_pause_drops_no_member():
    """Silence counts only while the aggregator listened. A pass of its
    loop longer than the lapse (here one send of results that stalls 3 s;
    a first packet compiling the data path on a cold cache did it, as can
    a loaded host) leaves every member's heartbeats queued in its socket:
    the members stay, and the next all-reduce sums."""
    from aggnet.hosts.switch import SwitchService

    svc = SwitchService("udp://127.0.0.1:0", pool=64, heartbeat_lapse=1.5)
    stalls = []
    send = svc.plan.send

    def stalled_send(sock, runs):
        if runs and not stalls:
            stalls.append(time.monotonic())
            time.sleep(3.0)
        send(sock, runs)

    svc.plan.send = stalled_send
    stop = threading.Event()
    loop = threading.Thread(target=svc.serve, args=(stop.is_set,), name="switch-under-test", daemon=True)
    loop.start()
    try:
        # the workers in a process of their own: their heartbeat threads do
        # not wait for this process's GIL
        ranks = subprocess.run([sys.executable, "-c", _TWO_RANKS, str(svc.address), f"pause-{uuid.uuid4().hex[:6]}"],
                               capture_output=True, text=True, timeout=120)
    finally:
        stop.set()
        loop.join(10)
    assert ranks.returncode == 0, ranks.stderr[-3000:]
    assert ranks.stdout.splitlines() == ["lapse 1.5 1.5", "sums 3.0 3.0", "sums 3.0 3.0"], ranks.stdout
    assert len(stalls) == 1
    assert svc.control_counters["own_pauses"] >= 1
    assert svc.control_counters["members_disconnected"] == 0


_FIRST_JOB = """
import json, threading
import numpy as np
from aggnet import Client
from aggnet.hosts import switch_datapath
from aggnet.hosts.switch import SwitchService

kernels = (switch_datapath.process_batch, switch_datapath.plan_sends)
svc = SwitchService("udp://127.0.0.1:0", pool=64, heartbeat_lapse=10.0)
ready = [len(k.signatures) for k in kernels]
stop = threading.Event()
loop = threading.Thread(target=svc.serve, args=(stop.is_set,), daemon=True)
loop.start()
clients = [Client(str(svc.address), job="first", rank=r, world_size=2, timeout=30) for r in range(2)]
sums = [float(p.result(30)[0]) for p in [c.allreduce(np.ones(5000, np.float32)) for c in clients]]
for c in clients:
    c.close()
stop.set()
loop.join(10)
print(json.dumps({"ready": ready, "after": [len(k.signatures) for k in kernels], "sums": sums}))
"""


def test_a_switch_service_has_its_data_path_compiled_before_it_serves():
    """The first packet of a fresh process's first job finds the kernels
    ready: compiled at that packet instead, a fresh install's (cold cache)
    loop stopped listening for seconds, and its first members lapsed."""
    out = subprocess.run([sys.executable, "-c", _FIRST_JOB], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen["sums"] == [2.0, 2.0]
    assert seen["ready"] == [1, 1] and seen["after"] == seen["ready"], seen
