"""The suite's own arrangement under pytest-xdist: tests/conftest.py puts
every system test (fixed namespace names, BMv2's ports, Mininet) in one
group, and --dist loadgroup must run a group on one worker, one test at a
time. A pytest or xdist upgrade that breaks grouping fails here, not as
system tests that wreck each other's namespaces."""

import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("xdist", reason="pytest-xdist is not installed (pip install 'aggnet[dev]')")

CONFTEST = pathlib.Path(__file__).resolve().parents[1] / "conftest.py"


def test_system_tests_run_on_one_worker(tmp_path):
    # the real conftest's grouping hook, without its imports of aggnet
    source = CONFTEST.read_text()
    hook = source[source.index("@pytest.hookimpl(tryfirst=True)"):]
    hook = hook[:hook.index("\n\n\n")]
    (tmp_path / "conftest.py").write_text("import os\nimport pytest\n\n\n" + hook + "\n")
    (tmp_path / "system").mkdir()
    probe = ("import os, time, pytest\n@pytest.mark.parametrize('i', range(4))\ndef test_{0}(i):\n"
             "    time.sleep(0.3)\n    with open({1!r}, 'a') as f:\n"
             "        f.write('{0} ' + os.environ['PYTEST_XDIST_WORKER'] + '\\n')\n")
    log = tmp_path / "log"
    (tmp_path / "system" / "test_s.py").write_text(probe.format("system", str(log)))
    (tmp_path / "test_o.py").write_text(probe.format("other", str(log)))
    r = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-q", "-p",
                        "no:cacheprovider", str(tmp_path)], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path, env={k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")})
    assert r.returncode == 0, r.stdout + r.stderr
    runs = [line.split() for line in log.read_text().splitlines()]
    assert len({worker for what, worker in runs if what == "system"}) == 1, runs
    assert len({worker for what, worker in runs if what == "other"}) >= 1
