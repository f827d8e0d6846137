"""CPU-seconds per test, to find where the suite's time goes.

With AGGNET_TEST_CPU=FILE each pytest process (every xdist worker) puts
itself in a cgroup of the cpuacct controller of its own, so a test is
charged for every process it started, those nobody waits for included
(fork-server children, a service's shards, BMv2), and not for the other
worker's. FILE gets {test id: [CPU-seconds, wall seconds]} and the run
ends with the tests that took the most CPU. Needs root and cgroup v1's
cpuacct (/sys/fs/cgroup/cpuacct); elsewhere it says so and records
nothing. Wall times under two busy workers say little on their own; CPU
is what a shorter suite must cut.
"""

from __future__ import annotations

import glob
import json
import os
import time

import pytest

ROOT = "/sys/fs/cgroup/cpuacct"


class CpuReport:
    def __init__(self, config, path: str):
        self.path = path
        #: the xdist worker this process is, or "main" for the one that reports
        self.worker = getattr(config, "workerinput", {}).get("workerid", "main")
        self.group = f"{ROOT}/aggnet-tests-{os.getpid()}"
        self.records: dict[str, list[float]] = {}
        self.ok = False
        for old in glob.glob(f"{ROOT}/aggnet-tests-*"):
            if os.path.exists(f"/proc/{old.rsplit('-', 1)[1]}"):
                continue  # a running pytest's (the other worker's)
            try:  # an earlier run's, emptied since (a child outlived that run)
                os.rmdir(old)
            except OSError:
                pass
        try:
            os.makedirs(self.group, exist_ok=True)
            with open(f"{self.group}/cgroup.procs", "w") as f:
                f.write(str(os.getpid()))
            self.ok = True
        except OSError as exc:
            print(f"AGGNET_TEST_CPU: no cpuacct cgroup here ({exc}); CPU per test is not recorded "
                  f"(it needs root and {ROOT})")

    def _usage(self) -> float:
        with open(f"{self.group}/cpuacct.usage") as f:
            return int(f.read()) / 1e9

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        if not self.ok:
            yield
            return
        cpu, wall = self._usage(), time.monotonic()
        yield
        self.records[item.nodeid] = [round(self._usage() - cpu, 3), round(time.monotonic() - wall, 3)]

    def pytest_sessionfinish(self, session):
        if self.ok and self.records:
            with open(f"{self.path}.{self.worker}", "w") as f:
                json.dump(self.records, f)

    def pytest_terminal_summary(self, terminalreporter):
        if self.worker != "main":
            return
        merged: dict[str, list[float]] = {}
        for part in glob.glob(f"{self.path}.*"):
            with open(part) as f:
                merged.update(json.load(f))
            os.remove(part)
        if not merged:
            return
        with open(self.path, "w") as f:
            json.dump(merged, f, indent=0)
        tr = terminalreporter
        tr.section(f"CPU-seconds per test ({sum(c for c, _ in merged.values()):.0f} in all; {self.path})")
        for test, (cpu, wall) in sorted(merged.items(), key=lambda kv: -kv[1][0])[:25]:
            tr.write_line(f"{cpu:7.1f} s CPU {wall:7.1f} s wall  {test}")

    def pytest_unconfigure(self, config):
        if self.ok:
            try:  # back to the root group, and the empty group removed
                with open(f"{ROOT}/cgroup.procs", "w") as f:
                    f.write(str(os.getpid()))
                os.rmdir(self.group)
            except OSError:
                pass  # a child still in it (one that outlived the run): the next run removes it
