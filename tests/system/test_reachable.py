"""A service listening on a wildcard address serves workers on other hosts.

The service runs in the rack's aggregator namespace on 0.0.0.0 (or [::]);
each worker is a process in a namespace of its own that reaches it at
10.77.0.254 (or fd00:77::fe), as a worker on another machine would. The
service's shard map names the wildcard (or --advertise HOST); the workers
must end up at addresses they can reach, on every network transport."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from aggnet.emulation.netns import Rack, can_emulate

OK, WHY = can_emulate()
pytestmark = [pytest.mark.requires_netns, pytest.mark.skipif(not OK, reason=f"no network namespaces here: {WHY}")]

WORKER = str(Path(__file__).resolve().parents[1] / "harness" / "remote_worker.py")
SIZE = 300_000  # more than one chunk on every shard
V6_PREFIX = "fd00:77::"


def _ucxx() -> bool:
    try:
        import ucxx  # noqa: F401
    except Exception:
        return False
    return True


@pytest.fixture(scope="module")
def rack():
    with Rack(2, prefix=f"agr{os.getpid() % 10000}") as r:
        # IPv6 beside IPv4 on the same cables; nodad: usable at once
        for i, h in enumerate(r.hosts):
            r.run(h, ["ip", "-6", "addr", "add", f"{V6_PREFIX}{i + 1:x}/64", "dev", h.dev, "nodad"])
        r.wait_reachable()
        yield r


def _v6(rack, host) -> str:
    return f"{V6_PREFIX}{rack.hosts.index(host) + 1:x}"


def _serve(rack, listen: str, *extra: str) -> subprocess.Popen:
    """``aggnet serve`` on the aggregator host; returns once it serves."""
    p = rack.popen(rack.aggregator, [sys.executable, "-m", "aggnet", "serve", "--listen", listen, "--shards",
                                     "2", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready, _, _ = select.select([p.stdout], [], [], 1.0)
        if ready:
            line = p.stdout.readline()
            if line.startswith("aggnet serving"):
                return p
            if not line:
                break
    p.kill()
    raise AssertionError(f"aggnet serve --listen {listen} did not start: {p.stderr.read()[-2000:]}")


def _workers(rack, address: str, connect_timeout: float = 20.0) -> list[str]:
    job = f"remote-{uuid.uuid4().hex[:8]}"
    procs = [rack.popen(w, [sys.executable, WORKER, address, job, str(r), str(len(rack.workers)), str(SIZE),
                            str(connect_timeout)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r, w in enumerate(rack.workers)]
    lines = []
    for p in procs:
        out, err = p.communicate(timeout=connect_timeout + 90)
        lines.append(out.strip().splitlines()[-1] if out.strip() else f"no output: {err[-2000:]}")
    return lines


def _expected(world: int) -> str:
    v = np.arange(SIZE, dtype=np.float32) * sum(r + 1 for r in range(world))
    return f"sum {float(v.astype(np.float64).sum())!r}"


def _stop(p: subprocess.Popen) -> None:
    p.terminate()
    try:
        p.wait(15)
    except subprocess.TimeoutExpired:
        p.kill()


CASES = [
    pytest.param("zmq+tcp", "0.0.0.0", id="zmq+tcp-ipv4"),
    pytest.param("zmq+tcp", "::", id="zmq+tcp-ipv6"),
    pytest.param("ucx", "0.0.0.0", id="ucx-ipv4",
                 marks=pytest.mark.skipif(not _ucxx(), reason="ucxx is not installed (pip install aggnet[rdma])")),
    pytest.param("udp", "0.0.0.0", id="switch-mode-ipv4"),
]


@pytest.mark.parametrize("scheme,wildcard", CASES)
def test_workers_on_other_hosts_reach_a_service_on_a_wildcard_address(rack, scheme, wildcard):
    port = 15555
    listen = f"{scheme}://{'[::]' if wildcard == '::' else wildcard}:{port}"
    extra = ("--mode", "switch") if scheme == "udp" else ()
    host = f"[{_v6(rack, rack.aggregator)}]" if wildcard == "::" else rack.aggregator.ip
    svc = _serve(rack, listen, *extra)
    try:
        got = _workers(rack, f"{scheme}://{host}:{port}")
    finally:
        _stop(svc)
    assert got == [_expected(len(rack.workers))] * len(rack.workers)


def test_the_shard_map_names_the_advertised_host(rack):
    """--advertise puts its host in HELLO's shard map; workers use it."""
    svc = _serve(rack, "zmq+tcp://0.0.0.0:15565", "--advertise", rack.aggregator.ip)
    try:
        stats = subprocess.run(["ip", "netns", "exec", rack.workers[0].name, sys.executable, "-m", "aggnet",
                                "stats", f"zmq+tcp://{rack.aggregator.ip}:15565"],
                               capture_output=True, text=True, timeout=60)
        got = _workers(rack, f"zmq+tcp://{rack.aggregator.ip}:15565")
    finally:
        _stop(svc)
    assert f"zmq+tcp://{rack.aggregator.ip}:15566" in stats.stdout, stats.stdout + stats.stderr
    assert got == [_expected(len(rack.workers))] * len(rack.workers)


def test_an_unreachable_advertised_host_is_named_with_the_fix(rack):
    """A service that advertises a host its workers cannot reach: the error
    says which address it advertised and how to change it."""
    svc = _serve(rack, "zmq+tcp://0.0.0.0:15575", "--advertise", "10.77.0.200")
    try:
        got = _workers(rack, f"zmq+tcp://{rack.aggregator.ip}:15575", connect_timeout=3)
    finally:
        _stop(svc)
    for line in got:
        assert line.startswith("error AggregatorUnreachable"), line
        assert "advertised its shards as zmq+tcp://10.77.0.200:15576" in line, line
        assert "--advertise HOST" in line, line
