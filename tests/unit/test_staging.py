"""The device staging's parts on the CPU: the narrowing a GPU runs on its
buckets equals the host codec's bit for bit, the pools reuse what is given
back and stay within their bound, and NaN/Inf are found in halves.

(The whole path with CUDA tensors: tests/integration/test_device_staging.py,
where a GPU is present.)"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the staging stages torch tensors")

from aggnet import kernels  # noqa: E402
from aggnet.torch.staging import BufferPool, Staged, Stager, result_nonfinite, wire_dtype  # noqa: E402

CPU = kernels.load("cpu")


def values(n: int = 20_001) -> np.ndarray:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(n) * np.exp2(rng.integers(-40, 40, n))).astype(np.float32)
    x[:10] = [0.0, -0.0, 1e-45, -3e-39, 65504, 65520, 7e4, -1e5, 3.4e38, 1.5]
    return x


@pytest.mark.parametrize("fmt", ["f16", "bf16"])
@pytest.mark.parametrize("multiplier", [1.0, 0.5, 1 / 3])
def test_narrowing_equals_the_host_codec(fmt, multiplier):
    """What the stager sends for a bucket (scaled in float32, one
    rounding) is what the client's codec would have sent."""
    x = values()
    want = np.empty(x.size, np.uint16)
    CPU.to_half(x, want, fmt, multiplier)
    stager = Stager(torch.device("cpu"))
    wire = torch.float16 if fmt == "f16" else torch.bfloat16
    out = torch.empty(x.size, dtype=wire)
    staged = Staged(torch.from_numpy(x), wire, out, multiplier)
    stager._narrow(torch.from_numpy(x), out, staged)
    got = out.view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(got, want)


def test_wire_dtypes_follow_the_codec():
    assert wire_dtype(torch.float32, "fp16") == torch.float16
    assert wire_dtype(torch.float32, "bf16") == torch.bfloat16
    assert wire_dtype(torch.float32, "int32") == torch.float32  # quantized on the host
    assert wire_dtype(torch.bfloat16, None) == torch.bfloat16
    with pytest.raises(ValueError, match="codec 'fp16' compresses float32 buffers"):
        wire_dtype(torch.float16, "fp16")


def test_a_pool_reuses_what_comes_back_and_counts_what_it_allocates():
    pool = BufferPool(torch.device("cpu"))
    a = pool.take(1000)
    assert a.numel() == 1024  # a power of two: near sizes share buffers
    pool.give(a)
    b = pool.take(900)
    assert b.data_ptr() == a.data_ptr()
    c = pool.take(900)  # the one buffer is out: a second is made
    assert c.data_ptr() != b.data_ptr()
    assert (pool.stats.allocations, pool.stats.reuses) == (2, 1)


def test_a_keyed_buffer_comes_back_to_its_key_however_takes_overlap():
    """Steps that overlap their buckets differently still reuse exactly
    their own buffers: a bucket's key gets the buffer it gave back."""
    pool = BufferPool(torch.device("cpu"))
    a, b = pool.take(1000, key=(0, "host")), pool.take(1000, key=(1, "host"))  # step 1: both in flight
    pool.give(a, key=(0, "host"))
    pool.give(b, key=(1, "host"))
    for _ in range(3):  # later steps: one at a time, then both, in either order
        first = pool.take(1000, key=(1, "host"))
        pool.give(first, key=(1, "host"))
        again = [pool.take(1000, key=(k, "host")) for k in (1, 0)]
        assert [t.data_ptr() for t in again] == [b.data_ptr(), a.data_ptr()]
        for k, t in zip((1, 0), again):
            pool.give(t, key=(k, "host"))
    assert pool.stats.allocations == 2
    grown = pool.take(5000, key=(0, "host"))  # a bucket that grew: a new buffer, the old one shared
    assert grown.numel() == 8192 and pool.take(1000).data_ptr() == a.data_ptr()


def test_pinned_memory_beyond_the_limit_is_pageable_and_counted():
    pool = BufferPool(torch.device("cpu"), pin=True, limit=4096)
    first = pool.take(4096)
    second = pool.take(4096)
    assert pool.stats.unpinned == 1 and pool.stats.allocated_bytes == 8192
    if torch.cuda.is_available():  # pinning needs a CUDA runtime
        assert first.is_pinned() and not second.is_pinned()


def test_a_cpu_bucket_is_sent_from_where_it_is():
    stager = Stager(torch.device("cpu"))
    buf = torch.from_numpy(values())
    staged = stager.stage(buf, codec="fp16", op="avg", world=3)
    assert staged.host.data_ptr() == buf.data_ptr()
    assert (staged.codec, staged.op) == ("fp16", "avg")  # the client encodes it
    assert staged.local_nonfinite() == 0
    assert stager.stats()["pinned"].allocations == 0


def test_integer_results_are_never_non_finite():
    host = torch.full((1000,), 0x7C00 | (0x7F80 << 16), dtype=torch.int32)  # half and bf16 Inf bit patterns
    assert result_nonfinite(Staged(host, torch.int32, host, 1.0)) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_non_finite_results_are_found_in_host_memory(dtype):
    host = torch.zeros(1000, dtype=dtype)
    staged = Staged(host, dtype, host, 1.0)
    assert result_nonfinite(staged) == 0
    host[3], host[500], host[999] = float("nan"), float("inf"), -float("inf")
    host[7] = 1e30 if dtype == torch.bfloat16 else 6e4  # large, finite
    assert result_nonfinite(staged) == 3


class _Event:
    """What a CUDA event answers to ``query()``: done after ``after`` asks."""

    def __init__(self, after: int | None):
        self.after, self.asked = after, 0

    def query(self) -> bool:
        self.asked += 1
        return self.after is not None and self.asked > self.after


def test_waiting_for_a_copy_has_a_limit_and_says_what_to_check():
    from aggnet.errors import AggnetError
    from aggnet.torch.staging import wait_event

    done_later = _Event(after=5)
    wait_event(done_later, "copying a bucket", limit=5)
    assert done_later.asked == 6
    with pytest.raises(AggnetError, match=r"copying a bucket did not finish within 0.05s; is the GPU still working"):
        wait_event(_Event(after=None), "copying a bucket", limit=0.05)


@pytest.mark.parametrize("codec", ["fp16", "bf16", "int32"])
def test_buckets_go_through_a_slice_of_device_scratch_at_a_time_to_the_bits_of_one_pass(monkeypatch, codec):
    """Buckets many slices long, under their keys (one a reduce-scatter's,
    its shares inside chunks, whose last share comes back alone), are
    encoded and decoded through the same slice of device scratch, to the
    bits of one pass over each; the scratch is bounded by the slice, not by
    the buckets."""
    from aggnet.torch import staging

    n, block, bounds = 50_003, 1000, [0, 20_001, 50_003]
    x = values(n)
    x[x.size // 2:] *= 1e-3  # chunks of other scales

    def run(slice_elements: int):
        monkeypatch.setattr(staging, "SLICE", slice_elements)
        stager = Stager(torch.device("cpu"), through_host=True)
        out = []
        for step in range(2):
            for key in range(3):
                buf = torch.from_numpy(x.copy())
                shares = bounds if key == 2 else None
                staged = stager.stage(buf, codec=codec, op="avg", world=2, check_finite=False,
                                      block=block if codec == "int32" else None, key=key, bounds=shares)
                if codec == "int32":
                    mine = staging.device_codec.exponents_of_bits(staged._best.numpy())
                    stager._quantize(staged, mine + 1)
                sent = staged.host.clone()
                staged.host.mul_(2)  # what two equal workers sum to
                if shares is None:
                    stager.unstage(staged)
                    got = buf
                else:
                    got = torch.empty(n - bounds[1])
                    stager.unstage(staged, slice(bounds[1], n), got)
                out.append((sent.view(torch.uint8).numpy().copy(), got.numpy().copy()))
        return out, stager.stats()["device"]

    one_pass, _ = run(1 << 22)
    sliced, device = run(4096)
    for (sent, got), (want_sent, want) in zip(sliced, one_pass):
        np.testing.assert_array_equal(sent, want_sent)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    # (one pass equals the host codec bit for bit: the tests above and
    # tests/unit/test_device_quantize.py)
    # three streams' scratch at most (out, quantizing, back), a slice each
    # (int32 through torch's operations: an int32 and a float64 view)
    assert device.allocations <= 3 and device.allocated_bytes <= 3 * 16 * 4096 < n * 4, device


def test_a_bucket_s_buffers_go_back_only_once_its_quantization_is_over():
    """The whole bucket is quantized on the stager's thread while the
    client goes on; a round that fails meanwhile gives the bucket back,
    and its pinned buffers must not reach the next bucket while the device
    still writes them: release waits for the quantization."""
    import threading

    from aggnet.torch import quantize as Q

    stager = Stager(torch.device("cpu"), through_host=True)
    x = torch.from_numpy(values(8192))
    staged = stager.stage(x, codec="int32", op="sum", world=2, block=1024, key=0)
    agreed = Q.exponents_of_bits(staged._best.numpy())
    with stager._quant.lock:  # the device is busy: the quantizing thread waits for its stream
        done = stager._quantize_later(staged, agreed)
        releasing = threading.Thread(target=stager.release, args=(staged,))
        releasing.start()
        releasing.join(0.2)
        assert releasing.is_alive() and not done.done() and staged._raw  # still the bucket's
    releasing.join(30)
    assert not releasing.is_alive() and done.result(0) is None and staged._raw == []
    want = np.empty(8192, np.int32)
    for i, e in enumerate(agreed):
        part = slice(i * 1024, (i + 1) * 1024)
        CPU.quantize(x.numpy()[part], kernels.quant_shift(int(e), 2), want[part], False)
    np.testing.assert_array_equal(staged.host.numpy(), want)  # written in full before it went back


def test_a_stager_no_one_uses_holds_no_thread_and_is_freed(monkeypatch):
    """Its threads end once idle, so a closed DDP state's stager (and its
    pinned and shared buffers) goes instead of living as long as the
    process; the next bucket starts a thread again."""
    import gc
    import weakref

    from aggnet.torch import quantize as Q
    from aggnet.torch import staging

    monkeypatch.setattr(staging, "IDLE", 0.05)
    stager = Stager(torch.device("cpu"), through_host=True)
    for _ in range(2):  # a thread again after the first one ended
        staged = stager.stage(torch.from_numpy(values(4096)), codec="int32", op="sum", world=2, block=1024)
        with stager._quant.lock:  # the thread is busy with it until this lets go
            done = stager._quantize_later(staged, Q.exponents_of_bits(staged._best.numpy()))
            thread = stager._quantizing._thread
        assert thread is not None and thread.name == "aggnet-quantizing"
        done.result(30)
        thread.join(30)
        assert not thread.is_alive() and stager._quantizing._thread is None
        stager.release(staged)
    gone = weakref.ref(stager)
    del stager, staged
    gc.collect()
    assert gone() is None


def test_a_stager_s_waiting_thread_holds_nothing_of_the_buckets_it_handled(monkeypatch):
    """While a thread waits for more work it keeps no bucket (nor, through
    one, a closed client: a closed DDP state's client lived on so, and the
    next job's steps ran 10-20% slower beside it)."""
    import gc
    import time
    import weakref

    from aggnet.torch import quantize as Q
    from aggnet.torch import staging

    monkeypatch.setattr(staging, "IDLE", 60.0)
    stager = Stager(torch.device("cpu"), through_host=True)
    staged = stager.stage(torch.from_numpy(values(4096)), codec="int32", op="sum", world=2, block=1024)
    stager._quantize_later(staged, Q.exponents_of_bits(staged._best.numpy())).result(30)
    stager.release(staged)
    gone = weakref.ref(staged)
    del staged
    deadline = time.monotonic() + 10  # the thread lets go of it right after completing its future
    while gone() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert gone() is None, "the waiting thread still holds the last bucket it quantized"
    assert stager._quantizing._thread is not None  # and it does wait


def test_a_bucket_staged_through_host_memory_reaches_the_client_as_a_gpu_s_does():
    """A CPU bucket staged through host memory goes the GPU's way to the
    client: handed over on the stager's thread, in the order submitted,
    and a bucket the client refuses fails alone, the next one going on."""
    import threading
    from concurrent.futures import Future

    stager = Stager(torch.device("cpu"), through_host=True)
    calls: list[tuple[int, str]] = []

    def send_as(i):
        def send(arr, **options):
            calls.append((i, threading.current_thread().name))
            if i == 2:
                raise RuntimeError("refused")
            done: Future = Future()
            done.set_result(arr)
            return done
        return send

    staged = [stager.stage(torch.full((1000,), float(i)), codec=None, op="sum", world=1) for i in range(5)]
    futures = [stager.submit(s, send_as(i)) for i, s in enumerate(staged)]
    for i, f in enumerate(futures):
        if i == 2:
            with pytest.raises(RuntimeError, match="refused"):
                f.result(30)
        else:
            assert np.all(f.result(30) == i)
    assert [i for i, _ in calls] == list(range(5))
    assert {name for _, name in calls} == {"aggnet-staging"}


def test_a_call_straight_on_the_client_waits_for_the_buckets_submitted_before_it():
    """A staged bucket reaches the client once its copy to the host is
    done; a collective called straight on the client after it (a CPU
    tensor of the backend's, an α agreement of the hook's) must not
    overtake it, or ranks whose copies took longer all-reduce in another
    order. Nothing waiting, the call goes at once on the caller's thread."""
    import threading
    from concurrent.futures import Future

    from aggnet.torch.staging import ClientQueue

    order = ClientQueue()
    cpu, other = (Stager(torch.device("cpu"), through_host=True, order=order) for _ in range(2))
    reached: list[tuple[str, str]] = []

    def client_call(name):
        def send(*_args, **_options):
            reached.append((name, threading.current_thread().name))
            done: Future = Future()
            done.set_result(name)
            return done
        return send

    assert order.call(client_call("alone")).result(0) == "alone"
    staged = cpu.stage(torch.ones(1000), codec=None, op="sum", world=1)
    staged._ready = copying = _Event(after=None)  # a device's copy, still running
    bucket = cpu.submit(staged, client_call("bucket"))
    straight = order.call(client_call("straight"))
    later = other.submit(other.stage(torch.ones(10), codec=None, op="sum", world=1), client_call("other stager"))
    assert not straight.done() and [name for name, _ in reached] == ["alone"]
    copying.after = 0  # the copy is done
    assert [f.result(30) is not None for f in (bucket, straight, later)] == [True] * 3
    assert reached == [("alone", "MainThread"), ("bucket", "aggnet-staging"), ("straight", "aggnet-staging"),
                       ("other stager", "aggnet-staging")]
    assert straight.result(0) == "straight"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
def test_shared_buffers_page_locked_for_the_gpu_are_unlocked_when_their_pool_goes():
    """A closed job's pool goes; its shared buffers are unlocked before
    their memory is unmapped, so the next pool's buffers, often mapped at
    the same addresses, are page-locked again rather than left pageable."""
    import gc

    for _ in range(3):
        pool = BufferPool(torch.device("cpu"), pin=True, shared=True)
        taken = [pool.take(1 << 20) for _ in range(4)]
        assert pool.stats.shared == 4 and pool.stats.unpinned == 0, pool.stats
        del taken, pool
        gc.collect()


def test_a_queued_call_that_fails_outside_its_future_leaves_the_queue_going(caplog):
    """What the queue runs reports its errors in its futures; one that
    raises all the same is logged in one line, and the calls queued
    after it still reach the client (a dead thread would hang them)."""
    import threading

    from aggnet.torch.staging import ClientQueue

    order = ClientQueue()
    held = threading.Event()
    order.later(lambda: held.wait(30))  # a bucket's copy still running: what follows queues
    order.later(lambda: 1 / 0)
    after = order.call(lambda: _done("next"))
    held.set()
    assert after.result(30) == "next"
    assert any("failed outside its future: division by zero" in r.getMessage() for r in caplog.records)


def _done(value):
    from concurrent.futures import Future

    f: Future = Future()
    f.set_result(value)
    return f
