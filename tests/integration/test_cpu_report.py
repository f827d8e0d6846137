"""AGGNET_TEST_CPU: CPU-seconds per test, counted for every process the
test started, including one nobody waits for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

BUSY_CHILD = '''
import subprocess, sys, time

def test_leaves_a_busy_child():
    # a child that burns about a second of CPU and is never waited for
    p = subprocess.Popen([sys.executable, "-c", "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 1.0: pass"])
    t = time.monotonic()
    while p.poll() is None and time.monotonic() - t < 30:
        time.sleep(0.05)

def test_idle():
    pass
'''

#: what tests/conftest.py does when AGGNET_TEST_CPU is set
CONFTEST = '''
import os
from harness.cpu_report import CpuReport

def pytest_configure(config):
    config.pluginmanager.register(CpuReport(config, os.environ["AGGNET_TEST_CPU"]), "aggnet-cpu-report")
'''


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.isdir("/sys/fs/cgroup/cpuacct"),
                    reason="counting a test's processes needs root and cgroup v1's cpuacct")
def test_a_test_is_charged_for_the_processes_it_started(tmp_path):
    (tmp_path / "test_busy.py").write_text(BUSY_CHILD)
    (tmp_path / "conftest.py").write_text(CONFTEST)
    report = tmp_path / "cpu.json"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                        "--rootdir", str(tmp_path), str(tmp_path / "test_busy.py")],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env={**os.environ, "AGGNET_TEST_CPU": str(report),
                            "PYTHONPATH": f"{tmp_path}{os.pathsep}{TESTS}"})
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:]
    records = json.loads(report.read_text())
    busy, idle = records["test_busy.py::test_leaves_a_busy_child"], records["test_busy.py::test_idle"]
    assert 0.9 <= busy[0] < 5, records
    assert idle[0] < 0.5, records
    assert "CPU-seconds per test" in r.stdout
