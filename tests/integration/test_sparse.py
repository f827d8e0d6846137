"""Sparse tables on the aggregator service: push/pull over real shard
processes and sockets, the DDP hook's sparse buckets (all-reduce mode),
ShardedEmbedding (PS mode), checkpoints across a restart of the service,
and refusals that change nothing."""

from __future__ import annotations


import numpy as np
import pytest

from aggnet.protocol import sparse_layout
from aggnet.errors import AggregationError, AggregationTimeout
from aggnet.processes import ServiceProcess
from aggnet.client.sparse import SparseClient
from aggnet.protocol.wire import MsgType
from harness.helpers import RunningService, free_port, run_workers

STEPS = 20


@pytest.fixture(scope="module")
def service():
    svc = RunningService("zmq+ipc", shards=2)
    yield svc
    svc.stop()


def shard_list(address: str) -> list[str]:
    from aggnet.protocol import wire
    from aggnet.transport import connect

    with connect([address]) as conn:
        conn.send(0, wire.Header(MsgType.HELLO).pack())
        msg = conn.recv(10.0)
    assert msg is not None
    return wire.parse_json(msg.payload)["shards"]


def rel_diff(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / max(np.linalg.norm(np.asarray(b)), 1e-30))


# -- push, pull and all-reduce over worker processes ------------------------------------

ROWS, WIDTH = 23, 5  # an odd width and rows that do not split evenly


def worker_rows(rank: int, step: int):
    """Each worker's rows for a step: many repeats within the worker (10
    indices out of 6 values) and across workers (the ranges overlap)."""
    rng = np.random.default_rng(100 * step + rank)
    idx = rng.integers(rank * 3, rank * 3 + 6, 10)
    if step == 1 and rank == 0:
        idx = np.array([], np.int64)  # a worker that touched nothing still steps
    return idx, rng.standard_normal((idx.size, WIDTH)).astype(np.float32)


def push_pull_worker(rank: int, shards: list, world: int):
    with SparseClient(shards, job="pp", rank=rank, world_size=world, timeout=20) as sc:
        store = sc.table("store", ROWS, WIDTH, mode="ps", optimizer="sum", partitions=3)
        ar = sc.table("ar", ROWS, WIDTH, mode="allreduce", partitions=4)
        pulled, reduced = [], []
        for step in range(3):
            idx, rows = worker_rows(rank, step)
            store.push(idx, rows).result(20)
            pulled.append(store.pull(np.array([4, 0, 4, 22, 7])).result(20))
            reduced.append(ar.allreduce(idx, rows).result(20))
        return pulled, reduced


def test_push_sums_rows_and_allreduce_returns_every_workers_sum(service):
    world = 3
    res = run_workers(service.address, world, push_pull_worker, shard_list(service.address), world, timeout=60)
    table = np.zeros((ROWS, WIDTH), np.float64)
    for step in range(3):
        total = np.zeros((ROWS, WIDTH), np.float64)
        touched = set()
        for rank in range(world):
            idx, rows = worker_rows(rank, step)
            np.add.at(total, idx, rows)
            touched |= set(idx.tolist())
        table += total
        for rank in range(world):
            pulled, reduced = res[rank]
            np.testing.assert_allclose(pulled[step], table[[4, 0, 4, 22, 7]], rtol=1e-6, atol=1e-6)
            idx, rows = reduced[step]
            assert idx.tolist() == sorted(touched)
            np.testing.assert_allclose(rows, total[idx], rtol=1e-6, atol=1e-6)
            # every worker got the very same bits
            assert np.array_equal(rows, res[0][1][step][1])


# -- workers of one host combine their rows -----------------------------------------------

def grouped_worker(rank: int, shards: list, nodes: int, local_size: int, job: str):
    from aggnet.client.host_group import HostGroup

    group = HostGroup(rank // local_size, nodes, rank % local_size, local_size)
    with SparseClient(shards, job=job, rank=rank, world_size=nodes * local_size, timeout=20,
                      host_group=group) as sc:
        store = sc.table("store", ROWS, WIDTH, mode="ps", optimizer="sum", partitions=3)
        ar = sc.table("ar", ROWS, WIDTH, mode="allreduce", partitions=4)
        pulled, reduced = [], []
        for step in range(3):
            idx, rows = worker_rows(rank, step)
            # both tables' rounds in flight at once, in the same order on
            # every worker (as DDP's buckets)
            pushed, summed = store.push(idx, rows), ar.allreduce(idx, rows)
            pushed.result(20)
            reduced.append(summed.result(20))
            pulled.append(store.pull(np.array([4, 0, 4, 22, 7])).result(20))
        return pulled, reduced, sc.bytes_sent, sc.bytes_local, sc.counters


def test_workers_of_a_host_combine_rows_before_the_network(service):
    nodes, local_size = 2, 2
    world = nodes * local_size
    before = service.stats()["totals"]
    res = run_workers(service.address, world, grouped_worker, shard_list(service.address), nodes, local_size,
                      "grouped", timeout=60)
    after = service.stats()["totals"]
    # one push per host, partition and round, for each of the two tables,
    # holding each row its host touched once
    assert after["sparse_pushes"] - before.get("sparse_pushes", 0) == nodes * (3 + 4) * 3
    host_rows = sum(len(set().union(*(worker_rows(r, step)[0].tolist() for r in range(n * local_size,
                                                                                       (n + 1) * local_size))))
                    for n in range(nodes) for step in range(3))
    assert after["sparse_bytes_in"] - before.get("sparse_bytes_in", 0) == 2 * host_rows * (8 + 4 * WIDTH)
    table = np.zeros((ROWS, WIDTH), np.float64)
    for step in range(3):
        total = np.zeros((ROWS, WIDTH), np.float64)
        for rank in range(world):
            idx, rows = worker_rows(rank, step)
            np.add.at(total, idx, rows)
        table += total
        for rank in range(world):
            pulled, reduced = res[rank][:2]
            np.testing.assert_allclose(pulled[step], table[[4, 0, 4, 22, 7]], rtol=1e-6, atol=1e-6)
            idx, rows = reduced[step]
            np.testing.assert_allclose(rows, total[idx], rtol=1e-6, atol=1e-6)
            assert np.array_equal(rows, res[0][1][step][1])
    for rank in range(world):
        sent, local, counters = res[rank][2:]
        assert local > 0  # rows were handed between the workers of the host
        assert not counters, counters  # nothing malformed on the host's socket


def test_host_group_comes_from_torchruns_variables(monkeypatch):
    from aggnet.client.host_group import HostGroup

    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("GROUP_RANK", "2")
    assert HostGroup.from_env(9, 12) == HostGroup(2, 3, 1, 4)
    assert HostGroup.from_env(8, 12) is None  # not numbered host by host
    monkeypatch.setenv("AGGNET_SPARSE_COMBINE", "0")
    assert HostGroup.from_env(9, 12) is None
    monkeypatch.delenv("AGGNET_SPARSE_COMBINE")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert HostGroup.from_env(9, 12) is None  # one worker per host: nothing to combine


def test_a_follower_without_its_leader_fails_clearly(service):
    from aggnet.client.host_group import HostGroup

    with SparseClient(shard_list(service.address), job="orphan", rank=1, world_size=2, timeout=2,
                      host_group=HostGroup(0, 1, 1, 2)) as sc:
        t = sc.table("t", ROWS, WIDTH, mode="allreduce")
        with pytest.raises(AggregationTimeout, match=r"rank 0, the first worker of host 0, which pushes the host's "
                                                     r"rows: is it running.*no answer within 2s"):
            t.allreduce([1], np.ones((1, WIDTH), np.float32)).result(10)
        # a follower's own push, past its client: refused, its leader pushes for it
        with pytest.raises(AggregationError, match=r"rank 1 opened table 't' as a worker whose rows its host's first "
                                                   r"worker combines and pushes; it cannot push itself"):
            _raw(sc, t, MsgType.SPARSE_PUSH, 0, 2, [1], np.ones((1, WIDTH)))
    with pytest.raises(ValueError, match=r"ranks must go host by host"):
        SparseClient(["zmq+ipc:///nonexistent"], job="x", rank=1, world_size=4, host_group=HostGroup(1, 2, 0, 2))


# -- refusals ---------------------------------------------------------------------------

def _raw(sc: SparseClient, t, msg_type, p, rnd, idx, rows, slot=0):
    """A row message built by hand, past the client's own checks: what a
    buggy or hostile worker could send."""
    h = t._header(msg_type, p, rnd, len(idx), slot)
    payload = np.asarray(idx, "<i8").tobytes() + (b"" if rows is None else np.asarray(rows, "<f4").tobytes())
    return sc._submit(sc._exchange, [(t._shard(p), h, payload)], 5.0, "raw").result(10)


def test_bad_pushes_fail_clearly_and_change_nothing(service):
    with SparseClient(shard_list(service.address), job="bad", rank=0, world_size=1, timeout=5) as sc:
        t = sc.table("t", 10, 4, mode="ps", optimizer="sgd", lr=1.0, partitions=2,
                     init={"kind": "uniform", "scale": 1.0, "seed": 3})
        before = t.pull(np.arange(10)).result(10)
        assert np.abs(before).max() > 0  # initialized on the server
        with pytest.raises(IndexError, match=r"rows 0\.\.9.*e\.g\. 10.*nothing was sent"):
            t.push([1, 10], np.ones((2, 4), np.float32))
        with pytest.raises(ValueError, match=r"rows of 4 floats.*got shape \(2, 3\)"):
            t.push([1, 2], np.ones((2, 3), np.float32))
        # the same mistakes reaching the shard: refused there too
        with pytest.raises(AggregationError, match=r"row index 7 of table 't' is in another partition"):
            _raw(sc, t, MsgType.SPARSE_PUSH, 0, 1, [1, 7], np.ones((2, 4)))
        with pytest.raises(AggregationError, match=r"row index 12 of table 't' is outside the table's rows \[0, 10\)"):
            _raw(sc, t, MsgType.SPARSE_PUSH, 1, 1, [6, 12], np.ones((2, 4)))
        with pytest.raises(AggregationError, match=r"rows of 3 floats; the table's rows are 4 floats"):
            _raw(sc, t, MsgType.SPARSE_PUSH, 0, 1, [1, 2], np.ones((2, 3)))
        with pytest.raises(AggregationError, match=r"NaN/Inf"):
            _raw(sc, t, MsgType.SPARSE_PUSH, 0, 1, [1], np.full((1, 4), np.nan))
        ghost = sc.table("ghost", 10, 4, partitions=2)
        ghost.close()  # gone from the shards: it does not exist any more
        with pytest.raises(AggregationError, match=r"does not exist on shard .* open it first"):
            _raw(sc, ghost, MsgType.SPARSE_PUSH, 0, 1, [1], np.ones((1, 4)))
        with pytest.raises(AggregationError, match=r"every worker must open it alike"):
            sc.tables.pop("t")
            try:
                sc.table("t", 10, 8, mode="ps", optimizer="sgd", lr=1.0, partitions=2)
            finally:
                sc.tables["t"] = t
        after = t.pull(np.arange(10)).result(10)
        assert np.array_equal(before, after)
        # a good push still works afterwards, and rounds go on
        t.push([3], np.ones((1, 4), np.float32)).result(10)
        np.testing.assert_allclose(t.pull([3]).result(10)[0], before[3] - 1.0, rtol=1e-6)
    counters = service.stats()["totals"]
    for reason in ("out_of_range", "width", "nonfinite", "unknown_table", "spec_mismatch"):
        assert counters.get(f"dropped_sparse_{reason}", 0) >= 1, (reason, counters)


def test_a_table_past_the_memory_bound_is_refused(tmp_path):
    svc = ServiceProcess(f"zmq+ipc://{tmp_path}/m.sock", 2, env={"AGGNET_SPARSE_MEMORY": "1M"})
    try:
        with SparseClient(shard_list(svc.address), job="mem", rank=0, world_size=1, timeout=5) as sc:
            with pytest.raises(AggregationError, match=r"needs \d+ bytes on shard .* may use 1048576 bytes.*"
                                                       r"AGGNET_SPARSE_MEMORY"):
                sc.table("big", 100_000, 4, mode="ps", optimizer="adam")  # 2 x 1.6 MB per shard
            small = sc.table("small", 1000, 4, mode="ps", optimizer="adam")
            small.push([1], np.ones((1, 4), np.float32)).result(10)
    finally:
        svc.stop()


# -- torch: all-reduce mode under the DDP hook -------------------------------------------

@pytest.mark.parametrize("world,opt,hosts", [(2, "sgd", 0), (3, "sgd", 0), (2, "adagrad", 0), (3, "adagrad", 0),
                                             (4, "adagrad", 2)])
@pytest.mark.slow
def test_ddp_sparse_buckets_through_tables_match_torch_and_single_process(service, world, opt, hosts):
    """``hosts``: 2 x 2 workers that torchrun's variables place on two
    hosts, so each host's rows are combined before they are pushed."""
    pytest.importorskip("torch")
    from harness import sparse_workers as W

    res = run_workers("spawn://", world, W.hook_run, world, free_port(), service.address, opt, STEPS, hosts,
                      timeout=180, start_method="spawn")
    ref_embed, ref_head = W.single_process(world, STEPS, opt, opt)
    for r in res:
        agg, tor = r["aggnet"], r["torch"]
        assert np.array_equal(agg["embed"], res[0]["aggnet"]["embed"])  # identical on every rank
        assert rel_diff(agg["embed"], ref_embed) <= 1e-6
        assert rel_diff(agg["embed"], tor["embed"]) <= 1e-6
        for a, b in zip(agg["head"], ref_head):
            assert rel_diff(a, b) <= 1e-6
        assert agg["dense_calls"] == STEPS  # the dense bucket still went through aggnet
        assert agg["sparse_bytes"][0] > 0 and tor["sparse_bytes"] is None
        assert (agg["bytes_local"] > 0) == bool(hosts)


# -- torch: PS mode ---------------------------------------------------------------------

def test_sharded_embedding_matches_single_process_for_each_server_optimizer(service):
    pytest.importorskip("torch")
    from harness import sparse_workers as W

    opts = ["sgd", "momentum", "adagrad", "adam"]
    res = run_workers("spawn://", 2, W.ps_run, 2, free_port(), service.address, opts, STEPS, timeout=120,
                      start_method="spawn")
    for opt in opts:
        ref_embed, ref_head = W.single_process(2, STEPS, opt, "sgd", cover=opt == "momentum")
        moved = rel_diff(ref_embed, W.initial()[0].numpy())
        assert moved > 1e-3, (opt, moved)  # training really changed the table
        for r in res:
            assert rel_diff(r[opt]["embed"], ref_embed) <= 1e-5, opt
            for a, b in zip(r[opt]["head"], ref_head):
                assert rel_diff(a, b) <= 1e-5, opt


def test_auto_partitions_agree_on_every_rank_and_train_the_same(service):
    """partitions="auto": the workers time a scratch table together at the
    partition counts Parallax's search visits and take the fit's best P;
    every rank must reach the same samples (the slowest rank's times) and
    the same P, and training is then what it is at any P."""
    pytest.importorskip("torch")
    from harness import sparse_workers as W

    res = run_workers("spawn://", 2, W.ps_run, 2, free_port(), service.address, ["adagrad"], 6, "auto",
                      timeout=180, start_method="spawn")
    tunings = [r["adagrad"]["tuning"] for r in res]
    assert tunings[0]["samples"] == tunings[1]["samples"]
    samples = tunings[0]["samples"]
    assert 2 in samples and len(samples) >= 2  # started at the service's 2 shards, went on from there
    assert all(t > 0 for t in samples.values())
    p = tunings[0]["partitions"]
    assert res[0]["adagrad"]["partitions"] == res[1]["adagrad"]["partitions"] == p
    assert min(samples) <= p <= max(samples)
    ref_embed, ref_head = W.single_process(2, 6, "adagrad", "sgd")
    for r in res:
        assert rel_diff(r["adagrad"]["embed"], ref_embed) <= 1e-5


@pytest.mark.slow
def test_checkpoint_restart_restore_continues_identically(tmp_path):
    pytest.importorskip("torch")
    from harness import sparse_workers as W

    steps = 6
    first = RunningService("zmq+ipc", shards=2)
    try:
        straight = run_workers("spawn://", 2, W.checkpoint_run, 2, free_port(), first.address, "save",
                               str(tmp_path), steps, timeout=120, start_method="spawn")
    finally:
        first.stop()
    meta = (tmp_path / "table" / "meta.json").read_text()
    assert '"step": 6' in meta and '"exp_avg_sq"' in meta
    second = RunningService("zmq+ipc", shards=2)  # a new service: nothing of the table is left
    try:
        restored = run_workers("spawn://", 2, W.checkpoint_run, 2, free_port(), second.address, "restore",
                               str(tmp_path), steps, timeout=120, start_method="spawn")
    finally:
        second.stop()
    for a, b in zip(straight, restored):
        assert np.array_equal(a["embed"], b["embed"])
        for x, y in zip(a["head"], b["head"]):
            assert np.array_equal(x, y)


def test_layout_puts_every_row_in_exactly_one_partition():
    for rows, parts in ((1, 1), (23, 3), (1000, 7), (5, 5)):
        edges = sparse_layout.bounds(rows, parts)
        assert edges[0] == 0 and edges[-1] == rows and (np.diff(edges) >= 1).all()
