"""aggnet as a torch.distributed backend: every collective gives what gloo
gives, DDP without a hook and FSDP2 train as they do on gloo, torchrun
starts it, and what it cannot do is refused by name. Underneath, the
reduce-scatter path of the service: each rank receives only its share."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the backend needs PyTorch (pip install aggnet[torch])")

from harness import backend_workers as B  # noqa: E402
from aggnet import Client  # noqa: E402
from aggnet.errors import JobMismatch  # noqa: E402
from aggnet.protocol.wire import PLAN_VALUES  # noqa: E402
from harness.helpers import RunningService, run_workers  # noqa: E402


@pytest.fixture(scope="module")
def service():
    svc = RunningService("shm", shards=2)
    yield svc
    svc.stop()


def spawn(world: int, fn, *args, timeout: float = 150):
    return run_workers("spawn://", world, fn, world, *args, timeout=timeout, start_method="spawn")


def rel_diff(a, b) -> float:
    return max(float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30)) for x, y in zip(a, b))


# -- the service's reduce-scatter, without torch -------------------------------------


def _reduce_scatter_worker(rank, address, world, bounds, chunk_bytes):
    with Client(address, job="rs-shares", rank=rank, world_size=world, timeout=20, chunk_bytes=chunk_bytes) as c:
        g = np.random.default_rng(rank)
        buf = g.integers(-(1 << 20), 1 << 20, bounds[-1]).astype(np.int32)
        kept = buf.copy()
        out = np.empty(bounds[rank + 1] - bounds[rank], np.int32)
        assert c.reduce_scatter(buf, out, bounds).result(30) is out
        assert np.array_equal(buf, kept), "reduce_scatter changed its input"
        return out, c.stats.bytes_received


@pytest.mark.parametrize("kind", ["shm", "zmq+tcp"])
def test_service_reduce_scatter_sends_each_rank_only_its_share(kind):
    svc = RunningService(kind, shards=2)
    try:
        world, chunk = 3, 4096
        bounds = [0, 2500, 2500, 9001]  # uneven, one empty share, none on a chunk boundary
        res = run_workers(svc.address, world, _reduce_scatter_worker, svc.address, world, bounds, chunk, timeout=60)
        total = sum(np.random.default_rng(r).integers(-(1 << 20), 1 << 20, bounds[-1]).astype(np.int32)
                    for r in range(world))
        for r in range(world):
            out, received = res[r]
            assert np.array_equal(out, total[bounds[r]:bounds[r + 1]])
            assert received == 4 * (bounds[r + 1] - bounds[r])  # S/N down, not S
        # the aggregator sent the sum once (and to each rank the 28-byte
        # buffer-size agreement), where an all-reduce sends it to every rank
        assert svc.stats()["totals"]["bytes_out"] == 4 * bounds[-1] + world * 4 * PLAN_VALUES
    finally:
        svc.stop()


def test_a_push_for_an_owner_outside_the_world_is_dropped_and_answered(service):
    from aggnet.protocol import wire
    from aggnet.protocol.wire import job_id_of
    from aggnet.transport import connect

    job = "rs-bad-owner"
    with connect([service.address]) as ctl:
        ctl.send(0, wire.Header(wire.MsgType.HELLO).pack())
        shards = wire.parse_json(ctl.recv(10).payload)["shards"]
    with connect(shards[:1]) as raw:
        join = wire.Header(wire.MsgType.JOIN, job_id=job_id_of(job), sender=0, world=2)
        payload = wire.json_payload({"name": job, "timeout": 5.0})
        raw.send(0, join.pack_for(payload), payload)
        reply = raw.recv(10)
        assert wire.unpack_header(reply.header).msg_type == wire.MsgType.JOIN_OK
        push = wire.Header(wire.MsgType.PUSH, job_id=job_id_of(job), round=1, index=0, sender=0, nsum=7,
                           flags=wire.Flag.LITTLE_ENDIAN | wire.Flag.TO_OWNER, dtype=wire.DType.FLOAT32, count=4)
        raw.send(0, push.pack(), np.ones(4, np.float32))
        reply = raw.recv(10)
        assert wire.unpack_header(reply.header).msg_type == wire.MsgType.ERROR
        code, text = wire.parse_error(reply.payload)
        assert code == "malformed" and "rank 7, outside world size 2" in text
        raw.send(0, wire.Header(wire.MsgType.LEAVE, job_id=job_id_of(job), sender=0, world=2).pack())
        raw.recv(10)
    assert service.stats()["totals"]["dropped_bad_owner"] == 1


def _mixed_worker(rank, address):
    with Client(address, job="rs-mixed", rank=rank, world_size=2, timeout=10) as c:
        buf = np.ones(1000, np.float32)
        try:
            if rank == 0:
                c.reduce_scatter(buf, np.empty(500, np.float32)).result(20)
            else:
                c.allreduce(buf).result(20)
        except JobMismatch as exc:
            return str(exc)
        return "no error"


def test_reduce_scatter_beside_an_allreduce_is_a_mismatch_not_a_hang(service):
    for text in run_workers(service.address, 2, _mixed_worker, service.address, timeout=60):
        assert "all workers must" in text, text


# -- the torch backend ---------------------------------------------------------------

#: per world size: the backend string and the parts one set of spawned
#: workers runs (each spawn of torch processes costs seconds on a small
#: machine, so the tests share them)
PLANS = {2: ("aggnet", ["collectives", "ddp", "fsdp", "stall", "monitored", "int32"]),
         3: ("cpu:aggnet", ["collectives", "ddp"]),
         4: ("aggnet", ["collectives"])}


@pytest.fixture(scope="module")
def suite(service, tmp_path_factory):
    """The results of each world size's workers, run on first use."""
    runs = {}

    def run(world: int):
        if world not in runs:
            backend, parts = PLANS[world]
            init = f"file://{tmp_path_factory.mktemp('init')}/store"
            runs[world] = spawn(world, B.suite_run, init, service.address, 4096, backend, parts)
        return runs[world]
    return run


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_collective_equals_gloo(suite, world):
    res = suite(world)
    for r in range(world):
        got, want = res[r]["collectives"]["aggnet"], res[r]["collectives"]["gloo"]
        assert got.keys() == want.keys()
        for name in want:
            if name == "all_reduce_f16_avg":
                # aggnet divides each fp16 contribution (|x| < 200) by N before
                # the sum, so that fp16 sums cannot overflow: N roundings of
                # at most 2**-11 * 200 / N each, and one of the result
                np.testing.assert_allclose(got[name], want[name], rtol=0, atol=2 * 2.0 ** -11 * 200, err_msg=name)
            elif name.endswith("_avg"):
                # aggnet multiplies by 1/N, gloo divides by N
                np.testing.assert_allclose(got[name], want[name], rtol=1e-6, err_msg=name)
            else:
                assert np.array_equal(got[name], want[name]), name
        assert res[r]["backend"] == PLANS[world][0]
        assert res[r]["job"] == res[0]["job"]
        # what went through aggnet: 8 all-reduces, 5 reduce-scatters and 6
        # asynchronous ones (the others were gloo's)
        assert res[r]["collectives"]["aggnet_ops"] == 19
        # a reduce-scatter of 4099 floats per rank brought back this rank's share only
        assert res[r]["collectives"]["share_received"] == 4 * 4099


def test_int32_all_reduces_carry_their_exponents_from_an_earlier_call_of_their_size(suite):
    """torch.distributed gives no key: the backend keys its int32 rounds
    (all-reduces and reduce-scatters) by the sizes of its calls in order,
    so that they skip the exponent agreement, and equal-size tensors
    issued together never wait for each other."""
    res = suite(2)
    for r in range(2):
        got = res[r]["int32"]
        for a, b in zip(got["got"], got["want"], strict=True):
            for x, y in zip(a, b, strict=True):
                assert np.array_equal(x, y)
        # the first step agrees; every all-reduce of a later one carries
        assert got["loop_carried"] == 3 * (B.INT32_STEPS - 1)
        # each from a round that was over: a synchronous loop never waits
        assert got["loop_awaited"] == 0
        # two of one size at once take different keys: neither waits
        assert got["pair_awaited"] == 0
        # the coalesced four: the last two may wait for the first two
        assert got["carried"] == got["loop_carried"] + 2 + 4 and got["awaited"] <= 2
        # and so does the loop through the staging a CUDA tensor takes
        assert got["staged_carried"] == got["loop_carried"]
        # a loop of reduce-scatters of one size alternates two keys, each
        # carried from two calls back, host memory or staged
        assert got["scatter_carried"] == got["staged_scatter_carried"] == B.INT32_STEPS - 2
        # FSDP2 on the int32 group trains as on gloo, within the codec's
        # quantization (2**-30 of each chunk's largest value a step), and
        # after its first step every reduce-scatter of its three units carries
        # (or agrees, where carrying would have sent most of it again)
        assert rel_diff(got["fsdp"], res[r]["fsdp"]["gloo"]) <= 1e-5
        carried, unsteady, _ = got["fsdp_counts"]
        assert carried + unsteady == 3 * (B.STEPS - 1) and unsteady <= 3
        # ranks whose AGGNET_PREDICT_SCALE differs key alike, so the first
        # round of each key (agreed on both) sums right, and the next, which
        # one carries and the other agrees, is refused at once naming the setting
        assert all(np.array_equal(*pair) for pair in got["mixed_first"])
        assert got["mismatch"].startswith("JobMismatch") and got["mismatch_s"] < 10, got["mismatch"]
        assert "some workers carry" in got["mismatch"] and "AGGNET_PREDICT_SCALE" in got["mismatch"]
    assert res[0]["int32"]["carried"] == res[1]["int32"]["carried"]


@pytest.mark.slow
def test_integer_averages_are_nccls_sum_then_truncated_division(suite):
    # Lightning's self.log(..., sync_dist=True) sends AVG of an int64 counter
    world = 2
    results = suite(world)
    for r in range(world):
        got = results[r]["collectives"]["integer_avg"]
        for dtype in ("torch.int64", "torch.int32", "torch.int8", "torch.uint8"):
            low = 0 if dtype == "torch.uint8" else -50
            parts = [B._ints(60, rank, 101, torch.int64, 50).clamp(min=low) for rank in range(world)]
            want = torch.div(sum(parts), world, rounding_mode="trunc").numpy()
            assert np.array_equal(got[dtype].astype(np.int64), want), dtype
        assert got["async"].tolist() == [7] * 5  # (7 + 8) / 2 truncated


def test_unsupported_collectives_are_refused_by_name(suite):
    refused = suite(2)[0]["collectives"]["refused"]
    for case in ("avg_bool", "avg_int16"):
        kind, text = refused[case]
        assert kind == "UnsupportedCollective" and "ReduceOp.AVG of" in text and "ReduceOp.SUM" in text, text
    kind, text = refused["premul_sum"]
    assert kind == "UnsupportedCollective" and "PREMUL_SUM" in text and "ReduceOp.SUM" in text
    kind, text = refused["meta_device"]
    assert kind == "UnsupportedCollective" and "meta tensor" in text and "CPU" in text
    kind, text = refused["avg_int32_reduce_scatter"]
    assert kind == "UnsupportedCollective" and "reduce_scatter_tensor" in text and "torch.int32" in text


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_without_a_hook_trains_like_gloo(suite, world):
    res = suite(world)
    for r in range(world):
        ddp = res[r]["ddp"]
        assert rel_diff(ddp["params"]["aggnet"], ddp["params"]["gloo"]) <= 1e-6
        assert rel_diff(ddp["params"]["aggnet"], res[0]["ddp"]["params"]["aggnet"]) == 0.0
        assert ddp["aggnet_ops"] == B.STEPS  # one bucket per step, through aggnet


@pytest.mark.slow
def test_fsdp2_trains_a_small_transformer_like_gloo(suite):
    world = 2
    res = suite(world)
    for r in range(world):
        fsdp = res[r]["fsdp"]
        assert rel_diff(fsdp["aggnet"], fsdp["gloo"]) <= 1e-6
        # every step reduce-scattered each of the 3 FSDP units' gradients through aggnet
        assert fsdp["aggnet_ops"] == 3 * B.STEPS


def test_a_rank_that_never_joins_the_collective_is_named_not_waited_for(suite):
    stall = suite(2)[0]["stall"]
    assert "rank(s) [1]" in stall["error"] and "aggnet backend: all_reduce on rank 0" in stall["error"], stall
    assert stall["seconds"] < 10  # the group's aggnet timeout is 2 s


def test_monitored_barrier_serves_aggnet_groups_and_names_a_missing_rank(suite):
    res = suite(2)
    assert res[1]["monitored"]["passed_s"] < 30
    missing = res[0]["monitored"]
    # gloo's own words, as on a gloo group: rank 1 never came
    assert "Rank 1" in missing["error"] and "monitoredBarrier" in missing["error"], missing
    assert missing["seconds"] < 10


TORCHRUN_SCRIPT = textwrap.dedent("""
    import json
    import torch, torch.distributed as dist
    import aggnet.torch  # registers the backend
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("aggnet")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 2))
    model(torch.ones(4, 8) * (rank + 1)).sum().backward()
    grad = model.module.weight.grad.sum().item()
    out = torch.empty(3)
    dist.reduce_scatter_tensor(out, torch.arange(3.0 * world))
    with open(f"rank{rank}.json", "w") as f:
        json.dump({"rank": rank, "sum": t[0].item(), "grad": grad, "share": out.tolist(),
                   "backend": dist.get_backend()}, f)
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_torchrun_starts_the_backend_with_the_embedded_default(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGGNET_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
                           str(script)], capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert sorted(x["rank"] for x in lines) == [0, 1, 2]
    # d sum(W x) / dW over 4 rows of (rank + 1) is 4 (rank + 1) for each of
    # the 16 weights; averaged over ranks 1, 2, 3: 16 * 4 * 2
    for x in lines:
        assert x["backend"] == "aggnet" and x["sum"] == 6.0
        assert x["grad"] == pytest.approx(16 * 4 * 2, rel=1e-6)
        assert x["share"] == [3.0 * (3 * x["rank"] + i) for i in range(3)]


def test_a_backend_string_mixing_aggnet_with_another_is_refused_in_one_line(tmp_path):
    """torch would take aggnet's group for every device and drop the other
    backend without a word; refused, saying what to use instead."""
    code = ("import torch.distributed as dist, aggnet.torch\n"
            f"dist.init_process_group('cpu:aggnet,cuda:nccl', init_method='file://{tmp_path}/store', rank=0, "
            "world_size=1)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "'cpu:aggnet,cuda:nccl' mixes aggnet with nccl" in r.stderr and "use backend='aggnet'" in r.stderr, \
        r.stderr[-2000:]


_NCCL_DELEGATE = """
import json, sys, torch, torch.distributed as dist, aggnet.torch
dist.init_process_group('aggnet', init_method='file://{store}', rank=0, world_size=1)
pg = dist.group.WORLD
out = {{"cuda": type(pg._get_backend(torch.device('cuda'))).__name__,
        "cpu": type(pg._get_backend(torch.device('cpu'))).__name__}}
x = torch.arange(8, dtype=torch.float32, device='cuda')
gathered = torch.empty(8, device='cuda')
dist.all_gather_into_tensor(gathered, x)                  # NCCL's
dist.broadcast(x, src=0)                                  # NCCL's
ints = torch.ones(4, dtype=torch.int64, device='cuda')
dist.all_reduce(ints, op=dist.ReduceOp.MAX)               # not aggnet's: NCCL's
dist.all_reduce(x)                                        # aggnet's
torch.cuda.synchronize()
out["gathered"] = gathered.tolist()
out["sum"] = x.tolist()
out["aggnet_calls"] = pg.client.stats.allreduces
cpu = torch.ones(3)
dist.all_gather_into_tensor(torch.empty(3), cpu)          # gloo's
dist.barrier()
dist.destroy_process_group()
print(json.dumps(out))
"""


def test_a_cuda_delegate_nccl_without_nccl_or_a_gpu_is_refused_in_one_line(tmp_path):
    if torch.cuda.is_available() and torch.distributed.is_nccl_available():
        pytest.skip("this machine has NCCL and a GPU: test_a_group_hands_cuda_collectives_to_nccl_where_asked runs")
    code = ("import torch.distributed as dist, aggnet.torch\n"
            f"dist.init_process_group('aggnet', init_method='file://{tmp_path}/store', rank=0, world_size=1)\n")
    env = {**os.environ, "AGGNET_CUDA_DELEGATE": "nccl"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert "cuda_delegate='nccl' (AGGNET_CUDA_DELEGATE)" in last and "leave it unset for gloo" in last, last
    env["AGGNET_CUDA_DELEGATE"] = "mpi"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode != 0
    assert "cuda_delegate must be gloo or nccl, got 'mpi'" in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.distributed.is_nccl_available()),
                    reason="no CUDA GPU with NCCL on this machine")
def test_a_group_hands_cuda_collectives_to_nccl_where_asked(tmp_path):
    # one rank: NCCL refuses two ranks on one GPU, and the lent machine has one
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGGNET_")}
    env["AGGNET_CUDA_DELEGATE"] = "nccl"
    r = subprocess.run([sys.executable, "-c", _NCCL_DELEGATE.format(store=tmp_path / "store")], capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["cuda"] == "ProcessGroupNCCL" and out["cpu"] == "ProcessGroupGloo", out
    assert out["gathered"] == [float(i) for i in range(8)] and out["sum"] == [float(i) for i in range(8)]
    assert out["aggnet_calls"] >= 1, out
