"""The switch control plane refuses bad values before it writes anything,
and names a missing tool in one line (no switch needed for either)."""

from __future__ import annotations

import pytest

from aggnet.p4 import tools
from aggnet.p4.control import Member, SwitchControl, SwitchControlError, Uplink

GOOD = [Member("10.77.0.1", "02:a6:6e:00:00:01", 0), Member("10.77.0.2", "02:a6:6e:00:00:02", 1)]


@pytest.mark.parametrize("members, uplink, message", [
    ([GOOD[0], Member("10.77.0.2", "zz", 1)], None, r"member 1 \(10.77.0.2,zz,1\): 'zz' is not a MAC address"),
    ([Member("10.77.0.300", "02:a6:6e:00:00:01", 0)], None, r"'10.77.0.300' is not an IPv4 address"),
    ([Member("10.77.0.1", "02:a6:6e:00:00:01", 511)], None, r"port 511 is not a switch port \(0..510\)"),
    ([GOOD[0], Member("10.77.0.1", "02:a6:6e:00:00:02", 1)], None, r"two members have the same address"),
    (GOOD, Uplink("10.77.1.1", "02:a6:6e:00:01:01", 2, 40), r"rack id 40 is not in 0..31"),
    (GOOD, Uplink("parent", "02:a6:6e:00:01:01", 2, 0), r"'parent' is not an IPv4 address"),
])
def test_bad_values_are_refused_before_the_switch_is_touched(members, uplink, message):
    ctl = SwitchControl()  # not connected: a check that passed would fail on the first read
    with pytest.raises(ValueError, match=message):
        ctl.install_job("x", members, uplink=uplink)


def test_a_missing_bmv2_cli_is_named_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(tools, "TOOL_DIRS", ())
    with pytest.raises(SwitchControlError, match=r"simple_switch_CLI .* is not on PATH; install BMv2"):
        SwitchControl().reset_slice(0, 4)


def test_switch_options_go_before_or_after_the_subcommand():
    """`aggnet switch load --grpc ...` works as `aggnet switch --grpc ... load`
    does (an unreachable switch is one line, with no logging of its own)."""
    import subprocess
    import sys

    for argv in (["jobs", "--grpc", "127.0.0.1:1"], ["--grpc", "127.0.0.1:1", "jobs"]):
        r = subprocess.run([sys.executable, "-m", "aggnet", "switch", *argv], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 1
        assert r.stderr.strip() == ("aggnet switch jobs: could not connect to the switch at 127.0.0.1:1 "
                                    "(is simple_switch_grpc running?)"), r.stderr
