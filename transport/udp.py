"""UDP datagrams: the switch protocol's transport.

Datagram endpoints for workers and for aggregators in switch mode, with the
batching Python allows: receives drain everything queued into preallocated
packet buffers (no per-packet allocation), and peers are named by one
integer (IPv4 << 16 | port) so the numba data path can compare them.
"""

from __future__ import annotations

import errno
import select
import socket
import struct

import numpy as np

from ..address import Address

#: socket buffers: a window of a few hundred packets in flight per peer
#: must fit, or the kernel drops what the protocol then has to retransmit
SOCKET_BUFFER = 8 << 20


def addr_key(addr: tuple) -> int:
    """(ip, port) -> IPv4 << 16 | port."""
    return (struct.unpack("!I", socket.inet_aton(addr[0]))[0] << 16) | addr[1]


def key_addr(key: int) -> tuple:
    return socket.inet_ntoa(struct.pack("!I", key >> 16)), key & 0xFFFF


def open_udp(addr: Address | tuple, buffer_bytes: int = SOCKET_BUFFER) -> socket.socket:
    """A UDP socket bound to ``addr`` with large kernel buffers (forced
    above the sysctl limits when running as root)."""
    host, port = (addr.host, addr.port) if isinstance(addr, Address) else addr
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for opt, force in ((socket.SO_RCVBUF, 33), (socket.SO_SNDBUF, 32)):  # SO_RCVBUFFORCE, SO_SNDBUFFORCE
        try:
            s.setsockopt(socket.SOL_SOCKET, force, buffer_bytes)
        except OSError:
            s.setsockopt(socket.SOL_SOCKET, opt, buffer_bytes)
    try:
        s.bind((host, port))
    except OSError as exc:
        s.close()
        raise OSError(f"cannot bind UDP {host}:{port}: {exc.strerror}") from None
    return s


class PacketBatch:
    """Preallocated buffers for up to ``capacity`` datagrams of ``mtu``
    bytes, their lengths and their sources."""

    def __init__(self, capacity: int, mtu: int):
        self.capacity = capacity
        self.mtu = mtu
        self.data = np.zeros((capacity, mtu), np.uint8)
        self.lengths = np.zeros(capacity, np.int32)
        self.sources = np.zeros(capacity, np.int64)
        self.views = [memoryview(self.data[i]) for i in range(capacity)]
        self.count = 0
        self._keys: dict = {}
        self.addrs: list = [None] * capacity

    def receive(self, sock: socket.socket, timeout: float) -> int:
        """Wait up to ``timeout`` for a datagram, then take every queued one
        (up to capacity) without blocking."""
        n = 0
        if timeout > 0:
            r, _, _ = select.select([sock], [], [], timeout)
            if not r:
                self.count = 0
                return 0
        views, lengths, sources, keys, addrs = self.views, self.lengths, self.sources, self._keys, self.addrs
        while n < self.capacity:
            try:
                nbytes, addr = sock.recvfrom_into(views[n], self.mtu, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno in (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH):
                    continue  # an ICMP error from an earlier send: not a datagram
                raise
            lengths[n] = nbytes
            key = keys.get(addr)
            if key is None:
                key = keys[addr] = addr_key(addr)
            sources[n] = key
            addrs[n] = addr
            n += 1
        self.count = n
        return n
