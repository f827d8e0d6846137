"""Plain TCP transport (``tcp://host:port``): aggnet's messages on kernel
sockets, with nothing between the caller and the kernel.

Why beside ZeroMQ: ZeroMQ hands every message to an I/O thread of its own,
which copies it into and out of its queues and wakes the caller's thread
for each batch (on a 2-core host plain sockets moved 1.2-2.7 times as
much point to point, at 0.45-0.8 of the CPU per GB: docs/benchmarks.md).
Here the caller's own thread moves the bytes:

* a send goes out at once as far as the socket takes it (``sendmsg`` of the
  frame prefix, the header and the payload in one call, the payload read
  where it lies); what the socket does not take yet waits in a queue of
  views that every later send, receive and wait moves on;
* a receive reads a block at a time and takes every whole message in it;
  a payload larger than what the block holds is read straight into a
  buffer of its own from a pool (:class:`aggnet.buffers.BufferPool`), so a
  chunk crosses user space once and steady state allocates nothing.

The wire: each side opens with an 8-byte greeting (``GREETING``), then
messages follow as an 8-byte prefix (header and payload lengths, little
endian), the header, and the payload. Lengths are checked against
``MAX_HEADER_BYTES`` and :data:`aggnet.protocol.limits.MAX_MESSAGE_BYTES`
before a byte is buffered; a stream that breaks them, or does not greet
within ``GREETING_TIMEOUT``, is closed and counted, and a header the
protocol refuses still frames right, so its owner drops and counts it as
it does on ZeroMQ. A listener's memory is bounded whatever its peers send:
a read block per stream, at most ``MAX_STREAMS`` streams, at most
``RECEIVE_BUDGET`` bytes of payloads being read at once (a stream whose
next payload does not fit waits, unread, and the kernel's flow control
holds its sender; ZeroMQ sizes each message by what its frame announces
and has no such budget), and at most ``UNSENT_BUDGET`` bytes unsent.

Semantics follow the ZeroMQ transport's, so every host and client runs on
either unchanged: a listener never blocks on a peer (a reply to one whose
queue is full is dropped and reported), a connection queues what it sends
before its peer is up and dials again after a peer goes away (reporting
it through :meth:`TcpConnection.gone`), and a send that finds no room for
``SEND_TIMEOUT`` seconds raises. One difference: with no thread of its
own, a connection moves bytes while its owner sends, receives or waits
(the client's I/O thread does one of those all the time; a send from
another thread wakes it). No encryption: ``tcp://`` is for trusted
networks, as UCX is; zmq+tcp with CURVE is the encrypted path.
"""

from __future__ import annotations

import collections
import errno
import itertools
import logging
import os
import select
import socket
import struct
import threading
import time
from typing import Sequence

from aggnet.buffers import BufferPool
from aggnet.protocol.address import Address
from aggnet.protocol.limits import MAX_MESSAGE_BYTES
from aggnet.transport.base import Connection, Incoming, Listener, Transport, TransportError, wait_jointly

log = logging.getLogger("aggnet.transport.tcp")

#: the first bytes each side sends: an aggnet stream, framing version 1
GREETING = b"aggnet\x00\x01"
#: header length, payload length
_PREFIX = struct.Struct("<II")
#: the longest header a frame may announce (aggnet's is 48 bytes)
MAX_HEADER_BYTES = 4096
#: bytes read per system call while no large payload is due
READ_BLOCK = 64 << 10
#: bytes one stream's read takes before the others get their turn (the
#: poll is level-triggered: the rest is read on the next one)
READ_BUDGET = 8 << 20
#: payloads up to this size are copied out of the read block as bytes;
#: larger ones get a pooled buffer
SMALL_PAYLOAD = 4096
#: bytes a stream may hold unsent before a listener drops replies to it
#: (a peer that reads nothing) and a connection's send waits for room
MAX_QUEUED_BYTES = 512 << 20
#: seconds a connection's send waits for room before it raises
SEND_TIMEOUT = 2.0
#: seconds between attempts to reach a listener that is not up (or back) yet
RECONNECT_INTERVAL = 0.1
#: seconds between attempts to resolve a name that did not resolve: the
#: look-up blocks its caller (the client's I/O thread), a slow resolver
#: for seconds
RESOLVE_INTERVAL = 1.0
#: seconds a new peer has to greet before the listener closes it
GREETING_TIMEOUT = 5.0
#: seconds a closing connection gives its queued sends (a LEAVE) to leave
CLOSE_LINGER = 0.2
#: bytes of payloads a listener reads at once, summed over its streams (a
#: payload counts its announced size from its first byte to its last):
#: past it, a stream whose next payload does not fit waits, unread, so the
#: kernel's flow control holds its sender. Four of the largest messages;
#: the default 1 MiB chunks of 256 workers at once
RECEIVE_BUDGET = 4 * MAX_MESSAGE_BYTES
#: seconds a stream reading a payload may send nothing of it while others
#: wait for the listener's receive budget, before it is closed
STALL_TIMEOUT = 10.0
#: bytes a listener holds unsent, summed over its streams: past it, the
#: stream holding the most is closed (peers that read none of their
#: replies; a worker's own is at most its window of chunks, 4 MiB by default)
UNSENT_BUDGET = 1 << 30
#: streams one listener holds; a connection past them is closed at once
#: (every stream keeps a read block, and the process has descriptors)
MAX_STREAMS = 4096
#: views handed to one sendmsg call (below the kernel's IOV_MAX)
_IOV_BATCH = 64
_EMPTY = memoryview(b"")
_IN = select.EPOLLIN | select.EPOLLRDHUP
_OUT = select.EPOLLOUT
_BROKEN = select.EPOLLHUP | select.EPOLLERR


class _BadStream(Exception):
    """The peer sent what no aggnet stream holds; the stream is closed."""


def frame_head(header: bytes, payload_bytes: int) -> bytes:
    """What goes on the wire before a message's payload: the prefix (the
    header's and payload's lengths) and the header."""
    return _PREFIX.pack(len(header), payload_bytes) + bytes(header)


def _frame(header: bytes, payload) -> list[memoryview]:
    """One message as the views that go on the wire: the prefix and the
    header in one small buffer, then the payload where it lies."""
    view = None if payload is None else memoryview(payload)
    n = 0 if view is None else view.nbytes
    parts = [memoryview(frame_head(header, n))]
    if n:
        parts.append(view if view.ndim == 1 and view.itemsize == 1 else view.cast("B"))
    return parts


class _Stream:
    """One socket's framing: the greeting, the unsent views, and the
    message being read. The owner (listener or connection) polls it."""

    __slots__ = ("sock", "fd", "out", "queued", "block", "view", "start", "end", "greeted", "body", "pool",
                 "key", "since", "watching_out", "budget", "waiting", "wants", "progress")

    def __init__(self, sock: socket.socket, pool: BufferPool, key, budget=None):
        self.sock = sock
        self.fd = sock.fileno()
        self.out: collections.deque = collections.deque()
        self.queued = 0
        self.block = bytearray(READ_BLOCK)
        self.view = memoryview(self.block)
        self.start = self.end = 0
        self.greeted = False
        #: (header, buffer, bytes in it) while a large payload is read in place
        self.body = None
        self.pool = pool
        self.key = key
        self.since = time.monotonic()
        self.watching_out = False
        #: the owner whose receive budget a large payload must fit (a
        #: listener's); None: no budget
        self.budget = budget
        #: waiting for room in that budget, unread, to take ``wants`` bytes
        self.waiting = False
        self.wants = 0
        #: when a byte of the payload being read last came
        self.progress = 0.0
        self.out.append(memoryview(GREETING))
        self.queued = len(GREETING)

    # -- sending --------------------------------------------------------------------------

    def put(self, header: bytes, payload) -> None:
        """Queue one message and send what the socket takes now."""
        was_idle = not self.out
        for part in _frame(header, payload):
            self.out.append(part)
            self.queued += part.nbytes
        if was_idle:
            self.flush()

    def flush(self) -> None:
        """Send queued views until the socket is full; raises OSError where
        the connection broke."""
        out = self.out
        while out:
            batch = list(itertools.islice(out, _IOV_BATCH))
            try:
                sent = self.sock.sendmsg(batch)
            except (BlockingIOError, InterruptedError):
                return
            self.queued -= sent
            while sent:
                head = out[0]
                if sent >= len(head):
                    sent -= len(head)
                    out.popleft()
                else:
                    out[0] = head[sent:]
                    sent = 0

    # -- receiving ------------------------------------------------------------------------

    def read(self, deliver) -> bool:
        """Read what the socket has and ``deliver(header, payload)`` each
        whole message; False once the peer closed. Raises _BadStream."""
        sock = self.sock
        taken = 0
        while taken < READ_BUDGET:
            body = self.body
            if body is not None:
                header, buf, got = body
                try:
                    n = sock.recv_into(buf[got:])
                except (BlockingIOError, InterruptedError):
                    return True
                if not n:
                    return False
                taken += n
                got += n
                if got < len(buf):
                    self.body = (header, buf, got)
                    if self.budget is not None:
                        self.progress = time.monotonic()
                    continue
                self.body = None
                if self.budget is not None:
                    self.budget.release(len(buf))
                deliver(header, buf)
                continue
            self._parse(deliver)
            if self.body is not None:
                continue
            if self.waiting:
                return True  # the next payload waits for room; the socket stays unread
            if self.start == self.end:
                self.start = self.end = 0
            elif READ_BLOCK - self.end < READ_BLOCK // 4:
                # a partial frame near the block's end: move it to the front
                left = self.end - self.start
                self.view[:left] = self.view[self.start:self.end]
                self.start, self.end = 0, left
            try:
                n = sock.recv_into(self.view[self.end:])
            except (BlockingIOError, InterruptedError):
                return True
            if not n:
                return False
            taken += n
            self.end += n
        return True

    def _parse(self, deliver) -> None:
        view, start, end = self.view, self.start, self.end
        if not self.greeted:
            if end - start < len(GREETING):
                if bytes(view[start:end]) != GREETING[:end - start]:
                    raise _BadStream(self._stranger(bytes(view[start:end])))
                return
            if bytes(view[start:start + len(GREETING)]) != GREETING:
                raise _BadStream(self._stranger(bytes(view[start:start + len(GREETING)])))
            self.greeted = True
            start += len(GREETING)
        while end - start >= _PREFIX.size:
            hlen, plen = _PREFIX.unpack_from(view, start)
            if hlen > MAX_HEADER_BYTES or plen > MAX_MESSAGE_BYTES:
                raise _BadStream(f"a frame of {hlen} header and {plen} payload bytes (at most {MAX_HEADER_BYTES} "
                                 f"and {MAX_MESSAGE_BYTES})")
            at = start + _PREFIX.size
            whole = at + hlen + plen
            if whole <= end:
                header = bytes(view[at:at + hlen])
                if not plen:
                    payload = _EMPTY
                elif plen <= SMALL_PAYLOAD:
                    payload = memoryview(bytes(view[at + hlen:whole]))
                else:
                    payload = self.pool.take(plen)[:plen]
                    payload[:] = view[at + hlen:whole]
                start = whole
                deliver(header, payload)
                continue
            if plen > SMALL_PAYLOAD and at + hlen <= end:
                if self.budget is not None and not self.budget.admit(self, plen):
                    break  # its frame stays at the block's front until there is room
                # the rest of a large payload goes straight into its buffer
                if self.budget is not None:
                    self.progress = time.monotonic()
                buf = self.pool.take(plen)[:plen]
                have = end - at - hlen
                buf[:have] = view[at + hlen:end]
                self.body = (bytes(view[at:at + hlen]), buf, have)
                start = end
            break
        self.start, self.end = start, end

    @staticmethod
    def _stranger(first: bytes) -> str:
        if first[:1] == b"\xff":
            return "it speaks ZeroMQ"
        if first[:4] in (b"GET ", b"POST", b"HEAD", b"HTTP"):
            return "it speaks HTTP"
        return f"it opened with {first!r}, not aggnet's greeting"

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
        self.out.clear()
        self.body = None


def _resolve(addr: Address, passive: bool) -> tuple:
    """(family, sockaddr) for ``addr``. A wildcard listener serves IPv6
    and IPv4 alike ([::] and *), or IPv4 only (0.0.0.0); a connection to a
    wildcard goes to this host's loopback."""
    host = addr.host
    if passive and host in ("", "*", "::"):
        return socket.AF_INET6, ("::", addr.port)
    if not passive and addr.is_wildcard:
        host = "::1" if ":" in host else "127.0.0.1"
    try:
        infos = socket.getaddrinfo(host, addr.port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE if passive else 0)
    except socket.gaierror as exc:
        raise TransportError(f"cannot resolve {addr.host!r} in {addr}: {exc.strerror}") from None
    family, _, _, _, sockaddr = infos[0]
    return family, sockaddr


def greets_as_plain_tcp(addr: Address, timeout: float = 0.5) -> bool:
    """Whether a tcp:// listener answers at ``addr``'s host and port (it
    greets first): a ZeroMQ worker that a service refused asks, to say
    which scheme the service takes."""
    try:
        family, sockaddr = _resolve(addr, passive=False)
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(sockaddr)
            first = b""
            while len(first) < len(GREETING):
                more = s.recv(len(GREETING) - len(first))
                if not more:
                    break
                first += more
        return first == GREETING
    except (OSError, TransportError):
        return False


def _tune(sock: socket.socket) -> None:
    sock.setblocking(False)
    # headers and acknowledgements are small and awaited: no Nagle delay
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class TcpListener(Listener):
    """Many peers' streams, polled by the owner's calls. Its memory is
    bounded whatever the peers send: a read block per stream, at most
    ``max_streams`` streams, at most ``receive_budget`` bytes of payloads
    being read at once (a stream whose next payload does not fit waits in
    line, unread; one that holds room and sends nothing of its payload for
    ``stall_timeout`` seconds while others wait is closed), and at most
    ``unsent_budget`` bytes unsent (past it, the stream holding the most is
    closed)."""

    def __init__(self, addr: Address, receive_budget: int = RECEIVE_BUDGET, stall_timeout: float = STALL_TIMEOUT,
                 max_streams: int = MAX_STREAMS, unsent_budget: int = UNSENT_BUDGET):
        for name, value in (("receive_budget", receive_budget), ("unsent_budget", unsent_budget)):
            if value < MAX_MESSAGE_BYTES:
                raise ValueError(f"{name} must hold the largest message ({MAX_MESSAGE_BYTES} bytes), got {value}")
        self.receive_budget = receive_budget
        self.unsent_budget = unsent_budget
        self.stall_timeout = stall_timeout
        self.max_streams = max_streams
        family, sockaddr = _resolve(addr, passive=True)
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and sockaddr[0] == "::":
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind(sockaddr)
            sock.listen(1024)
        except OSError as exc:
            sock.close()
            raise TransportError(f"cannot listen on {addr}: {exc.strerror or exc}") from None
        sock.setblocking(False)
        self._sock = sock
        self.address = addr.with_port(sock.getsockname()[1])
        self._epoll = select.epoll()
        self._epoll.register(sock.fileno(), select.EPOLLIN)
        self._pool = BufferPool()
        self._streams: dict[int, _Stream] = {}  # descriptor -> stream
        self._peers: dict[int, _Stream] = {}  # peer id -> stream
        self._ids = itertools.count(1)
        self._ready: collections.deque[Incoming] = collections.deque()
        self._closed: collections.deque = collections.deque(maxlen=65536)
        #: why the listener itself closed a greeted peer, by peer, for the
        #: owner's error to the peer's job (the most recent ones)
        self._why_closed: collections.OrderedDict = collections.OrderedDict()
        #: streams closed for what they sent (no greeting, a frame too large)
        self.bad_streams = 0
        #: streams closed for holding receive budget without sending
        self.stalled_streams = 0
        #: connections closed at once because ``max_streams`` were open
        self.streams_over_limit = 0
        #: streams closed for holding the most unsent past ``unsent_budget``
        self.unread_streams = 0
        #: bytes queued unsent, summed over the streams
        self.unsent = 0
        #: times a stream waited for room in the receive budget
        self.receive_waits = 0
        #: bytes of the payloads being read now (at most ``receive_budget``)
        self.receiving = 0
        #: streams waiting for room, first come first served
        self._for_room: collections.deque[_Stream] = collections.deque()
        self._room_freed = False
        self._next_check = time.monotonic() + 1.0

    # -- the interface ----------------------------------------------------------------------

    def recv(self, timeout: float) -> Incoming | None:
        if not self._ready:
            deadline = time.monotonic() + timeout
            self._pump(timeout)
            # an accept, a partial frame or a flush brings no message yet
            while not self._ready and (left := deadline - time.monotonic()) > 0:
                self._pump(left)
        return self._ready.popleft() if self._ready else None

    def send(self, peer, header: bytes, payload=None) -> bool:
        stream = self._peers.get(peer)
        if stream is None or stream.queued > MAX_QUEUED_BYTES:
            # gone, or reading none of its replies: never stall the others
            return False
        if not self._moved(stream, lambda: stream.put(header, payload)):
            return False
        if self.unsent > self.unsent_budget:
            self._shed()
            return self._peers.get(peer) is stream
        return True

    def wait(self, timeout: float, connections=()) -> None:
        if self._room_freed:
            self._resume()  # a stream that waits for room is not polled: nothing else would wake it
        if self._ready:
            return
        if not connections:
            self._pump(timeout)
            return
        # the epoll descriptor is readable while any stream has news
        wait_jointly(self, self._epoll.fileno(), timeout, connections)

    def gone(self) -> list:
        out = list(self._closed)
        self._closed.clear()
        return out

    def closed_because(self, peer) -> str | None:
        """Why this listener closed ``peer``'s stream itself (it held memory
        without sending, or read none of its replies), or None where the
        peer closed it or broke it."""
        return self._why_closed.pop(peer, None)

    def memory_gauges(self) -> dict:
        """What the budgets hold now, and the budgets."""
        return {"receiving_bytes": self.receiving, "receive_budget": self.receive_budget,
                "unsent_bytes": self.unsent, "unsent_budget": self.unsent_budget, "streams": len(self._streams),
                "max_streams": self.max_streams}

    def transport_counters(self) -> dict:
        """What the listener itself dropped or held back, named as the
        shard's counters are (zeros left out, as in STATS)."""
        counts = {"dropped_bad_stream": self.bad_streams, "dropped_stalled_stream": self.stalled_streams,
                  "dropped_stream_over_limit": self.streams_over_limit, "dropped_unread_stream": self.unread_streams,
                  "receive_waits": self.receive_waits}
        return {k: v for k, v in counts.items() if v}

    # -- the receive budget ------------------------------------------------------------------

    def admit(self, stream: _Stream, nbytes: int) -> bool:
        """Whether ``stream`` may start reading a payload of ``nbytes`` now;
        else it waits in line, unread (it asks again when resumed)."""
        behind = self._for_room and self._for_room[0] is not stream
        if behind or (self.receiving and self.receiving + nbytes > self.receive_budget):
            if not stream.waiting:
                stream.waiting = True
                stream.wants = nbytes
                self._for_room.append(stream)
                self.receive_waits += 1
                self._rearm(stream)
            return False
        if stream.waiting:
            self._for_room.popleft()
            stream.waiting = False
            self._rearm(stream)
        self.receiving += nbytes
        return True

    def release(self, nbytes: int) -> None:
        """A payload of ``nbytes`` is read (or its stream closed)."""
        self.receiving -= nbytes
        self._room_freed = True

    def _resume(self) -> None:
        """Let the streams at the head of the line read, as far as the
        budget has room, first come first served."""
        self._room_freed = False
        while self._for_room:
            stream = self._for_room[0]
            if self.receiving and self.receiving + stream.wants > self.receive_budget:
                return
            self._read(stream)
            if stream.waiting and self._for_room and self._for_room[0] is stream:
                return  # cannot happen while the check above holds; never spin

    def close(self) -> None:
        for stream in list(self._streams.values()):
            stream.close()
        self._streams.clear()
        self._peers.clear()
        self._epoll.close()
        self._sock.close()

    # -- moving bytes -------------------------------------------------------------------------

    def _pump(self, timeout: float) -> None:
        try:
            events = self._epoll.poll(max(0.0, timeout))  # seconds; a negative one waits for ever
        except InterruptedError:
            return
        lfd = self._sock.fileno()
        for fd, ev in events:
            if fd == lfd:
                self._accept()
                continue
            stream = self._streams.get(fd)
            if stream is None:
                continue
            if ev & _OUT and not self._flush(stream):
                continue
            if stream.waiting:
                if ev & _BROKEN:
                    self._drop(stream, None)
            elif ev & (_IN | _BROKEN):
                self._read(stream)
        if self._room_freed:
            self._resume()
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + 1.0
            self._check_streams(now)

    def _read(self, stream: _Stream) -> None:
        try:
            if not stream.read(lambda h, p, key=stream.key: self._ready.append(Incoming(key, h, p))):
                self._drop(stream, None)
        except _BadStream as exc:
            self._drop(stream, str(exc))
        except OSError:
            self._drop(stream, None)

    def _check_streams(self, now: float) -> None:
        """Close streams that never greeted, and streams that hold room in
        the receive budget but send nothing of their payload while others
        wait for it (a peer that stopped, or one that means to hold it)."""
        for stream in [s for s in self._streams.values() if not s.greeted and now - s.since > GREETING_TIMEOUT]:
            self._drop(stream, f"it did not greet within {GREETING_TIMEOUT:g}s")
        if not self._for_room:
            return
        stalled = [s for s in self._streams.values() if s.body is not None and now - s.progress > self.stall_timeout]
        for stream in stalled:
            self.stalled_streams += 1
            self._drop(stream, f"it sent nothing of a {len(stream.body[1])}-byte payload for "
                               f"{self.stall_timeout:g}s while {len(self._for_room)} streams waited for room in the "
                               f"listener's {self.receive_budget >> 20} MiB (--receive-budget)", bad=False)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors: the peer waits in the backlog
                log.warning("%s cannot accept a connection: %s", self.address, exc)
                return
            if len(self._streams) >= self.max_streams:
                sock.close()
                self.streams_over_limit += 1
                (log.warning if self.streams_over_limit == 1 else log.debug)(
                    "%s closed a new connection (%d so far): it holds %d streams already, its limit",
                    self.address, self.streams_over_limit, self.max_streams)
                continue
            _tune(sock)
            stream = _Stream(sock, self._pool, next(self._ids), budget=self)
            self._streams[stream.fd] = stream
            self._peers[stream.key] = stream
            self._epoll.register(stream.fd, _IN)
            self.unsent += stream.queued  # its greeting
            self._flush(stream)

    def _flush(self, stream: _Stream) -> bool:
        """Send what ``stream`` has queued as far as its socket takes it;
        False where it broke (and is closed)."""
        return self._moved(stream, stream.flush)

    def _moved(self, stream: _Stream, move) -> bool:
        """``move()`` (a put or a flush) on ``stream``, its change to what
        is queued counted in ``unsent``; False where the stream broke (and
        is closed)."""
        before = stream.queued
        try:
            move()
        except OSError:
            self.unsent += stream.queued - before
            self._drop(stream, None)
            return False
        self.unsent += stream.queued - before
        self._watch_out(stream)
        return True

    def _shed(self) -> None:
        """Close the streams holding the most unsent until the rest fit the
        queue budget: peers that read none of their replies (an honest
        worker holds a window of chunks' worth)."""
        while self.unsent > self.unsent_budget and self._streams:
            worst = max(self._streams.values(), key=lambda st: st.queued)
            self.unread_streams += 1
            self._drop(worst, f"it left {worst.queued / (1 << 20):.1f} MiB of replies unread, the most of any peer, "
                              f"when the unsent replies passed the listener's {self.unsent_budget >> 20} MiB "
                              f"(--unsent-budget)", bad=False)

    def _watch_out(self, stream: _Stream) -> None:
        want = bool(stream.out)
        if want != stream.watching_out:
            stream.watching_out = want
            self._rearm(stream)

    def _rearm(self, stream: _Stream) -> None:
        """Poll ``stream`` for what it waits on: input unless it waits for
        room, output while it has some queued."""
        if stream.fd in self._streams:
            self._epoll.modify(stream.fd, (0 if stream.waiting else _IN) | (_OUT if stream.watching_out else 0))

    def _drop(self, stream: _Stream, why: str | None, bad: bool = True) -> None:
        """Close ``stream``; ``why`` (logged) where it was closed for what
        it did: a ``bad`` stream (not aggnet's framing) is counted here and
        logged at warning level once, as a scanner sends many; the caller
        counts the others (held memory), each worth a warning."""
        if self._streams.pop(stream.fd, None) is None:
            return
        self._peers.pop(stream.key, None)
        try:
            self._epoll.unregister(stream.fd)
        except (OSError, ValueError):
            pass
        self.unsent -= stream.queued
        if stream.body is not None:
            self.release(len(stream.body[1]))
        if stream.waiting:
            self._for_room.remove(stream)
            stream.waiting = False
            self._room_freed = True  # the next in line may fit
        stream.close()
        if why is not None:
            if bad:
                self.bad_streams += 1
            (log.warning if not bad or self.bad_streams == 1 else log.debug)(
                "%s closed a connection: %s", self.address, why)
        if stream.greeted:
            self._closed.append(stream.key)
            if why is not None:
                self._why_closed[stream.key] = why
                while len(self._why_closed) > 1024:
                    self._why_closed.popitem(last=False)


class TcpConnection(Connection):
    """Streams to endpoints ``0..n-1``, each dialled at once and again
    after it breaks. One thread receives (the client's I/O thread); sends
    may come from any thread."""

    def __init__(self, addrs: Sequence[Address]):
        self.addresses = list(addrs)
        #: (family, sockaddr) of each endpoint once its name resolved: a
        #: name that does not resolve yet (a Kubernetes service whose DNS
        #: entry comes after its workers) is tried again at every dial
        self._targets: list[tuple | None] = [None] * len(self.addresses)
        #: why each endpoint's last dial failed, for the caller's error
        self._dial_errors: list[str | None] = [None] * len(self.addresses)
        self._epoll = select.epoll()
        self._pool = BufferPool()
        self._lock = threading.RLock()
        self._streams: list[_Stream | None] = [None] * len(self.addresses)
        self._by_fd: dict[int, int] = {}
        #: per endpoint: messages queued while no stream is up
        self._waiting: list[collections.deque] = [collections.deque() for _ in self.addresses]
        self._waiting_bytes = [0] * len(self.addresses)
        self._dial_at = [0.0] * len(self.addresses)
        self._ready: collections.deque[Incoming] = collections.deque()
        self._gone: set[int] = set()
        self._refused: dict[int, str] = {}
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._epoll.register(self._wake_fd, select.EPOLLIN)
        self._closed = False
        self._woken = False
        with self._lock:
            for i in range(len(self.addresses)):
                self._dial(i)

    # -- the interface ----------------------------------------------------------------------

    def send(self, endpoint: int, header: bytes, payload=None) -> None:
        deadline = None
        while True:
            with self._lock:
                if self._closed:
                    raise TransportError(f"send to {self.addresses[endpoint]} failed: the connection is closed")
                stream = self._streams[endpoint]
                fd = None
                if stream is not None and stream.greeted is None:
                    # a connect under way: it may have finished since
                    stream = self._finish_connect(endpoint, stream)
                if stream is not None and stream.greeted is not None:
                    try:
                        if stream.queued > MAX_QUEUED_BYTES:
                            stream.flush()
                        if stream.queued <= MAX_QUEUED_BYTES:
                            stream.put(header, payload)
                            self._watch_out(stream)
                            return
                    except OSError:
                        # broken: the message waits for the stream dialled next
                        self._broken(endpoint, stream)
                        continue
                    fd = stream.fd
                elif self._waiting_bytes[endpoint] <= MAX_QUEUED_BYTES:
                    self._hold(endpoint, header, payload)
                    return
            # no room: wait for the peer to take some, at most SEND_TIMEOUT
            now = time.monotonic()
            deadline = deadline or now + SEND_TIMEOUT
            if now >= deadline:
                raise TransportError(f"send to {self.addresses[endpoint]} failed: it took nothing of the "
                                     f"{MAX_QUEUED_BYTES >> 20} MiB queued for it within {SEND_TIMEOUT:g}s")
            if fd is None:
                time.sleep(0.01)
            else:
                p = select.poll()
                p.register(fd, select.POLLOUT)
                p.poll(50)

    def recv(self, timeout: float) -> Incoming | None:
        if self._ready:
            return self._ready.popleft()
        deadline = time.monotonic() + timeout
        self._pump(timeout)
        # a connect, a partial frame or a flush brings no message yet; a
        # wakeup ends the wait
        while not self._ready and not self._woken and (left := deadline - time.monotonic()) > 0:
            self._pump(left)
        self._woken = False
        return self._ready.popleft() if self._ready else None

    def _pump(self, timeout: float) -> None:
        with self._lock:
            if self._closed:
                self._woken = True
                return
            now = time.monotonic()
            due = [t for i, t in enumerate(self._dial_at) if self._streams[i] is None]
            if due:
                soonest = min(due)
                if soonest <= now:
                    self._redial(now)
                    due = [t for i, t in enumerate(self._dial_at) if self._streams[i] is None]
                if due:
                    timeout = min(timeout, max(0.0, min(due) - now))
        try:
            events = self._epoll.poll(max(0.0, timeout))  # seconds; a negative one waits for ever
        except InterruptedError:
            return
        except ValueError:  # closed meanwhile
            self._woken = True
            return
        with self._lock:
            for fd, ev in events:
                if fd == self._wake_fd:
                    try:
                        os.eventfd_read(self._wake_fd)
                    except BlockingIOError:
                        pass
                    self._woken = True
                    continue
                i = self._by_fd.get(fd)
                if i is None:
                    continue
                stream = self._streams[i]
                try:
                    if stream.greeted is None:
                        if not ev & (_OUT | _BROKEN) or not self._connected(i, stream):
                            continue
                    if ev & _OUT:
                        stream.flush()
                        self._watch_out(stream)
                    if ev & (_IN | _BROKEN):
                        if not stream.read(lambda h, p, i=i: self._ready.append(Incoming(i, h, p))):
                            self._broken(i, stream)
                except _BadStream as exc:
                    hint = "; use its zmq+tcp:// address instead" if "ZeroMQ" in str(exc) else ""
                    self._refused[i] = f"it is not an aggnet tcp:// listener: {exc}{hint}"
                    self._broken(i, stream)
                except OSError:
                    self._broken(i, stream)

    def wakeup(self) -> None:
        try:
            os.eventfd_write(self._wake_fd, 1)
        except OSError:
            pass  # closed

    def gone(self) -> list[int]:
        with self._lock:
            out = sorted(self._gone)
            self._gone.clear()
        return out

    def refused(self) -> dict[int, str]:
        return dict(self._refused)

    def poll_items(self) -> list:
        # one descriptor, readable while any stream (or a wakeup) has news
        return [self._epoll.fileno()]

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            streams = [s for s in self._streams if s is not None]
        # a short linger lets a last message (a LEAVE) go out
        deadline = time.monotonic() + CLOSE_LINGER
        for s in streams:
            while s.out and s.greeted is not None and time.monotonic() < deadline:
                try:
                    s.flush()
                except OSError:
                    break
                if s.out:
                    p = select.poll()
                    p.register(s.fd, select.POLLOUT)
                    p.poll(max(1, int((deadline - time.monotonic()) * 1000)))
        with self._lock:
            for s in streams:
                s.close()
            self._streams = [None] * len(self.addresses)
            self._by_fd.clear()
            self._epoll.close()
            os.close(self._wake_fd)

    # -- streams --------------------------------------------------------------------------------

    def last_error(self, i: int) -> str | None:
        """Why endpoint ``i``'s last dial failed (a name that does not
        resolve, a refused connection), or None: what a worker that heard
        nothing can say beside its timeout."""
        return self._dial_errors[i]

    def _dial(self, i: int) -> None:
        if self._targets[i] is None:
            try:
                self._targets[i] = _resolve(self.addresses[i], passive=False)
            except TransportError as exc:
                self._dial_errors[i] = str(exc)
                self._dial_at[i] = time.monotonic() + RESOLVE_INTERVAL
                return
        family, sockaddr = self._targets[i]
        sock = socket.socket(family, socket.SOCK_STREAM)
        _tune(sock)
        err = sock.connect_ex(sockaddr)
        if err not in (0, errno.EINPROGRESS):
            sock.close()
            self._dial_errors[i] = f"connecting to {self.addresses[i]}: {os.strerror(err)}"
            self._dial_at[i] = time.monotonic() + RECONNECT_INTERVAL
            return
        stream = _Stream(sock, self._pool, i)
        stream.greeted = None  # connecting: nothing goes out until the connect completes
        self._streams[i] = stream
        self._by_fd[stream.fd] = i
        self._epoll.register(stream.fd, _IN | _OUT)
        stream.watching_out = True

    def _finish_connect(self, i: int, stream: _Stream) -> _Stream | None:
        p = select.poll()
        p.register(stream.fd, select.POLLOUT)
        if not p.poll(0) or not self._connected(i, stream):
            return self._streams[i]
        try:
            stream.flush()
        except OSError:
            self._broken(i, stream)
        return self._streams[i]

    def _connected(self, i: int, stream: _Stream) -> bool:
        err = stream.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            self._dial_errors[i] = f"connecting to {self.addresses[i]}: {os.strerror(err)}"
            self._unwatch(stream)
            stream.close()
            self._streams[i] = None
            self._dial_at[i] = time.monotonic() + RECONNECT_INTERVAL
            return False
        stream.greeted = False
        stream.since = time.monotonic()
        self._dial_errors[i] = None
        # what was sent before the stream was up goes first, in order
        waiting = self._waiting[i]
        while waiting:
            stream.out.extend(waiting.popleft())
        stream.queued += self._waiting_bytes[i]
        self._waiting_bytes[i] = 0
        return True

    def _hold(self, i: int, header: bytes, payload) -> None:
        parts = _frame(header, payload)
        self._waiting[i].append(parts)
        self._waiting_bytes[i] += sum(p.nbytes for p in parts)

    def _redial(self, now: float) -> None:
        for i, at in enumerate(self._dial_at):
            if self._streams[i] is None and at <= now:
                self._dial(i)

    def _broken(self, i: int, stream: _Stream) -> None:
        """A stream that ended: a peer that was up is reported gone (what
        it had not taken is lost with it, as on ZeroMQ); either way it is
        dialled again."""
        if self._streams[i] is not stream:
            return
        if stream.greeted:
            self._gone.add(i)
        self._unwatch(stream)
        stream.close()
        self._streams[i] = None
        self._dial_at[i] = time.monotonic() + RECONNECT_INTERVAL

    def _unwatch(self, stream: _Stream) -> None:
        self._by_fd.pop(stream.fd, None)
        try:
            self._epoll.unregister(stream.fd)
        except (OSError, ValueError):
            pass

    def _watch_out(self, stream: _Stream) -> None:
        want = bool(stream.out)
        if want != stream.watching_out:
            stream.watching_out = want
            try:
                self._epoll.modify(stream.fd, _IN | _OUT if want else _IN)
            except (OSError, ValueError):
                pass


class TcpTransport(Transport):
    def listen(self, address: Address, **options) -> Listener:
        return TcpListener(address, **options)

    def connect(self, addresses: Sequence[Address], **options) -> Connection:
        return TcpConnection(addresses)
