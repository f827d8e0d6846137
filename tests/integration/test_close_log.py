"""A worker that dies without LEAVE is logged by the aggregator that
outlives it, and not by one stopped with it (a Ctrl-C that ends a harness's
workers and then the aggregator it started for them)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

from aggnet.hosts.shard import CLOSE_LOG_DELAY
from aggnet.protocol import wire
from aggnet.transport import connect

LINE = "connection closed without LEAVE"
_WORKER = """
import os, signal, sys
import numpy as np
from aggnet import Client
c = Client(sys.argv[1], job="closes", rank=0, world_size=1, timeout=30)
c.allreduce(np.ones(1000, np.float32)).result(30)
os.kill(os.getpid(), signal.SIGKILL)  # no LEAVE, no close: as a crash
"""


def _serve() -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, "-m", "aggnet", "serve", "--listen", "zmq+tcp://127.0.0.1:0", "--shards",
                          "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    line = p.stdout.readline().decode().split()
    assert line[:2] == ["aggnet", "serving"], line
    return p, line[2]


def _kill_a_worker_and_wait_for_its_count(address: str) -> None:
    w = subprocess.run([sys.executable, "-c", _WORKER, address], capture_output=True, text=True, timeout=120)
    assert w.returncode == -signal.SIGKILL, w.stderr[-2000:]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with connect([address]) as conn:
            conn.send(0, wire.Header(wire.MsgType.STATS).pack())
            msg = conn.recv(10)
        if msg and wire.parse_json(msg.payload)["totals"].get("members_disconnected"):
            return
        time.sleep(0.02)
    raise AssertionError("the service never counted the killed worker")


def _stderr_until(p: subprocess.Popen, text: str, seconds: float) -> str:
    """What the service wrote to stderr until ``text`` (read from the
    descriptor: a buffered reader could hold lines select cannot see)."""
    seen, deadline, fd = b"", time.monotonic() + seconds, p.stderr.fileno()
    while text.encode() not in seen and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        seen += chunk
    return seen.decode()


def test_a_running_aggregator_logs_a_worker_that_died_without_leave():
    p, address = _serve()
    try:
        _kill_a_worker_and_wait_for_its_count(address)
        said = _stderr_until(p, LINE, 10)
        assert "job 'closes' rank 0's " + LINE in said, said
    finally:
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=30)


def test_an_aggregator_stopped_with_its_workers_does_not_report_them():
    p, address = _serve()
    try:
        _kill_a_worker_and_wait_for_its_count(address)
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
        took = time.monotonic() - t0
        err = err.decode()
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err
    # a stop that took longer than the delay may have logged it, rightly
    if took < CLOSE_LOG_DELAY * 0.8:
        assert LINE not in err, err
    assert "Traceback" not in err, err
