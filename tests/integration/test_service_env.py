"""An aggregator started from a worker's process runs numpy's OpenBLAS on
one thread (it multiplies no matrices; more threads only spin at its
start), unless the worker's environment asks for more."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = """
import os
from aggnet.processes import ServiceProcess
with ServiceProcess("zmq+tcp://127.0.0.1:0", 1) as s:
    env = dict(v.split("=", 1) for v in open(f"/proc/{s.pid}/environ").read().split("\\0") if "=" in v)
    print(env.get("OPENBLAS_NUM_THREADS"), env.get("AGGNET_PROBE_MARK"))
"""


def _service_env(**extra) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    env.update(extra, AGGNET_PROBE_MARK="kept")
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.split()


def test_an_aggregator_gets_one_openblas_thread_and_the_rest_of_the_environment():
    assert _service_env() == ["1", "kept"]


def test_a_worker_that_sets_openblas_threads_keeps_its_choice():
    assert _service_env(OPENBLAS_NUM_THREADS="3") == ["3", "kept"]
