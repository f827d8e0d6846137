"""Two runs that pick the same job name on one service: the second is
refused at once, naming the clash, while the first finishes untouched;
once the first run's workers are gone, the name can be used again."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from harness.helpers import RunningService

from aggnet import Client, JobMismatch


@pytest.fixture(scope="module", params=["zmq+tcp", "udp"])
def service(request):
    """The service, and a host in switch mode (which knows a member is
    alive by its heartbeats)."""
    s = RunningService(request.param, shards=2)
    yield s
    s.stop()


def _run(address, job, rank, rounds, out, started):
    with Client(address, job=job, rank=rank, world_size=2) as c:
        started.set()
        for i in range(rounds):
            buf = np.full(20000, rank + i, dtype=np.float32)
            c.allreduce(buf).result(timeout=60)
            out.append(float(buf[0]))


def test_a_second_run_under_a_live_jobs_name_is_refused_and_the_first_finishes(service):
    results = {0: [], 1: []}
    started = [threading.Event(), threading.Event()]
    first = [threading.Thread(target=_run, args=(service.address, "shared", r, 200, results[r], started[r]))
             for r in range(2)]
    for t in first:
        t.start()
    for e in started:
        assert e.wait(30)
    while len(results[0]) < 5:  # the first run is in its rounds
        time.sleep(0.01)
    t0 = time.monotonic()
    with pytest.raises(JobMismatch, match="rank 1 of job 'shared' is running at another (connection|address)"):
        Client(service.address, job="shared", rank=1, world_size=2).allreduce(
            np.ones(10, dtype=np.float32)).result(timeout=60)
    assert time.monotonic() - t0 < 5  # at once, not after a timeout
    for t in first:
        t.join(120)
    # every round of the first run summed both of its ranks
    assert results[0] == results[1] == [float(2 * i + 1) for i in range(200)]


def test_a_name_is_free_again_once_its_workers_have_left(service):
    for _ in range(2):
        outs, ev = {0: [], 1: []}, [threading.Event(), threading.Event()]
        threads = [threading.Thread(target=_run, args=(service.address, "reused", r, 3, outs[r], ev[r]))
                   for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert outs[0] == outs[1] == [1.0, 3.0, 5.0]
