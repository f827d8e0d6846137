"""The benchmarks, the demo and the simulator refuse a value they cannot
run with in one line naming the option, before any process starts: a
zero count, an empty buffer or a zero duration used to fail in a worker,
or after every run, with a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("args, option, said", [
    (["bench", "--workers", "0"], "--workers", "0: give 1 or more (comma-separated counts, e.g. 2,4)"),
    (["bench", "--workers", "2,two"], "--workers", "'two' is not a whole number"),
    (["bench", "--sizes", "64KiB,3B"], "--sizes", "'3B' holds no float32 value: give 4 bytes or more"),
    (["bench", "--sizes", "lots"], "--sizes", "cannot read size 'lots'"),
    (["bench", "--reps", "0"], "--reps", "0: give 1 or more"),
    (["bench", "--shards", "-1"], "--shards", "-1: give 1 or more"),
    (["bench-ddp", "--steps", "0"], "--steps", "0: give 1 or more"),
    (["bench-ddp", "--width", "0"], "--width", "0: give 1 or more"),
    (["bench-ddp", "--batch", "x"], "--batch", "'x' is not a whole number"),
    (["bench-transport", "--sizes", "0"], "--sizes", "holds no float32 value"),
    (["bench-transport", "--volume", "1MiB,2MiB"], "--volume", "give one size"),
    (["bench-udp", "--elements", "99999"], "--elements", "a datagram holds at most 16364 values"),
    (["bench-udp", "--seconds", "0"], "--seconds", "0: give a duration in seconds above 0"),
    (["bench-udp", "--size", "0"], "--size", "holds no float32 value"),
    (["demo", "--epochs", "0"], "--epochs", "0: give 1 or more"),
    (["demo", "--batch", "0"], "--batch", "0: give 1 or more"),
    (["demo", "--lr", "-1"], "--lr", "-1: give a number above 0"),
    (["sim", "--size", "0"], "--size", "holds no float32 value"),
    (["compare", "--pairs", "0", "--arm", "a", "--arm", "b", "--", "bench"], "--pairs", "0: give 1 or more"),
    (["compare", "--timeout", "-1", "--arm", "a", "--arm", "b", "--", "bench"], "--timeout",
     "-1: give a duration in seconds above 0"),
])
def test_a_value_a_command_cannot_run_with_is_refused_in_one_line(args, option, said):
    r = subprocess.run([sys.executable, "-m", "aggnet", *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"aggnet {args[0]}: error: argument {option}: ") and said in last, last
