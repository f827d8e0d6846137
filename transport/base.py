"""The transport interface: how aggnet messages move, whatever carries them.

A message is a 48-byte header (:mod:`aggnet.protocol.wire`) and an optional payload
buffer. Servers (aggregator shards) hold a :class:`Listener`; clients hold a
:class:`Connection` to every endpoint of a service. Transports are chosen by
address scheme through :func:`listen` and :func:`connect`; each lives in its
own module, imported only when its scheme is used so that heavy optional
dependencies (ucxx) load only for those who ask.
"""

from __future__ import annotations

import importlib
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Sequence

from aggnet.protocol.address import SCHEMES, Address, AddressError, parse


class TransportError(ConnectionError):
    """A transport could not do what it was asked (bind, connect, send)."""


@dataclass(slots=True)
class Incoming:
    """One received message. ``peer`` identifies the sender to reply to (a
    listener) or the endpoint index it came from (a connection). ``payload``
    may point into transport-owned memory: use it before the next ``recv``."""

    peer: Any
    header: Any
    payload: Any


class Listener(ABC):
    """The server end of a transport: receives from many peers, replies to
    any of them."""

    address: Address

    @abstractmethod
    def recv(self, timeout: float) -> Incoming | None:
        """The next message, or None after ``timeout`` seconds."""

    @abstractmethod
    def send(self, peer: Any, header: bytes, payload=None) -> bool:
        """Send to ``peer``; False if the peer is gone (the message is dropped)."""

    def wait(self, timeout: float, connections=()) -> None:
        """Return once this listener or one of ``connections`` may have a
        message, or after ``timeout`` seconds: a shard that also talks to a
        parent sleeps on both. Transports without a joint poll look often."""
        time.sleep(min(timeout, 0.001))

    def gone(self) -> list:
        """Peers whose connection closed since the last call (a worker that
        died without LEAVE), where the transport can tell; [] otherwise."""
        return []

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Connection(ABC):
    """The client end: connected to endpoints ``0..n-1`` of a service."""

    addresses: list[Address]

    @abstractmethod
    def send(self, endpoint: int, header: bytes, payload=None) -> None: ...

    @abstractmethod
    def recv(self, timeout: float) -> Incoming | None:
        """The next message from any endpoint (``peer`` is its index), or
        None after ``timeout`` seconds or on :meth:`wakeup`."""

    @abstractmethod
    def wakeup(self) -> None:
        """Make a blocked :meth:`recv` return early; safe from any thread."""

    def poll_items(self) -> list:
        """What a listener's joint wait polls for this connection's
        messages (ZeroMQ sockets, descriptors); [] where it cannot."""
        return []

    def gone(self) -> list[int]:
        """Endpoints whose connection closed since the last call (an
        aggregator shard that died; it may be back on the same address),
        where the transport can tell; [] otherwise."""
        return []

    def refused(self) -> dict[int, str]:
        """Endpoints whose security handshake failed, and why in words a
        user can act on (a missing or wrong key); no wait makes those
        answer. {} where the transport cannot tell."""
        return {}

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def wait_jointly(owner, own, timeout: float, connections) -> None:
    """Sleep until ``own`` (a listener's socket or descriptor) or one of
    ``connections`` may have a message, or ``timeout`` seconds pass: a
    rack's shard sleeps on its workers and its parent at once. The poller
    is kept on ``owner`` while the set it polls stays the same."""
    import zmq

    items = [own]
    for c in connections:
        if getattr(c, "_ready", None):
            return
        items.extend(c.poll_items())
    if getattr(owner, "_wait_key", None) != items:
        owner._wait_poller = zmq.Poller()
        for item in items:
            owner._wait_poller.register(item, zmq.POLLIN)
        owner._wait_key = items
    owner._wait_poller.poll(max(0, int(timeout * 1000)))


class Transport(ABC):
    @abstractmethod
    def listen(self, address: Address, **options) -> Listener: ...

    @abstractmethod
    def connect(self, addresses: Sequence[Address], **options) -> Connection: ...


#: scheme -> "module:class", imported on first use. ``udp://`` is not
#: here on purpose: the switch protocol is not a stream of messages to
#: endpoints but datagrams batched by the hundred per system call, parsed
#: and built in place by numba kernels over one arena (transport/udp.py,
#: transport/mmsg.py), sent to a P4 switch that answers what it receives
#: and nothing else. A Connection's one-message-per-call interface would
#: cost that path its batching; the switch client and switch-mode hosts
#: use :class:`aggnet.transport.udp.DatagramSocket` directly instead.
_BACKENDS = {
    "tcp": "aggnet.transport.tcp:TcpTransport",
    "zmq+tcp": "aggnet.transport.zmq:ZmqTransport",
    "zmq+ipc": "aggnet.transport.zmq:ZmqTransport",
    "shm": "aggnet.transport.zmq:ZmqTransport",
    "inproc": "aggnet.transport.inproc:InprocTransport",
    "ucx": "aggnet.transport.ucx:UcxTransport",
}
_loaded: dict[str, Transport] = {}


def transport_for(scheme: str) -> Transport:
    if scheme not in _BACKENDS:
        served = ", ".join(_BACKENDS)
        known = ", ".join(SCHEMES)
        raise AddressError(
            f"scheme {scheme!r} has no message transport; transports exist for: {served} (all schemes: {known})"
        )
    target = _BACKENDS[scheme]
    if target not in _loaded:
        module, cls = target.split(":")
        _loaded[target] = getattr(importlib.import_module(module), cls)()
    return _loaded[target]


def listen(address: str | Address, **options) -> Listener:
    addr = parse(address)
    return transport_for(addr.scheme).listen(addr, **options)


def connect(addresses: Sequence[str | Address], **options) -> Connection:
    addrs = [parse(a) for a in addresses]
    if not addrs:
        raise ValueError("connect needs at least one address")
    schemes = {a.scheme for a in addrs}
    if len(schemes) != 1:
        raise AddressError(f"one connection cannot mix schemes {sorted(schemes)}")
    return transport_for(addrs[0].scheme).connect(addrs, **options)
