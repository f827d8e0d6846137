"""Workers from aggnet's fork server: the server imports what every call
in the process named before it started, so a caller asking for less
first (a benchmark run in-process) does not leave later workers to import
torch themselves."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROGRAM = """
import sys
from aggnet.processes import fork_server
fork_server(("wave",))
ctx = fork_server(("colorsys",))
with ctx.Pool(1) as pool:
    print(pool.apply(eval, ("sorted(m for m in ('wave', 'colorsys', 'mailbox') if m in __import__('sys').modules)",)))
print(sorted(m for m in ("wave", "colorsys") if m in sys.modules))
"""


def test_a_worker_starts_with_what_every_call_named_and_the_caller_imports_none_of_it():
    r = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    worker, caller = r.stdout.splitlines()[-2:]
    # both calls' modules, imported once in the server; one nobody named is not there
    assert worker == "['colorsys', 'wave']", r.stdout
    # the calling process imported nothing of it itself
    assert caller == "[]", r.stdout


CTRL_C = """
import signal
from aggnet.processes import NUMPY_WORKER_PRELOAD, fork_server
ctx = fork_server(NUMPY_WORKER_PRELOAD)
for target, args in ((signal.raise_signal, (signal.SIGINT,)), (int, ("not a number",))):
    p = ctx.Process(target=target, args=args)
    p.start()
    p.join(60)
    print(p.exitcode, flush=True)
"""


def test_ctrl_c_stops_a_worker_without_a_traceback_and_other_errors_keep_theirs():
    """A terminal's Ctrl-C reaches every worker of the command: each stops
    with status 130 and prints nothing (the command says "interrupted"
    once); a worker that fails otherwise still shows its traceback."""
    r = subprocess.run([sys.executable, "-c", CTRL_C], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["130", "1"], (r.stdout, r.stderr)
    assert "KeyboardInterrupt" not in r.stderr, r.stderr
    assert r.stderr.count("Traceback") == 1 and "ValueError: invalid literal" in r.stderr, r.stderr


def test_ctrl_c_inside_a_comm_hook_reads_as_ctrl_c():
    """Ctrl-C that lands while a comm hook's callback runs reaches
    ``backward()`` as torch's RuntimeError naming it: a worker stops on it
    as on a plain KeyboardInterrupt."""
    torch = pytest.importorskip("torch")

    from aggnet.processes import interrupted

    def ctrl_c(_):
        raise KeyboardInterrupt

    done = torch.futures.Future()
    after = done.then(ctrl_c)
    done.set_result(None)
    with pytest.raises(RuntimeError) as caught:
        after.wait()
    assert interrupted(caught.value)
    assert not interrupted(RuntimeError("Got the following error when running the callback: NonFiniteError: x"))
