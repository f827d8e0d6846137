"""int32 quantized where the values are (a GPU bucket, on its device):
the exponents found there, agreed by the client, the bucket quantized
once they are and sent as it is, the sums dequantized there. Run on CPU
tensors through the same functions a GPU runs, against a real service
and real worker processes: every bit equals the client's own int32
codec, and a job may mix the two."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the device codec runs torch operations")

from harness import device_workers as DW  # noqa: E402
from harness.helpers import RunningService, run_workers  # noqa: E402

from aggnet import Client  # noqa: E402
from aggnet.client.codec import Quantized  # noqa: E402
from aggnet.errors import AggregationError  # noqa: E402
from aggnet.torch.staging import quantize_block  # noqa: E402


@pytest.fixture(scope="module")
def service():
    svc = RunningService("zmq+tcp", shards=2)
    yield svc
    svc.stop()


def allreduce(service, *hows: str, key=None) -> list:
    return run_workers("spawn://", len(hows), DW.quantized_allreduce, len(hows), service.address,
                       f"q-{uuid.uuid4().hex[:8]}", list(hows), 3, key, timeout=120, start_method="spawn")


def test_quantized_on_the_device_every_bit_is_the_host_codecs_and_a_job_may_mix_them(service):
    host = allreduce(service, "host", "host")
    device = allreduce(service, "device", "device")
    mixed = allreduce(service, "device", "host")
    want = host[0]["results"][0]
    for run in (host, device, mixed):
        for rank in run:
            for got in rank["results"]:
                np.testing.assert_array_equal(got, want)
    # the first round allocated the stager's buffers; the others reused them
    for rank in device:
        assert rank["pools"][0] == rank["pools"][-1] and rank["pools"][0]["device"] > 0


def test_exponents_carried_on_the_device_quantize_again_only_the_chunks_sent_again(service):
    """Under a key the second and third rounds carry the exponents of the
    one before; in the second a chunk that grew, one that shrank and the
    short last one go again, which a device bucket quantizes again on its device, chunk by
    chunk, into a pinned buffer that holds other chunks' sums already."""
    host = allreduce(service, "host", "host", key=3)
    device = allreduce(service, "device", "device", key=3)
    mixed = allreduce(service, "device", "host", key=3)
    for run in (host, device, mixed):
        for rank in run:
            assert (rank["carried"], rank["again"]) == (2, 3)
            for got, want in zip(rank["results"], host[0]["results"]):
                np.testing.assert_array_equal(got, want)
    agreed = allreduce(service, "host", "host")
    np.testing.assert_array_equal(host[0]["results"][0], agreed[0]["results"][0])


def test_a_quantizer_that_fails_fails_its_round_and_the_client_goes_on(service):
    with Client(service.address, job=f"q-{uuid.uuid4().hex[:8]}", chunk_bytes=4096) as client:
        buf = np.zeros(3000, np.int32)
        exps = np.zeros(3, np.int16)

        def broken(agreed, chunks):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        fut = client.allreduce(buf, codec="int32", _quantized=Quantized(exps, broken))
        with pytest.raises(AggregationError, match="quantizing the buffer failed: CUDA error"):
            fut.result(30)

        def fill(agreed, chunks):
            assert agreed.tolist() == [0, 0, 0]
            buf[:] = 7

        client.allreduce(buf, codec="int32", _quantized=Quantized(exps, fill)).result(30)
        assert (buf == 7).all()  # one worker: its own values, as sent
        with pytest.raises(ValueError, match="3000 elements has 3 chunks of 1024: give as many int16 exponents"):
            client.allreduce(buf, codec="int32", _quantized=Quantized(np.zeros(2, np.int16), fill))


def test_an_owner_that_quantizes_on_its_own_thread_leaves_the_client_free_meanwhile(service):
    """An owner may answer with a future (a GPU's copy to host memory,
    waited for on its own thread): the client's I/O thread goes on with
    other rounds meanwhile. Here the first bucket is written only once the
    second bucket's exponents are agreed and its owner called, which the
    I/O thread does only if it is not waiting for the first: a client that
    waited would never finish either. A future that fails fails its round
    in one line, and the client goes on."""
    import threading
    from concurrent.futures import Future

    with Client(service.address, job=f"q-{uuid.uuid4().hex[:8]}", chunk_bytes=4096) as client:
        first, second = np.zeros(3000, np.int32), np.zeros(2000, np.int32)
        second_called = threading.Event()

        def quantize_first(agreed, chunks):
            assert chunks is None
            written: Future = Future()

            def write():
                if second_called.wait(30):
                    first[:] = 5
                    written.set_result(None)
                else:
                    written.set_exception(RuntimeError("the second bucket's owner was never called"))

            threading.Thread(target=write, daemon=True).start()
            return written

        def quantize_second(agreed, chunks):
            second[:] = 9
            second_called.set()

        a = client.allreduce(first, codec="int32", _quantized=Quantized(np.zeros(3, np.int16), quantize_first))
        b = client.allreduce(second, codec="int32", _quantized=Quantized(np.zeros(2, np.int16), quantize_second))
        assert a.result(30) is first and b.result(30) is second
        assert (first == 5).all() and (second == 9).all()  # one worker: its own values, as sent

        def fails_later(agreed, chunks):
            failed: Future = Future()
            threading.Timer(0.01, failed.set_exception, [RuntimeError("CUDA error: launch failure")]).start()
            return failed

        with pytest.raises(AggregationError, match="quantizing the buffer failed: CUDA error: launch failure"):
            client.allreduce(first, codec="int32", _quantized=Quantized(np.zeros(3, np.int16), fails_later)).result(30)

        def quantize_now(agreed, chunks):
            first[:] = 3

        client.allreduce(first, codec="int32", _quantized=Quantized(np.zeros(3, np.int16), quantize_now)).result(30)
        assert (first == 3).all()


def test_only_a_client_that_agrees_exponents_per_chunk_is_handed_a_bucket_to_quantize(service):
    with Client(service.address, job=f"q-{uuid.uuid4().hex[:8]}", chunk_bytes=8192) as client:
        assert quantize_block(client, "int32", torch.float32) == 2048
        assert quantize_block(client, "fp16", torch.float32) is None
        assert quantize_block(client, "int32", torch.float16) is None
    switch = RunningService("udp", shards=1)
    try:
        with Client(switch.address, job=f"q-{uuid.uuid4().hex[:8]}") as client:
            assert quantize_block(client, "int32", torch.float32) is None  # quantizes float32 itself
            with pytest.raises(TypeError, match="quantizes int32 itself; give the client the float32 buffer"):
                client.allreduce(np.zeros(10, np.int32), codec="int32",
                                 _quantized=Quantized(np.zeros(1, np.int16), lambda a, c: None))
    finally:
        switch.stop()
