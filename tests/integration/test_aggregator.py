"""Both aggregator kinds through hosts/aggregator.py's interface (what
``aggnet serve`` and the metrics exporter rely on), and what `aggnet serve`
does when a shard process of either kind dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import uuid

import numpy as np
import pytest

from aggnet import Client
from aggnet import metrics
from aggnet.hosts.aggregator import Aggregator
from harness.helpers import child_pids as _children, process_gone as _gone

K = 64


def _service():
    from aggnet.hosts import service

    return service.start(f"zmq+ipc://{tempfile.mkdtemp(prefix='agg-')}/agg.sock", shards=2)


def _switch():
    from aggnet.hosts.switch import SwitchService

    # its loop shares this process (and its GIL) with the clients under
    # test: a heartbeat lapse meant for a separate process (1.5 s) dropped them
    # once on a loaded machine; heartbeats are tested in test_torch_faults
    return SwitchService("udp://127.0.0.1:0", pool=64, elements=K, shards=2, heartbeat_lapse=10.0)




@pytest.mark.parametrize("make", [_service, _switch], ids=["service", "switch"])
@pytest.mark.slow
def test_each_kind_serves_until_told_and_reports_in_the_one_shape(make):
    before = set(_children(os.getpid()))
    agg = make()
    stop = threading.Event()
    started = threading.Event()
    loop = threading.Thread(target=agg.serve, args=(stop.is_set, started.set), name=f"{agg.kind}-under-test",
                            daemon=True)
    try:
        assert isinstance(agg, Aggregator) and agg.kind in metrics.KINDS
        assert agg.shard_count == 2 and "://" in str(agg.address)
        loop.start()
        assert started.wait(60), "started() did not run"
        # the switch's shard 0 is the serving process itself
        shard_pids = set(_children(os.getpid())) - before
        assert len(shard_pids) == (1 if agg.kind == "switch" else 2), shard_pids
        job = f"agg-{uuid.uuid4().hex[:6]}"
        opts = {"elements": K} if agg.kind == "switch" else {}
        clients = [Client(str(agg.address), job=job, rank=r, world_size=2, timeout=20, **opts) for r in range(2)]
        try:
            bufs = [np.full(3000, r + 1, np.int32) for r in range(2)]
            for f in [c.allreduce(b) for c, b in zip(clients, bufs)]:
                f.result(30)
            assert (bufs[0] == 3).all()
            stats = agg.stats()
        finally:
            for c in clients:
                c.close()
        assert set(stats) == {"kind", "totals", "jobs", "histograms", "pool", "shards", "restarts"}
        assert stats["kind"] == agg.kind
        # the job's table: aggregator-wide (switch) or on the shards it joined (service)
        tables = [stats["jobs"]] + [part["jobs"] for part in stats["shards"] if part is not None]
        assert max(t[job]["members"] for t in tables if job in t) == 2
        assert set(stats["pool"]) == {"slots", "used", "buffers"}
        for part in stats["shards"]:
            assert set(part) == {"counters", "jobs", "histograms", "pool", "memory"}
            assert part["memory"]["rss_bytes"] > 0
        stop.set()
        loop.join(30)
        assert not loop.is_alive(), "serve() did not return after should_stop()"
        # serve() stopped the shard processes it ran
        assert all(_gone(p) for p in shard_pids)
    finally:
        stop.set()
        if loop.is_alive():
            loop.join(30)
        agg.close()
        agg.close()  # twice is harmless


@pytest.mark.parametrize("mode", ["service", "switch"])
def test_serve_stops_when_a_shard_dies_and_names_it(tmp_path, mode):
    listen = "udp://127.0.0.1:0" if mode == "switch" else f"zmq+ipc://{tmp_path}/agg"
    extra = ["--mode", "switch", "--elements", str(K), "--pool", "64"] if mode == "switch" else []
    proc = subprocess.Popen([sys.executable, "-m", "aggnet", "serve", "--listen", listen, "--shards", "2",
                             "--log-level", "INFO", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("aggnet serving ") and " shards=2 " in line, line
        shards = _children(proc.pid)
        # the switch forks shards 1..K-1 (shard 0 is the serving process)
        assert len(shards) == (1 if mode == "switch" else 2), shards
        victim = shards[-1]
        os.kill(victim, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, err
    assert f"shard 1 (pid {victim}) died with status -9" in err, err
    assert "Traceback" not in err, err
    assert all(_gone(p) for p in shards)


def test_stats_reach_the_shards_over_one_connection_each():
    # a connection per STATS left one socket in TIME_WAIT per shard and query
    import shutil

    from aggnet.client import stats as stats_cli
    from aggnet.processes import ServiceProcess
    from aggnet.protocol.address import parse

    if shutil.which("ss") is None:
        pytest.skip("ss (iproute2) lists the sockets")
    svc = ServiceProcess("zmq+tcp://127.0.0.1:0", shards=2)
    try:
        shard_ports = [parse(a).port for a in stats_cli.query(svc.address)["service"]["shards"]]

        def lingering() -> int:
            out = subprocess.run(["ss", "-Htan", "state", "time-wait"], capture_output=True, text=True).stdout
            return sum(1 for line in out.splitlines() for p in shard_ports if line.split()[-1].endswith(f":{p}"))

        before = lingering()
        for _ in range(30):
            reply = stats_cli.query(svc.address)
            assert all(s is not None for s in reply["shards"]), reply
        assert lingering() - before == 0
    finally:
        svc.stop()
