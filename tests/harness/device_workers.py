"""Workers of the device staging tests (imported by spawned processes)."""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from aggnet.torch.teardown import ends_process_group

from harness.ddp_workers import make_model, train


@ends_process_group
def client_encoded_ddp(rank: int, world: int, port: int, address: str, codec: str, steps: int):
    """DDP on the CPU whose hook hands each float32 bucket to an aggnet
    client that encodes it itself: what the staged path must equal."""
    torch.set_num_threads(1)
    from aggnet import Client
    from aggnet.torch.futures import torch_future

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    client = Client(address, job=f"client-encoded-{port}", rank=rank, world_size=world)
    try:
        def hook(_, bucket):
            buf = bucket.buffer()
            fut = client.allreduce(buf.numpy(), op="avg", codec=codec, key=bucket.index())
            return torch_future(fut, lambda f: (f.result(), buf)[1])

        model = make_model(0)
        ddp = DDP(model)
        ddp.register_comm_hook(None, hook)
        return {"params": [train(model, steps, world, rank, False, None, ddp=ddp)]}
    finally:
        client.close()


def _inputs(rank: int, device: str) -> dict:
    g = torch.Generator().manual_seed(rank)
    return {
        "f32 sum": (torch.randn(300_001, generator=g), "SUM"),
        "f32 avg": (torch.randn(4097, generator=g), "AVG"),
        "f16 sum": (torch.randn(5000, generator=g).half(), "SUM"),
        "bf16 sum": (torch.randn(5000, generator=g).bfloat16(), "SUM"),
        "i32 sum": (torch.randint(-1000, 1000, (999,), generator=g, dtype=torch.int32), "SUM"),
        "i64 avg": (torch.randint(-1000, 1000, (999,), generator=g), "AVG"),
        "strided": (torch.randn(64, 32, generator=g).t(), "SUM"),
    }


#: CPU tensors through what a CUDA tensor goes through (the backend's
#: ``stage_cpu_tensors``)
CPU_STAGED = "cpu-staged"


def _backend_on(device: str, port: int, rank: int, world: int) -> str:
    """``init_process_group("aggnet")`` for tensors on ``device``; the
    torch device they are made on."""
    import aggnet.torch  # noqa: F401  (registers the backend)

    dist.init_process_group("aggnet", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    if device == CPU_STAGED:
        dist.group.WORLD.stage_cpu_tensors = True
        return "cpu"
    return device


def _staging_counts() -> dict:
    """What the backend's staging did: buffers its pools allocated, and
    the client's chunks read and results written in shared memory."""
    group = dist.group.WORLD
    client = group.client
    return {"allocations": sum(s.stats()["pinned"].allocations + s.stats()["device"].allocations
                               for s in group._stagers.values()),
            "chunks_shared": client.stats.chunks_shared, "results_in_place": client.stats.results_in_place}


@ends_process_group
def backend_collectives(rank: int, world: int, port: int, address: str, device: str) -> dict:
    """Each collective through the aggnet backend and through a gloo group,
    on ``device`` tensors; {name: (aggnet's result, gloo's)} as NumPy, and
    under "staging" what the staging did."""
    os.environ["AGGNET_ADDRESS"] = address
    os.environ.pop("AGGNET_CODEC", None)
    torch.set_num_threads(1)
    device = _backend_on(device, port, rank, world)
    gloo = dist.new_group(backend="gloo")
    out = {}
    for name, (t, op) in _inputs(rank, device).items():
        mine = t.clone().to(device)
        dist.all_reduce(mine, op=getattr(dist.ReduceOp, op))
        ref = t.clone()
        dist.all_reduce(ref, op=dist.ReduceOp.SUM, group=gloo)
        if op == "AVG":
            ref = ref / world if ref.is_floating_point() else torch.div(ref, world, rounding_mode="trunc")
        out[name] = (_numpy(mine), _numpy(ref))
    g = torch.Generator().manual_seed(10 + rank)
    before = dist.group.WORLD.client.stats.results_in_place
    # one chunk a share, then several (a float16 share's last one short);
    # bfloat16 travels as its bits with a hint
    for n, dtype, op in [(1000, torch.float32, "SUM"), (700_001, torch.float32, "AVG"),
                         (700_001, torch.float16, "SUM"), (3001, torch.bfloat16, "SUM")]:
        whole = torch.randn(world * n, generator=g).to(dtype)
        share = torch.empty(2 * n, dtype=dtype, device=device)[::2]  # strided: received in a contiguous copy
        dist.reduce_scatter_tensor(share, whole.clone().to(device), op=getattr(dist.ReduceOp, op))
        ref = whole.clone()
        dist.all_reduce(ref, group=gloo)
        if op == "AVG":
            ref = ref / world
        out[f"reduce_scatter_tensor {n} {dtype} {op}"] = (_numpy(share), _numpy(ref[rank * n:(rank + 1) * n]))
    if device == "cuda":
        torch.cuda.synchronize()
        out["a CPU tensor right after a CUDA one"] = _cpu_after_cuda(rank, world)
        out["a strided result read on another stream"] = _strided_on_another_stream(rank, world)
    out["staging"] = _staging_counts()
    out["staging"]["scattered_in_place"] = out["staging"]["results_in_place"] - before
    return out


def _strided_on_another_stream(rank: int, world: int) -> tuple[np.ndarray, np.ndarray]:
    """A non-contiguous CUDA tensor's all-reduce (its result copied on
    from a contiguous copy), waited for while the default stream is busy,
    then read on another stream: the copy must be over when ``wait``
    returns, not queued behind the default stream's work."""
    t = torch.full((256, 128), float(rank + 1), device="cuda").t()
    work = dist.all_reduce(t, async_op=True)
    torch.cuda._sleep(200_000_000)  # the default stream busy for a good while
    work.wait()
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):
        got = t.to("cpu")
    return got.numpy(), np.full((128, 256), float(sum(range(1, world + 1))), np.float32)


def _cpu_after_cuda(rank: int, world: int) -> tuple[np.ndarray, np.ndarray]:
    """A CPU tensor's all-reduce called right after a CUDA tensor's of the
    same size, the CUDA one's copy to the host held back on rank 1 only
    (its stream busy): both must reach the aggregator in the order called
    on every rank, or each rank's sum mixes the two. (aggregated, expected)"""
    n, got, want = 1 << 16, [], []
    for i in range(3):
        on_gpu = torch.full((n,), float(rank + 1 + 10 * i), device="cuda")
        on_cpu = torch.full((n,), -float(rank + 1 + 10 * i))
        if rank == 1:
            torch.cuda._sleep(100_000_000)  # tens of milliseconds on the stream the copy waits for
        works = [dist.all_reduce(on_gpu, async_op=True), dist.all_reduce(on_cpu, async_op=True)]
        for w in works:
            w.wait()
        total = float(sum(r + 1 + 10 * i for r in range(world)))
        got += [on_gpu.cpu().numpy(), on_cpu.numpy()]
        want += [np.full(n, total, np.float32), np.full(n, -total, np.float32)]
    return np.stack(got), np.stack(want)


@ends_process_group
def backend_scatter_codec(rank: int, world: int, port: int, address: str, device: str, codec: str) -> list:
    """Reduce-scatters (sum, avg) of float32 under ``AGGNET_CODEC``: the
    shares as NumPy, then what the staging did. The shares start inside a
    chunk of the whole buffer, then on chunk boundaries (2 MiB shares)."""
    os.environ["AGGNET_ADDRESS"] = address
    os.environ["AGGNET_CODEC"] = codec
    torch.set_num_threads(1)
    device = _backend_on(device, port, rank, world)
    g = torch.Generator().manual_seed(20 + rank)
    out = []
    for n, op in [(700_001, dist.ReduceOp.SUM), (4097, dist.ReduceOp.AVG), (1 << 19, dist.ReduceOp.AVG)]:
        share = torch.empty(n, device=device)
        dist.reduce_scatter_tensor(share, torch.randn(world * n, generator=g).to(device), op=op)
        out.append(_numpy(share))
    if device == "cuda":
        torch.cuda.synchronize()
    return out + [_staging_counts()]


@ends_process_group
def staged_scatter_alone(rank: int, world: int, port: int, address: str, device: str) -> dict:
    """Rank 0 reduce-scatters through the staging in a group whose other
    ranks never do, twice: each fails within the aggnet timeout naming the
    missing rank, and the second reuses the buffers the first gave back."""
    import datetime
    import time

    from aggnet.client.config import ClientConfig

    torch.set_num_threads(1)
    device = _backend_on(device, port, rank, world)
    group = dist.new_group(backend="aggnet", pg_options=ClientConfig(address=address, timeout=2.0),
                           timeout=datetime.timedelta(seconds=30))
    group.stage_cpu_tensors = dist.group.WORLD.stage_cpu_tensors
    gloo = dist.new_group(backend="gloo")
    out = {"errors": [], "seconds": [], "pools": []}
    if rank == 0:
        for _ in range(2):
            t0 = time.monotonic()
            try:
                dist.reduce_scatter_tensor(torch.empty(5000, device=device), torch.ones(5000 * world, device=device),
                                           group=group)
                out["errors"].append("no error")
            except Exception as exc:
                out["errors"].append(f"{type(exc).__name__}: {exc}")
            out["seconds"].append(time.monotonic() - t0)
            stats = next(iter(group._stagers.values())).stats()
            out["pools"].append({k: (v.allocations, v.reuses) for k, v in stats.items()})
    dist.barrier(group=gloo)
    return out


def _numpy(t: torch.Tensor):
    t = t.detach().cpu()
    return (t.float() if t.dtype in (torch.float16, torch.bfloat16) else t).numpy()


@ends_process_group
def fsdp_on_device(rank: int, world: int, port: int, address: str, device: str) -> dict:
    """FSDP2 on ``device`` over the aggnet backend, and again over gloo."""
    os.environ["AGGNET_ADDRESS"] = address
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import DeviceMesh

    from harness.backend_workers import _fsdp_train

    device = _backend_on(device, port, rank, world)
    gloo = dist.new_group(backend="gloo")
    # each rank's shards: gathering DTensors on CUDA over a Python
    # process group (torch's functional all-gather) crashes torch 2.11
    agg = _fsdp_train(rank, world, DeviceMesh.from_group(dist.group.WORLD, device), device, gather=False)
    staging = _staging_counts()
    ref = _fsdp_train(rank, world, DeviceMesh.from_group(gloo, device), device, gather=False)
    return {"aggnet": agg, "gloo": ref, "staging": staging}


def quantized_allreduce(rank: int, world: int, address: str, job: str, hows: list, rounds: int = 3,
                        key: int | None = None) -> dict:
    """All-reduce one float32 buffer ``rounds`` times with the int32 codec,
    quantized where ``hows[rank]`` says: ``device`` through a stager (every
    function a GPU bucket goes through, run on CPU tensors), ``host`` by
    the client. Under a ``key`` the exponents are carried from round to
    round, and from the second round on one chunk grows 256x, another
    shrinks 4096x and the short last one grows 4096x: those three go
    again. The result bits, what the stager
    allocated, and the chunks sent again."""
    import numpy as np

    from aggnet import Client
    from aggnet.torch.staging import Stager, quantize_block

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(200_003, generator=g) * torch.exp2(torch.randint(-30, 30, (200_003,), generator=g).float())
    x[rank * 7] = 3e38 if rank else 1e-44  # a huge value in one chunk, a subnormal in another
    client = Client(address, job=job, rank=rank, world_size=world, chunk_bytes=64 << 10)
    block = (64 << 10) // 4
    results, pools = [], []
    try:
        stager = Stager(torch.device("cpu"), through_host=True)
        for rnd in range(rounds):
            buf = x.clone()
            if key is not None and rnd >= 1:
                buf[2 * block:3 * block] *= 256
                buf[5 * block:6 * block] *= 2.0 ** -12
                buf[12 * block:] *= 2.0 ** 12  # the short last chunk
            if hows[rank] == "device":
                staged = stager.stage(buf, codec="int32", op="avg", world=world,
                                      block=quantize_block(client, "int32", buf.dtype))
                sent, again = client.stats.bytes_sent, client.stats.chunks_sent_again
                stager.submit(staged, lambda arr, **o: client.allreduce(arr, op=staged.op, codec=staged.codec,
                                                                        key=key, **o)).result(60)
                stager.unstage(staged)
                # int32 on the wire, and the chunks sent again in the second round
                resent = 2 * block + buf.numel() - 12 * block if key is not None and rnd == 1 else 0
                assert client.stats.chunks_sent_again - again == (3 if resent else 0)
                assert client.stats.bytes_sent - sent == 4 * (buf.numel() + resent), "int32 on the wire"
                pools.append({k: v.allocations for k, v in stager.stats().items()})
            else:
                client.allreduce(buf.numpy(), op="avg", codec="int32", key=key).result(60)
            results.append(buf.numpy().view(np.uint32).copy())
    finally:
        client.close()
    return {"results": results, "pools": pools, "again": client.stats.chunks_sent_again,
            "carried": client.stats.scales_carried}
