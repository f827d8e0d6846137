"""``aggnet up`` / ``aggnet down`` over real processes on loopback: the
one-machine example on free ports, started, left alone, repaired, used for
an all-reduce across two racks, and stopped; a switch that does not answer
and one that does (BMv2)."""

from __future__ import annotations

import inspect
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from aggnet import Client
from aggnet.deploy import state as up_state
from aggnet.client.stats import query
from harness.helpers import free_ports

ROOT = pathlib.Path(__file__).resolve().parents[2]
ONE_MACHINE = ROOT / "examples" / "topologies" / "one-machine.toml"
CLI_TIMEOUT = 120


def aggnet(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aggnet", *args], capture_output=True, text=True,
                          timeout=CLI_TIMEOUT, cwd=ROOT)


class Deployment:
    """A topology file in a temporary directory, its own state directory,
    and every process ``up`` was seen to record (stopped at the end even
    when ``down`` is broken)."""

    def __init__(self, tmp_path: pathlib.Path, text: str, job: str):
        self.path = tmp_path / "topology.toml"
        self.path.write_text(text)
        self.state_dir = str(tmp_path / "state")
        self.job = job
        self.seen: dict = {}

    @property
    def state_file(self) -> str:
        return up_state.state_path(self.state_dir, self.job, str(self.path))

    def up(self, *extra: str) -> subprocess.CompletedProcess:
        r = aggnet("up", str(self.path), "--state-dir", self.state_dir, *extra)
        self.records()
        return r

    def down(self) -> subprocess.CompletedProcess:
        return aggnet("down", str(self.path), "--state-dir", self.state_dir)

    def records(self) -> dict:
        try:
            with open(self.state_file) as f:
                recs = json.load(f)["aggregators"]
        except FileNotFoundError:
            return {}
        for rec in recs.values():
            self.seen[rec["pid"]] = rec["argv"]
        return recs

    def pids(self) -> dict:
        return {role: rec["pid"] for role, rec in self.records().items()}

    def cleanup(self) -> None:
        try:
            self.down()
        finally:
            up_state.stop_all(list(self.seen.items()), timeout=5)


def _one_machine(ports: list[int]) -> str:
    text = ONE_MACHINE.read_text()
    for old, new in zip(("42700", "42701", "42702"), ports):
        text = text.replace(f"127.0.0.1:{old}", f"127.0.0.1:{new}")
    return text


@pytest.fixture
def one_machine(tmp_path, request):
    ports = free_ports(3, socket.SOCK_DGRAM)
    d = Deployment(tmp_path, _one_machine(ports), "one-machine")
    d.ports = ports
    request.addfinalizer(d.cleanup)
    return d


def _ok(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return r.stdout


def _row(out: str, role: str) -> str:
    """The summary table's line for ``role``."""
    lines = [line for line in out.splitlines() if line.startswith(role + "  ")]
    assert lines, out
    return lines[-1]


def _alive(pid: int, argv) -> bool:
    return up_state.running(pid, argv)


# -- the aggregators of this machine ------------------------------------------------------


def test_up_starts_the_root_then_the_racks_and_again_changes_nothing(one_machine):
    out = _ok(one_machine.up())
    recs = one_machine.records()
    assert set(recs) == {"root", "rack rack0", "rack rack1"}
    # the root first: racks join it
    assert recs["root"]["started"] < recs["rack rack0"]["started"] < recs["rack rack1"]["started"]
    for role, port in zip(("root", "rack rack0", "rack rack1"), one_machine.ports):
        assert f"udp://127.0.0.1:{port}" in _row(out, role) and _row(out, role).endswith("started")
        assert "totals" in query(f"udp://127.0.0.1:{port}", timeout=5)
    assert "--parent" in recs["rack rack1"]["argv"] and "--rack-id" in recs["rack rack1"]["argv"]
    assert oct(os.stat(one_machine.state_dir).st_mode & 0o777) == "0o700"

    pids = one_machine.pids()
    again = _ok(one_machine.up())
    assert one_machine.pids() == pids
    for role in pids:
        assert _row(again, role).endswith("already running")
        assert _alive(pids[role], recs[role]["argv"])


@pytest.mark.slow
def test_up_restarts_only_what_died_or_changed(one_machine):
    _ok(one_machine.up())
    before = one_machine.records()
    dead = before["rack rack1"]
    os.kill(dead["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _alive(dead["pid"], dead["argv"]) and time.monotonic() < deadline:
        time.sleep(0.05)

    out = _ok(one_machine.up())
    after = one_machine.records()
    assert after["root"]["pid"] == before["root"]["pid"]
    assert after["rack rack0"]["pid"] == before["rack rack0"]["pid"]
    assert after["rack rack1"]["pid"] != dead["pid"]
    assert f"pid {dead['pid']} had stopped" in out
    assert _row(out, "rack rack1").endswith("started") and _row(out, "root").endswith("already running")
    assert "totals" in query(f"udp://127.0.0.1:{one_machine.ports[2]}", timeout=5)

    # an edited setting restarts that aggregator, and says so
    one_machine.path.write_text(one_machine.path.read_text() + "elements = 512\n")
    out = _ok(one_machine.up())
    edited = one_machine.records()
    assert _row(out, "rack rack1").endswith("restarted") and "its settings changed" in out
    assert "--elements" in edited["rack rack1"]["argv"]
    assert edited["rack rack1"]["pid"] != after["rack rack1"]["pid"]
    assert not _alive(after["rack rack1"]["pid"], after["rack rack1"]["argv"])
    assert edited["rack rack0"]["pid"] == before["rack rack0"]["pid"]


def _worker(rank: int, deployment: Deployment, rack_addresses: list[str], out: dict) -> None:
    if "topology" in inspect.signature(Client.__init__).parameters:
        client = Client(topology=str(deployment.path), rank=rank, timeout=30)
    else:
        client = Client(rack_addresses[rank // 2], job=deployment.job, rank=rank, world_size=4,
                        member_rank=rank % 2, members=2, timeout=30)
    with client:
        results = []
        for step in range(3):
            buf = (np.arange(40_000, dtype=np.int32) % 1000) * (rank + 1) + step
            client.allreduce(buf).result(timeout=60)
            results.append(buf)
        out[rank] = results


def test_an_allreduce_across_two_racks_runs_through_what_up_started(one_machine):
    _ok(one_machine.up())
    racks = [f"udp://127.0.0.1:{p}" for p in one_machine.ports[1:]]
    out: dict = {}
    errors: list = []

    def run(rank):
        try:
            _worker(rank, one_machine, racks, out)
        except BaseException as exc:  # reported below, with its rank
            errors.append((rank, repr(exc)))

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert sorted(out) == [0, 1, 2, 3]
    base = np.arange(40_000, dtype=np.int32) % 1000
    for step in range(3):
        want = base * (1 + 2 + 3 + 4) + 4 * step
        for rank in range(4):
            np.testing.assert_array_equal(out[rank][step], want)
    # the racks' partial sums went through the root
    assert query(f"udp://127.0.0.1:{one_machine.ports[0]}", timeout=5)["totals"].get("completed", 0) > 0


@pytest.mark.slow
def test_down_stops_everything_and_a_second_down_does_nothing(one_machine):
    _ok(one_machine.up())
    recs = one_machine.records()
    out = _ok(one_machine.down())
    for role, rec in recs.items():
        assert f"{role}: stopped (pid {rec['pid']})" in out
        assert not _alive(rec["pid"], rec["argv"])
    assert not os.path.exists(one_machine.state_file)
    again = _ok(one_machine.down())
    assert "nothing to stop" in again
    # and up brings it all back
    out = _ok(one_machine.up())
    assert _row(out, "root").endswith("started")


# -- what goes wrong ---------------------------------------------------------------------------


def test_an_aggregator_that_cannot_start_is_named_and_the_run_undone(one_machine):
    holder = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        holder.bind(("127.0.0.1", one_machine.ports[2]))  # rack1's port, taken
        r = one_machine.up("--timeout", "20")
    finally:
        holder.close()
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"rack rack1 (host-switch at udp://127.0.0.1:{one_machine.ports[2]}) failed to start" in r.stderr
    assert "Address already in use" in r.stderr  # the tail of its log
    assert "something else listens at" in r.stderr
    # what this run started before it is stopped again, and nothing is recorded
    for pid, argv in one_machine.seen.items():
        assert not _alive(pid, argv)
    assert "stopping root" in r.stderr and "stopping rack rack0" in r.stderr
    assert one_machine.records() == {}


def test_a_bad_topology_exits_2_naming_its_line(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('job = "x"\n[[racks]]\nrank = "0-1"\n')
    r = aggnet("up", str(path), "--state-dir", str(tmp_path / "state"))
    assert r.returncode == 2
    assert r.stderr.startswith(f"aggnet up: {path}:3: unknown key 'rank'"), r.stderr
    r = aggnet("up", str(tmp_path / "absent.toml"), "--state-dir", str(tmp_path / "state"))
    assert r.returncode == 2 and "cannot read topology file" in r.stderr


def test_aggregators_of_other_hosts_get_the_command_to_run_there(tmp_path):
    d = Deployment(tmp_path, (ROOT / "examples" / "topologies" / "two-racks.toml").read_text(), "two-racks")
    out = _ok(d.up())
    assert _row(out, "rack rack0").endswith(
        "elsewhere: run `aggnet serve --listen udp://10.77.1.254:42606 --mode switch --parent "
        "udp://10.77.0.1:42606 --rack-id 0 --racks 2` on r0agg")
    assert "elsewhere: run `aggnet serve --listen udp://10.77.0.1:42606 --mode switch` on spine" in _row(out, "root")
    assert d.records() == {}


# -- P4 racks ----------------------------------------------------------------------------------


P4_RACK = """
job = "{job}"

[hosts]
w0 = {{ ip = "10.79.0.1", mac = "02:00:00:00:79:01" }}
w1 = {{ ip = "10.79.0.2", mac = "02:00:00:00:79:02" }}
w2 = {{ ip = "10.79.1.1", mac = "02:00:00:00:79:03" }}
w3 = {{ ip = "10.79.1.2", mac = "02:00:00:00:79:04" }}
spine = {{ ip = "{root_ip}", mac = "02:00:00:00:79:64" }}

[root]
kind = "host-switch"
address = "udp://{root_ip}:42606"
shards = 1

[[racks]]
name = "rack0"
hosts = ["w0", "w1"]
[racks.aggregator]
kind = "p4"
address = "udp://10.79.0.253:42606"
p4runtime = "127.0.0.1:{grpc}"
thrift_port = {thrift}
ports = [1, 2]
uplink_port = 3
slots = 32
[racks.fallback]
kind = "host-switch"
address = "udp://127.0.0.1:{fallback}"
shards = 1

[[racks]]
name = "rack1"
hosts = ["w2", "w3"]
[racks.aggregator]
kind = "host-switch"
address = "udp://127.0.0.1:{rack1}"
shards = 1
"""


P4_SOLO = """
job = "{job}"

[hosts]
w0 = {{ ip = "10.79.0.1", mac = "02:00:00:00:79:01" }}
w1 = {{ ip = "10.79.0.2", mac = "02:00:00:00:79:02" }}

[[racks]]
name = "rack0"
hosts = ["w0", "w1"]
[racks.aggregator]
kind = "p4"
address = "udp://10.79.0.253:42606"
p4runtime = "127.0.0.1:{grpc}"
thrift_port = {thrift}
ports = [1, 2]
slots = 32
[racks.fallback]
kind = "host-switch"
address = "udp://127.0.0.1:{fallback}"
shards = 1
"""


def _p4_solo(tmp_path, request, grpc: int, thrift: int) -> Deployment:
    """One P4 rack and its fallback, no root."""
    (fallback,) = free_ports(1, socket.SOCK_DGRAM)
    job = f"up-p4-{os.getpid()}"
    d = Deployment(tmp_path, P4_SOLO.format(job=job, grpc=grpc, thrift=thrift, fallback=fallback), job)
    d.fallback = f"udp://127.0.0.1:{fallback}"
    request.addfinalizer(d.cleanup)
    return d


def test_a_p4_rack_under_a_root_whose_switch_is_dead_is_left_to_its_fallback(tmp_path, request):
    pytest.importorskip("p4runtime_sh", reason="without p4runtime-shell no switch is asked at all")
    grpc, thrift = free_ports(2)  # nothing listens there
    d = _p4_deployment(tmp_path, request, grpc, thrift)
    out = _ok(d.up())
    assert _row(out, "rack rack0").endswith("switch unreachable")
    assert f"the workers of rack 'rack0' will use its fallback {d.fallback}" in out
    assert _row(out, "fallback rack0").endswith("started")
    assert set(d.records()) == {"root", "fallback rack0", "rack rack1"}


def _p4_deployment(tmp_path, request, grpc: int, thrift: int) -> Deployment:
    fallback, rack1 = free_ports(2, socket.SOCK_DGRAM)
    # the root must take port 42606 (the P4 program's); a loopback address
    # of its own keeps it clear of any other aggregator on this machine
    root_ip = f"127.79.{os.getpid() % 250}.{1 + int(time.monotonic() * 1000) % 250}"
    job = f"up-p4-{os.getpid()}"
    d = Deployment(tmp_path, P4_RACK.format(job=job, grpc=grpc, thrift=thrift, fallback=fallback, rack1=rack1,
                                            root_ip=root_ip), job)
    d.fallback = f"udp://127.0.0.1:{fallback}"
    d.root_ip = root_ip
    request.addfinalizer(d.cleanup)
    return d


def test_a_switch_that_does_not_answer_leaves_its_rack_to_the_fallback(tmp_path, request):
    grpc, thrift = free_ports(2)  # nothing listens there
    d = _p4_solo(tmp_path, request, grpc, thrift)
    out = _ok(d.up())
    said = [line for line in out.splitlines() if line.startswith("rack rack0: ")]
    assert len(said) == 1, out
    try:
        import p4runtime_sh  # noqa: F401

        assert f"does not answer at 127.0.0.1:{grpc}" in said[0]
        assert _row(out, "rack rack0").endswith("switch unreachable")
    except ImportError:
        assert "needs p4runtime-shell (pip install 'aggnet[p4]')" in said[0]
    assert f"the workers of rack 'rack0' will use its fallback {d.fallback}" in said[0]
    # the rest is up regardless
    assert _row(out, "fallback rack0").endswith("started")
    assert "totals" in query(d.fallback, timeout=5)
    assert set(d.records()) == {"fallback rack0"}


def _bmv2_ok() -> tuple[bool, str]:
    from aggnet.emulation.bmv2 import find_simple_switch_grpc

    if find_simple_switch_grpc() is None:
        return False, "simple_switch_grpc (BMv2) is not installed"
    try:
        import p4runtime_sh  # noqa: F401
    except ImportError:
        return False, "p4runtime-shell is not installed (pip install 'aggnet[p4]')"
    return True, ""


def _loaded_switch(request):
    """BMv2 with the aggnet pipeline loaded (the switch's own set-up, not
    the job's), stopped at the test's end; (switch, gRPC port, Thrift port)."""
    from aggnet.emulation.bmv2 import Bmv2Switch
    from aggnet.p4.control import SwitchControl

    grpc, thrift = free_ports(2)
    switch = Bmv2Switch({}, grpc_port=grpc, thrift_port=thrift)
    request.addfinalizer(switch.stop)
    SwitchControl(switch.grpc_addr, thrift_port=thrift).connect(load_pipeline=True).close()
    return switch, grpc, thrift


@pytest.mark.requires_bmv2
@pytest.mark.skipif(not _bmv2_ok()[0], reason=_bmv2_ok()[1])
def test_up_installs_the_job_on_a_switch_once_and_down_removes_it(tmp_path, request):
    from aggnet.protocol.wire import job_id_of
    from aggnet.p4.control import SwitchControl

    switch, grpc, thrift = _loaded_switch(request)
    d = _p4_solo(tmp_path, request, grpc, thrift)

    def jobs():
        with SwitchControl(switch.grpc_addr, thrift_port=thrift) as ctl:
            return {j.job_id: j for j in ctl.jobs()}

    out = _ok(d.up())
    assert _row(out, "rack rack0").endswith("installed on switch")
    job = jobs()[job_id_of(d.job)]
    assert (job.world, job.slots) == (2, 32)

    again = _ok(d.up())
    assert _row(again, "rack rack0").endswith("already installed on switch")
    assert list(jobs()) == [job_id_of(d.job)]

    out = _ok(d.down())
    assert f"rack rack0: job '{d.job}' removed from the switch at 127.0.0.1:{grpc}" in out
    assert jobs() == {}


@pytest.mark.slow  # 15 s: BMv2, a root and up/down twice
@pytest.mark.requires_bmv2
@pytest.mark.skipif(not _bmv2_ok()[0], reason=_bmv2_ok()[1])
def test_up_installs_a_p4_racks_job_with_its_uplink_and_joins_the_root_for_the_switch(tmp_path, request):
    from aggnet.protocol.wire import job_id_of
    from aggnet.p4.control import SwitchControl

    switch, grpc, thrift = _loaded_switch(request)
    d = _p4_deployment(tmp_path, request, grpc, thrift)

    out = _ok(d.up())
    assert _row(out, "rack rack0").endswith("installed on switch")
    assert f"uplink to {d.root_ip} as rack 0, joined at the root udp://{d.root_ip}:42606" in out
    with SwitchControl(switch.grpc_addr, thrift_port=thrift) as ctl:
        assert [j.job_id for j in ctl.jobs()] == [job_id_of(d.job)]
    # the root holds the job, rack 0 joined (tests/integration/test_p4_parent.py: at the switch's address)
    job = query(f"udp://{d.root_ip}:42606", timeout=5)["jobs"][d.job]
    assert (job["world"], job["slots"], job["elements"], job["members"]) == (2, 32, 64, [0]), job

    _ok(d.down())
    with SwitchControl(switch.grpc_addr, thrift_port=thrift) as ctl:
        assert ctl.jobs() == []

    # with the root gone, an install under it is taken back off the switch: all or nothing
    r = aggnet("switch", "--grpc", switch.grpc_addr, "--thrift-port", str(thrift), "--switch-ip", "10.79.0.253",
               "add-job", "orphan", "--member", "10.79.0.1,02:00:00:00:79:01,1", "--uplink",
               f"{d.root_ip},02:00:00:00:79:64,3,0", "--parent", f"udp://{d.root_ip}:42606", "--racks", "2",
               "--timeout", "1")
    assert r.returncode == 1
    assert r.stderr.strip() == (f"aggnet switch add-job: the parent udp://{d.root_ip}:42606 did not answer rack 0's "
                                f"JOIN for job 'orphan' within 1s; start it (`aggnet serve --mode switch --listen "
                                f"udp://{d.root_ip}:42606`) or check the route to {d.root_ip}")
    with SwitchControl(switch.grpc_addr, thrift_port=thrift) as ctl:
        assert ctl.jobs() == []
