"""A worker killed mid-training, as DDP on the aggnet backend sees it: the
survivor's backward fails within seconds with torch's RuntimeError, whose
message names the aggnet exception and the dead rank, on both aggregator
kinds (the service hears the connection close, a host in switch mode the
heartbeats stop)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid

import pytest

pytest.importorskip("torch", reason="DDP needs PyTorch (pip install aggnet[torch])")

_WORKER = """
import datetime, os, signal, sys, time
import torch, torch.distributed as dist, torch.nn as nn
import aggnet.torch  # noqa: F401
from aggnet.client.config import ClientConfig

rank, address, init = int(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.set_num_threads(1)
dist.init_process_group("aggnet", init_method=init, rank=rank, world_size=2,
                        pg_options=ClientConfig(address=address, timeout=60.0, connect_timeout=30.0),
                        timeout=datetime.timedelta(seconds=120))
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)))
x = torch.randn(64, 256)

def step():
    model.zero_grad()
    model(x).sum().backward()

step()
step()  # DDP rebuilds its buckets here, a broadcast aggnet leaves to gloo; later steps only all-reduce
print("stepped", flush=True)
sys.stdin.readline()
if rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)  # no LEAVE, no close: as a crash
t0 = time.monotonic()
try:
    step()
    print("no error", flush=True)
except RuntimeError as exc:
    print(f"failed after {time.monotonic() - t0:.2f}s: {str(exc).splitlines()[0][:2000]}", flush=True)
os._exit(0)  # the process group cannot be destroyed cleanly with a peer gone
"""


@pytest.mark.parametrize("kind", ["zmq+tcp", "udp"])
@pytest.mark.slow
def test_ddp_on_the_backend_names_a_killed_worker_within_seconds(shared_service, tmp_path, kind):
    svc = shared_service(kind)
    init = f"file://{tmp_path}/init-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "AGGNET_JOB": f"ddp-killed-{uuid.uuid4().hex[:6]}"}
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(r), svc.address, init], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env) for r in range(2)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "stepped"
        procs[1].stdin.write("go\n")
        procs[1].stdin.flush()
        assert procs[1].wait(30) == -signal.SIGKILL
        procs[0].stdin.write("go\n")
        procs[0].stdin.flush()
        line = procs[0].stdout.readline().strip()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
    assert line.startswith("failed after"), line
    seconds = float(line.split()[2].rstrip("s:"))
    # a closed connection at once; silence within the lapse (3 s)
    assert seconds < (5 if kind == "udp" else 2), line
    # the service names it as the connection closes, or as a round finds it gone
    assert "AggregationTimeout" in line and ("rank 1 of job" in line or "rank(s) [1]" in line), line
