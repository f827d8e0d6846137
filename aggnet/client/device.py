"""Device (CUDA) buffers given to a client: sent as they are, or staged
through pinned host memory.

Aggregators sum in host memory, so a device buffer's bytes cross to the
host somewhere. Over ``ucx://`` UCX can read device memory itself; that
pays where the NIC reads GPU memory (GPUDirect RDMA). Without it UCX bounces
every chunk through host buffers of its own, and on an H100 host with no
RDMA device the direct path took 2.3x as long as one copy into pinned
memory, an all-reduce of that, and one copy back (docs/ucx.md). So the
client stages by default and goes direct where GPUDirect RDMA is present
or ``device_path="direct"`` says so; staged works on every transport.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future

import numpy as np

from aggnet.transport import shm

#: pinned bytes a client keeps for reuse: page-locking is slow (about a
#: millisecond per 10 MB), so buffers are kept, up to this much
PINNED_KEEP = 1 << 30


def gpudirect_rdma() -> bool:
    """Whether a NIC here can read GPU memory: the peer-memory module is
    loaded and an RDMA device exists."""
    peermem = any(os.path.isdir(f"/sys/module/{m}") for m in ("nvidia_peermem", "nv_peer_mem"))
    try:
        rdma = bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        rdma = False
    return peermem and rdma


def cupy_or_fail():
    try:
        import cupy
    except ImportError:
        raise TypeError("a device (CUDA) buffer needs CuPy to reach it: pip install 'aggnet[gpu]', or copy the "
                        "buffer to the host first") from None
    return cupy


def device_view(buf):
    """A CuPy view of ``buf`` (a CuPy array or anything with
    ``__cuda_array_interface__``, a CUDA tensor), once the device has
    finished what was queued to write it."""
    cupy = cupy_or_fail()
    view = cupy.asarray(buf)
    with view.device:
        cupy.cuda.runtime.deviceSynchronize()  # the caller's kernels on any stream wrote it
    return view


class PinnedPool:
    """Page-locked host buffers, reused by size. ``shared``: in shared
    memory (the client's aggregator reads them in place, over shm://),
    page-locked for the GPU there; ordinary pinned memory where /dev/shm
    cannot hold them or CUDA will not lock them."""

    def __init__(self, keep: int = PINNED_KEEP, shared: bool = False):
        self.keep = keep
        self.shared = shared
        self._free: dict[int, list] = {}
        self._kept = 0
        self._lock = threading.Lock()
        #: buffers page-locked so far (a test reads it: reuse, not growth)
        self.allocations = 0
        #: addresses of the shared buffers this pool registered with CUDA
        #: (unregistered before they go: their memory is unmapped then)
        self._registered: set[int] = set()

    def take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self._kept -= nbytes
                return free.pop()
        import cupyx

        self.allocations += 1
        if self.shared:
            raw = shm.shared_bytes(nbytes)
            if raw is not None and _register(raw):
                with self._lock:
                    self._registered.add(raw.ctypes.data)
                return raw
        return cupyx.empty_pinned(nbytes, np.uint8)

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            if self._kept + buf.nbytes <= self.keep:
                self._free.setdefault(buf.nbytes, []).append(buf)
                self._kept += buf.nbytes
                return
            registered = buf.ctypes.data in self._registered
            self._registered.discard(buf.ctypes.data)
        if registered:
            cupy_or_fail().cuda.runtime.hostUnregister(buf.ctypes.data)


def _register(raw: np.ndarray) -> bool:
    """Page-lock ``raw`` for the GPU's copies (cudaHostRegisterPortable)."""
    cupy = cupy_or_fail()
    try:
        cupy.cuda.runtime.hostRegister(raw.ctypes.data, raw.nbytes, 1)
    except cupy.cuda.runtime.CUDARuntimeError:
        if hasattr(cupy.cuda.runtime, "getLastError"):
            cupy.cuda.runtime.getLastError()  # handled: no later launch may report it
        return False
    return True


_streams: dict = {}
_streams_lock = threading.Lock()


def _results_stream(device_id: int):
    """The stream results are copied back to device ``device_id`` on (made
    with that device current): one of the process's, not synchronized with
    the device's default stream."""
    with _streams_lock:
        stream = _streams.get(device_id)
        if stream is None:
            stream = _streams[device_id] = cupy_or_fail().cuda.Stream(non_blocking=True)
        return stream


def staged(view, caller, pool: PinnedPool, allreduce_host, share: slice | None = None, into=None) -> Future:
    """All-reduce device buffer ``view`` through pinned host memory:
    ``allreduce_host(host_array)`` is the client's own all-reduce of a
    host buffer. The returned future resolves to ``caller`` once the result
    is back in device memory; a failed all-reduce leaves it untouched.
    ``share`` and ``into``: only those elements of the flat result come
    back, into device array ``into`` (a reduce-scatter's share)."""
    raw = pool.take(view.nbytes)
    host = raw.view(view.dtype).reshape(view.shape)
    view.get(out=host)  # waits for the copy: the host all-reduce reads it next
    out: Future = Future()
    try:
        inner = allreduce_host(host)
    except BaseException:
        pool.give(raw)
        raise

    def done(f: Future) -> None:
        try:
            exc = f.exception()
            if exc is None:
                with view.device:
                    # on a stream of the client's, waited for alone: the
                    # default stream (or the whole device) would make this
                    # thread, the client's I/O thread, wait for every kernel
                    # the caller queued since
                    stream = _results_stream(view.device.id)
                    if share is None:
                        view.set(host, stream=stream)
                    else:
                        into.set(host.reshape(-1)[share].reshape(into.shape), stream=stream)
                    stream.synchronize()  # the caller finds the result in place
        except BaseException as copy_error:  # noqa: BLE001 - a CUDA error fails this all-reduce only
            exc = copy_error
        pool.give(raw)
        if exc is not None:
            out.set_exception(exc)
        else:
            out.set_result(caller)

    inner.add_done_callback(done)
    return out


__all__ = ["gpudirect_rdma", "device_view", "cupy_or_fail", "PinnedPool", "staged", "PINNED_KEEP"]
