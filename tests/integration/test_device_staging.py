"""Buckets on a device through the DDP hook and the backend: encoded on the
device, staged through pinned memory off the training stream
(:mod:`aggnet.torch.staging`).

Every test runs on the CPU too: ``cpu`` sends a CPU bucket from where it
is, ``cpu-staged`` (``AggnetState(staging="always")``) takes it through
every function a GPU bucket goes through (pools, narrowing, int32
quantized where the bucket is), run on CPU tensors; the ``cuda`` cases
skip where no GPU is present and run the whole hook and backend with CUDA
tensors, two processes on one GPU."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the DDP hook needs PyTorch (pip install aggnet[torch])")

from harness import ddp_workers as W  # noqa: E402
from harness import device_workers as DW  # noqa: E402
from harness.helpers import RunningService, free_port, run_workers  # noqa: E402

STEPS = 20
CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                      reason="no CUDA GPU on this machine"))
#: CPU buckets taken through what a GPU bucket goes through
CPU_STAGED = "cpu-staged"
DEVICES = ["cpu", CPU_STAGED, CUDA]


def on(device: str) -> dict:
    """The DDP run's options for ``device``."""
    return {"device": "cpu", "staging": "always"} if device == CPU_STAGED else {"device": device}


@pytest.fixture(scope="module")
def service():
    svc = RunningService("zmq+tcp", shards=2)
    yield svc
    svc.stop()


@pytest.mark.parametrize("device", [CPU_STAGED, CUDA])
def test_a_staged_result_goes_back_to_the_device_off_the_client_s_io_thread(service, device):
    """Whoever waits on a staged all-reduce (the DDP hook, which copies the
    result back to the device and waits for that copy) runs on the stager's
    thread, not on the client's I/O thread, which goes on with the next
    buckets' chunks meanwhile."""
    import threading
    import uuid

    from aggnet.client.base import Client
    from aggnet.torch.staging import Stager

    dev = torch.device("cpu" if device == CPU_STAGED else "cuda")
    stager = Stager(dev, through_host=True)
    ran_on, done = [], threading.Event()
    bufs = [torch.arange(1000, dtype=torch.float32, device=dev) * (k + 1) for k in range(3)]
    with Client(service.address, job=f"unstage-{uuid.uuid4().hex[:8]}", rank=0, world_size=1) as client:
        for k, buf in enumerate(bufs):
            staged = stager.stage(buf, codec=None, op="sum", world=1, key=k)

            def back(f, staged=staged, k=k):
                stager.unstage(staged)
                ran_on.append((k, threading.current_thread().name))
                if len(ran_on) == len(bufs):
                    done.set()

            # sent once the callback is on: a future already done would
            # run it here, on this thread, whoever completed it
            attached = threading.Event()

            def send(arr, attached=attached, **o):
                assert attached.wait(30)
                return client.allreduce(arr, **o)

            stager.submit(staged, send).add_done_callback(back)
            attached.set()
        assert done.wait(60), "the staged all-reduces did not complete within 60 s"
    assert sorted(ran_on) == [(k, "aggnet-unstaging") for k in range(3)]
    for k, buf in enumerate(bufs):
        assert torch.equal(buf.cpu(), torch.arange(1000, dtype=torch.float32) * (k + 1))


def ddp(world: int, mode: str, **options):
    return run_workers("spawn://", world, W.ddp_run, world, free_port(), mode, options, timeout=180,
                       start_method="spawn")


def rel_diff(a, b) -> float:
    return max(float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30)) for x, y in zip(a, b))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.slow
def test_float32_buckets_train_like_one_process_on_their_device(service, device):
    world = 2
    reference = W.single_process(world, STEPS, device=on(device)["device"])
    agg = ddp(world, "aggnet", address=service.address, bucket_mb=0.01, **on(device))  # several buckets
    assert rel_diff(agg[0]["params"][0], reference) <= 1e-6
    assert rel_diff(agg[1]["params"][0], agg[0]["params"][0]) == 0.0


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_an_embedding_s_sparse_gradient_on_its_device_goes_through_the_service_s_tables(service, device):
    """A sparse bucket on a GPU takes the service's sparse tables as a CPU
    one does (its rows to pinned memory without blocking the training
    thread, the union of every rank's rows back to the device), rather
    than torch.distributed's sparse all-reduce; training equals one process."""
    world = 2
    reference = W.single_process(world, STEPS, sparse=True, device=device)
    agg = ddp(world, "aggnet", address=service.address, sparse=True, device=device)
    assert rel_diff(agg[0]["params"][0], reference) <= 1e-6
    assert rel_diff(agg[1]["params"][0], agg[0]["params"][0]) == 0.0
    for r in agg:
        assert len(r["sparse_tables"][0]) == 1, r["sparse_tables"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", ["int32", "fp16", "bf16"])
@pytest.mark.slow
def test_codecs_on_the_device_send_what_the_host_codec_sends(service, device, codec):
    """Staged (narrowed or quantized on the device) and synchronous (copied
    to the CPU, encoded by the client) put the same bytes on the wire:
    training ends bit-identical. On the CPU the reference is the client
    encoding the same float32 buckets itself."""
    world = 2
    staged = ddp(world, "aggnet", address=service.address, codec=codec, steps=8, **on(device))
    if device == "cuda":
        plain = ddp(world, "aggnet", address=service.address, device=device, codec=codec, steps=8, staging=False)
    else:
        plain = run_workers("spawn://", world, DW.client_encoded_ddp, world, free_port(), service.address, codec, 8,
                            timeout=180, start_method="spawn")
    assert rel_diff(staged[0]["params"][0], plain[0]["params"][0]) == 0.0
    reference = W.single_process(world, 8, device=on(device)["device"])
    assert 0 < rel_diff(staged[0]["params"][0], reference) <= 1e-2  # compressed, and close


@pytest.mark.parametrize("device", [CPU_STAGED, CUDA])
@pytest.mark.parametrize("codec", [None, pytest.param("int32", marks=pytest.mark.slow)])
def test_a_service_on_the_host_reads_the_staged_buckets_in_place(device, codec):
    """Over shm:// the pinned buffers a bucket is staged through lie in
    shared memory, and the shards read its chunks there: training is
    bit-identical to buckets the client copies into the rings itself."""
    svc = RunningService("shm", shards=2)
    try:
        staged = ddp(2, "aggnet", address=svc.address, codec=codec, steps=6, bucket_mb=0.01, **on(device))
        if device == "cuda":
            plain = ddp(2, "aggnet", address=svc.address, device=device, codec=codec, steps=6, bucket_mb=0.01,
                        staging=False)
        else:
            plain = ddp(2, "aggnet", address=svc.address, codec=codec, steps=6, bucket_mb=0.01)
    finally:
        svc.stop()
    for rank in range(2):
        for a, b in zip(staged[rank]["params"][0], plain[rank]["params"][0]):
            np.testing.assert_array_equal(a, b)
        assert staged[rank]["chunks_shared"][0] > 0
        assert plain[rank]["chunks_shared"][0] == 0


@pytest.mark.parametrize("device,codec", [(CPU_STAGED, "int32"), pytest.param("cuda", "fp16", marks=CUDA.marks),
                                          pytest.param("cuda", "int32", marks=CUDA.marks)])
def test_no_bucket_allocates_once_ddp_has_rebuilt_its_buckets(service, device, codec):
    """DDP rebuilds its buckets once, after the first backward pass: from
    the second step on no bucket allocates a pinned or device buffer, and
    CUDA's allocator maps no new memory."""
    agg = ddp(2, "aggnet", address=service.address, codec=codec, bucket_mb=0.01, **on(device))
    where = "cpu" if device == CPU_STAGED else "cuda:0"
    for rank in agg:
        first, last = rank["allocations"]
        assert first == last, (first, last)
        pools = first["pools"][where]  # pinned and device buffers were really used
        assert pools["pinned"] > 0 and pools["device"] > 0


@pytest.mark.parametrize("device", DEVICES)
def test_the_backend_all_reduces_and_reduce_scatters_device_tensors_like_gloo(service, device):
    """Every all-reduce and reduce-scatter of the backend equals gloo's,
    on CPU tensors sent from where they are, on CPU tensors through the
    staging, and on CUDA tensors (staged)."""
    results = run_workers("spawn://", 2, DW.backend_collectives, 2, free_port(), service.address, device,
                          timeout=180, start_method="spawn")
    for r in results:
        staging = r.pop("staging")
        for name, (mine, gloo) in r.items():
            np.testing.assert_array_equal(mine, gloo, err_msg=name)
        assert (staging["allocations"] > 0) == (device != "cpu"), staging
        assert staging["scattered_in_place"] == 0  # zmq+tcp: nothing is written where a worker reads


@pytest.mark.parametrize("device", [CPU_STAGED, CUDA])
@pytest.mark.parametrize("codec", ["int32", "fp16", "bf16"])
def test_the_backend_s_staged_reduce_scatter_sends_what_the_host_codec_sends(service, device, codec):
    """Narrowed on the device (fp16, bf16) or staged as float32 for the
    client to quantize (int32), a staged reduce-scatter's shares are the
    bits of the same tensors' reduce-scatter from the CPU."""
    def shares(where):
        return run_workers("spawn://", 2, DW.backend_scatter_codec, 2, free_port(), service.address, where, codec,
                           timeout=180, start_method="spawn")
    staged, plain = shares(device), shares("cpu")
    for rank in range(2):
        assert staged[rank].pop()["allocations"] > 0 and plain[rank].pop()["allocations"] == 0
        for a, b in zip(staged[rank], plain[rank]):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("device", [CPU_STAGED, CUDA])
def test_a_reduce_scatter_quantized_on_the_device_is_read_and_received_in_place(device):
    """int32 quantized where the tensor is, share by share as the client
    chunks the shares: over shm:// the shards read the quantized bytes where
    they were staged and write the share's sums there, and the shares are
    the bits the host codec gives."""
    svc = RunningService("shm", shards=2)
    try:
        def shares(where):
            return run_workers("spawn://", 2, DW.backend_scatter_codec, 2, free_port(), svc.address, where, "int32",
                               timeout=180, start_method="spawn")
        staged, plain = shares(device), shares("cpu")
    finally:
        svc.stop()
    for rank in range(2):
        done, host = staged[rank].pop(), plain[rank].pop()
        for a, b in zip(staged[rank], plain[rank]):
            np.testing.assert_array_equal(a, b)
        # quantized on the host, int32 goes through the rings: nothing shared
        assert host["chunks_shared"] == 0 and host["results_in_place"] == 0
        # 2 MiB chunks of int32: 2 + 2, 1 + 1 and 1 + 1 sent, one share's received
        assert done["chunks_shared"] == 8 and done["results_in_place"] == 4, done


@pytest.mark.parametrize("device", [CPU_STAGED, CUDA])
def test_a_staged_reduce_scatter_a_rank_never_joins_fails_naming_it_and_gives_its_buffers_back(service, device):
    out = run_workers("spawn://", 2, DW.staged_scatter_alone, 2, free_port(), service.address, device, timeout=180,
                      start_method="spawn")[0]
    for text, seconds in zip(out["errors"], out["seconds"]):
        assert "rank 1" in text and "reduce_scatter" in text, text
        assert seconds < 10, out
    first, second = out["pools"]
    assert first["pinned"][0] > 0, out["pools"]
    for pool in ("pinned", "device"):
        # nothing allocated again: the failed one's buffers were reused
        assert second[pool][0] == first[pool][0] and second[pool][1] - first[pool][1] == first[pool][0], out["pools"]


@pytest.mark.parametrize("device", [CPU_STAGED, CUDA])
def test_the_backend_s_staged_reduce_scatter_takes_its_share_in_place_from_a_service_on_the_host(device):
    """Over shm:// a staged tensor's reduce-scatter is read where it was
    staged, and the shards write this rank's share there: the worker copies
    none of it, and the shares are gloo's."""
    svc = RunningService("shm", shards=2)
    try:
        results = run_workers("spawn://", 2, DW.backend_collectives, 2, free_port(), svc.address, device,
                              timeout=180, start_method="spawn")
    finally:
        svc.stop()
    for r in results:
        staging = r.pop("staging")
        for name, (mine, gloo) in r.items():
            np.testing.assert_array_equal(mine, gloo, err_msg=name)
        # 2 MiB chunks: the 1000-element share in one, the 700_001-element
        # float32 one in two, the float16 one in one, the bfloat16 one in one
        assert staging["scattered_in_place"] == 1 + 2 + 1 + 1, staging
        assert staging["chunks_shared"] > 0


@pytest.mark.parametrize("device,codec", [("cpu", None), (CPU_STAGED, "int32"),
                                          pytest.param("cuda", None, marks=CUDA.marks),
                                          pytest.param("cuda", "int32", marks=CUDA.marks)])
def test_non_finite_values_on_the_device_name_the_rank(service, device, codec):
    where = on(device)
    res = run_workers("spawn://", 2, W.nan_run, 2, free_port(), service.address, codec, "raise", where["device"],
                      where.get("staging", True), timeout=180, start_method="spawn")
    (kind0, text0), (kind1, text1) = res
    assert kind1 == "error" and "rank 1" in text1 and "NaN/Inf" in text1, text1
    assert kind0 == "error" and "NaN/Inf" in text0 and "names it" in text0, text0


@pytest.mark.parametrize("device", DEVICES)
def test_fsdp2_on_the_device_trains_like_gloo(service, device):
    results = run_workers("spawn://", 2, DW.fsdp_on_device, 2, free_port(), service.address, device, timeout=180,
                          start_method="spawn")
    for r in results:
        assert rel_diff(r["aggnet"], r["gloo"]) <= 1e-6
        assert (r["staging"]["allocations"] > 0) == (device != "cpu"), r["staging"]
