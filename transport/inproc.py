"""In-process transport: queues between threads of one process.

The fast, switchless default for tests: the whole client and aggregator run
in one process with no sockets. Payloads are copied on send, as a socket
would, so a sender may reuse its buffer at once.
"""

from __future__ import annotations

import queue
import threading
from typing import Sequence

from aggnet.protocol.address import Address
from aggnet.transport.base import Connection, Incoming, Listener, Transport, TransportError

_registry: dict[str, "InprocListener"] = {}
_lock = threading.Lock()
_WAKE = object()


def _copy(payload) -> memoryview | None:
    return None if payload is None else memoryview(bytes(payload))


class _Inbox:
    """A connection's receive queue; the listener's handle to reply."""

    __slots__ = ("queue", "open", "__weakref__")

    def __init__(self):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.open = True


class InprocListener(Listener):
    def __init__(self, addr: Address):
        self.address = addr
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        with _lock:
            if addr.path in _registry:
                raise TransportError(f"cannot listen on {addr}: the name is taken in this process")
            _registry[addr.path] = self

    def recv(self, timeout: float) -> Incoming | None:
        try:
            return self._queue.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return None

    def send(self, peer: _Inbox, header: bytes, payload=None) -> bool:
        if not peer.open:
            return False
        peer.queue.put(Incoming(self.address.path, bytes(header), _copy(payload) or memoryview(b"")))
        return True

    def deliver(self, item: Incoming) -> None:
        self._queue.put(item)

    def close(self) -> None:
        with _lock:
            if _registry.get(self.address.path) is self:
                del _registry[self.address.path]


class InprocConnection(Connection):
    def __init__(self, addrs: Sequence[Address]):
        self.addresses = list(addrs)
        self._inbox = _Inbox()
        self._index = {a.path: i for i, a in enumerate(self.addresses)}

    def _listener(self, endpoint: int) -> InprocListener | None:
        addr = self.addresses[endpoint]
        with _lock:
            lst = _registry.get(addr.path)
        if lst is None:
            # like a datagram to a closed port: the message is lost and the
            # sender's timeout reports it
            return None
        return lst

    def send(self, endpoint: int, header: bytes, payload=None) -> None:
        lst = self._listener(endpoint)
        if lst is not None:
            lst.deliver(Incoming(self._inbox, bytes(header), _copy(payload) or memoryview(b"")))

    def recv(self, timeout: float) -> Incoming | None:
        try:
            item = self._inbox.queue.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return None
        if item is _WAKE:
            return None
        item.peer = self._index[item.peer]
        return item

    def wakeup(self) -> None:
        self._inbox.queue.put(_WAKE)

    def close(self) -> None:
        self._inbox.open = False


class InprocTransport(Transport):
    def listen(self, address: Address, **options) -> Listener:
        return InprocListener(address)

    def connect(self, addresses: Sequence[Address], **options) -> Connection:
        return InprocConnection(addresses)
