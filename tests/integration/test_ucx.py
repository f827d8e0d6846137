"""The UCX transport itself: zero-copy payloads into reused buffers, CuPy
buffers where a GPU is present, and which UCX transports are active; a
client all-reducing device buffers over ucx:// as it does host ones. The
aggregator conformance tests run over UCX in test_allreduce.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

ucxx = pytest.importorskip("ucxx", reason="ucxx is not installed (pip install aggnet[rdma])")

from aggnet.bench.cpu import cpu_seconds, descendants  # noqa: E402
from aggnet.protocol import wire  # noqa: E402
from aggnet.transport import connect, listen  # noqa: E402
from aggnet.transport import ucx  # noqa: E402
from harness.helpers import run_workers  # noqa: E402


def _gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def test_payloads_arrive_intact_into_buffers_that_are_reused():
    lst = listen("ucx://127.0.0.1:0")
    conn = connect([str(lst.address)])
    try:
        seen_buffers = set()
        for i in range(20):
            data = np.arange(1 << 16, dtype=np.int32) * (i + 1)
            h = wire.Header(wire.MsgType.PUSH, dtype=wire.DType.INT32, count=data.size, round=i)
            conn.send(0, h.pack(), data)
            m = lst.recv(10)
            assert m is not None and wire.unpack_header(m.header).round == i
            got = np.frombuffer(m.payload, np.int32)
            np.testing.assert_array_equal(got, data)
            seen_buffers.add(m.payload.__array_interface__["data"][0])  # where it was received
            del m, got  # the consumer is done: the buffer goes back to the pool
        # one buffer (or two, with the next receive already posted) served all
        assert len(seen_buffers) <= 2
    finally:
        conn.close()
        lst.close()


def test_messages_keep_their_order_and_framing_across_sizes():
    lst = listen("ucx://127.0.0.1:0")
    conn = connect([str(lst.address)])
    try:
        sizes = [0, 1, 17, 4096, 1 << 20, 3, 0, 1 << 18]
        for i, n in enumerate(sizes):
            body = np.full(n, i % 251, np.uint8)
            h = wire.Header(wire.MsgType.PUSH, count=n, round=i)  # NONE dtype: bytes
            conn.send(0, h.pack(), body if n else None)
        for i, n in enumerate(sizes):
            m = lst.recv(10)
            h = wire.unpack_header(m.header)
            assert h.round == i and len(m.payload) == n
            assert bytes(m.payload) == bytes([i % 251]) * n
    finally:
        conn.close()
        lst.close()


def _sum_ones(rank, address):
    from aggnet import Client

    with Client(address, job="idle", rank=rank, world_size=2, timeout=20) as c:
        x = np.ones(4096, np.float32)
        c.allreduce(x).result(30)
        return float(x[0])


def test_a_service_that_served_sleeps_when_idle(service_factory):
    """After its first workers and a STATS (which leaves the service's
    connections to its shards open), an idle UCX service and its shards
    stay asleep: ucxx's blocking progress waited for a posted receive by
    spinning the event loop, at half a core or more per process."""
    svc = service_factory("ucx")
    assert run_workers(svc.address, 2, _sum_ones, svc.address) == [2.0, 2.0]
    assert svc.stats()["shards"]
    pids = [svc._svc.pid, *descendants(svc._svc.pid)]
    assert len(pids) == 3, pids  # the service and its two shards
    before = {p: cpu_seconds(p) for p in pids}
    time.sleep(3)  # the span measured: nothing happens in it
    spent = {p: cpu_seconds(p) - before[p] for p in pids}
    assert all(s < 0.3 for s in spent.values()), f"CPU-seconds over 3 idle seconds: {spent}"


#: a listener and a connection in a process of their own (the test's
#: process runs other tests' threads): CPU-seconds over 2 idle seconds
_IDLE_PAIR = """
import time
import numpy as np
from aggnet.protocol import wire
from aggnet.transport import connect, listen
lst = listen("ucx://127.0.0.1:0")
conn = connect([str(lst.address)])
conn.send(0, wire.Header(wire.MsgType.PUSH, dtype=wire.DType.INT32, count=4).pack(), np.arange(4, dtype=np.int32))
assert lst.recv(10) is not None
before = time.process_time()
deadline = time.monotonic() + 2
while time.monotonic() < deadline:
    assert lst.recv(0.2) is None and conn.recv(0.2) is None
print(time.process_time() - before)
conn.close()
lst.close()
"""


def test_an_idle_connected_pair_costs_no_cpu():
    """One thread drives UCX and sleeps in epoll while nothing moves: a
    listener and a connection with receives posted spend next to nothing
    while idle (ucxx's asyncio layer, with its progress and notifier
    threads, spent 20 ms a second: this failed)."""
    r = subprocess.run([sys.executable, "-c", _IDLE_PAIR], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    spent = float(r.stdout.strip().splitlines()[-1])
    assert spent < 0.02, f"{spent:.3f} CPU-seconds in 2 idle seconds"


def test_an_ended_connection_is_gone_on_both_sides_and_made_again_at_the_next_send():
    """A header nobody can read ends its connection at the listener; the
    client hears it through gone(), its next send fails and dials again,
    and a later one reaches the listener on a new connection."""
    from aggnet.transport import TransportError

    lst = listen("ucx://127.0.0.1:0")
    conn = connect([str(lst.address)])
    try:
        h = wire.Header(wire.MsgType.PUSH, count=4).pack()
        conn.send(0, h, b"abcd")
        first = lst.recv(10).peer
        conn.send(0, b"\0" * wire.HEADER_SIZE)
        assert lst.recv(10) is not None  # the bad header is handed on, to be refused and counted
        deadline = time.monotonic() + 10
        while not (gone := conn.gone()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gone == [0]
        assert lst.gone() == [first]
        with pytest.raises(TransportError):
            conn.send(0, h, b"lost")
        while time.monotonic() < deadline:
            try:
                conn.send(0, h, b"back")
                break
            except TransportError:
                time.sleep(0.05)
        m = lst.recv(10)
        assert m is not None and bytes(m.payload) == b"back" and m.peer != first
    finally:
        conn.close()
        lst.close()


def test_active_transports_are_reported():
    names = ucx.active_transports()
    assert names and ("tcp" in names or any(n.startswith(("rc", "dc", "ud")) for n in names)), names


@pytest.mark.requires_gpu
@pytest.mark.skipif(not _gpu(), reason="no CUDA GPU with CuPy on this machine")
def test_cupy_buffers_go_zero_copy_device_to_device():
    import cupy

    lst = listen("ucx://127.0.0.1:0", memory="cuda")
    conn = connect([str(lst.address)])
    try:
        data = cupy.arange(1 << 20, dtype=cupy.float32)
        h = wire.Header(wire.MsgType.PUSH, dtype=wire.DType.FLOAT32, count=data.size)
        conn.send(0, h.pack(), data)
        m = lst.recv(10)
        assert isinstance(m.payload, cupy.ndarray)
        cupy.testing.assert_array_equal(m.payload.view(cupy.float32), data)
    finally:
        conn.close()
        lst.close()


def _device_worker(rank, address, world, job, device_path=None):
    """Each codec and op on a CuPy buffer and on the same values in host
    memory, through one client: the results must be the same bits."""
    import cupy

    from aggnet import Client

    rng = np.random.default_rng(rank)
    x = (rng.standard_normal(300_000) * np.exp(rng.uniform(-6, 6, 300_000))).astype(np.float32)
    out = []
    with Client(address, job=job, rank=rank, world_size=world, chunk_bytes=64 * 1024, timeout=30,
                device_path=device_path) as c:
        for codec in (None, "fp16", "bf16", "int32"):
            for op in ("sum", "avg"):
                host = x.copy()
                c.allreduce(host, op=op, codec=codec).result(30)
                dev = cupy.asarray(x)
                assert c.allreduce(dev, op=op, codec=codec).result(30) is dev
                out.append((codec, op, host, dev.get()))
        try:
            import torch
        except ImportError:
            torch = None
        if torch is not None and torch.cuda.is_available():
            t = torch.from_numpy(x).cuda()
            host = x.copy()
            c.allreduce(host).result(30)
            assert c.allreduce(t).result(30) is t  # the caller's own CUDA tensor holds the result
            out.append(("torch", "sum", host, t.cpu().numpy()))
        # a reduce-scatter of device buffers: this rank's share of the sum,
        # equal to the same share received in host memory
        for codec in (None, "int32"):
            bounds = [0, 100_001, x.size]
            mine = slice(bounds[rank], bounds[rank + 1])
            host_out = np.empty(mine.stop - mine.start, np.float32)
            c.reduce_scatter(x.copy(), host_out, bounds, op="avg", codec=codec).result(30)
            dev, dev_out = cupy.asarray(x), cupy.empty(host_out.size, cupy.float32)
            assert c.reduce_scatter(dev, dev_out, bounds, op="avg", codec=codec).result(30) is dev_out
            assert (dev.get() == x).all()  # the input is left as it was
            out.append((f"reduce_scatter {codec}", "avg", host_out, dev_out.get()))
        # staged: one pinned buffer, reused by every all-reduce of that size
        # (over shm://, in shared memory, where the shards read the chunks)
        # and, the staging copy being the client's own, the results written there
        out.append(("pinned", c._sends_device_memory(), c._pinned.allocations, c.stats.chunks_shared > 0,
                    c.stats.results_in_place > 0))
    return out


@pytest.mark.requires_gpu
@pytest.mark.skipif(not _gpu(), reason="no CUDA GPU with CuPy on this machine")
@pytest.mark.parametrize("transport, device_path", [("ucx", "direct"), ("ucx", None), ("zmq+ipc", "staged"),
                                                    ("shm", "staged")])
def test_device_buffers_all_reduce_to_the_same_bits_as_host_buffers(service_factory, transport, device_path):
    """Direct (UCX reads device memory) and staged (through pinned host
    memory, on any transport; the default without GPUDirect RDMA; over
    shm:// that memory is shared, and the shards read it in place)."""
    from aggnet.client.device import gpudirect_rdma

    svc = service_factory(transport, 2)
    results = run_workers(svc.address, 2, _device_worker, svc.address, 2, f"device-{transport}-{device_path}",
                          device_path, timeout=120, start_method="spawn")  # CUDA does not survive fork
    direct = device_path == "direct" or (device_path is None and transport == "ucx" and gpudirect_rdma())
    for rank_out in results:
        # (the reduce-scatters are staged on every path, in a buffer of the same size)
        assert rank_out.pop() == ("pinned", direct, 1, transport == "shm", transport == "shm")
    for rank_out in results:
        assert len(rank_out) >= 10
        for codec, op, host, dev in rank_out:
            np.testing.assert_array_equal(dev.view(np.uint32), host.view(np.uint32), err_msg=f"{codec} {op}")
    # and the ranks agree (each on its own share of a reduce-scatter)
    for a, b in zip(results[0], results[1]):
        if not a[0].startswith("reduce_scatter"):
            np.testing.assert_array_equal(a[3].view(np.uint32), b[3].view(np.uint32))


class _DeviceStandIn:
    """Something that says it lives on a CUDA device."""

    __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0, False), "version": 3}


def test_direct_device_buffers_on_a_host_transport_are_refused_naming_ucx(shared_service):
    from aggnet import Client

    svc = shared_service("zmq+ipc", 1)
    with Client(svc.address, job="refuse-device", rank=0, world_size=1, timeout=10, device_path="direct") as c:
        with pytest.raises(TypeError, match=r"sends device buffers as they are, which only ucx:// does; .* leave "
                                            r"device_path unset"):
            c.allreduce(_DeviceStandIn())


def test_a_device_buffer_without_cupy_names_the_install(shared_service):
    try:
        import cupy  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("CuPy is installed here: device buffers are reached through it")
    from aggnet import Client

    svc = shared_service("zmq+ipc", 1)
    with Client(svc.address, job="no-cupy", rank=0, world_size=1, timeout=10) as c:
        with pytest.raises(TypeError, match=r"needs CuPy to reach it: pip install 'aggnet\[gpu\]'"):
            c.allreduce(_DeviceStandIn())
        with pytest.raises(TypeError, match=r"needs CuPy to reach it: pip install 'aggnet\[gpu\]'"):
            c.reduce_scatter(_DeviceStandIn(), _DeviceStandIn())


def test_a_reduce_scatter_between_host_and_device_memory_is_refused_naming_both(shared_service):
    from aggnet import Client

    svc = shared_service("zmq+ipc", 1)
    with Client(svc.address, job="mixed-memory", rank=0, world_size=1, timeout=10) as c:
        with pytest.raises(TypeError, match="both in device memory or both in host memory, got buf in device "
                                            "memory and out in host memory"):
            c.reduce_scatter(_DeviceStandIn(), np.zeros(4, np.float32))
        out = np.zeros(4, np.float32)  # and the client goes on
        assert c.reduce_scatter(np.ones(4, np.float32), out).result(10) is out and out.tolist() == [1.0] * 4


def test_a_ucx_transfer_prints_no_warning_a_user_cannot_act_on():
    """ucxx sets UCX_MEMTYPE_CACHE for UCX releases that had it; the UCX it
    ships has no such option and warned of it at every context; and a
    listener closed before its accept handlers ended warned too."""
    import os
    import subprocess
    import sys

    code = ("import numpy as np\n"
            "from aggnet.protocol import wire\n"
            "from aggnet.transport import connect, listen\n"
            "lst = listen('ucx://127.0.0.1:0'); conn = connect([str(lst.address)])\n"
            "conn.send(0, wire.Header(wire.MsgType.PUSH, dtype=wire.DType.INT32, count=4).pack(),"
            " np.arange(4, dtype=np.int32))\n"
            "assert lst.recv(10) is not None\n"
            "conn.close(); lst.close()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    out = r.stdout + r.stderr  # UCX prints its warnings to standard output
    assert r.returncode == 0, out[-2000:]
    # nor, at the close, that the listener went before its accept handlers
    assert "WARN" not in out, out


@pytest.mark.slow  # three fresh services and six workers: about 20 s
def test_workers_that_close_after_all_reducing_print_no_task_exception(service_factory):
    """A worker's last header receive is posted ahead and fails when the
    connection ends ("Message truncated" where a payload meets it); read
    or not, such a failure is the transport's own and prints nothing.
    Before, about one close in four printed asyncio's "Task exception was
    never retrieved" with a traceback."""
    import subprocess
    import sys

    code = ("import sys, numpy as np\n"
            "from aggnet import Client\n"
            "with Client(sys.argv[1], job=sys.argv[2], rank=int(sys.argv[3]), world_size=2) as c:\n"
            "    for _ in range(3):\n"
            "        c.allreduce(np.ones(1 << 22, np.float32)).result(60)\n")
    for attempt in range(3):
        svc = service_factory("ucx", 1)  # a fresh one: its first connections are where it showed
        job = f"ucx-close-{os.getpid()}-{attempt}"
        procs = [subprocess.Popen([sys.executable, "-c", code, svc.address, job, str(r)], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for r in range(2)]
        outs = [p.communicate(timeout=120)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs
        assert not any("Traceback" in out or "never retrieved" in out for out in outs), outs
