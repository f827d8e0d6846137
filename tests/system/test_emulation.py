"""An emulated rack in network namespaces: the switch protocol over real
links with real drops and duplicates, bytes on the wire beside gloo's ring,
and the DDP demo with one worker per namespace."""

from __future__ import annotations

import os
import subprocess

import pytest

from aggnet.emulation import rack_runs
from aggnet.emulation.netns import EmulationError, Rack, can_emulate

OK, WHY = can_emulate()
pytestmark = [pytest.mark.requires_netns, pytest.mark.skipif(not OK, reason=f"no network namespaces here: {WHY}")]
MiB = 1 << 20


def namespaces() -> list[str]:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()


def test_rack_is_torn_down_even_when_the_run_fails():
    with pytest.raises(RuntimeError, match="boom"):
        with Rack(2, prefix="agt") as rack:
            assert {h.name for h in rack.hosts} <= set(namespaces())
            raise RuntimeError("boom")
    assert not [n for n in namespaces() if n.startswith("agt-")]


def test_a_failed_build_leaves_nothing_behind():
    with pytest.raises(EmulationError):
        with Rack(2, prefix="agu", mtu=10**9):  # no link takes that MTU
            pass
    assert not [n for n in namespaces() if n.startswith("agu-")]


@pytest.mark.parametrize("drop, duplicate", [(0.01, 0.0), (0.10, 0.05)], ids=["drop1%", "drop10%+dup5%"])
def test_allreduce_in_the_rack_is_exact_under_drop_and_duplication(drop, duplicate):
    with Rack(3, rate_mbit=200, prefix="agd") as rack:
        agg = rack_runs.start_aggregator(rack)
        try:
            # iptables drops an skb: a GSO batch of up to 7 packets at once,
            # so 8 MiB gives 1% of ~150 batch pairs per worker some drops
            clean = rack_runs.run_system(rack, "aggnet", 8 * MiB, reps=1)
            # every shard's port: a job's slots live on all of them
            rack.impair(drop=drop, duplicate=duplicate, ports=agg.shards)
            lossy = rack_runs.run_system(rack, "aggnet", 8 * MiB, reps=1)
            counts = rack.impairment_counts()
        finally:
            agg.stop()
    assert counts["dropped"] > 0 and (counts["duplicated"] > 0) == (duplicate > 0)
    assert len({tuple(c) for c in clean["checksums"]}) == 1
    assert lossy["checksums"] == clean["checksums"]
    assert sum(s["retransmissions"] for s in lossy["client_stats"]) > 0


@pytest.mark.slow
def test_each_worker_moves_S_up_and_S_down_where_gloo_moves_2S_N_1_over_N():
    torch = pytest.importorskip("torch", reason="the gloo side of the comparison needs PyTorch")
    assert torch
    n, size = 4, 32 * MiB
    with Rack(n, rate_mbit=200, prefix="agb") as rack:
        agg = rack_runs.start_aggregator(rack)
        try:
            ours = rack_runs.run_system(rack, "aggnet", size, reps=1, aggregator_pids=[agg.pid])
            ring = rack_runs.run_system(rack, "gloo", size, reps=1)
        finally:
            agg.stop()
        floor = rack_runs.FloorProcess.in_rack(rack)
        try:
            base = rack_runs.run_system(rack, "floor", size, reps=1, address=floor.address,
                                        aggregator_pids=[floor.pid])
        finally:
            floor.stop()
    assert floor.process.returncode is not None  # its shards went with it
    for name, w in ours["per_worker"].items():
        # payload, 1.1% of headers at 8 KiB per packet, the priming window
        # (64 packets, 1.6% of 32 MiB), the odd retransmission
        assert 1.0 <= w["tx_bytes"] / size <= 1.05, (name, w)
        assert 1.0 <= w["rx_bytes"] / size <= 1.05, (name, w)
    for name, w in ring["per_worker"].items():
        assert 1.45 <= w["tx_bytes"] / size <= 1.6, (name, w)
        assert 1.45 <= w["rx_bytes"] / size <= 1.6, (name, w)
    # the floor, a parameter server in plain TCP sockets: S each way and
    # TCP's headers and acknowledgements
    for name, w in base["per_worker"].items():
        assert 1.0 <= w["tx_bytes"] / size <= 1.03, (name, w)
        assert 1.0 <= w["rx_bytes"] / size <= 1.03, (name, w)
    a, g, f = ours["checksums"][0][0], ring["checksums"][0][0], base["checksums"][0][0]
    assert abs(a - g) <= 1e-3 * max(1.0, abs(g))
    assert abs(f - g) <= 1e-3 * max(1.0, abs(g))
    assert len({tuple(c) for c in base["checksums"]}) == 1  # every worker holds the same sum
    # host cycles per byte, beside the peer's
    assert ours["worker_cpu_s_per_gb"] > 0 and ring["worker_cpu_s_per_gb"] > 0 and base["worker_cpu_s_per_gb"] > 0
    assert ours["aggregator_cpu_s_per_gb"] > 0 and ring["aggregator_cpu_s_per_gb"] is None
    # read while the floor's shards were still there to be read
    assert base["aggregator_cpu_s_per_gb"] > 0


def _join_from(rack, host, address, elements=None) -> str:
    """In a worker's namespace: the K and I/O a client gets, or its error."""
    code = ("import sys\nfrom aggnet import Client\n"
            f"try:\n    c = Client({address!r}, job='mtu', rank=0, world_size=1, elements={elements!r}, "
            "connect_timeout=10)\n"
            "    print('ok', c.elements, c.io); c.close()\n"
            "except Exception as exc:\n    print('error', type(exc).__name__, exc)\n")
    import sys

    return rack.run(host, [sys.executable, "-c", code], timeout=120).stdout.strip().splitlines()[-1]


def test_packets_fit_the_path_mtu_and_never_fragment():
    """On 1500-byte links a host gives the job what fits (356 values, a
    1500-byte IP packet at most); asking for more fails at JOIN saying so."""
    with Rack(1, prefix="agq", mtu=1500) as rack:
        agg = rack_runs.start_aggregator(rack)
        try:
            address = rack_runs.aggregator_address(rack)
            line = _join_from(rack, rack.workers[0], address)
            assert line.split()[:2] == ["ok", "356"], line
            line = _join_from(rack, rack.workers[0], address, elements=2048)
            assert line.startswith("error ValueError") and "path MTU" in line and "1500" in line, line
            res = rack_runs.run_system(rack, "aggnet", 1 * MiB, reps=1)
            assert res["client_stats"][0]["elements"] == 356
        finally:
            agg.stop()
    with Rack(1, prefix="agq", mtu=9000) as rack:
        agg = rack_runs.start_aggregator(rack)
        try:
            line = _join_from(rack, rack.workers[0], rack_runs.aggregator_address(rack))
            assert line.split()[:2] == ["ok", "2048"], line  # jumbo frames carry the host's default
        finally:
            agg.stop()


@pytest.mark.slow
def test_ddp_demo_runs_with_one_worker_per_namespace():
    pytest.importorskip("torch", reason="the demo trains with PyTorch")
    pytest.importorskip("sklearn", reason="the demo's data set ships with scikit-learn")
    with Rack(2, prefix="agm") as rack:
        agg = rack_runs.start_aggregator(rack)
        try:
            seen = []  # rank 0's lines as it prints them, not at the end
            lines = rack_runs.run_demo(rack, epochs=2, codec="float32", timeout=600,
                                       on_line=lambda line: seen.append((line, agg.alive())))
            names = [h.name for h in rack.hosts]
        finally:
            agg.stop()
    assert any("epoch   2" in line for line in lines), lines
    assert [line for line, _ in seen] == lines and all(running for _, running in seen)
    # the namespaces name each other's addresses: torch's rendezvous has
    # nothing to warn about, and the names go with the namespaces
    assert not [line for line in lines if "hostname of the client socket" in line], lines
    assert not [n for n in names if os.path.exists(f"/etc/netns/{n}")]
    acc = [line for line in lines if "test accuracy" in line]
    assert acc and float(acc[0].split("test accuracy")[1].split("%")[0]) > 85, lines


@pytest.mark.slow
def test_stale_gradient_ddp_steps_in_the_rack_beside_their_halves():
    pytest.importorskip("torch", reason="DDP needs PyTorch")
    systems = "aggnet-int32,aggnet-int32-stale1-predict,compute,comm-int32"
    with Rack(2, rate_mbit=100, prefix="ags") as rack:
        agg = rack_runs.start_aggregator(rack)
        try:
            records = rack_runs.run_ddp_bench(rack, steps=3, width=128, systems=systems, batch=64, timeout=600)
        finally:
            agg.stop()
    by = {r["system"]: r for r in records}
    assert list(by) == systems.split(",")
    # the stale step's all-reduce went through the switch protocol, one per step
    stale = by["aggnet-int32-stale1-predict"]["client_stats"]
    assert all(s["allreduces"] >= 5 and s["packets"] > 0 for s in stale), stale
    assert by["compute"]["client_stats"] == [None, None]


def test_each_run_owns_its_prefix_and_a_second_run_is_refused_or_moved_aside():
    """Two emulations at once: one that asks for a prefix a live run holds
    is refused naming it (the first keeps its namespaces), the default
    picks the next free prefix, and namespaces no live run holds are
    leftovers of a dead one, removed by the next run."""
    import subprocess as sp
    import sys

    from aggnet.emulation.netns import free_prefix

    sp.run(["ip", "netns", "add", "agt-w7"], check=True)  # a dead run's leftover
    with Rack(1, prefix="agt") as first:
        names = sp.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert "agt-w7" not in names and "agt-w0" in names
        with pytest.raises(EmulationError, match=r"belong to a running emulation \(pid \d+\)"):
            with Rack(1, prefix="agt"):
                pass
        assert "agt-w0" in sp.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert free_prefix("agt") == "agtb"
        r = sp.run([sys.executable, "-m", "aggnet", "emulate", "bench", "--workers", "2", "--prefix", "agt"],
                   capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and "give this run another --prefix" in r.stderr and "Traceback" not in r.stderr
        assert first.run(first.workers[0], ["true"]).returncode == 0
    assert free_prefix("agt") == "agt"
    assert not [n for n in namespaces() if n.startswith("agt-")]


def test_a_missing_bmv2_or_no_workers_is_one_line():
    import os
    import sys

    path = ":".join(d for d in os.environ["PATH"].split(":") if not os.path.exists(os.path.join(d, "simple_switch_grpc")))
    r = subprocess.run([sys.executable, "-m", "aggnet", "emulate", "bench", "--switch", "bmv2", "--workers", "2",
                        "--prefix", "agm"], capture_output=True, text=True, timeout=120, env={**os.environ, "PATH": path})
    if "simple_switch_grpc" in r.stderr:
        assert r.returncode == 1 and "is not on PATH" in r.stderr and "Traceback" not in r.stderr
    else:  # found where a source build puts it (/opt/p4/bin, /usr/local/bin): nothing to hide
        assert r.returncode == 0, r.stderr[-2000:]
    d = subprocess.run([sys.executable, "-m", "aggnet", "demo", "--workers", "0"], capture_output=True, text=True,
                       timeout=60)
    assert d.returncode == 2 and d.stderr.strip() == "aggnet demo: --workers must be at least 1, got 0"


def test_an_aggregator_in_an_emulated_namespace_does_not_warn_of_other_hosts():
    """`aggnet emulate`'s aggregators serve namespaces only this machine
    reaches: no warning about serving other hosts without keys (which an
    aggregator on the machine's own network still gives, test_hostile)."""
    import sys

    with Rack(1, prefix="agk") as rack:
        p = rack.popen(rack.aggregator, [sys.executable, "-m", "aggnet", "serve", "--listen", "zmq+tcp://0.0.0.0:0",
                                         "--shards", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert p.stdout.readline().startswith("aggnet serving"), p.stderr.read()
        finally:
            p.terminate()
            _, err = p.communicate(timeout=30)
    assert "WITHOUT job keys" not in err, err


def test_bench_in_rounds_alternates_the_systems_and_gives_each_rounds_ratios(tmp_path):
    """``--rounds 2``: every system runs twice, the second round in another
    order, and each round's ratios are printed and written beside the
    records, which hold every round's repetitions."""
    import json
    import sys

    pytest.importorskip("torch", reason="gloo's side of the benchmark needs PyTorch")
    out = tmp_path / "rounds.json"
    r = subprocess.run([sys.executable, "-m", "aggnet", "emulate", "bench", "--workers", "2", "--size", "4MiB",
                        "--rate", "0", "--reps", "2", "--rounds", "2", "--prefix", "ago", "--json", str(out)],
                       capture_output=True, text=True, timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [sorted(x) for x in data["rounds"]] == [["aggnet", "floor", "gloo"]] * 2
    for rec in data["records"]:
        assert len(rec["times"]) == 4 and len(rec["round_medians"]) == 2, rec["system"]
        assert rec["round_medians"] == [x[rec["system"]] for x in data["rounds"]]
        assert min(rec["times"]) <= rec["median_s"] <= max(rec["times"])
        assert all(len(c) == 4 for c in rec["checksums"])  # every repetition's, on every worker
    for pair in ("aggnet/gloo", "aggnet/floor", "floor/gloo"):
        line = next(x for x in r.stdout.splitlines() if x.startswith(f"time {pair} by round: "))
        a, b = (x[pair.split("/")[0]] / x[pair.split("/")[1]] for x in data["rounds"])
        assert f"{a:.3f}, {b:.3f};" in line
    # the second round started with the system that ran second in the first
    assert r.stderr.index("gloo: 2 x 4MiB, round 2/2") < r.stderr.index("aggnet: 2 x 4MiB, round 2/2")
    assert not [n for n in namespaces() if n.startswith("ago")]
    refused = subprocess.run([sys.executable, "-m", "aggnet", "emulate", "bench", "--rounds", "0"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--rounds must be at least 1, got 0" in refused.stderr
    assert "Traceback" not in refused.stderr
