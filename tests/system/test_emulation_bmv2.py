"""The P4 program on BMv2 in an emulated rack's ToR: an all-reduce and the
DDP demo through it, end to end, and two P4 racks under a host root."""

from __future__ import annotations

import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from aggnet.emulation import fabric_runs, rack_runs
from aggnet.emulation.fabric import Fabric
from aggnet.emulation.fabric_plan import plan
from aggnet.emulation.bmv2 import can_run_bmv2
from aggnet.emulation.netns import Rack, can_emulate

P4_RACKS = Path(__file__).resolve().parents[2] / "examples" / "topologies" / "p4-racks.toml"
OK, WHY = can_emulate()
if OK:
    OK, WHY = can_run_bmv2()
# each test starts BMv2, loads the program and runs processes in namespaces:
# 55-75 s here beside the other pytest worker, so room past the default 120 s
pytestmark = [pytest.mark.requires_bmv2, pytest.mark.requires_netns, pytest.mark.timeout(300),
              pytest.mark.skipif(not OK, reason=f"cannot run BMv2 in a rack here: {WHY}")]


def test_allreduce_through_bmv2_equals_the_host_switch_mode():
    size = 128 * 1024
    with Rack(3, aggregator=False, bridge=False, prefix="agp") as rack:
        switch = rack_runs.RackSwitch(rack)
        try:
            through_p4 = rack_runs.run_system(rack, "aggnet", size, reps=1, switch=switch, elements=64)
            counters = switch.counters()
        finally:
            switch.stop()
    with Rack(3, prefix="agh") as rack:
        agg = rack_runs.start_aggregator(rack, elements=64)
        try:
            through_host = rack_runs.run_system(rack, "aggnet", size, reps=1, elements=64)
        finally:
            agg.stop()
    # integer sums of the same quantized blocks: bit-identical results
    assert through_p4["checksums"] == through_host["checksums"]
    assert len({tuple(c) for c in through_p4["checksums"]}) == 1
    assert counters["events"]["completed"] >= size // 4 // 64
    assert set(counters["drops"]) <= {"type", "duplicate"}  # LEAVEs go to the control plane; retransmissions


@pytest.mark.slow
def test_two_p4_racks_under_a_host_root_reduce_through_their_switches_exactly_under_drops():
    """Each switch sends its rack's partial to the root and multicasts the
    root's final; the control plane joined the root for it. 1% of the
    protocol's datagrams dropped on rack and spine links: every lost one
    recovered, through the switch's own resend of its partial."""
    size = 256 * 1024
    with Fabric(plan(P4_RACKS, host_mbit=0, uplink_mbit=0), prefix="agy") as fabric:
        fabric.start_aggregators()
        fabric.wait_reachable()
        fabric.impair(0.01)
        res = fabric_runs.run_system(fabric, "aggnet", size, dtype="int32")
        drops = fabric.impairment_counts()
        switches = [fabric.stats(i) for i in range(2)]
        root = fabric.stats()
    assert res["exact"] == [True] * 4
    assert len({tuple(c) for c in res["checksums"]}) == 1
    assert drops["rack_links"] > 0 and drops["spine_links"] > 0, drops
    packets = size // 4 // 64  # per worker, 64 values each (and the codec's exponent rounds)
    for s in switches:
        events = s["events"]
        # each completed slot went up as one partial and its final came down once
        assert events["uplink_sent"] >= packets and events["finals"] == events["uplink_sent"], events
        assert events.get("completed", 0) == 0, events  # nothing completes at a rack under a root
    assert sum(s["events"]["uplink_resent"] for s in switches) > 0, switches
    assert root["totals"]["completed"] >= packets
    for u in res["uplinks"]:  # S up and S down per rack, plus what the drops cost
        assert size <= u["up"] < 2 * size and size <= u["down"] < 2 * size, res["uplinks"]


@pytest.mark.slow
def test_p4_racks_finish_their_all_reduce_through_a_restart_of_the_root():
    """The root comes back without the job; each switch's control plane
    joins it again (its keeper), and the partials the switches resend on
    their workers' retransmissions complete there."""
    size = 512 * 1024
    with Fabric(plan(P4_RACKS, host_mbit=0, uplink_mbit=0), prefix="age") as fabric:
        fabric.start_aggregators()
        fabric.wait_reachable()
        with ThreadPoolExecutor(1) as pool:
            run = pool.submit(fabric_runs.run_system, fabric, "aggnet", size, dtype="int32")
            deadline = time.monotonic() + 60
            # a part of the buffer went up: the root holds the job, mid-round
            while sum(u["up"] for u in fabric.uplink_counters()) < size // 4:
                assert time.monotonic() < deadline and not run.done(), "the all-reduce did not start"
                time.sleep(0.05)
            fabric.restart_root()
            res = run.result(timeout=300)
        root = fabric.stats()
    assert res["exact"] == [True] * 4
    assert len({tuple(c) for c in res["checksums"]}) == 1
    assert root["totals"]["completed"] > 0  # the new root completed what was left


@pytest.mark.slow
def test_ddp_demo_through_bmv2():
    pytest.importorskip("torch", reason="the demo trains with PyTorch")
    pytest.importorskip("sklearn", reason="the demo's data set ships with scikit-learn")
    with Rack(2, aggregator=False, bridge=False, prefix="agq") as rack:
        switch = rack_runs.RackSwitch(rack)
        try:
            lines = rack_runs.run_demo(rack, epochs=1, codec="float32", switch=switch, extra=["--hidden", "32"],
                                       timeout=600)
        finally:
            switch.stop()
    assert any("via aggnet (float32) through udp://10.77.0.253" in line for line in lines), lines
    assert any("test accuracy" in line for line in lines), lines


_WORKER = """
import sys, numpy as np
from aggnet import Client
rank, job = int(sys.argv[1]), sys.argv[2]
with Client("{address}", job=job, rank=rank, world_size=2, elements=64, timeout=60) as c:
    for _ in range(20):
        buf = np.full(64 * 200, rank + 1, np.int32)
        c.allreduce(buf).result(timeout=120)
        assert (buf == 3).all(), buf[:8]
print("exact")
"""

_FOREIGN = """
import socket, sys, time
from aggnet.protocol import wire
from aggnet.protocol.wire import job_id_of
from aggnet.protocol.wire import DType, Flag, Header, MsgType
job, dest = sys.argv[1], ("{ip}", {port})
jid = job_id_of(job)
join = Header(MsgType.JOIN, job_id=jid, sender=0, world=2).pack()
payload = b"\\x7f" * 256
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    end = time.monotonic() + 4
    sent = 0
    while time.monotonic() < end:
        for slot in range(32):
            for tag in (1, 2, 3):
                push = Header(MsgType.PUSH, job_id=jid, sender=0, index=slot, ref=tag, dtype=DType.INT32, count=64,
                              world=2, flags=Flag.VERSION if tag & 1 else 0)
                s.sendto(push.pack() + payload, dest)
                sent += 1
        s.sendto(join, dest)
        time.sleep(0.002)
print(sent)
"""


@pytest.mark.slow
def test_bmv2_admits_only_installed_members():
    """A host the control plane did not install can neither join a job nor
    add to its sums (the admission table keys on the job, the rank and the
    source address)."""
    import sys

    from aggnet.emulation.rack_runs import SWITCH_IP, SWITCH_PORT

    with Rack(3, aggregator=False, bridge=False, prefix="agx") as rack:
        switch = rack_runs.RackSwitch(rack)
        try:
            job = "admitted"
            members = [f"{h.ip},{rack.mac(h)},{i}" for i, h in enumerate(rack.workers[:2])]
            switch.ctl("add-job", job, "--slots", "32", *[x for m in members for x in ("--member", m)])
            code = _WORKER.format(address=switch.address)
            procs = [rack.popen(h, [sys.executable, "-c", code, str(i), job], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for i, h in enumerate(rack.workers[:2])]
            foreign = rack.run(rack.workers[2], [sys.executable, "-c", _FOREIGN.format(ip=SWITCH_IP, port=SWITCH_PORT),
                                                 job], timeout=120)
            outs = [p.communicate(timeout=300) for p in procs]
            counters = switch.counters()
        finally:
            switch.stop()
    assert all(o[0].strip() == "exact" for o in outs), outs
    assert int(foreign.stdout) > 1000
    # BMv2 takes what its queue holds of the flood; every one it took was refused
    assert counters["drops"].get("not_admitted", 0) > 1000, counters["drops"]
    assert set(counters["drops"]) <= {"not_admitted", "type", "duplicate"}, counters["drops"]


_COLLIDE = """
import sys
from aggnet.p4.control import SwitchControl
# a multicast group in the place the next job's would go: that job's last
# write fails, after its table entries are in
with SwitchControl(switch_ip=sys.argv[1]) as ctl:
    row = len(ctl.jobs())
    ctl.sh.MulticastGroupEntry(row + 1).add(0, 4242).insert()
print(row + 1)
"""

_UNCOLLIDE = """
from aggnet.p4.control import SwitchControl
import sys
with SwitchControl(switch_ip=sys.argv[1]) as ctl:
    ctl.sh.MulticastGroupEntry(int(sys.argv[2])).delete()
"""


@pytest.mark.slow
def test_the_control_plane_installs_a_job_all_or_nothing():
    """A bad value is refused before anything is written; a write that fails
    half-way is taken back; errors are one line; remove-job removes what
    there is and says so when there is nothing."""
    import json
    import sys

    from aggnet.emulation.netns import EmulationError
    from aggnet.emulation.rack_runs import SWITCH_IP

    with Rack(2, aggregator=False, bridge=False, prefix="agc") as rack:
        switch = rack_runs.RackSwitch(rack)
        try:
            good = [f"{h.ip},{rack.mac(h)},{i}" for i, h in enumerate(rack.workers)]
            args = [x for m in good for x in ("--member", m)]
            bad = [good[0], f"{rack.workers[1].ip},zz,1"]
            with pytest.raises(EmulationError) as err:
                switch.ctl("add-job", "x", *[x for m in bad for x in ("--member", m)])
            message = str(err.value)
            assert "member 1" in message and "'zz' is not a MAC address" in message and "Traceback" not in message
            assert json.loads(switch.ctl("jobs")) == []
            # a write refused half-way: the entries before it are taken back
            group = rack.run(rack.tor, [sys.executable, "-c", _COLLIDE, SWITCH_IP], timeout=120).stdout.strip()
            with pytest.raises(EmulationError) as err:
                switch.ctl("add-job", "x", *args)
            message = str(err.value)
            assert f"failed writing multicast group {group}" in message, message
            assert "nothing of it was left on the switch" in message and "Traceback" not in message
            assert json.loads(switch.ctl("jobs")) == []
            with pytest.raises(EmulationError, match="job 'x' is not installed"):
                switch.ctl("remove-job", "x")
            rack.run(rack.tor, [sys.executable, "-c", _UNCOLLIDE, SWITCH_IP, group], timeout=120)
            # and the same job installs, serves and goes
            switch.ctl("add-job", "x", *args)
            assert [j["world"] for j in json.loads(switch.ctl("jobs"))] == [2]
            removed = json.loads(switch.ctl("remove-job", "x"))["entries_removed"]
            assert removed == 1 + 2 * 2 + 1, removed  # the job, 2 x (admission, result address), its group
            assert json.loads(switch.ctl("jobs")) == []
            switch.ctl("add-job", "x", *args)
        finally:
            switch.stop()
