"""UDP datagrams: the switch protocol's transport, batched.

One system call per datagram is what made the switch path slow: a Python
loop moves about 0.05 GB/s of 304-byte datagrams that way on a 2-core
machine, and 1.6-1.8 GB/s with UDP GSO/GRO. :class:`DatagramSocket` moves
many datagrams per call, with the best mechanism the kernel offers,
probed once when the socket opens:

* ``gso``: UDP GSO on send (one ``sendmsg`` of up to 64 equal segments,
  the segment size in a ``UDP_SEGMENT`` control message) and UDP GRO on
  receive (``recvmsg`` returns datagrams of one flow coalesced, their size
  in a ``UDP_GRO`` control message);
* ``mmsg``: ``sendmmsg``/``recvmmsg`` (through libc, :mod:`.mmsg`);
* ``plain``: one datagram per call.

``AGGNET_UDP_IO=gso|mmsg|plain`` forces one (tests, benchmarks). A GSO send
that the route refuses (``EIO``: no checksum offload on the device, as on
interfaces a software switch reads with pcap) moves the socket to ``mmsg``
for good, with one log line. Received datagrams land in one preallocated
arena and are described by three arrays (offset, length, source), so numba
kernels parse a whole batch in one call; peers are named by one integer
(IPv4 << 16 | port) that the kernels can compare.

Sockets set ``IP_PMTUDISC_DO``: a datagram larger than the path MTU fails
with ``EMSGSIZE`` instead of being fragmented, and :func:`path_mtu` tells
what fits before anything is sent.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import socket
import struct

import numba
import numpy as np

from aggnet.protocol.address import Address

log = logging.getLogger("aggnet.transport.udp")

#: socket buffers: a window of a few thousand packets in flight per peer
#: must fit, or the kernel drops what the protocol then has to retransmit
SOCKET_BUFFER = 16 << 20

SOL_UDP = 17
UDP_SEGMENT = 103
UDP_GRO = 104
#: as plain ints: socket's are IntFlag members, and an IntFlag's & costs a
#: microsecond or two in Python, once per received batch
_MSG_TRUNC = int(socket.MSG_TRUNC)
IP_MTU_DISCOVER = 10
IP_PMTUDISC_DO = 2
IP_MTU = 14
#: segments per GSO send: the kernel's UDP_MAX_SEGMENTS on older kernels
MAX_SEGMENTS = 64
#: bytes of UDP payload in one datagram (and so in one GSO send)
MAX_DATAGRAM = 65507
#: bytes one receive call may write (a GRO super-datagram is at most 64 KiB)
RECEIVE_CHUNK = 65536
#: bytes a receiver takes per batch before it processes and answers them
BATCH_BYTES = 256 << 10

IO_MODES = ("gso", "mmsg", "plain")
#: peers whose (ip, port) <-> key conversions are remembered
ADDRESS_CACHE = 4096


def addr_key(addr: tuple) -> int:
    """(ip, port) -> IPv4 << 16 | port."""
    return (struct.unpack("!I", socket.inet_aton(addr[0]))[0] << 16) | addr[1]


def key_addr(key: int) -> tuple:
    return socket.inet_ntoa(struct.pack("!I", key >> 16)), key & 0xFFFF


def open_udp(addr: Address | tuple, buffer_bytes: int = SOCKET_BUFFER) -> socket.socket:
    """A UDP socket bound to ``addr`` with large kernel buffers (forced
    above the sysctl limits when running as root), never fragmenting."""
    host, port = (addr.host, addr.port) if isinstance(addr, Address) else addr
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for opt, force in ((socket.SO_RCVBUF, 33), (socket.SO_SNDBUF, 32)):  # SO_RCVBUFFORCE, SO_SNDBUFFORCE
        try:
            s.setsockopt(socket.SOL_SOCKET, force, buffer_bytes)
        except OSError:
            s.setsockopt(socket.SOL_SOCKET, opt, buffer_bytes)
    try:
        s.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
    except OSError:
        pass
    try:
        s.bind((host, port))
    except OSError as exc:
        s.close()
        raise OSError(exc.errno, f"cannot bind UDP {host}:{port}: {exc.strerror}") from None
    return s


def path_mtu(dest: tuple) -> int:
    """The MTU of the route to ``dest`` (what the kernel would let a
    datagram to it grow to, plus the IP and UDP headers)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
        s.connect(dest)
        return s.getsockopt(socket.IPPROTO_IP, IP_MTU)
    except OSError:
        return 1500
    finally:
        s.close()


def _probe_gso(sock: socket.socket) -> bool:
    try:
        sock.setsockopt(SOL_UDP, UDP_GRO, 1)
    except OSError:
        return False
    try:
        # the send side is per call (a control message); check the option exists
        sock.setsockopt(SOL_UDP, UDP_SEGMENT, 0)
    except OSError:
        sock.setsockopt(SOL_UDP, UDP_GRO, 0)
        return False
    return True


def choose_io(sock: socket.socket, wanted: str | None = None) -> str:
    """The batching this socket gets: ``wanted`` (or ``AGGNET_UDP_IO``) when
    the kernel supports it, else the best available."""
    from aggnet.transport import mmsg

    wanted = wanted or os.environ.get("AGGNET_UDP_IO") or None
    if wanted is not None and wanted not in IO_MODES:
        raise ValueError(f"UDP I/O mode must be one of {IO_MODES}, got {wanted!r} (AGGNET_UDP_IO)")
    order = IO_MODES[IO_MODES.index(wanted):] if wanted else IO_MODES
    for mode in order:
        if mode == "gso" and _probe_gso(sock):
            return "gso"
        if mode == "mmsg" and mmsg.available():
            return "mmsg"
        if mode == "plain":
            return "plain"
    return "plain"


_logged_modes: set = set()


@numba.njit(cache=True, nogil=True)
def _split_segments(call_off, call_len, call_seg, call_src, calls, offsets, lengths, sources):
    """One record per datagram from one per receive call (a GRO run of
    equal segments, the last maybe shorter)."""
    n = 0
    for c in range(calls):
        pos = 0
        total = call_len[c]
        seg = call_seg[c]
        while pos < total:
            offsets[n] = call_off[c] + pos
            lengths[n] = min(seg, total - pos)
            sources[n] = call_src[c]
            n += 1
            pos += seg
    return n


class DatagramSocket:
    """A UDP socket that sends and receives batches of datagrams.

    Received datagrams are described by ``offsets``/``lengths``/``sources``
    (``count`` of them) over ``arena``; they stay valid until the next
    :meth:`receive`. Senders pass one contiguous buffer of equal segments.
    """

    def __init__(self, addr: Address | tuple, *, io: str | None = None, arena_bytes: int = 4 << 20,
                 max_datagrams: int = 8192, max_datagram_bytes: int = RECEIVE_CHUNK,
                 buffer_bytes: int = SOCKET_BUFFER):
        from aggnet.transport import mmsg

        self.sock = open_udp(addr, buffer_bytes)
        self.fd = self.sock.fileno()
        self.io = choose_io(self.sock, io)
        if self.io not in _logged_modes:
            _logged_modes.add(self.io)
            log.info("aggnet UDP I/O: %s (%s)", self.io, {"gso": "UDP GSO send, GRO receive",
                                                          "mmsg": "sendmmsg/recvmmsg",
                                                          "plain": "one datagram per system call"}[self.io])
        self.arena = np.zeros(max(arena_bytes, 2 * RECEIVE_CHUNK), np.uint8)
        self._arena_view = memoryview(self.arena)
        self.offsets = np.zeros(max_datagrams, np.int64)
        self.lengths = np.zeros(max_datagrams, np.int32)
        self.sources = np.zeros(max_datagrams, np.int64)
        self.count = 0
        self.max_datagram_bytes = max_datagram_bytes
        self._mmsg = mmsg.MMsg(MAX_SEGMENTS) if self.io in ("gso", "mmsg") and mmsg.available() else None
        self._mmsg_lengths = np.zeros(MAX_SEGMENTS, np.int32)
        calls = max(1, self.arena.size // 512)
        self._calls = (np.zeros(calls, np.int64), np.zeros(calls, np.int64), np.zeros(calls, np.int64),
                       np.zeros(calls, np.int64))
        self._mmsg_sources = np.zeros(MAX_SEGMENTS, np.int64)
        self._keys: dict = {}
        self._addrs: dict = {}
        self._gso_cmsg: dict = {}
        #: system calls and datagrams, both ways (benchmarks report them)
        self.send_calls = self.recv_calls = self.datagrams_sent = self.datagrams_received = 0
        #: datagrams larger than any of aggnet's, dropped on receipt (a
        #: receiver counts them among its drops: ``take_truncated``)
        self.datagrams_truncated = 0
        self.send_errors: dict = {}

    @property
    def address(self) -> tuple:
        return self.sock.getsockname()

    def close(self) -> None:
        self.sock.close()

    def key_of(self, addr: tuple) -> int:
        key = self._keys.get(addr)
        if key is None:
            if len(self._keys) >= ADDRESS_CACHE:
                self._keys.clear()  # a flood of sources must not grow it without bound
            key = self._keys[addr] = addr_key(addr)
        return key

    def addr_of(self, key: int) -> tuple:
        addr = self._addrs.get(key)
        if addr is None:
            if len(self._addrs) >= ADDRESS_CACHE:
                self._addrs.clear()
            addr = self._addrs[key] = key_addr(key)
        return addr

    # -- receive ---------------------------------------------------------------------

    def wait(self, timeout: float) -> bool:
        """Whether a datagram is queued within ``timeout``."""
        r, _, _ = select.select([self.sock], [], [], max(0.0, timeout))
        return bool(r)

    def receive(self, timeout: float = 0.0, max_bytes: int | None = None) -> int:
        """Wait up to ``timeout`` for datagrams, then take what is queued
        without blocking, until about ``max_bytes`` arrived (or the arena
        is full). A bounded batch keeps both ends of a window busy: a
        receiver that drained a whole window before answering would leave
        its peer idle meanwhile, and the window would move in lockstep."""
        self.count = 0
        if timeout > 0 and not self.wait(timeout):
            return 0
        budget = self.arena.size if max_bytes is None else max(1, max_bytes)
        if self.io == "gso":
            return self._receive_gro(budget)
        if self.io == "mmsg":
            return self._receive_mmsg(budget)
        return self._receive_plain(budget)

    def _receive_gro(self, budget: int) -> int:
        sock, view = self.sock, self._arena_view
        calls_off, calls_len, calls_seg, calls_src = self._calls
        space = socket.CMSG_SPACE(4)
        max_calls = min(calls_off.size, self.offsets.size // MAX_SEGMENTS)
        off = c = got = 0
        limit = self.arena.size
        while off + RECEIVE_CHUNK <= limit and c < max_calls and got < budget:
            try:
                nbytes, anc, flags, addr = sock.recvmsg_into([view[off:off + RECEIVE_CHUNK]], space,
                                                             socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno in (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH):
                    continue  # an ICMP error from an earlier send: not a datagram
                raise
            if flags & _MSG_TRUNC:
                self.datagrams_truncated += 1
                continue
            seg = nbytes
            if anc:
                level, kind, data = anc[0]
                if level == SOL_UDP and kind == UDP_GRO and len(data) >= 4:
                    seg = struct.unpack_from("i", data)[0] or nbytes
            calls_off[c], calls_len[c], calls_seg[c], calls_src[c] = off, nbytes, seg, self.key_of(addr)
            c += 1
            got += nbytes
            # keep each coalesced run 8-byte aligned for the kernels' wide loads
            off += (nbytes + 7) & ~7
        self.recv_calls += c
        n = _split_segments(calls_off, calls_len, calls_seg, calls_src, c, self.offsets, self.lengths, self.sources)
        self.count = n
        self.datagrams_received += n
        return n

    def _receive_mmsg(self, budget: int) -> int:
        mm, offsets, lengths, sources = self._mmsg, self.offsets, self.lengths, self.sources
        slot = (self.max_datagram_bytes + 7) & ~7
        off = n = received = 0
        limit = self.arena.size
        while received < budget:
            room = min((limit - off) // slot, offsets.size - n, MAX_SEGMENTS)
            if room <= 0:
                break
            got = mm.recv(self.fd, self.arena[off:], slot, room, self._mmsg_lengths, self._mmsg_sources)
            self.recv_calls += 1
            if got <= 0:
                break
            lens = self._mmsg_lengths[:got]
            keep = np.flatnonzero(lens >= 0)  # truncated ones (-1) are larger than any datagram of ours
            k = keep.size
            self.datagrams_truncated += got - k
            offsets[n:n + k] = off + keep * slot
            lengths[n:n + k] = lens[keep]
            sources[n:n + k] = self._mmsg_sources[:got][keep]
            n += k
            received += int(lens[keep].sum())
            off += got * slot
            if got < room:
                break
        self.count = n
        self.datagrams_received += n
        return n

    def _receive_plain(self, budget: int) -> int:
        sock, view, offsets, lengths, sources = self.sock, self._arena_view, self.offsets, self.lengths, self.sources
        size = (self.max_datagram_bytes + 7) & ~7
        off = n = got = 0
        limit = self.arena.size
        while off + size <= limit and n < offsets.size and got < budget:
            try:
                # recvmsg says when a datagram did not fit: recvfrom would
                # hand on its first bytes as a datagram of the largest size
                nbytes, _, flags, addr = sock.recvmsg_into([view[off:off + size]], 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno in (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH):
                    continue
                raise
            self.recv_calls += 1
            if flags & _MSG_TRUNC or nbytes > self.max_datagram_bytes:
                self.datagrams_truncated += 1
                continue
            offsets[n], lengths[n], sources[n] = off, nbytes, self.key_of(addr)
            got += nbytes
            n += 1
            off += size
        self.count = n
        self.datagrams_received += n
        return n

    def take_truncated(self) -> int:
        """Datagrams dropped as too large since the last call."""
        n, self.datagrams_truncated = self.datagrams_truncated, 0
        return n

    def datagram(self, i: int) -> memoryview:
        off = int(self.offsets[i])
        return self._arena_view[off:off + int(self.lengths[i])]

    # -- send ------------------------------------------------------------------------

    def send_segments(self, buf: np.ndarray, seg: int, nbytes: int, dest) -> int:
        """Send ``buf[:nbytes]`` as datagrams of ``seg`` bytes (the last may
        be shorter) to ``dest`` ((ip, port) or a key); returns how many the
        kernel took (a full buffer or an ICMP error loses the rest, which
        the protocol retransmits)."""
        if nbytes <= 0:
            return 0
        if not isinstance(dest, tuple):
            dest = self.addr_of(int(dest))
        total = -(-nbytes // seg)
        if self.io == "gso" and total > 1:
            sent = self._send_gso(buf, seg, nbytes, dest)
            if sent is not None:
                return sent
        if self.io in ("gso", "mmsg") and total > 1:
            try:
                sent = self._mmsg.send(self.fd, buf, seg, nbytes, dest)
            except OSError as exc:
                self._count_error(exc)
                sent = 0
            self.send_calls += -(-total // MAX_SEGMENTS)
            self.datagrams_sent += sent
            return sent
        return self._send_plain(buf, seg, nbytes, dest)

    def _send_gso(self, buf, seg: int, nbytes: int, dest) -> int | None:
        per_call = max(1, min(MAX_SEGMENTS, MAX_DATAGRAM // seg)) * seg
        cmsg = self._gso_cmsg.get(seg)
        if cmsg is None:
            cmsg = self._gso_cmsg[seg] = [(SOL_UDP, UDP_SEGMENT, struct.pack("H", seg))]
        view = memoryview(buf)
        sent = 0
        pos = 0
        while pos < nbytes:
            end = min(nbytes, pos + per_call)
            try:
                self.sock.sendmsg([view[pos:end]], cmsg, 0, dest)
            except OSError as exc:
                if exc.errno in (errno.EIO, errno.EINVAL, errno.EOPNOTSUPP) and sent == 0:
                    # the route's device cannot checksum segments: batch another way
                    log.warning("aggnet UDP I/O: GSO refused towards %s:%d (%s); using %s from now on", *dest,
                                exc.strerror, "sendmmsg" if self._mmsg is not None else "one call per datagram")
                    self.io = "mmsg" if self._mmsg is not None else "plain"
                    return None
                self._count_error(exc)
                break
            self.send_calls += 1
            sent += -(-(end - pos) // seg)
            pos = end
        self.datagrams_sent += sent
        return sent

    def _send_plain(self, buf, seg: int, nbytes: int, dest) -> int:
        view = memoryview(buf)
        sent = 0
        for pos in range(0, nbytes, seg):
            try:
                self.sock.sendto(view[pos:min(nbytes, pos + seg)], dest)
            except OSError as exc:
                self._count_error(exc)
                continue
            sent += 1
        self.send_calls += -(-nbytes // seg)
        self.datagrams_sent += sent
        return sent

    def send(self, data, dest) -> bool:
        """One datagram (control messages)."""
        if not isinstance(dest, tuple):
            dest = self.addr_of(int(dest))
        try:
            self.sock.sendto(data, dest)
        except OSError as exc:
            self._count_error(exc)
            return False
        self.send_calls += 1
        self.datagrams_sent += 1
        return True

    def _count_error(self, exc: OSError) -> None:
        name = errno.errorcode.get(exc.errno, str(exc.errno))
        self.send_errors[name] = self.send_errors.get(name, 0) + 1
        if exc.errno == errno.EMSGSIZE:
            raise OSError(exc.errno, "a datagram is larger than the path MTU allows (and aggnet never "
                                     "fragments): use fewer elements per packet or raise the MTU") from None
