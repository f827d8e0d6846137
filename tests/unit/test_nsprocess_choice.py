"""Which commands a rack forks into its namespaces and which go through
``ip netns exec``: only ``python -m`` with this interpreter, Popen keywords
a forked child honours, and an existing namespace; AGGNET_NETNS_EXEC=1
(or AGGNET_EXEC_CHILDREN=1, which also turns off forked services)
sends everything through ``ip netns exec``."""

from __future__ import annotations

import os
import sys

from aggnet.emulation import nsprocess


def test_only_python_modules_in_an_existing_namespace_are_forked(monkeypatch, tmp_path):
    (tmp_path / "ns1").touch()
    monkeypatch.setattr(nsprocess, "NETNS_DIR", str(tmp_path))
    monkeypatch.delenv("AGGNET_NETNS_EXEC", raising=False)
    monkeypatch.delenv("AGGNET_EXEC_CHILDREN", raising=False)
    module = [sys.executable, "-m", "aggnet.demo", "--epochs", "1"]
    assert nsprocess.forkable("ns1", module, {"stdout": -1, "text": True})
    assert not nsprocess.forkable("ns2", module, {})  # no such namespace
    assert not nsprocess.forkable("ns1", ["ip", "link"], {})
    assert not nsprocess.forkable("ns1", [sys.executable, "-c", "pass"], {})
    assert not nsprocess.forkable("ns1", ["/opt/other/python3", "-m", "aggnet.demo"], {})  # another interpreter
    assert not nsprocess.forkable("ns1", module, {"preexec_fn": os.getpid})
    assert nsprocess.forkable("ns1", module, {"start_new_session": True, "env": {}, "cwd": "/"})
    monkeypatch.setenv("AGGNET_EXEC_CHILDREN", "1")
    assert not nsprocess.forkable("ns1", module, {})
    monkeypatch.delenv("AGGNET_EXEC_CHILDREN")
    monkeypatch.setenv("AGGNET_NETNS_EXEC", "1")
    assert not nsprocess.forkable("ns1", module, {})
