"""Workers from aggnet's fork server: the server imports what every call
in the process named before it started, so a caller asking for less
first (a benchmark run in-process) does not leave later workers to import
torch themselves."""

from __future__ import annotations

import subprocess
import sys

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
