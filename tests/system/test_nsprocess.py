"""Python workers forked into a namespace see what ``ip netns exec``
would show them: the namespace's interfaces and /sys, the names the
emulation wrote in /etc/netns, the caller's environment, directory and
pipes; their exit status and signals reach the caller as a Popen's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from aggnet.emulation.netns import Rack, can_emulate
from aggnet.emulation.nsprocess import NamespacePopen

OK, WHY = can_emulate()
pytestmark = [pytest.mark.requires_netns, pytest.mark.skipif(not OK, reason=f"no network namespaces here: {WHY}")]

TESTS = str(Path(__file__).resolve().parents[1])


@pytest.fixture(scope="module")
def rack():
    with Rack(1, prefix=f"agq{os.getpid() % 10000}") as r:
        yield r


def _probe(rack, how: str, code: int, cwd: str):
    host = rack.workers[0]
    cmd = [sys.executable, "-m", "harness.ns_probe", rack.aggregator.name, str(code)]
    env = {"AGGNET_PROBE": how, "PYTHONPATH": TESTS}
    kw = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)
    if how == "forked":
        p = rack.popen(host, cmd, env=env, **kw)
        assert isinstance(p, NamespacePopen)
    else:
        p = subprocess.Popen(["ip", "netns", "exec", host.name, *cmd], env={**os.environ, **env}, **kw)
    out, err = p.communicate("hello\n", timeout=60)
    lines = out.splitlines()
    return p.returncode, json.loads(lines[0]), json.loads(lines[1]), err


def test_a_forked_worker_sees_what_ip_netns_exec_shows(rack, tmp_path):
    forked = _probe(rack, "forked", 3, str(tmp_path))
    execed = _probe(rack, "execed", 3, str(tmp_path))
    code, seen, stdin, err = forked
    assert code == 3 and stdin == {"stdin": "hello"} and err == "to stderr\n", forked
    assert seen["env"] == "forked" and seen["cwd"] == str(tmp_path) and seen["main"] == "__main__"
    # the namespace's own interfaces (not the host's), and its hosts file
    assert seen["interfaces"] == sorted(["lo", rack.workers[0].dev]), seen
    assert seen["hosts_name"] == rack.aggregator.ip
    for key in ("interfaces", "sys_class_net", "hosts_name", "argv", "main"):
        assert seen[key] == execed[1][key], (key, seen, execed[1])
    assert execed[0] == 3 and execed[3] == err


def test_a_killed_or_failing_forked_worker_reports_it_as_a_process_would(rack):
    host = rack.workers[0]
    p = rack.popen(host, [sys.executable, "-m", "harness.ns_probe", rack.aggregator.name, "0"],
                   env={"PYTHONPATH": TESTS}, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert isinstance(p, NamespacePopen)
    assert json.loads(p.stdout.readline())["env"] is None
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(timeout=0.2)  # waits on stdin
    p.send_signal(signal.SIGKILL)
    assert p.wait(timeout=30) == -signal.SIGKILL
    p.stdin.close()
    p.stdout.close()
    bad = rack.popen(host, [sys.executable, "-m", "harness.no_such_module"], stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True)
    out, err = bad.communicate(timeout=60)
    assert bad.returncode == 1 and "No module named harness.no_such_module" in err, err
