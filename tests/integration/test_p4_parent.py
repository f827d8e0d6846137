"""A P4 rack's job at a host root, joined by the control plane on the
switch's behalf (aggnet/p4/parent.py): the root takes the switch's
partials from the address the JOIN names and sends its finals there.
The switches here are UDP sockets at the program's port sending what the
P4 program sends (the differential tests hold the program to the same
bytes); tests/system/test_emulation_bmv2.py runs the real thing."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest

from aggnet.processes import ServiceProcess
from aggnet.protocol import wire
from aggnet.protocol.keys import new_key, parse_key, write_job_key
from aggnet.protocol.limits import DEFAULT_ELEMENTS as K
from aggnet.protocol.limits import SWITCH_PORT
from aggnet.protocol.wire import DType, Flag, Header, MsgType, job_id_of
from aggnet.p4.parent import ParentJoinError, RackAtParent, join_parent, keep_joined

SLOTS = 8


def job_name() -> str:
    return f"p4-parent-{uuid.uuid4().hex[:8]}"


def _loopback_at_switch_port() -> socket.socket:
    """A socket at the program's port on a loopback IP of its own."""
    rng = np.random.default_rng()
    while True:
        ip = f"127.{rng.integers(1, 250)}.{rng.integers(1, 250)}.{rng.integers(2, 250)}"
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.bind((ip, SWITCH_PORT))
        except OSError:
            s.close()
            continue
        s.settimeout(5)
        return s


@pytest.fixture
def root():
    """A switch-mode root on the program's port (the switch sends there)."""
    probe = _loopback_at_switch_port()
    ip = probe.getsockname()[0]
    probe.close()
    svc = ServiceProcess(f"udp://{ip}:{SWITCH_PORT}", args=["--mode", "switch", "--shards", "1"])
    yield svc
    svc.stop()


@pytest.fixture
def switches():
    socks = [_loopback_at_switch_port() for _ in range(2)]
    yield socks
    for s in socks:
        s.close()


def partial(job: str, rack: int, slot: int, tag: int, values) -> bytes:
    """A rack's complete partial as the program's as_partial writes it."""
    h = Header(MsgType.PUSH, job_id=job_id_of(job), round=7, index=slot, sender=rack, dtype=DType.INT32, count=K,
               next_exponent=3, nsum=2, world=2, ref=tag, offset=slot, flags=Flag.UPLINK)
    v = np.zeros(K, ">i4")
    v[: len(values)] = values
    return h.pack() + v.tobytes()


def test_the_root_sums_partials_from_the_switches_the_control_plane_joined(root, switches):
    job = job_name()
    joined = [join_parent(job, RackAtParent(root.address, r, 2, s.getsockname()[0]), SLOTS)
              for r, s in enumerate(switches)]
    assert [(ok.slots, ok.elements) for ok in joined] == [(SLOTS, K)] * 2
    target = (root.address[len("udp://"):].rsplit(":", 1)[0], SWITCH_PORT)
    switches[0].sendto(partial(job, 0, 5, 1, [1, -2, 3]), target)
    switches[1].sendto(partial(job, 1, 5, 1, [10, 20, 2**30]), target)
    for s in switches:  # the final goes to each switch's data address, as the switch takes it
        data, src = s.recvfrom(65536)
        assert src == target
        h = wire.unpack_header(data)
        assert h.msg_type == MsgType.RESULT and h.flags & Flag.UPLINK and h.ref == 1 and h.index == 5
        assert np.frombuffer(data[wire.HEADER_SIZE:], ">i4")[:4].tolist() == [11, 18, 2**30 + 3, 0]


def test_a_partial_from_the_control_planes_address_is_not_the_switchs(root, switches):
    job = job_name()
    for r, s in enumerate(switches):
        join_parent(job, RackAtParent(root.address, r, 2, s.getsockname()[0]), SLOTS)
    target = (root.address[len("udp://"):].rsplit(":", 1)[0], SWITCH_PORT)
    before = _dropped(root.address)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as stranger:
        stranger.sendto(partial(job, 0, 2, 1, [1]), target)
        for _ in range(50):
            if _dropped(root.address) > before:
                break
    assert _dropped(root.address) == before + 1
    switches[1].sendto(partial(job, 1, 2, 1, [1]), target)
    switches[1].settimeout(0.5)
    with pytest.raises(socket.timeout):  # rack 0 never counted: no final
        switches[1].recvfrom(65536)


def _dropped(address: str) -> int:
    from aggnet.client.switch import query_stats

    return query_stats(address)["totals"].get("dropped_not_admitted", 0)


def test_a_root_that_gives_other_slots_is_an_install_error(root, switches):
    job = job_name()
    join_parent(job, RackAtParent(root.address, 0, 2, switches[0].getsockname()[0]), SLOTS)
    with pytest.raises(ParentJoinError, match=f"gave job '{job}' {SLOTS} slots of {K} values; the switch uses 16"):
        join_parent(job, RackAtParent(root.address, 1, 2, switches[1].getsockname()[0]), 16)


def test_the_parent_must_be_where_the_switch_sends():
    with pytest.raises(ValueError, match=f"UDP port {SWITCH_PORT} of the parent"):
        join_parent("j", RackAtParent("udp://127.0.0.1:5000", 0, 2, "10.0.0.1"), SLOTS)
    with pytest.raises(ValueError, match="rack id 2 is not in 0..1"):
        join_parent("j", RackAtParent(f"udp://127.0.0.1:{SWITCH_PORT}", 2, 2, "10.0.0.1"), SLOTS)
    with pytest.raises(ValueError, match="not IPv4"):
        join_parent("j", RackAtParent(f"udp://127.0.0.1:{SWITCH_PORT}", 0, 2, "switch"), SLOTS)


def test_no_root_is_one_line_naming_it_after_the_timeout():
    s = _loopback_at_switch_port()  # a port nobody answers at
    ip = s.getsockname()[0]
    s.close()
    with pytest.raises(ParentJoinError, match=rf"udp://{ip}:{SWITCH_PORT} did not answer rack 0's JOIN .* within 1s"):
        join_parent("j", RackAtParent(f"udp://{ip}:{SWITCH_PORT}", 0, 2, "10.0.0.1"), SLOTS, timeout=1)


def test_a_keyed_root_takes_the_switch_only_with_the_jobs_key(tmp_path, switches):
    job = job_name()
    keys = tmp_path / "keys.json"
    key = parse_key(write_job_key(str(keys), job, new_key()))
    probe = _loopback_at_switch_port()
    ip = probe.getsockname()[0]
    probe.close()
    svc = ServiceProcess(f"udp://{ip}:{SWITCH_PORT}", args=["--mode", "switch", "--shards", "1", "--keys", str(keys)])
    try:
        rack = RackAtParent(svc.address, 0, 2, switches[0].getsockname()[0])
        with pytest.raises(ParentJoinError, match="is not signed"):
            join_parent(job, rack, SLOTS, timeout=5)
        assert join_parent(job, rack, SLOTS, key=key).slots == SLOTS
    finally:
        svc.stop()


def test_a_root_that_restarts_is_joined_again_and_the_round_in_flight_finishes(switches):
    """The keeper joins again on its timer; the switches' partials, resent
    as the program resends them (on its workers' retransmissions), then
    find the job at the new root."""
    probe = _loopback_at_switch_port()
    ip = probe.getsockname()[0]
    probe.close()
    address = f"udp://{ip}:{SWITCH_PORT}"
    args = ["--mode", "switch", "--shards", "1"]
    root = ServiceProcess(address, args=args)
    job = job_name()
    said: list[str] = []
    stop = threading.Event()
    keepers = [threading.Thread(target=keep_joined, args=(job, RackAtParent(address, r, 2, s.getsockname()[0]), SLOTS),
                                kwargs={"every": 0.2, "stop": stop, "say": said.append}, daemon=True)
               for r, s in enumerate(switches)]
    for t in keepers:
        t.start()
    target = (ip, SWITCH_PORT)
    try:
        from aggnet.client.switch import query_stats

        deadline = time.monotonic() + 10
        while query_stats(address)["jobs"].get(job, {}).get("members") != [0, 1]:
            assert time.monotonic() < deadline, "the keepers did not join both racks"
            time.sleep(0.05)
        switches[0].sendto(partial(job, 0, 1, 1, [5]), target)  # rack 0's partial, then the root goes
        root.stop()
        root = ServiceProcess(address, args=args)
        for s in switches:
            s.settimeout(0.3)
        got = {}
        deadline = time.monotonic() + 15
        while len(got) < 2 and time.monotonic() < deadline:
            for r, s in enumerate(switches):  # each rack resends its partial until its final comes
                if r in got:
                    continue
                s.sendto(partial(job, r, 1, 1, [5 + 10 * r]), target)
                try:
                    got[r] = s.recv(65536)
                except socket.timeout:
                    pass
        assert sorted(got) == [0, 1], said  # without the keeper the new root drops every partial
        for data in got.values():
            assert wire.unpack_header(data).msg_type == MsgType.RESULT
            assert np.frombuffer(data[wire.HEADER_SIZE:], ">i4")[0] == 5 + 15
    finally:
        stop.set()
        for t in keepers:
            t.join(5)
        root.stop()


def test_join_parent_keep_prints_the_first_answer_and_stops_on_sigterm(root, switches):
    job = job_name()
    cmd = [sys.executable, "-m", "aggnet", "switch", "--switch-ip", switches[0].getsockname()[0], "join-parent", job,
           "--parent", root.address, "--rack-id", "0", "--racks", "2", "--slots", str(SLOTS), "--keep", "0.2"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = json.loads(p.stdout.readline())
        assert (first["job"], first["rack_id"], first["racks"]) == (job, 0, 2)
        p.send_signal(signal.SIGTERM)
        assert p.wait(10) == 0
        assert p.stderr.read() == ""  # the root never went away: nothing to say
    finally:
        p.kill()
    bad = subprocess.run(cmd[:-1] + ["0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1
    assert bad.stderr == "aggnet switch join-parent: --keep wants a positive number of seconds, got 0\n"
