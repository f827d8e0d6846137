"""ZeroMQ transport: ROUTER listeners, one DEALER per endpoint on clients.

A message is two frames, [header, payload] (one without payload); a ROUTER
prefixes the peer identity. Payload frames are sent zero-copy (pyzmq copies
frames below its copy threshold itself, where a copy is cheaper than
tracking) and received zero-copy: the caller reads the payload straight out
of ZeroMQ's message. Queues are bounded by high-water marks; a ROUTER is
mandatory-routing so that a reply to a vanished peer is reported, not
silently queued.
"""

from __future__ import annotations

import collections
import os
from dataclasses import dataclass
from typing import Sequence

import zmq
from zmq.utils.monitor import recv_monitor_message

from aggnet.protocol.address import Address
from aggnet.protocol.limits import MAX_MESSAGE_BYTES
from aggnet.transport.base import Connection, Incoming, Listener, Transport, TransportError, wait_jointly

#: messages queued per socket before sends block (clients bound their
#: in-flight chunks by a window far below this)
HIGH_WATER_MARK = 4096
_EMPTY = memoryview(b"")
#: milliseconds a client's send may wait for room
SEND_TIMEOUT_MS = 2000


def zmq_endpoint(addr: Address) -> str:
    if addr.scheme == "zmq+tcp":
        host = f"[{addr.host}]" if ":" in addr.host else addr.host
        return f"tcp://{host}:{addr.port}"
    if addr.scheme in ("zmq+ipc", "shm"):
        return f"ipc://{addr.path}"
    raise TransportError(f"ZeroMQ cannot serve {addr}")


def _context() -> zmq.Context:
    return zmq.Context.instance()


@dataclass(frozen=True)
class Curve:
    """ZeroMQ CURVE keys (Z85 text): a listener's own pair, or the server's
    public key a connection expects (with a throwaway pair of its own)."""

    public: bytes
    secret: bytes | None = None


def make_curve_keys(path: str) -> str:
    """Write a new CURVE key pair to ``path`` (0600; the secret stays on the
    aggregator host) and return the public key clients need."""
    public, secret = zmq.curve_keypair()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"public {public.decode()}\nsecret {secret.decode()}\n")
    return public.decode()


def load_curve_secret(path: str) -> Curve:
    try:
        st = os.stat(path)
        with open(path) as f:
            fields = dict(line.split(None, 1) for line in f.read().splitlines() if line.strip())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read CURVE key file {path}: {exc}") from None
    if st.st_mode & 0o077:
        raise ValueError(f"CURVE key file {path} is readable by others; chmod 600 {path}")
    if not zmq.has("curve"):
        raise ValueError("this libzmq has no CURVE support")
    try:
        return Curve(fields["public"].strip().encode(), fields["secret"].strip().encode())
    except KeyError:
        raise ValueError(f"CURVE key file {path} must hold 'public KEY' and 'secret KEY' lines "
                         f"(aggnet job curve-keys makes one)") from None


def _apply_curve(sock, curve: Curve | None, server: bool) -> None:
    if curve is None:
        return
    if server:
        sock.curve_secretkey = curve.secret
        sock.curve_publickey = curve.public
        sock.curve_server = True
    else:
        public, secret = zmq.curve_keypair()
        sock.curve_serverkey = curve.public
        sock.curve_publickey = public
        sock.curve_secretkey = secret


def _split(frames) -> tuple:
    header = frames[0].buffer if frames else _EMPTY
    if len(frames) == 1:
        return header, _EMPTY
    if len(frames) == 2:
        return header, frames[1].buffer
    # more frames than the format has: hand them on joined, so the length
    # check rejects the message and counts it
    return header, memoryview(b"".join(f.bytes for f in frames[1:]))


class ZmqListener(Listener):
    def __init__(self, addr: Address, curve: Curve | None = None):
        self._sock = _context().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        _apply_curve(self._sock, curve, server=True)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.SNDHWM, HIGH_WATER_MARK)
        self._sock.setsockopt(zmq.RCVHWM, HIGH_WATER_MARK)
        # [::] then serves IPv6 and IPv4 workers alike
        self._sock.setsockopt(zmq.IPV6, 1)
        # a peer that sends a larger frame is disconnected, not buffered
        # (a header, a chunk or a block of rows is never larger)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        endpoint = zmq_endpoint(addr)
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as exc:
            self._sock.close()
            raise TransportError(f"cannot listen on {addr}: {exc}") from None
        bound = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if addr.scheme == "zmq+tcp":
            self.address = addr.with_port(int(bound.rsplit(":", 1)[1]))
        else:
            self.address = addr
        # which connection each peer's messages came in on, and the
        # connections that closed: a worker killed without LEAVE is told
        # at once (its kernel closes the socket), not by a stall timeout
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._fd_of: dict = {}  # routing id -> descriptor of its connection
        self._peers_on: dict = {}  # descriptor -> routing ids seen on it
        # bounded: a listener whose owner never asks (a control endpoint)
        # keeps only the latest
        self._closed: collections.deque = collections.deque(maxlen=65536)

    def recv(self, timeout: float) -> Incoming | None:
        if not self._sock.poll(max(0, int(timeout * 1000))):
            return None
        frames = self._sock.recv_multipart(copy=False)
        peer = frames[0].bytes
        if peer not in self._fd_of and len(frames) > 1:
            # a new peer: first take in what the monitor knows (a descriptor
            # closed before this peer's connection could reuse it)
            self._drain_monitor()
            try:
                fd = frames[1].get(zmq.SRCFD)
            except zmq.ZMQError:
                fd = None
            if fd is not None:
                self._fd_of[peer] = fd
                self._peers_on.setdefault(fd, set()).add(peer)
        header, payload = _split(frames[1:])
        return Incoming(peer, header, payload)

    def _drain_monitor(self) -> None:
        while self._monitor.poll(0):
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.ZMQError:
                return
            # a closed descriptor, or one accepted again (so closed before):
            # every peer seen on it is gone
            for peer in self._peers_on.pop(int(event["value"]), ()):
                self._fd_of.pop(peer, None)
                self._closed.append(peer)

    def gone(self) -> list:
        self._drain_monitor()
        out = list(self._closed)
        self._closed.clear()
        return out

    def wait(self, timeout: float, connections=()) -> None:
        wait_jointly(self, self._sock, timeout, connections)

    def send(self, peer, header: bytes, payload=None) -> bool:
        frames = [peer, header] if payload is None else [peer, header, payload]
        try:
            # never block on one peer: one that reads none of its replies
            # (its queue full) must not stall everybody else's
            self._sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            if exc.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                return False
            raise TransportError(f"send from {self.address} failed: {exc}") from None
        return True

    def close(self) -> None:
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        if self.address.scheme in ("zmq+ipc", "shm"):
            try:
                os.unlink(self.address.path)
            except OSError:
                pass


#: connections a peer may close before its first word (or fail the handshake
#: of without a reason) before the worker takes it for a refused handshake:
#: a missing or wrong CURVE key, which ZeroMQ retries for ever, and which
#: the worker should hear at once rather than at its connect timeout
SILENT_CLOSES = 3
_PLAIN_TCP = "it serves plain tcp://"
#: the monitor's events of a failed security handshake
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
#: the failures that are the peer's answer (a mechanism it does not take, a
#: key it refused): ZeroMQ does not connect again after them
_HANDSHAKE_REFUSED = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH


class ZmqConnection(Connection):
    def __init__(self, addrs: Sequence[Address], curve: Curve | None = None):
        self.addresses = list(addrs)
        ctx = _context()
        self._socks = []
        self._poller = zmq.Poller()
        self._index = {}
        # a shard that dies closes its connections: the client hears it at
        # once on its monitor and can join the shard's successor on the same
        # address
        self._monitors = {}
        for i, addr in enumerate(self.addresses):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, HIGH_WATER_MARK)
            s.setsockopt(zmq.RCVHWM, HIGH_WATER_MARK)
            # a send with no way out (a refused CURVE handshake, a full
            # queue to a stuck peer) raises instead of blocking for ever
            s.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
            s.setsockopt(zmq.IPV6, 1)  # IPv6 service addresses; IPv4 ones work as before
            _apply_curve(s, curve, server=False)
            # the monitor before the connect: a refused handshake is one
            # event, never repeated (libzmq does not reconnect after a
            # protocol error), and one attached after it would miss it
            m = s.get_monitor_socket(zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED)
            self._monitors[m] = i
            self._poller.register(m, zmq.POLLIN)
            try:
                s.connect(zmq_endpoint(addr))
            except zmq.ZMQError as exc:
                s.close()
                self.close()
                raise TransportError(f"cannot connect to {addr}: {exc}") from None
            self._socks.append(s)
            self._poller.register(s, zmq.POLLIN)
            self._index[s] = i
        self._gone: set[int] = set()
        self._refused: dict[int, str] = {}
        #: endpoints that sent something; and, of the others, how often each
        #: closed a connection before saying a word (see _drain_monitor)
        self._heard: set[int] = set()
        self._closed_silent: collections.Counter = collections.Counter()
        #: endpoints whose handshake failed without a reason (see _drain_monitor)
        self._failed_handshakes: set[int] = set()
        self._curve = curve is not None
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._poller.register(self._wake_fd, zmq.POLLIN)
        self._ready: collections.deque[Incoming] = collections.deque()

    def send(self, endpoint: int, header: bytes, payload=None) -> None:
        frames = [header] if payload is None else [header, payload]
        try:
            self._socks[endpoint].send_multipart(frames, copy=False)
        except zmq.ZMQError as exc:
            raise TransportError(f"send to {self.addresses[endpoint]} failed: {exc}") from None

    def recv(self, timeout: float) -> Incoming | None:
        if self._ready:
            return self._ready.popleft()
        events = self._poller.poll(max(0, int(timeout * 1000)))
        for sock, _ in events:
            if sock == self._wake_fd:
                try:
                    os.eventfd_read(self._wake_fd)
                except BlockingIOError:
                    pass
                continue
            if sock in self._monitors:
                self._drain_monitor(sock)
                continue
            # drain what is there so one poll serves many messages
            i = self._index[sock]
            self._heard.add(i)
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                header, payload = _split(frames)
                self._ready.append(Incoming(i, header, payload))
        return self._ready.popleft() if self._ready else None

    def _drain_monitor(self, monitor) -> None:
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.ZMQError:
                return
            i = self._monitors[monitor]
            if event["event"] & _HANDSHAKE_REFUSED:
                self._refused[i] = self._why_refused(event["event"], i)
                continue
            if event["event"] & zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                # a wrong CURVE key, but also a peer that died half-way
                # through the handshake (a shard killed while this worker
                # connects, whose successor takes it a second later): both
                # close the connection, and ZeroMQ connects again, so the
                # disconnection it brings is counted with the silent ones
                self._failed_handshakes.add(i)
                continue
            self._gone.add(i)
            if i not in self._heard:
                # a peer that takes the connection and drops it before a
                # word, again and again (ZeroMQ reconnects every 100 ms), is
                # refusing this worker's security mechanism: a loaded peer's
                # close can come before the handshake's failure is seen, and
                # the event then says only "disconnected"
                self._closed_silent[i] += 1
                if self._closed_silent[i] >= SILENT_CLOSES and i not in self._refused:
                    why = self._why_refused(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, i)
                    self._refused[i] = why + (
                        "" if why.startswith(_PLAIN_TCP) or i in self._failed_handshakes else
                        f" (it closed {SILENT_CLOSES} connections before answering; or what listens there is not "
                        f"an aggnet service)")

    def _why_refused(self, event: int, i: int) -> str:
        addr = self.addresses[i]
        if addr.scheme == "zmq+tcp":
            from aggnet.transport.tcp import greets_as_plain_tcp

            if greets_as_plain_tcp(addr):
                # no handshake at all: the service speaks aggnet's own TCP
                return f"{_PLAIN_TCP} (no ZeroMQ): connect at tcp://{zmq_endpoint(addr)[len('tcp://'):]} instead"
        # the event's kind races with the peer closing: what this side
        # brought (a key or none) says more
        if not self._curve:
            return ("its security handshake failed: the service encrypts with CURVE (--curve-secret-file) and "
                    "this worker does not: give it the service's public key (server_key=..., AGGNET_SERVER_KEY, "
                    "printed by `aggnet job curve-keys`)")
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            return ("its security handshake failed: this worker encrypts with CURVE and the service does not "
                    "(it runs without --curve-secret-file): unset server_key / AGGNET_SERVER_KEY")
        return ("its CURVE handshake failed: this worker's server key is not the service's public key; use the "
                "one `aggnet job curve-keys` printed for it (server_key=..., AGGNET_SERVER_KEY)")

    def refused(self) -> dict[int, str]:
        return dict(self._refused)

    def poll_items(self) -> list:
        return list(self._socks)

    def gone(self) -> list[int]:
        out = sorted(self._gone)
        self._gone.clear()
        return out

    def wakeup(self) -> None:
        os.eventfd_write(self._wake_fd, 1)

    def close(self) -> None:
        # a short linger lets a last message (a LEAVE) go out; the shared
        # context is never terminated, so this never blocks the caller
        for s in self._socks:
            try:
                s.disable_monitor()
            except zmq.ZMQError:
                pass
        for m in getattr(self, "_monitors", {}):
            m.close(linger=0)
        self._monitors = {}
        for s in self._socks:
            s.close(linger=200)
        self._socks = []
        fd, self._wake_fd = getattr(self, "_wake_fd", -1), -1
        if fd >= 0:
            os.close(fd)


class ZmqTransport(Transport):
    def listen(self, address: Address, curve: Curve | None = None, **options) -> Listener:
        return ZmqListener(address, curve)

    def connect(self, addresses: Sequence[Address], curve: Curve | None = None, **options) -> Connection:
        return ZmqConnection(addresses, curve)
