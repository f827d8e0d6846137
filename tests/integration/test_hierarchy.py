"""Racks under a root, placed by a topology file: both aggregator kinds sum
across racks exactly as one aggregator sums the whole job, under loss on
rack and spine links, and a P4 rack falls back to its host aggregator.

Every aggregator is a real ``aggnet serve`` process on loopback; loss is
iptables dropping packets at random on the aggregators' ports (the rack
links: to and from a rack's aggregator; the spine links: to and from the
root), so the client and aggregator code under test is what recovers."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import time
import uuid

import numpy as np
import pytest

from aggnet import Client
from aggnet.client import stats as stats_cli
from aggnet.errors import AggregationError, AggregatorUnreachable
from aggnet.processes import ServiceProcess
from aggnet.protocol.limits import SWITCH_PORT
from aggnet.bench.soak import kill_shard
from harness.helpers import free_port, free_port_block, run_workers
from harness.racks import Racks, topology_text

N = 300_003  # not a multiple of any chunk or packet size


def _job() -> str:
    return f"hier-{uuid.uuid4().hex[:8]}"


def data(rank: int, n: int = N):
    """Integer-valued float32 (sums exact in any order) and int32."""
    rng = np.random.default_rng(100 + rank)
    return rng.integers(-1000, 1000, n).astype(np.float32), rng.integers(-(1 << 20), 1 << 20, n).astype(np.int32)


def expected(world: int, n: int = N):
    xs, ys = zip(*(data(r, n) for r in range(world)))
    return np.sum(xs, axis=0, dtype=np.float64).astype(np.float32), np.sum(ys, axis=0, dtype=np.int64).astype(np.int32)


def _worker(rank: int, topology: str, job: str, codecs, n: int = N, reps: int = 1):
    x, y = data(rank, n)
    out = {}
    with Client(topology=topology, rank=rank, job=job, timeout=60, connect_timeout=30) as c:
        for _ in range(reps):
            for codec in codecs:
                a = x.copy()
                c.allreduce(a, codec=codec).result(120)
                out[codec] = a
            b = y.copy()
            c.allreduce(b).result(120)
            out["i32"] = b
        out["fell_back"] = getattr(c, "fell_back", False)
        out["address"] = c.address
        out["members"] = (c.member_rank, c.members, c.world_size)
        out["chunk_bytes"] = getattr(c, "chunk_bytes", None)
    return out


def run_topology(topology: str, world: int, codecs=(None,), n: int = N, threads: bool = False, reps: int = 1):
    """Every rank's results; ``threads`` runs the workers in this process
    (so that the test sees their log), else each in a process of its own."""
    # run_workers runs threads for inproc:// services, processes otherwise
    return run_workers("inproc://threads" if threads else "topology://", world, _worker, topology, _job(), codecs, n,
                       reps, timeout=240)


def check(results, world: int, codecs=(None,), n: int = N):
    fx, fy = expected(world, n)
    for r in results:
        for codec in codecs:
            np.testing.assert_array_equal(r[codec], fx)
        np.testing.assert_array_equal(r["i32"], fy)


@pytest.fixture(scope="module", params=["service", "host-switch"])
def racks(request):
    """One root and two racks per kind for the module: every test runs a
    job of its own on them, as jobs share a deployment."""
    r = Racks(request.param)
    yield r
    r.stop()


@contextlib.contextmanager
def drops(ports: list[int], probability: float, proto: str):
    """Drop packets to and from ``ports`` on loopback at random."""
    counted = {"dropped": 0}
    if not probability:
        yield counted
        return
    if os.geteuid() != 0 or shutil.which("iptables") is None:
        pytest.skip("random drops need root and iptables (apt-get install iptables)")
    chain = f"AGGNET-{uuid.uuid4().hex[:8].upper()}"
    spec = ",".join(str(p) for p in sorted(set(ports)))
    rules = [["-p", proto, "-m", "multiport", "--dports", spec], ["-p", proto, "-m", "multiport", "--sports", spec]]

    def ipt(*args):
        subprocess.run(["iptables", "-w", "5", *args], check=True, capture_output=True, timeout=30)

    try:
        ipt("-N", chain)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"iptables cannot add a chain here: {exc.stderr.decode().strip()}")
    try:
        for r in rules:
            ipt("-A", chain, *r)  # counts every packet
            ipt("-A", chain, *r, "-m", "statistic", "--mode", "random", "--probability", str(probability), "-j", "DROP")
        ipt("-I", "INPUT", "-i", "lo", "-j", chain)
        yield counted
        listing = subprocess.run(["iptables", "-w", "5", "-L", chain, "-v", "-x", "-n"], capture_output=True,
                                 text=True, timeout=30).stdout
        rows = [line.split() for line in listing.splitlines()[2:] if line.strip()]
        counted["dropped"] = sum(int(r[0]) for r in rows if r[2] == "DROP")
        counted["packets"] = sum(int(r[0]) for r in rows if r[2] != "DROP")
    finally:
        subprocess.run(["iptables", "-w", "5", "-D", "INPUT", "-i", "lo", "-j", chain], capture_output=True, timeout=30)
        subprocess.run(["iptables", "-w", "5", "-F", chain], capture_output=True, timeout=30)
        subprocess.run(["iptables", "-w", "5", "-X", chain], capture_output=True, timeout=30)


def test_two_racks_sum_like_one_aggregator(racks):
    """Float32 (integer data: any order sums exactly) and int32 bit-identical
    to the one-aggregator sum, and every worker placed by the topology."""
    codecs = (None, "int32") if racks.kind == "service" else (None,)
    results = run_topology(racks.topology, racks.world, codecs)
    check(results, racks.world, codecs)
    assert [r["members"] for r in results] == [(0, 2, 4), (1, 2, 4), (0, 2, 4), (1, 2, 4)]
    assert [r["address"] for r in results] == [racks.racks[0].address] * 2 + [racks.racks[1].address] * 2


def test_a_finished_job_leaves_the_root_too(racks):
    """A rack whose job's last worker left leaves the root as well: the
    root's share of the job (its slots, in switch mode) is free at once,
    not after the root's idle reclaim minutes later."""
    job = _job()
    run_workers("topology://", racks.world, _worker, racks.topology, job, (None,), 1000, 1, timeout=240)
    deadline = time.monotonic() + 10
    while job in _job_names(stats_cli.query(racks.root.address)):
        assert time.monotonic() < deadline, f"the root still holds job {job!r} its racks finished"
        time.sleep(0.1)


@pytest.mark.parametrize("scheme", ["zmq+tcp", "tcp"])
def test_service_racks_carry_one_partial_per_chunk_across_racks(scheme):
    """Cross-rack bytes per all-reduce are R·S up and R·S down, whatever the
    number of workers per rack (4 here), plus the small agreements; the
    sums are exact over either TCP transport (racks to root included)."""
    r = Racks("service", per_rack=4, scheme=scheme)
    try:
        n = 1 << 20
        check(run_topology(r.topology, r.world, (None,), n), r.world, (None,), n)
        nbytes = 4 * n
        for rack in r.racks:
            shards = r.stats(rack)["shards"]
            up = sum(s["uplink"]["bytes_up"] for s in shards)
            down = sum(s["uplink"]["bytes_down"] for s in shards)
            # two all-reduces (float32 and int32 buffers) of S bytes each
            assert 2 * nbytes <= up <= 2 * nbytes * 1.05, up
            assert 2 * nbytes <= down <= 2 * nbytes * 1.05, down
    finally:
        r.stop()


def test_racks_behind_slow_uplinks_cut_quarter_mib_chunks_and_stay_exact():
    """A topology that gives its uplinks' rate has its workers cut chunks
    that cross such an uplink in 25 ms: 256 KiB at 100 Mbit/s, where 1 MiB
    chunks left a rack's uplink filling and draining by 84 ms steps
    (docs/benchmarks.md). Every worker reads the same file, so all cut
    alike, and each rack sends four partials up where it sent one."""
    r = Racks("service")
    try:
        n = 1 << 20  # 4 MiB a buffer: 4 chunks of 1 MiB, 16 of 256 KiB

        def partials_up() -> list[int]:
            return [sum(sh["uplink"]["partials_up"] for sh in r.stats(rack)["shards"]) for rack in r.racks]

        before = partials_up()
        plain = run_topology(r.topology, r.world, (None,), n)
        between = partials_up()
        slow = r.topology.replace('job = "hier"\n', 'job = "hier"\n[links]\nuplink_mbit = 100\n', 1)
        assert slow != r.topology
        shaped = run_topology(slow, r.world, (None,), n)
        after = partials_up()
        check(plain, r.world, (None,), n)
        check(shaped, r.world, (None,), n)
        assert {w["chunk_bytes"] for w in plain} == {1 << 20}
        assert {w["chunk_bytes"] for w in shaped} == {256 << 10}
        for b, m, a in zip(before, between, after):
            # two all-reduces (float32, int32) a run: 12 more chunks each
            assert (a - m) - (m - b) == 2 * 12, (before, between, after)
    finally:
        r.stop()


@pytest.mark.parametrize("where", ["rack", "spine"])
@pytest.mark.parametrize("loss", [0.01, 0.1])
def test_loss_on_rack_and_spine_links_recovers_exactly(racks, where, loss):
    ports = racks.ports(racks.racks if where == "rack" else [racks.root])
    proto = "tcp" if racks.kind == "service" else "udp"
    # enough packets that 1% of them is sure to be some (a hundred or more)
    n = 400_003
    with drops(ports, loss, proto) as counted:
        results = run_topology(racks.topology, racks.world, (None,), n, reps=4 if loss < 0.05 else 1)
    check(results, racks.world, (None,), n)
    assert counted["dropped"] > 0, counted


def test_a_service_rack_refuses_workers_when_the_root_has_other_shards():
    root = ServiceProcess("zmq+tcp://127.0.0.1:0", shards=1)
    rack = ServiceProcess("zmq+tcp://127.0.0.1:0", shards=2,
                          args=["--parent", root.address, "--rack-id", "0", "--racks", "2"])
    try:
        with pytest.raises(AggregationError, match="root .* has 1 shard.*this rack 2.*same --shards"):
            Client(rack.address, job=_job(), rank=0, world_size=4, member_rank=0, members=2, connect_timeout=10)
    finally:
        rack.stop()
        root.stop()


def _switch_address() -> str:
    """A P4 switch's address (the program's UDP port) on a loopback IP
    that nothing else in the suite uses."""
    while True:
        ip = f"127.0.{np.random.randint(1, 250)}.{np.random.randint(2, 250)}"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.bind((ip, SWITCH_PORT))
            except OSError:
                continue
        return f"udp://{ip}:{SWITCH_PORT}"


def test_a_dead_switch_falls_back_to_the_racks_host_aggregator(caplog):
    """A P4 rack whose switch answers nothing: its workers go to the host
    aggregator the topology names, say so once each, and sum exactly."""
    # a P4 switch sends partials to the program's port: the root listens there
    root = ServiceProcess(_switch_address(), shards=1, args=["--mode", "switch"])
    fallbacks = [ServiceProcess("udp://127.0.0.1:0", shards=1,
                                args=["--mode", "switch", "--parent", root.address, "--rack-id", str(i), "--racks", "2"])
                 for i in range(2)]
    try:
        dead = [_switch_address() for _ in range(2)]
        topo = topology_text("p4", root.address, dead, 2, fallbacks=[f.address for f in fallbacks])
        with caplog.at_level(logging.WARNING, logger="aggnet.client"):
            results = run_topology(topo, 4, (None,), 50_000, threads=True)
        check(results, 4, (None,), 50_000)
        assert all(r["fell_back"] for r in results)
        assert [r["address"] for r in results] == [fallbacks[0].address] * 2 + [fallbacks[1].address] * 2
        lines = [m for m in caplog.messages if "falling back" in m]
        assert len(lines) == 4 and all("no aggregator answered" in m for m in lines), lines
    finally:
        for p in fallbacks + [root]:
            p.stop()


def test_a_full_switch_pool_falls_back_to_the_racks_host_aggregator(caplog):
    """The switch (here a host speaking the same protocol, with a 4-slot
    pool that another job holds) refuses the job for lack of room."""
    switch = ServiceProcess(_switch_address(), shards=1, args=["--mode", "switch", "--pool", "4"])
    fallback = ServiceProcess("udp://127.0.0.1:0", shards=1, args=["--mode", "switch"])
    try:
        with Client(switch.address, job=_job(), rank=0, world_size=1, slots=4, connect_timeout=10) as holder:
            holder.allreduce(np.ones(10, np.int32)).result(30)
            topo = topology_text("p4", None, [switch.address], 2, fallbacks=[fallback.address])
            with caplog.at_level(logging.WARNING, logger="aggnet.client"):
                results = run_topology(topo, 2, (None,), 50_000, threads=True)
        check(results, 2, (None,), 50_000)
        assert all(r["fell_back"] for r in results)
        lines = [m for m in caplog.messages if "falling back" in m]
        assert len(lines) == 2 and all("no room" in m for m in lines), lines
    finally:
        fallback.stop()
        switch.stop()


def test_without_a_fallback_a_dead_switch_is_an_error_naming_it():
    topo = topology_text("p4", None, [_switch_address()], 1)
    with pytest.raises(Exception, match="no aggregator answered"):
        Client(topology=topo, rank=0, connect_timeout=1.5)


def test_client_takes_topology_from_the_environment(tmp_path, monkeypatch):
    svc = ServiceProcess("zmq+tcp://127.0.0.1:0", shards=1)
    try:
        path = tmp_path / "one.toml"
        path.write_text(topology_text("service", None, [svc.address], 1))
        monkeypatch.delenv("AGGNET_ADDRESS", raising=False)
        monkeypatch.setenv("AGGNET_TOPOLOGY", str(path))
        with Client(rank=0) as c:
            a = np.arange(10, dtype=np.float32)
            c.allreduce(a).result(30)
            assert c.address == svc.address and c.job == "hier" and c.world_size == 1
        with pytest.raises(ValueError, match="world_size=3 but topology .* holds 1"):
            Client(rank=0, world_size=3)
    finally:
        svc.stop()


def test_ddp_through_two_racks_trains_like_one_process():
    """DDP with the aggnet hook placed by a topology (service racks under
    a service root) computes what one process computes on the global batch."""
    pytest.importorskip("torch", reason="DDP needs PyTorch (pip install aggnet[torch])")
    from harness import ddp_workers as W
    from test_torch_hook import STEPS, rel_diff

    r = Racks("service", per_rack=2)
    try:
        results = run_workers("spawn://", 4, W.ddp_run, 4, free_port(), "aggnet", {"topology": r.topology},
                              timeout=240, start_method="spawn")
        reference = W.single_process(4, STEPS)
        for res in results:
            assert res["calls"] == [STEPS]
            assert rel_diff(res["params"][0], reference) <= 1e-6
        assert sum(s["uplink"]["partials_up"] for s in r.stats(r.racks[0])["shards"]) > 0
    finally:
        r.stop()


def _rack_clients(r: Racks, job: str) -> list:
    """A client for each of the racks' 4 workers, joined at once (each
    rack holds its members' JOIN answers until the root takes the job)."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda rank: Client(topology=r.topology, rank=rank, job=job, timeout=20,
                                                 connect_timeout=30), range(4)))


def _results(futures) -> None:
    for f in futures:
        f.result(timeout=60)


def test_a_restarted_root_shard_takes_the_racks_back_and_the_round_in_flight_finishes():
    """The root loses the job when a shard of it restarts: each rack joins
    it again and sends it what it lost (its open partials, the finals
    another rack may lack), and the round in flight completes exactly.
    Workers stay members of their racks and join nothing again."""
    r = Racks("service", root_args=["--restart"])
    clients = []
    try:
        clients = _rack_clients(r, _job())
        bufs = [np.full(200_000, k + 1, np.int32) for k in range(4)]
        _results([c.allreduce(b) for c, b in zip(clients, bufs)])
        assert all((b == 10).all() for b in bufs)
        # ranks 0..2 start the next round: rack 0's partials reach the root,
        # rack 1 waits for rank 3 when the root shard dies
        bufs = [np.full(200_000, 2 * k, np.int32) for k in range(4)]
        early = [c.allreduce(b) for c, b in zip(clients[:3], bufs[:3])]
        kill_shard(r.root.address, 0)
        assert not any(f.done() for f in early)
        _results(early + [clients[3].allreduce(bufs[3])])
        assert all((b == 12).all() for b in bufs)
        bufs = [np.full(1000, k, np.int32) for k in range(4)]
        _results([c.allreduce(b) for c, b in zip(clients, bufs)])
        assert all((b == 6).all() for b in bufs)
        assert [c.stats.rejoins for c in clients] == [0] * 4
        rack_shards = [sh for rack in r.racks for sh in r.stats(rack)["shards"]]
        assert sum(sh["counters"].get("uplink_rejoins", 0) for sh in rack_shards) >= 1
    finally:
        for c in clients:
            c.close()
        r.stop()


@pytest.mark.slow
def test_a_restarted_rack_shard_is_taken_back_by_the_root_and_the_round_in_flight_finishes():
    """A rack's shard dies with the round open: the root keeps the rack's
    place (its open chunks wait), the rack's successor joins the root
    again, its workers join the successor and send what it lost, and the
    round completes exactly."""
    r = Racks("service", rack_args=["--restart"])
    clients = []
    try:
        clients = _rack_clients(r, _job())
        bufs = [np.full(300_000, k + 1, np.int32) for k in range(4)]
        _results([c.allreduce(b) for c, b in zip(clients, bufs)])
        # ranks 0..2 start a round; rack 1 waits for rank 3 when a shard of rack 0 dies
        bufs = [np.full(300_000, 3 * k, np.int32) for k in range(4)]
        early = [c.allreduce(b) for c, b in zip(clients[:3], bufs[:3])]
        kill_shard(r.racks[0].address, 1)
        assert not any(f.done() for f in early)
        _results(early + [clients[3].allreduce(bufs[3])])
        assert all((b == 18).all() for b in bufs)
        bufs = [np.full(1000, k, np.int32) for k in range(4)]
        _results([c.allreduce(b) for c, b in zip(clients, bufs)])
        assert all((b == 6).all() for b in bufs)
        root = [sh["counters"] for sh in r.stats(r.root)["shards"]]
        assert sum(c.get("racks_disconnected", 0) for c in root) == 1, root
        assert sum(c.get("racks_back", 0) for c in root) == 1, root
        # rack 0's workers joined the successor; rack 1's had nothing to do
        assert [c.stats.rejoins >= 1 for c in clients] == [True, True, False, False]
    finally:
        for c in clients:
            c.close()
        r.stop()


def _serve_at(address: str, args: list, timeout: float = 30.0) -> ServiceProcess:
    """``aggnet serve`` at ``address``, again once the ports its stopped
    predecessor held are free."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            return ServiceProcess(address, shards=2, args=args)
        except AggregatorUnreachable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_a_rack_service_stopped_and_started_again_at_its_address_is_taken_back():
    """A whole rack service stops (SIGTERM: an operator, or the Ray actor
    that ran it died) with the round open and starts again at the same
    address: it does not tell the root its job left (its workers did not),
    so the root keeps the rack's place and the other rack's chunks wait for
    it, and the round completes exactly on the new service."""
    root = ServiceProcess("zmq+tcp://127.0.0.1:0", shards=2)
    address = f"zmq+tcp://127.0.0.1:{free_port_block(3)}"
    rack_args = [["--parent", root.address, "--rack-id", str(i), "--racks", "2"] for i in range(2)]
    racks = [_serve_at(address, rack_args[0]), ServiceProcess("zmq+tcp://127.0.0.1:0", shards=2, args=rack_args[1])]
    topology = topology_text("service", root.address, [p.address for p in racks], 2, 2)
    clients = []
    try:
        import concurrent.futures

        job = _job()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            clients = list(pool.map(lambda rank: Client(topology=topology, rank=rank, job=job, timeout=30,
                                                        connect_timeout=30), range(4)))
        bufs = [np.full(300_000, k + 1, np.int32) for k in range(4)]
        _results([c.allreduce(b) for c, b in zip(clients, bufs)])
        # ranks 0..2 start a round; rack 1 waits for rank 3 while rack 0 stops
        bufs = [np.full(300_000, 3 * k, np.int32) for k in range(4)]
        early = [c.allreduce(b) for c, b in zip(clients[:3], bufs[:3])]
        assert racks[0].stop() == 0
        racks[0] = _serve_at(address, rack_args[0])
        _results(early + [clients[3].allreduce(bufs[3])])
        assert all((b == 18).all() for b in bufs)
        bufs = [np.full(1000, k, np.int32) for k in range(4)]
        _results([c.allreduce(b) for c, b in zip(clients, bufs)])
        assert all((b == 6).all() for b in bufs)
        counters = [sh["counters"] for sh in stats_cli.query(root.address, 5.0)["shards"]]
        assert sum(c.get("racks_back", 0) for c in counters) >= 1, counters
        assert sum(c.get("dropped_member_left", 0) for c in counters) == 0, counters
    finally:
        for c in clients:
            c.close()
        for p in [*racks, root]:
            p.stop()


@pytest.mark.slow
def test_sparse_buckets_through_racks_keep_torch_distributed_and_train_like_one_process():
    """Sparse tables need one service every worker reaches; through racks
    the hook's sparse buckets take torch.distributed's path instead of
    failing, and the dense ones still go through the racks."""
    pytest.importorskip("torch", reason="DDP needs PyTorch (pip install aggnet[torch])")
    from harness import ddp_workers as W
    from test_torch_hook import STEPS, rel_diff

    r = Racks("service", per_rack=1)
    try:
        results = run_workers("spawn://", 2, W.ddp_run, 2, free_port(), "aggnet",
                              {"topology": r.topology, "sparse": True}, timeout=240, start_method="spawn")
        reference = W.single_process(2, STEPS, sparse=True)
        for res in results:
            assert res["calls"] == [STEPS]
            assert rel_diff(res["params"][0], reference) <= 1e-6
    finally:
        r.stop()


def _whole_job_worker(rank: int, address: str, job: str, root: str):
    x, _ = data(rank)
    with Client(address, job=job, rank=rank, world_size=2, timeout=30, connect_timeout=30) as c:
        c.allreduce(x).result(60)
        at_root = stats_cli.query(root)
    return x, at_root


def _job_names(stats: dict) -> set:
    """Job names in a STATS answer of either kind."""
    if stats.get("mode") == "switch":
        return set(stats["jobs"])
    return {name for shard in stats["shards"] for name in shard["jobs"]}


def test_a_job_whose_workers_are_all_in_one_rack_completes_there(racks):
    # a model-parallel stage's data-parallel group inside one rack: the
    # rack's aggregator has a root, but the job is whole in the rack
    job = _job()
    results = run_workers("inproc://threads", 2, _whole_job_worker, racks.racks[1].address, job,
                          racks.root.address, timeout=120)
    want = np.sum([data(r)[0] for r in range(2)], axis=0, dtype=np.float64).astype(np.float32)
    for x, at_root in results:
        np.testing.assert_array_equal(x, want)
        assert job not in _job_names(at_root)
