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

One thread per process drives UCX (:class:`_Engine`), on ucxx's low-level
API: it posts every send and receive, progresses the UCX worker, and sleeps
in epoll on the worker's descriptor while nothing moves, so an idle process
with open connections costs no CPU. A received message goes from that
thread straight into its listener's or connection's inbox, and a send from
the caller's thread straight into the engine's command queue: one hand-off
each way, as ZeroMQ's own I/O thread does. No asyncio and no Python
futures: ucxx's asyncio layer handed each message through an event loop, a
progress thread and a notifier thread, and those hand-offs cost aggnet's
workers more CPU than the bytes themselves.

Endpoints first agree on the tags they send with (a random 64-bit tag and
its checksum each way on the UCX stream API): UCX matches tags per worker,
not per endpoint, and every endpoint of a listener needs tags of its own.
Both ends of a connection run this module: aggnet releases before it (on
ucxx's asyncio layer) do not talk to it.
"""

from __future__ import annotations

import atexit
import collections
import heapq
import itertools
import logging
import os
import select
import threading
import time
from typing import Callable, Sequence

import numpy as np

_USER_SET_MEMTYPE_CACHE = "UCX_MEMTYPE_CACHE" in os.environ
try:
    import ucxx._lib.libucxx as ucx_api
    from ucxx._lib.arr import Array
    from ucxx._lib_async.utils import hash64bits
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

#: seconds between attempts to reach a listener that is not up (or back) yet
RECONNECT_INTERVAL = 0.1
#: seconds an endpoint's close may take (a service stops within its grace period)
EP_CLOSE_TIMEOUT = 1.0
#: seconds a connection's close waits for its queued sends (a LEAVE) to leave
FLUSH_TIMEOUT = 2.0
#: seconds two endpoints may take to agree on their tags
HANDSHAKE_TIMEOUT = 5.0
#: seconds a connection whose header could not be read stays open, so the
#: error already queued for its sender goes out before it ends
BAD_HEADER_LINGER = 1.0
#: sends posted and not yet complete, per endpoint (the rest wait, in order)
MAX_INFLIGHT_SENDS = 16
#: the longest the engine sleeps without looking at its endpoints' state
#: (UCX's descriptor covers traffic; this covers deadlines nobody set)
IDLE_WAKE = 1.0
#: UCX peer-failure handling: a vanished peer becomes an error instead of
#: taking the process down, but UCX then uses only transports that detect
#: failures (rc, dc, tcp), never shared memory (posix, cma); on one host,
#: AGGNET_UCX_ERROR_HANDLING=0 lets UCX use shared memory
ERROR_HANDLING = os.environ.get("AGGNET_UCX_ERROR_HANDLING", "1") != "0"
#: UCX's tcp transport moves data in segments of these sizes (UCX's own
#: defaults: 8 KiB out, 64 KiB in). aggnet's chunks are large: on loopback,
#: 256 KiB segments halve the CPU a 16 MiB transfer costs and more than
#: double its rate. Either set by the user (UCX_TCP_TX_SEG_SIZE,
#: UCX_TCP_RX_SEG_SIZE) leaves both to UCX, whose receive segment must not
#: be the smaller one.
TCP_SEGMENTS = {"TCP_TX_SEG_SIZE": "256k", "TCP_RX_SEG_SIZE": "256k"}
_WAKE = object()
_EMPTY = memoryview(b"")


def _ucx_config() -> dict:
    """Options aggnet sets on its UCX context where the user set none."""
    if any(f"UCX_{name}" in os.environ for name in TCP_SEGMENTS):
        return {}
    return dict(TCP_SEGMENTS)


class _Inbox:
    """Messages the engine received for one listener or connection, and the
    events of those who wait for them: a shard's joint wait watches several
    inboxes at once, which a queue cannot offer."""

    def __init__(self):
        self.items: collections.deque = collections.deque()
        self.bell = threading.Event()
        self.waiters = {self.bell}

    def put(self, item) -> None:
        self.items.append(item)
        for ev in list(self.waiters):
            ev.set()

    def take(self, timeout: float) -> Incoming | None:
        """The next message, or None after ``timeout`` or a wakeup."""
        if not self.items:
            self.bell.clear()
            if not self.items and timeout > 0:
                self.bell.wait(timeout)
        try:
            item = self.items.popleft()
        except IndexError:
            return None
        return None if item is _WAKE else item


def _wait_any(inboxes: list[_Inbox], timeout: float) -> None:
    """Sleep until one of ``inboxes`` has a message, or ``timeout``."""
    ev = threading.Event()
    for box in inboxes:
        box.waiters.add(ev)
    try:
        # registered first, looked at second: a message put in between sets ev
        if not any(box.items for box in inboxes) and timeout > 0:
            ev.wait(timeout)
    finally:
        for box in inboxes:
            box.waiters.discard(ev)


class _Engine:
    """The process's one UCX worker and the thread that drives it.

    Everything that touches UCX runs on this thread, so the worker needs no
    locks and a message is never handed between threads inside the
    transport. Callers reach it through :meth:`call` (a command queue and
    an eventfd that wakes the thread only when it sleeps)."""

    _instance: "_Engine | None" = None
    _lock = threading.Lock()

    def __init__(self):
        self.context = ucx_api.UCXContext(_ucx_config())
        self.worker = ucx_api.UCXWorker(self.context, enable_delayed_submission=False, enable_python_future=False)
        self.worker.init_blocking_progress_mode()
        self.commands: collections.deque = collections.deque()
        self.timers: list = []
        self._seq = itertools.count()
        #: endpoints with requests to watch, in the order they started
        self.peers: dict[int, "_Peer"] = {}
        self.sleeping = False
        self.stopping = False
        self.cuda_device: int | None = None
        #: requests UCX did not give back within EP_CLOSE_TIMEOUT, and their buffers
        self.orphans: list = []
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._epoll = select.epoll()
        self._epoll.register(self.worker.epoll_file_descriptor, select.EPOLLIN)
        self._epoll.register(self._wake_fd, select.EPOLLIN)
        self.thread = threading.Thread(target=self._run, name="aggnet-ucx", daemon=True)
        self.thread.start()
        atexit.register(self.stop)

    @classmethod
    def get(cls) -> "_Engine":
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    # -- from any thread -----------------------------------------------------

    def call(self, fn: Callable, *args) -> None:
        """Run ``fn(*args)`` on the engine thread, after the commands before it."""
        self.commands.append((fn, args))
        if self.sleeping:
            os.eventfd_write(self._wake_fd, 1)

    def run(self, fn: Callable, *args, timeout: float = 30.0):
        """Run ``fn(*args)`` on the engine thread and return what it returns
        (or raise what it raised); TransportError after ``timeout``."""
        done = threading.Event()
        out: list = []

        def job():
            try:
                out.append((True, fn(*args)))
            except Exception as exc:  # handed to the caller, who reports it
                out.append((False, exc))
            done.set()

        self.call(job)
        if not done.wait(timeout):
            raise TransportError(f"UCX did not answer within {timeout:g}s")
        ok, value = out[0]
        if not ok:
            raise value
        return value

    def stop(self) -> None:
        """At exit: end every endpoint and the thread while the interpreter
        still runs, so no UCX callback reaches Python during its teardown."""
        if self.stopping or not self.thread.is_alive():
            return
        self.stopping = True
        os.eventfd_write(self._wake_fd, 1)
        self.thread.join(timeout=EP_CLOSE_TIMEOUT + 1.0)

    # -- on the engine thread --------------------------------------------------

    def later(self, delay: float, fn: Callable, *args) -> None:
        heapq.heappush(self.timers, (time.monotonic() + delay, next(self._seq), fn, args))

    def watch(self, peer: "_Peer") -> None:
        self.peers[id(peer)] = peer

    def unwatch(self, peer: "_Peer") -> None:
        self.peers.pop(id(peer), None)

    def _run(self) -> None:
        try:
            while not self.stopping:
                if not self._step():
                    self._sleep()
        except Exception:  # a bug here must not leave every caller hanging silently
            log.exception("the UCX engine stopped")
        finally:
            self._shut_down()

    def _step(self) -> bool:
        """One round of work; False when there was none."""
        busy = False
        while self.commands:
            fn, args = self.commands.popleft()
            busy = True
            try:
                fn(*args)
            except Exception:
                log.exception("a UCX command failed")
        busy |= self._due_timers()
        self.worker.progress()
        for peer in list(self.peers.values()):
            busy |= peer.poll()
        return busy

    def _due_timers(self) -> bool:
        now = time.monotonic()
        fired = False
        while self.timers and self.timers[0][0] <= now:
            _, _, fn, args = heapq.heappop(self.timers)
            fired = True
            try:
                fn(*args)
            except Exception:
                log.exception("a UCX timer failed")
        return fired

    def _sleep(self) -> None:
        """Sleep in epoll until UCX or a caller has something, or the next
        deadline. UCX is armed first; an arm that fails means events are
        already waiting, and the loop goes round again instead."""
        self.sleeping = True
        try:
            if self.commands or not self.worker.arm():
                return
            timeout = IDLE_WAKE
            if self.timers:
                timeout = min(timeout, max(0.0, self.timers[0][0] - time.monotonic()))
            for fd, _ in self._epoll.poll(timeout):
                if fd == self._wake_fd:
                    try:
                        os.eventfd_read(self._wake_fd)
                    except BlockingIOError:
                        pass
        finally:
            self.sleeping = False

    def _shut_down(self) -> None:
        for peer in list(self.peers.values()):
            peer.abort()
        deadline = time.monotonic() + EP_CLOSE_TIMEOUT
        while self.peers and time.monotonic() < deadline:
            self.worker.progress()
            for peer in list(self.peers.values()):
                peer.poll()
            time.sleep(0.001)
        self.peers.clear()

    def use_cuda(self, device: int) -> None:
        """Make ``device``'s CUDA context current on this thread, as UCX's
        cuda transports need where the engine moves device memory."""
        if self.cuda_device == device:
            return
        try:
            from ucxx._cuda_context import ensure_cuda_context

            ensure_cuda_context(device)
        except ImportError:
            pass  # CuPy's device below makes the context current on first use
        try:
            import cupy

            cupy.cuda.Device(device).use()  # the receive pool allocates on this thread
        except ImportError:
            pass
        self.cuda_device = device

    def until(self, ready: Callable[[], bool], deadline: float, then: Callable[[], None]) -> None:
        """Call ``then()`` once ``ready()`` or at ``deadline``, whichever is first."""
        if ready() or time.monotonic() >= deadline:
            then()
        else:
            self.later(0.002, self.until, ready, deadline, then)


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


def _device_of(buf) -> int | None:
    """The CUDA device a payload lives on; None for host memory."""
    if not hasattr(buf, "__cuda_array_interface__"):
        return None
    device = getattr(buf, "device", None)
    for name in ("id", "index"):  # CuPy's device, torch's
        number = getattr(device, name, None)
        if number is not None:
            return int(number)
    return 0


def _wire_view(buf):
    """What UCX sends for a header or payload: device buffers as they are,
    host ones as the bytes they hold (no copy)."""
    if hasattr(buf, "__cuda_array_interface__"):
        return buf
    return np.frombuffer(buf, np.uint8)


class _Peer:
    """One UCX endpoint, driven by the engine: the tag agreement, then a
    receive chain (header, payload, next header) and an ordered send queue.

    States: ``handshake`` (agreeing on tags), ``open``, ``linger`` (a header
    could not be read: no more receives, replies still leave), ``flushing``
    (closed here: queued sends leave first), ``ended`` (closed; waiting
    for UCX to give back the requests it still holds)."""

    def __init__(self, engine: _Engine, ep, owner, key, pool: BufferPool, listener_side: bool):
        self.engine = engine
        self.ep = ep
        self.owner = owner
        self.key = key
        self.pool = pool
        self.state = "handshake"
        self.deadline = time.monotonic() + HANDSHAKE_TIMEOUT
        self.recv_value = int.from_bytes(os.urandom(8), "little")
        self.recv_tag = ucx_api.UCXXTag(self.recv_value)
        self.send_tag = None
        self.theirs = np.zeros(2, np.uint64)
        mine = np.array([self.recv_value, hash64bits(self.recv_value)], np.uint64)
        send, recv = (ep.stream_send, mine), (ep.stream_recv, self.theirs)
        # the listener speaks first, the client answers: one step at a time
        self.steps = collections.deque([send, recv] if listener_side else [recv, send])
        self.step = self.step_buf = None
        self.outbox: collections.deque = collections.deque()
        self.inflight: collections.deque = collections.deque()
        self.header = self.header_buf = None
        self.body = self.body_header = self.body_buf = None
        engine.watch(self)

    # -- called by the owner, on the engine thread ---------------------------------

    def send(self, header: bytes, payload) -> None:
        if self.state not in ("open", "linger", "flushing"):
            return
        if self.outbox or len(self.inflight) >= MAX_INFLIGHT_SENDS:
            self.outbox.append((header, payload))
        else:
            self._post_send(header, payload)

    def close(self) -> None:
        """End once what was sent has left (at most FLUSH_TIMEOUT)."""
        if self.state in ("open", "linger"):
            self.state = "flushing"
            self.deadline = time.monotonic() + FLUSH_TIMEOUT
        elif self.state == "handshake":
            self.abort()

    def abort(self) -> None:
        self._end("closed here")

    # -- the engine's round ------------------------------------------------------------

    def poll(self) -> bool:
        """Move this endpoint on as far as UCX allows; True if anything moved."""
        state = self.state
        if state == "ended":
            return self._drain()
        if state == "handshake":
            return self._poll_handshake()
        busy = self._poll_sends()
        if self.state == "open":
            busy |= self._poll_receives()
        if self.state == "ended":
            return True
        if not self.ep.alive:
            self._end(self._ep_error())
            return True
        if self.state == "flushing" and (not (self.outbox or self.inflight) or time.monotonic() > self.deadline):
            self._end("closed here")
        elif self.state == "linger" and time.monotonic() > self.deadline:
            self._end("its header could not be read")
        return busy

    def _poll_handshake(self) -> bool:
        if self.step is not None:
            if not self.step.completed:
                if not self.ep.alive or time.monotonic() > self.deadline:
                    self._end(f"no tag agreement: {self._ep_error()}")
                    return True
                return False
            req, self.step = self.step, None
            if not self._succeeded(req, "the tag exchange"):
                return True
        if self.steps:
            op, self.step_buf = self.steps.popleft()  # held until UCX is done with it
            self.step = op(Array(self.step_buf))
            return True
        value, check = int(self.theirs[0]), int(self.theirs[1])
        if hash64bits(value) != check:
            self._end("its tag came with a wrong checksum")
            return True
        self.send_tag = ucx_api.UCXXTag(value)
        self.state = "open"
        self._post_header()
        self.owner.peer_opened(self)
        return True

    def _poll_sends(self) -> bool:
        busy = False
        inflight = self.inflight
        while inflight and inflight[0][0].completed:
            req, _ = inflight.popleft()
            busy = True
            if not self._succeeded(req, "a send"):
                return True
        while self.outbox and len(inflight) < MAX_INFLIGHT_SENDS:
            self._post_send(*self.outbox.popleft())
            busy = True
        return busy

    def _post_send(self, header: bytes, payload) -> None:
        """Header and payload on one tag: UCX keeps them in posting order,
        so the payload is the very next message the receiver matches."""
        views = [np.frombuffer(header, np.uint8)]
        if payload is not None and len(payload):
            device = _device_of(payload)
            if device is not None:
                self.engine.use_cuda(device)
            views.append(_wire_view(payload))
        for view in views:
            # the view rides along until UCX is done with its memory
            self.inflight.append((self.ep.tag_send(Array(view), self.send_tag), view))

    def _post_header(self) -> None:
        # zeroed, so a short message cannot leave stale bytes behind
        self.header_buf = np.zeros(wire.HEADER_SIZE, np.uint8)
        self.header = self.ep.tag_recv(Array(self.header_buf), self.recv_tag)

    def _poll_receives(self) -> bool:
        """Deliver what completed, in order; the next header's receive is
        posted right behind each payload's so the two are never waited for
        in turn."""
        busy = False
        while self.state == "open":
            if self.body is not None:
                if not self.body.completed:
                    break
                req, self.body = self.body, None
                if not self._succeeded(req, "a payload receive"):
                    break
                raw, buf, self.body_header, self.body_buf = self.body_header, self.body_buf, None, None
                self.owner.inbox.put(Incoming(self.key, raw, buf))
            elif self.header is not None and self.header.completed:
                req, self.header = self.header, None
                if self._succeeded(req, "a header receive"):
                    self._on_header(self.header_buf.tobytes())
            else:
                break
            busy = True
        return busy

    def _on_header(self, raw: bytes) -> None:
        try:
            h = wire.unpack_header(raw)
        except wire.WireError:
            # a payload may follow that no header describes: hand the bad
            # header on (it is counted), then end the connection rather
            # than mistake that payload for another
            self._refuse(raw)
            return
        n = 0 if h.flags & wire.Flag.SHM else h.payload_bytes
        if n > MAX_MESSAGE_BYTES:
            # no buffer of whatever size a header claims: the header goes on
            # without it (refused and counted), the connection ends
            self._refuse(raw)
            return
        if n:
            self.body_buf = self.pool.take(n)[:n]
            self.body_header = raw
            self.body = self.ep.tag_recv(Array(self.body_buf), self.recv_tag)
            self._post_header()
        else:
            self._post_header()
            self.owner.inbox.put(Incoming(self.key, raw, _EMPTY))

    def _refuse(self, raw: bytes) -> None:
        self.owner.inbox.put(Incoming(self.key, raw, _EMPTY))
        self.state = "linger"
        self.deadline = time.monotonic() + BAD_HEADER_LINGER

    def _succeeded(self, req, what: str) -> bool:
        """Whether a completed request succeeded; a failed one ends the
        endpoint (the peer went away, or sent more than it announced)."""
        try:
            req.check_error()
        except Exception as exc:
            self._end(f"{what} failed: {exc}")
            return False
        return True

    def _ep_error(self) -> str:
        try:
            self.ep.raise_on_error()
        except Exception as exc:
            return str(exc)
        return "the peer went away"

    def _end(self, why: str) -> None:
        """Close the endpoint now. UCX cancels the requests still posted on
        it; the buffers they point into stay referenced until it has."""
        if self.state == "ended":
            return
        was_open = self.state != "handshake"
        self.state = "ended"
        self.deadline = time.monotonic() + EP_CLOSE_TIMEOUT
        self.outbox.clear()
        log.debug("UCX endpoint %r ended: %s", self.key, why)
        try:
            # the blocking close: ucxx's other one crashes on an endpoint
            # that already failed; without a progress thread it progresses
            # the worker itself, on this thread
            self.ep.close_blocking(period=int(EP_CLOSE_TIMEOUT * 1e9), max_attempts=1)
        except Exception as exc:
            log.debug("closing UCX endpoint %r: %s", self.key, exc)
        self.owner.peer_ended(self, was_open)

    def _drain(self) -> bool:
        pending = [r for r in (self.step, self.header, self.body) if r is not None]
        pending.extend(r for r, _ in self.inflight)
        done = all(r.completed for r in pending)
        if done or time.monotonic() > self.deadline:
            if not done:
                # never freed under UCX: a request it did not give back in
                # time keeps its buffer for the life of the process
                self.engine.orphans.append((pending, self.step_buf, self.header_buf, self.body_buf,
                                            list(self.inflight)))
            self.engine.unwatch(self)
            self.step = self.header = self.body = None
            self.inflight.clear()
            self.ep = None
        return False


def _host_of(addr: Address) -> str:
    """Where to connect for ``addr``: a wildcard is this host's loopback
    (workers resolve a service's wildcard shard addresses before this)."""
    if addr.is_wildcard:
        return "::1" if ":" in addr.host else "127.0.0.1"
    return "127.0.0.1" if addr.host == "localhost" else addr.host


def _owns_none(engine: _Engine, owner) -> Callable[[], bool]:
    """Whether the engine is done with every endpoint of ``owner``."""
    return lambda: not any(p.owner is owner for p in engine.peers.values())


class UcxListener(Listener):
    def __init__(self, addr: Address, memory: str = "host"):
        _pool(memory)  # a wrong memory kind is said here, not at the first accept
        self._memory = memory
        self._engine = _Engine.get()
        self.inbox = _Inbox()
        self._peers: dict[int, _Peer] = {}
        self._gone: list[int] = []
        self._ids = itertools.count(1)
        self._closed = False
        self._listener = None
        if memory == "cuda":
            self._engine.call(self._engine.use_cuda, _current_device())
        try:
            self._engine.run(self._create, addr.port, timeout=30)
        except Exception as exc:
            raise TransportError(f"cannot listen on {addr}: {exc}") from None
        self.address = addr.with_port(self._listener.port)

    def _create(self, port: int) -> None:
        # kept before any accept can run: accepts happen on this thread's
        # next progress, which may come before the caller hears of it
        self._listener = ucx_api.UCXListener.create(self._engine.worker, port, self._accept)

    def _accept(self, conn_request) -> None:
        """A client connects (on the engine thread, inside UCX's progress)."""
        try:
            ep = self._listener.create_endpoint_from_conn_request(conn_request, ERROR_HANDLING)
        except Exception as exc:
            log.debug("UCX listener %s could not accept: %s", self.address, exc)
            return
        if self._closed:
            ep.close_blocking(period=int(EP_CLOSE_TIMEOUT * 1e9), max_attempts=1)
            return
        key = next(self._ids)
        self._peers[key] = _Peer(self._engine, ep, self, key, _pool(self._memory), listener_side=True)

    def peer_opened(self, peer: _Peer) -> None:
        pass

    def peer_ended(self, peer: _Peer, was_open: bool) -> None:
        self._peers.pop(peer.key, None)
        if was_open and not self._closed:
            self._gone.append(peer.key)

    def recv(self, timeout: float) -> Incoming | None:
        return self.inbox.take(timeout)

    def wait(self, timeout: float, connections=()) -> None:
        inboxes = [self.inbox]
        for c in connections:
            if isinstance(c, UcxConnection):
                inboxes.append(c.inbox)
            else:
                timeout = min(timeout, 0.001)  # one this wait cannot watch: look often
        _wait_any(inboxes, timeout)

    def send(self, peer, header: bytes, payload=None) -> bool:
        p = self._peers.get(peer)
        if p is None or p.state not in ("open", "linger"):
            return False
        self._engine.call(p.send, bytes(header), payload)
        return True

    def gone(self) -> list:
        out, self._gone = self._gone, []
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        done = threading.Event()
        try:
            self._engine.call(self._shut, done)
        except Exception as exc:
            log.debug("closing UCX listener %s: %s", self.address, exc)
        # bounded: each endpoint's close is
        done.wait(EP_CLOSE_TIMEOUT + 1.0)

    def _shut(self, done: threading.Event) -> None:
        for p in list(self._peers.values()):
            p.abort()

        def finish():
            self._listener = None  # ucxx stops listening when its listener goes
            done.set()

        self._engine.until(_owns_none(self._engine, self), time.monotonic() + EP_CLOSE_TIMEOUT, finish)


class UcxConnection(Connection):
    """Endpoints to every address, made in the background and retried until
    the listener is up (as ZeroMQ reconnects): messages sent meanwhile wait
    in order, and the caller's own timeout reports an absent service. An
    endpoint that fails after it opened is reported by :meth:`gone` and
    made again at the next send to it, which fails (a restarted shard on
    the same address takes the worker back once a later send reaches it).
    Only then: UCX logs every failed attempt, and an endpoint nobody sends
    to any more must not fill a worker's log while its shard is away."""

    def __init__(self, addrs: Sequence[Address], memory: str = "host"):
        self.addresses = list(addrs)
        self._engine = _Engine.get()
        self.inbox = _Inbox()
        n = len(self.addresses)
        self._pools = [_pool(memory) for _ in range(n)]
        self._peers: list[_Peer | None] = [None] * n
        self._pending: list[collections.deque] = [collections.deque() for _ in range(n)]
        self._lost = [False] * n
        #: endpoints that opened once: a failed attempt to make them again
        #: waits for the next send instead of retrying on its own
        self._opened = [False] * n
        self._gone: list[int] = []
        self._closing = False
        if memory == "cuda":
            self._engine.call(self._engine.use_cuda, _current_device())
        for i in range(n):
            self._engine.call(self._dial, i)

    def _dial(self, i: int) -> None:
        if self._closing or self._peers[i] is not None:
            return
        addr = self.addresses[i]
        try:
            ep = ucx_api.UCXEndpoint.create(self._engine.worker, _host_of(addr), addr.port, ERROR_HANDLING)
        except Exception as exc:
            log.debug("UCX endpoint to %s: %s", addr, exc)
            if not self._opened[i]:
                self._engine.later(RECONNECT_INTERVAL, self._dial, i)
            return
        self._peers[i] = _Peer(self._engine, ep, self, i, self._pools[i], listener_side=False)

    def peer_opened(self, peer: _Peer) -> None:
        i = peer.key
        self._lost[i] = False
        self._opened[i] = True
        pending = self._pending[i]
        while pending:
            peer.send(*pending.popleft())

    def peer_ended(self, peer: _Peer, was_open: bool) -> None:
        i = peer.key
        if self._peers[i] is not peer:
            return
        self._peers[i] = None
        if self._closing:
            return
        if was_open:
            self._lost[i] = True
            self._pending[i].clear()
            self._gone.append(i)
        if not self._opened[i]:
            self._engine.later(RECONNECT_INTERVAL, self._dial, i)

    def _enqueue(self, i: int, header: bytes, payload) -> None:
        peer = self._peers[i]
        if peer is not None and peer.state == "open":
            peer.send(header, payload)
        elif not self._lost[i]:
            self._pending[i].append((header, payload))
        # else the endpoint failed after this send was accepted: it is
        # lost with the others in flight, as gone() says

    def send(self, endpoint: int, header: bytes, payload=None) -> None:
        if self._lost[endpoint] or self._closing:
            if not self._closing:
                self._engine.call(self._dial, endpoint)
            raise TransportError(f"the UCX connection to {self.addresses[endpoint]} is closed")
        self._engine.call(self._enqueue, endpoint, bytes(header), payload)

    def recv(self, timeout: float) -> Incoming | None:
        return self.inbox.take(timeout)

    def wakeup(self) -> None:
        self.inbox.put(_WAKE)

    def gone(self) -> list[int]:
        out, self._gone = self._gone, []
        return sorted(set(out))

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        done = threading.Event()
        self._engine.call(self._shut, done)
        # bounded: the flush, then each endpoint's close
        done.wait(FLUSH_TIMEOUT + EP_CLOSE_TIMEOUT + 1.0)

    def _shut(self, done: threading.Event) -> None:
        for p in self._peers:
            if p is not None:
                p.close()
        deadline = time.monotonic() + FLUSH_TIMEOUT + EP_CLOSE_TIMEOUT
        self._engine.until(_owns_none(self._engine, self), deadline, done.set)


def _current_device() -> int:
    import cupy

    return cupy.cuda.runtime.getDevice()


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
    info = _Engine.get().context.info
    names = set()
    for line in info.splitlines():
        # "#      resource 2  :  md 1  dev 2  flags -- tcp/lo"
        if line.startswith("#") and "resource" in line and " md " in line and " dev " in line:
            names.add(line.split()[-1].split("/")[0])
    return sorted(names)
