"""UCX transport through ucxx: RDMA verbs where the fabric has them, tcp or
shared memory elsewhere, behind the same interface as ZeroMQ.

A message is two UCX tag messages on one endpoint, the 48-byte header then
(if the header announces one) the payload, matched in order by the
receiver, which learns the payload size from the header and receives the
payload straight into a buffer from its pool: buffers are allocated once
and reused for the life of the connection, so UCX's registration cache
registers each of them once (``UCX_RCACHE_*``), and no chunk is ever copied
or allocated on the way. CuPy payloads go as they are (GPUDirect where UCX
has it).

One limit: ucxx does not say how many bytes a tag receive got. A message
longer than announced fails the receive (and ends the connection); one
shorter than announced is not seen here, and a header that cannot be read
ends the connection, since no later message could be framed. UCX is a
transport for trusted fabrics; ZeroMQ and UDP validate every length.

ucxx is asyncio-based; this module runs one event loop per process in a
background thread and gives the synchronous Listener/Connection interface
on top of it. Sends on an endpoint leave in order from one task, so a
header is never separated from its payload.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import logging
import os
import queue
import threading
from typing import Sequence

import numpy as np

_USER_SET_MEMTYPE_CACHE = "UCX_MEMTYPE_CACHE" in os.environ
try:
    import ucxx
except ImportError as exc:  # pragma: no cover - depends on the machine
    raise ImportError("the ucx:// transport needs ucxx: pip install 'aggnet[rdma]'") from exc
if not _USER_SET_MEMTYPE_CACHE:
    # ucxx sets it for UCX releases that had the option; the UCX it ships
    # has none and warns of an unused variable at every context a user
    # cannot act on. A value the user set stays, and so does UCX's warning.
    os.environ.pop("UCX_MEMTYPE_CACHE", None)

from aggnet.protocol import wire
from aggnet.protocol.limits import MAX_MESSAGE_BYTES
from aggnet.protocol.address import Address
from aggnet.buffers import BufferPool
from aggnet.transport.base import Connection, Incoming, Listener, Transport, TransportError

log = logging.getLogger("aggnet.transport.ucx")

#: seconds between attempts to reach a listener that is not up yet
RECONNECT_INTERVAL = 0.1
#: seconds an endpoint's close may take (a service stops within its grace period)
EP_CLOSE_TIMEOUT = 1.0
#: sends posted and not yet complete, per endpoint
MAX_INFLIGHT_SENDS = 16
#: seconds between checks that UCX's worker is armed while the loop waits
#: (see _keep_armed)
REARM_INTERVAL = 0.25
#: UCX peer-failure handling: a vanished peer becomes an error instead of
#: taking the process down, but UCX then uses only transports that detect
#: failures (rc, dc, tcp), never shared memory (posix, cma); on one host,
#: AGGNET_UCX_ERROR_HANDLING=0 lets UCX use shared memory
ERROR_HANDLING = os.environ.get("AGGNET_UCX_ERROR_HANDLING", "1") != "0"
# ucxx's progress thread, with requests completed through Python futures
# (its notifier thread): any other mode waits for each request by yielding
# to the event loop until it completes, so a process with a receive posted
# (every open endpoint) spins a core, idle or not. On 2 cores, 2 workers'
# 1 MiB all-reduce takes 12-17 ms this way, 30-50 ms in blocking mode.
os.environ.setdefault("UCXPY_PROGRESS_MODE", "thread")
os.environ.setdefault("UCXPY_ENABLE_PYTHON_FUTURE", "1")
_WAKE = object()
_EMPTY = memoryview(b"")


class _Loop:
    """The process's asyncio loop for UCX, in a daemon thread."""

    _instance: "_Loop | None" = None
    _lock = threading.Lock()

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="aggnet-ucx-loop", daemon=True)
        self.thread.start()
        atexit.register(_stop_ucx_threads)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.create_task(self._keep_armed())
        self.loop.run_forever()

    async def _keep_armed(self) -> None:
        """Where a user chose blocking progress (UCXPY_PROGRESS_MODE):
        ucxx (0.52) arms the UCX worker once there, and after the first
        message the worker's descriptor stays readable and the loop
        progresses the worker without pause for the rest of the process.
        Each event here progresses the worker and arms it again."""
        from ucxx._lib_async import application_context

        if os.environ.get("UCXPY_PROGRESS_MODE") != "blocking":
            return
        while True:
            await asyncio.sleep(REARM_INTERVAL)
            progress = application_context.ProgressTasks.get(self.loop)
            if progress is not None and hasattr(progress, "_arm_worker"):
                _arm_after_each_event(progress, self.loop)

    @classmethod
    def get(cls) -> "_Loop":
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def call(self, fn, *args) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


def _stop_ucx_threads() -> None:
    """At exit, stop ucxx's threads while the interpreter still runs, as
    ucxx asks where Python futures are on (aggnet turns them on): its
    notifier, a daemon thread, would otherwise be inside the C++ worker
    when the process's destructors run, and its progress thread still
    running there; either can abort a process whose run succeeded
    ("terminate called without an active exception"). The notifier is
    woken rather than left to its one-second wait, so an exit costs no
    more than before."""
    try:
        from ucxx import core

        ctx = core._ctx
        if ctx is None:
            return
        notifier = getattr(ctx, "notifier_thread", None)
        if notifier is not None and notifier.is_alive():
            ctx.notifier_thread_q.put("shutdown")
            ctx.worker.stop_request_notifier_thread()
            notifier.join(timeout=2.0)
        if os.environ.get("UCXPY_PROGRESS_MODE") == "thread":
            ctx.worker.stop_progress_thread()
    except Exception as exc:  # exiting anyway: a failure here must not hide the run's own status
        log.debug("stopping UCX's threads at exit: %s", exc)


def _arm_after_each_event(progress, loop: asyncio.AbstractEventLoop) -> None:
    """Make ucxx's blocking progress arm its worker after every event (see
    _Loop._keep_armed), and arm it now if nothing is arming it."""
    if not getattr(progress, "_aggnet_arms_again", False):
        fd = progress.worker.epoll_file_descriptor

        def on_event():
            progress.worker.progress()
            _arm(progress, loop)

        loop.remove_reader(fd)
        loop.add_reader(fd, on_event)
        progress._aggnet_arms_again = True
    _arm(progress, loop)


def _arm(progress, loop: asyncio.AbstractEventLoop) -> None:
    task = progress.arm_task
    if task is None or task.done():
        progress.arm_task = loop.create_task(progress._arm_worker())


def _posted(coro) -> asyncio.Future:
    """A send or receive posted to UCX, whose failure is read even when
    nobody awaits it any more: a connection that ends leaves receives
    posted ahead (the next header's), which UCX then fails (a LEAVE's
    header matched to a payload's buffer is "Message truncated"); unread,
    asyncio would print each as a task exception never retrieved."""
    fut = asyncio.ensure_future(coro)
    fut.add_done_callback(_read_failure)
    return fut


def _read_failure(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.debug("UCX request ended: %s", fut.exception())


def _pool(memory: str) -> BufferPool:
    """Receive buffers in host memory, or on the GPU (``memory="cuda"``:
    UCX then receives device to device, GPUDirect where the fabric has it)."""
    if memory == "host":
        return BufferPool()
    if memory == "cuda":
        try:
            import cupy
        except ImportError as exc:
            raise ImportError("receiving into GPU memory needs CuPy: pip install 'aggnet[gpu]'") from exc
        return BufferPool(allocator=lambda n: cupy.empty(n, cupy.uint8))
    raise ValueError(f"memory must be 'host' or 'cuda', got {memory!r}")


class _Peer:
    """One UCX endpoint: an ordered send queue and a receive loop."""

    def __init__(self, loop: _Loop, deliver, key, memory: str = "host"):
        self.loop = loop
        self.deliver = deliver
        self.key = key
        self.ep = None
        self.sends: asyncio.Queue | None = None
        self.closed = False
        self.pool = _pool(memory)
        self.tasks: list = []
        self.inflight: collections.deque = collections.deque()

    def start(self, ep) -> None:
        self.ep = ep
        self.sends = asyncio.Queue()
        self.tasks = [asyncio.ensure_future(self._send_loop()), asyncio.ensure_future(self._recv_loop())]

    def enqueue(self, header: bytes, payload) -> None:
        self.sends.put_nowait((header, payload))

    async def _send_loop(self) -> None:
        """Post sends in order without waiting for each to finish (UCX
        matches them in posting order), keeping a bounded number in flight."""
        inflight = self.inflight
        try:
            while True:
                if inflight and (self.sends.empty() or len(inflight) >= MAX_INFLIGHT_SENDS):
                    await inflight.popleft()
                    continue
                header, payload = await self.sends.get()
                inflight.append(_posted(self.ep.send(np.frombuffer(header, np.uint8))))
                if payload is not None and len(payload):
                    body = payload if hasattr(payload, "__cuda_array_interface__") else np.frombuffer(payload, np.uint8)
                    inflight.append(_posted(self.ep.send(body)))
        except asyncio.CancelledError:
            for f in inflight:
                f.cancel()
        except Exception as exc:  # the peer went away
            log.debug("UCX send to %s stopped: %s", self.key, exc)
            self.closed = True

    def _post_header(self):
        # zeroed, so a short message cannot leave stale bytes behind
        hbuf = np.zeros(wire.HEADER_SIZE, np.uint8)
        return hbuf, _posted(self.ep.recv(hbuf))

    async def _recv_loop(self) -> None:
        """Receive header, then payload; the next header's receive is posted
        right behind the payload's so the two are never waited for in turn."""
        try:
            hbuf, pending = self._post_header()
            while True:
                await pending
                raw = hbuf.tobytes()
                try:
                    h = wire.unpack_header(raw)
                except wire.WireError:
                    # a payload may follow that no header describes: hand
                    # the bad header on (it is counted), then end the
                    # connection rather than mistake that payload for another
                    self.deliver(Incoming(self.key, raw, _EMPTY))
                    break
                n = 0 if h.flags & wire.Flag.SHM else h.payload_bytes
                payload = _EMPTY
                if n > MAX_MESSAGE_BYTES:
                    # no buffer of whatever size a header claims: the header
                    # goes on without it (refused and counted), the
                    # connection ends
                    self.deliver(Incoming(self.key, raw, _EMPTY))
                    break
                if n:
                    payload = self.pool.take(n)[:n]
                    body = _posted(self.ep.recv(payload))
                    hbuf, pending = self._post_header()
                    await body
                else:
                    hbuf, pending = self._post_header()
                self.deliver(Incoming(self.key, raw, payload))
        except asyncio.CancelledError:
            # closed from this side: end now (the listener's close waits
            # for its accept handlers, which wait for this task)
            self.closed = True
            return
        except Exception as exc:
            log.debug("UCX receive from %s stopped: %s", self.key, exc)
        # let the replies already queued (an error about the bad header)
        # leave, then end the connection
        await asyncio.sleep(1.0)
        self.closed = True
        for t in self.tasks:
            t.cancel()

    async def flush(self, timeout: float) -> None:
        """Wait (at most ``timeout``) for queued and posted sends to finish,
        so a last message (a LEAVE) is not cut off by the close."""
        deadline = self.loop.loop.time() + timeout
        while self.sends is not None and (not self.sends.empty() or any(not f.done() for f in self.inflight)):
            if self.closed or self.loop.loop.time() > deadline:
                return
            await asyncio.sleep(0.002)

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        if self.ep is not None:
            try:
                # a peer that stopped answering must not hold a service's
                # stop past its grace period: the close is bounded
                await asyncio.wait_for(self.ep.close(), EP_CLOSE_TIMEOUT)
            except Exception:
                pass


def _take(q: queue.SimpleQueue, timeout: float) -> Incoming | None:
    """The next received message, or None after ``timeout`` or a wakeup."""
    try:
        item = q.get(timeout=max(timeout, 0.0))
    except queue.Empty:
        return None
    return None if item is _WAKE else item


def _host_of(addr: Address) -> str:
    """Where to connect for ``addr``: a wildcard is this host's loopback
    (workers resolve a service's wildcard shard addresses before this)."""
    if addr.is_wildcard:
        return "::1" if ":" in addr.host else "127.0.0.1"
    return "127.0.0.1" if addr.host == "localhost" else addr.host


class UcxListener(Listener):
    def __init__(self, addr: Address, memory: str = "host"):
        self._memory = memory
        self._loop = _Loop.get()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._peers: dict[int, _Peer] = {}
        self._ids = iter(range(1, 1 << 62))

        async def create():
            return ucxx.create_listener(self._accept, addr.port, endpoint_error_handling=ERROR_HANDLING)

        try:
            self._listener = self._loop.run(create(), timeout=30)
        except Exception as exc:
            raise TransportError(f"cannot listen on {addr}: {exc}") from None
        self.address = addr.with_port(self._listener.port)

    async def _accept(self, ep) -> None:
        key = next(self._ids)
        peer = _Peer(self._loop, self._queue.put, key, self._memory)
        self._peers[key] = peer
        peer.start(ep)
        await asyncio.gather(*peer.tasks, return_exceptions=True)
        self._peers.pop(key, None)

    def recv(self, timeout: float) -> Incoming | None:
        return _take(self._queue, timeout)

    def send(self, peer, header: bytes, payload=None) -> bool:
        p = self._peers.get(peer)
        if p is None or p.closed:
            return False
        self._loop.call(p.enqueue, bytes(header), payload)
        return True

    def close(self) -> None:
        async def shutdown():
            # side by side: each close is bounded, and a service's stop waits for all
            await asyncio.gather(*(p.close() for p in list(self._peers.values())), return_exceptions=True)
            # each accept handler ends once its peer's tasks did: a listener
            # closed before them warns of handlers still alive
            deadline = self._loop.loop.time() + 1.0
            while self._peers and self._loop.loop.time() < deadline:
                await asyncio.sleep(0.001)
            self._listener.close()

        try:
            self._loop.run(shutdown(), timeout=10)
        except Exception as exc:
            log.debug("closing UCX listener %s: %s", self.address, exc)


class UcxConnection(Connection):
    """Endpoints to every address, made in the background and retried until
    the listener is up (as ZeroMQ reconnects): messages sent meanwhile wait
    in order, and the caller's own timeout reports an absent service."""

    def __init__(self, addrs: Sequence[Address], memory: str = "host"):
        self.addresses = list(addrs)
        self._loop = _Loop.get()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._peers = [_Peer(self._loop, self._queue.put, i, memory) for i in range(len(addrs))]
        self._pending: list[collections.deque] = [collections.deque() for _ in addrs]
        self._closing = False
        self._connectors = [asyncio.run_coroutine_threadsafe(self._connect(i, a), self._loop.loop)
                            for i, a in enumerate(self.addresses)]

    async def _connect(self, i: int, addr: Address) -> None:
        while not self._closing:
            try:
                ep = await ucxx.create_endpoint(_host_of(addr), addr.port, endpoint_error_handling=ERROR_HANDLING)
            except Exception:
                await asyncio.sleep(RECONNECT_INTERVAL)
                continue
            peer = self._peers[i]
            peer.start(ep)
            while self._pending[i]:
                peer.enqueue(*self._pending[i].popleft())
            return

    def _enqueue(self, i: int, header: bytes, payload) -> None:
        peer = self._peers[i]
        if peer.ep is None:
            self._pending[i].append((header, payload))
        else:
            peer.enqueue(header, payload)

    def send(self, endpoint: int, header: bytes, payload=None) -> None:
        if self._peers[endpoint].closed:
            raise TransportError(f"the UCX connection to {self.addresses[endpoint]} is closed")
        self._loop.call(self._enqueue, endpoint, bytes(header), payload)

    def recv(self, timeout: float) -> Incoming | None:
        return _take(self._queue, timeout)

    def wakeup(self) -> None:
        self._queue.put(_WAKE)

    def close(self) -> None:
        self._closing = True

        async def shutdown():
            for p in self._peers:
                await p.flush(2.0)
            for p in self._peers:
                await p.close()

        try:
            self._loop.run(shutdown(), timeout=10)
        except Exception as exc:
            log.debug("closing UCX connection: %s", exc)


class UcxTransport(Transport):
    """``memory="cuda"`` receives payloads into GPU buffers."""

    def listen(self, address: Address, **options) -> Listener:
        return UcxListener(address, **options)

    def connect(self, addresses: Sequence[Address], **options) -> Connection:
        return UcxConnection(addresses, **options)


def active_transports() -> list[str]:
    """The UCX transports this process may use (e.g. rc_mlx5, dc_mlx5, tcp,
    posix, cma, cuda_copy), to check what UCX picked up on this machine.
    Which one carries a given transfer: run with ``UCX_PROTO_INFO=y``."""
    _Loop.get()
    return sorted(ucxx.get_active_transports())
