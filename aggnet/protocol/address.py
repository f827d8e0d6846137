"""Addresses as URLs, parsed in this one module.

``tcp://host:port`` (plain sockets), ``zmq+tcp://host:port``,
``zmq+ipc:///path``, ``shm:///path`` (shared-memory payloads with an ipc
control socket), ``udp://host:port`` (the switch protocol),
``ucx://host:port`` and ``inproc://name`` (one process, tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

#: every scheme aggnet knows, with what it is for; an unknown scheme fails
#: with this list.
SCHEMES = {
    "tcp": "plain TCP to an aggregator service, no ZeroMQ between (no encryption)",
    "zmq+tcp": "ZeroMQ over TCP",
    "zmq+ipc": "ZeroMQ over a Unix socket",
    "shm": "shared-memory payloads, ZeroMQ ipc control (same host only)",
    "udp": "UDP datagrams (the switch protocol)",
    "ucx": "UCX (RDMA where the fabric has it)",
    "inproc": "in-process (tests)",
}


class AddressError(ValueError):
    pass


#: hosts that mean "every interface" when a service listens on them. In an
#: address a service hands out (its shard map) they mean "the host you
#: reached me at": a listener on 0.0.0.0 cannot know which of its addresses
#: a worker can reach, the worker can (see :func:`reached_via`).
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "*", ""})


@dataclass(frozen=True)
class Address:
    scheme: str
    host: str = ""
    port: int = 0
    path: str = ""

    def __str__(self) -> str:
        if self.scheme in ("zmq+ipc", "shm"):
            return f"{self.scheme}://{self.path}"
        if self.scheme == "inproc":
            return f"inproc://{self.path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    def with_port(self, port: int) -> "Address":
        return Address(self.scheme, self.host, port, self.path)

    def with_path(self, path: str) -> "Address":
        return Address(self.scheme, self.host, self.port, path)

    @property
    def is_local_only(self) -> bool:
        return self.scheme in ("zmq+ipc", "shm", "inproc")

    @property
    def is_wildcard(self) -> bool:
        """A network address on every interface (0.0.0.0, [::], *)."""
        return not self.is_local_only and self.host in WILDCARD_HOSTS

    def with_host(self, host: str) -> "Address":
        return Address(self.scheme, host, self.port, self.path)


def reached_via(advertised: "str | Address", control: "str | Address") -> Address:
    """Where a worker that reached a service's control endpoint at
    ``control`` finds a shard the service advertised as ``advertised``: a
    wildcard host is replaced by the control endpoint's host (the one
    address of the service this worker is known to reach); any other
    address is taken as given (``aggnet serve --advertise HOST``)."""
    shard, via = parse(advertised), parse(control)
    if shard.is_wildcard and not via.is_local_only:
        return shard.with_host(via.host)
    return shard


def advertised_as(listening: "str | Address", advertise: str | None) -> Address:
    """The address a service lists for a socket bound at ``listening``:
    with ``advertise`` (a host name or IP) that host, else the bound address
    (a wildcard there is resolved by each worker, see :func:`reached_via`)."""
    addr = parse(listening)
    if advertise and not addr.is_local_only:
        return addr.with_host(advertise.strip("[]"))
    return addr


def parse(url: str | Address) -> Address:
    """Parse ``url``; raise :class:`AddressError` naming the problem and the
    known schemes."""
    if isinstance(url, Address):
        return url
    if not isinstance(url, str) or "://" not in url:
        raise AddressError(f"address {url!r} is not a URL like zmq+tcp://host:port; known schemes: {_known()}")
    scheme, rest = url.split("://", 1)
    scheme = scheme.lower()
    if scheme not in SCHEMES:
        raise AddressError(f"unknown address scheme {scheme!r} in {url!r}; known schemes: {_known()}")
    if scheme in ("zmq+ipc", "shm"):
        if not rest.startswith("/"):
            raise AddressError(f"{url!r}: {scheme} needs an absolute path, e.g. {scheme}:///tmp/aggnet.sock")
        return Address(scheme, path=rest)
    if scheme == "inproc":
        if not rest:
            raise AddressError(f"{url!r}: inproc needs a name, e.g. inproc://agg")
        return Address(scheme, path=rest)
    parts = urlsplit(f"//{rest}")
    try:
        port = parts.port
    except ValueError:
        raise AddressError(f"{url!r}: port must be a number from 0 to 65535") from None
    if not parts.hostname or port is None:
        raise AddressError(f"{url!r}: {scheme} needs host and port, e.g. {scheme}://127.0.0.1:5555")
    return Address(scheme, host=parts.hostname, port=port)


def _known() -> str:
    return ", ".join(SCHEMES)
