"""Batched UDP I/O through ``sendmmsg(2)``/``recvmmsg(2)``, IPv4 only.

The datagram engine (:mod:`.udp`) falls back to this where UDP GSO/GRO is
missing or refused (a route whose device cannot checksum segments): still
one system call for up to ``capacity`` datagrams, but each datagram is its
own message, so nothing needs the kernel to split or coalesce.

Python's ``socket`` module has no binding for either call, so they are
reached through libc with ctypes. The message headers, I/O vectors and
addresses are ctypes arrays allocated once per :class:`MMsg`; their fields
are also exposed as strided NumPy views, so filling in a batch before the
call and reading lengths and sources after it are a few vector operations
instead of a Python loop over datagrams.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import socket
import struct
import sys

import numpy as np

__all__ = ["available", "MMsg"]

MSG_DONTWAIT = 0x40
MSG_TRUNC = 0x20
AF_INET = 2

#: errors an ICMP message from an earlier datagram leaves on a socket; they
#: say nothing about the call that reports them
_ICMP_ERRORS = (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH)


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class _MsgHdr(ctypes.Structure):
    # ctypes pads like the C compiler does, so the x86_64 holes after
    # msg_namelen and msg_flags come out where glibc's struct msghdr has them
    _fields_ = [
        ("msg_name", ctypes.c_void_p),
        ("msg_namelen", ctypes.c_uint32),
        ("msg_iov", ctypes.c_void_p),
        ("msg_iovlen", ctypes.c_size_t),
        ("msg_control", ctypes.c_void_p),
        ("msg_controllen", ctypes.c_size_t),
        ("msg_flags", ctypes.c_int),
    ]


class _MMsgHdr(ctypes.Structure):
    _fields_ = [("msg_hdr", _MsgHdr), ("msg_len", ctypes.c_uint)]


class _SockAddrIn(ctypes.Structure):
    _fields_ = [
        ("sin_family", ctypes.c_uint16),
        ("sin_port", ctypes.c_uint16),  # network byte order
        ("sin_addr", ctypes.c_uint32),  # network byte order
        ("sin_zero", ctypes.c_ubyte * 8),
    ]


_SOCKADDR_IN_SIZE = ctypes.sizeof(_SockAddrIn)
# NumPy dtypes of the same width as the C fields, for the strided views
_UINTP = np.dtype(np.uintp)
_SIZE_T = np.dtype(f"u{ctypes.sizeof(ctypes.c_size_t)}")

_libc = None
_loaded = False


def _load():
    """libc's two functions with their prototypes, or ``None``; loaded on
    first use so that importing the module does nothing."""
    global _libc, _loaded
    if _loaded:
        return _libc
    _loaded = True
    if not sys.platform.startswith("linux"):
        return None
    try:
        try:
            lib = ctypes.CDLL(None, use_errno=True)
            lib.sendmmsg, lib.recvmmsg  # noqa: B018
        except (OSError, AttributeError):
            name = ctypes.util.find_library("c")
            if name is None:
                return None
            lib = ctypes.CDLL(name, use_errno=True)
        send, recv = lib.sendmmsg, lib.recvmmsg
    except (OSError, AttributeError):
        return None
    # addresses are passed as plain integers: no per-call byref objects
    send.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int]
    send.restype = ctypes.c_int
    recv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int, ctypes.c_void_p]
    recv.restype = ctypes.c_int
    _libc = (send, recv)
    return _libc


def available() -> bool:
    """Whether libc offers ``sendmmsg`` and ``recvmmsg`` (Linux)."""
    try:
        return _load() is not None
    except Exception:
        return False


def _field(raw: np.ndarray, count: int, stride: int, offset: int, dtype) -> np.ndarray:
    """A writable NumPy view of one field of each of ``count`` structs."""
    return np.ndarray((count,), dtype=dtype, buffer=raw, offset=offset, strides=(stride,))


def _buffer_address(buf, writable: bool) -> tuple[int, int, object]:
    """(address, size in bytes, object to keep alive for the call)."""
    arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, np.uint8)
    if not arr.flags.c_contiguous:
        raise ValueError("the buffer must be C-contiguous")
    if writable and not arr.flags.writeable:
        raise ValueError("the receive buffer must be writable")
    return arr.__array_interface__["data"][0], arr.nbytes, arr


class _Batch:
    """One array of ``capacity`` message headers, each with one I/O vector
    and one address slot, plus NumPy views of the fields set per call."""

    def __init__(self, capacity: int):
        self.hdrs = (_MMsgHdr * capacity)()
        self.iovs = (_IOVec * capacity)()
        self.names = (_SockAddrIn * capacity)()
        self.address = ctypes.addressof(self.hdrs)
        hdr_raw = np.frombuffer(self.hdrs, np.uint8)
        iov_raw = np.frombuffer(self.iovs, np.uint8)
        name_raw = np.frombuffer(self.names, np.uint8)
        hs, is_, ns = ctypes.sizeof(_MMsgHdr), ctypes.sizeof(_IOVec), _SOCKADDR_IN_SIZE
        off = _MMsgHdr.msg_hdr.offset
        self.msg_name = _field(hdr_raw, capacity, hs, off + _MsgHdr.msg_name.offset, _UINTP)
        self.msg_namelen = _field(hdr_raw, capacity, hs, off + _MsgHdr.msg_namelen.offset, np.uint32)
        self.msg_flags = _field(hdr_raw, capacity, hs, off + _MsgHdr.msg_flags.offset, np.int32)
        self.msg_len = _field(hdr_raw, capacity, hs, _MMsgHdr.msg_len.offset, np.uint32)
        self.iov_base = _field(iov_raw, capacity, is_, _IOVec.iov_base.offset, _UINTP)
        self.iov_len = _field(iov_raw, capacity, is_, _IOVec.iov_len.offset, _SIZE_T)
        # addresses as the kernel writes them, read in network byte order
        self.sin_port = _field(name_raw, capacity, ns, _SockAddrIn.sin_port.offset, np.dtype(">u2"))
        self.sin_addr = _field(name_raw, capacity, ns, _SockAddrIn.sin_addr.offset, np.dtype(">u4"))
        iov0, name0 = ctypes.addressof(self.iovs), ctypes.addressof(self.names)
        _field(hdr_raw, capacity, hs, off + _MsgHdr.msg_iov.offset, _UINTP)[:] = (
            iov0 + np.arange(capacity, dtype=_UINTP) * is_)
        _field(hdr_raw, capacity, hs, off + _MsgHdr.msg_iovlen.offset, _SIZE_T)[:] = 1
        self.name_addresses = name0 + np.arange(capacity, dtype=_UINTP) * ns


class MMsg:
    """Preallocated mmsghdr/iovec/sockaddr_in arrays for up to `capacity` datagrams per call.

    Send and receive keep separate header arrays: the kernel writes lengths,
    flags and address lengths into a received batch, and keeping those out
    of the send headers lets what a send set up (buffer, segment size,
    destination) stay valid for the next send. Not safe to share between
    threads.
    """

    def __init__(self, capacity: int = 64):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity!r}")
        if _load() is None:
            raise OSError(errno.ENOSYS, "sendmmsg/recvmmsg are not available from libc on this system")
        self.capacity = capacity
        self._sendmmsg, self._recvmmsg = _libc
        self._tx = _Batch(capacity)
        self._rx = _Batch(capacity)
        self._rx.msg_name[:] = self._rx.name_addresses
        # one destination for the whole batch: every send header names slot 0
        self._dest_ptr = int(self._tx.name_addresses[0])
        self._dest_name = self._tx.names[0]
        self._dest_key: object = False  # nothing set yet (None means connected)
        self._steps_seg = -1
        self._steps = np.zeros(capacity, _UINTP)
        self._index = np.arange(capacity, dtype=_UINTP)
        self._tx_layout: tuple | None = None
        self._rx_layout: tuple | None = None

    # -- send ------------------------------------------------------------------------

    def _set_dest(self, dest) -> None:
        if type(dest) is type(self._dest_key) and dest == self._dest_key:
            return
        tx = self._tx
        if dest is None:
            tx.msg_name[:] = 0
            tx.msg_namelen[:] = 0
        else:
            if isinstance(dest, tuple):
                host, port = dest[0], int(dest[1])
                ip = struct.unpack("!I", socket.inet_aton(host))[0]
            else:
                key = int(dest)
                ip, port = key >> 16, key & 0xFFFF
            if not (0 <= ip <= 0xFFFFFFFF and 0 <= port <= 0xFFFF):
                raise ValueError(f"not an IPv4 destination: {dest!r}")
            name = self._dest_name
            name.sin_family = AF_INET
            name.sin_port = socket.htons(port)
            name.sin_addr = socket.htonl(ip)
            tx.msg_name[:] = self._dest_ptr
            tx.msg_namelen[:] = _SOCKADDR_IN_SIZE
        self._dest_key = dest

    def send(self, fd: int, buf, seg: int, nbytes: int, dest: tuple[str, int] | int | None) -> int:
        """Send bytes buf[0:nbytes] as ceil(nbytes/seg) datagrams of `seg` bytes each (the last may be shorter).

        One ``sendmmsg`` per ``capacity`` datagrams. Returns how many the
        kernel took: a full socket buffer (``EAGAIN``, ``ENOBUFS``) ends the
        send early rather than raising, since the protocol above resends
        what is lost anyway. An ``ECONNREFUSED`` left by an earlier
        datagram's ICMP error is not about this send: the call is tried
        once more before giving up with the count so far. Other errors
        raise ``OSError``. Blocking follows the socket's own mode.
        """
        if nbytes <= 0:
            return 0
        if seg <= 0:
            raise ValueError(f"segment size must be positive, got {seg!r}")
        addr, size, _keep = _buffer_address(buf, writable=False)
        if nbytes > size:
            raise ValueError(f"nbytes {nbytes} exceeds the buffer's {size} bytes")
        self._set_dest(dest)
        tx, cap = self._tx, self.capacity
        if seg != self._steps_seg:
            np.multiply(self._index, seg, out=self._steps)
            self._steps_seg = seg
        total = -(-nbytes // seg)
        sent = 0
        retried = False
        while sent < total:
            k = min(cap, total - sent)
            pos = sent * seg
            last = min(seg, nbytes - pos - (k - 1) * seg)
            layout = (addr, seg, pos, k, last)
            if layout != self._tx_layout:
                np.add(self._steps[:k], addr + pos, out=tx.iov_base[:k])
                tx.iov_len[:k] = seg
                tx.iov_len[k - 1] = last
                self._tx_layout = layout
            got = self._sendmmsg(fd, tx.address, k, 0)
            if got < 0:
                err = ctypes.get_errno()
                if err == errno.EINTR:
                    continue
                if err in (errno.EAGAIN, errno.ENOBUFS):
                    break
                if err == errno.ECONNREFUSED:
                    if retried:
                        break
                    retried = True
                    continue
                raise OSError(err, f"sendmmsg: {os.strerror(err)}")
            if got == 0:
                break
            sent += got
            retried = False
        return sent

    # -- receive ---------------------------------------------------------------------

    def recv(self, fd: int, arena, slot_bytes: int, max_msgs: int, lengths, sources) -> int:
        """Take up to min(max_msgs, capacity, arena.size // slot_bytes) queued datagrams without blocking.

        Datagram i lands at ``arena[i*slot_bytes:]``; ``lengths[i]`` gets
        its size, or -1 where it was longer than a slot and so arrived cut
        (the caller drops it), and ``sources[i]`` its sender as
        ``IPv4 << 16 | port``. Returns the count, 0 when nothing is queued.
        An ICMP error an earlier send left on the socket is not a
        datagram: the call is tried once more, then 0 is returned.
        """
        if slot_bytes <= 0:
            raise ValueError(f"slot size must be positive, got {slot_bytes!r}")
        addr, size, _keep = _buffer_address(arena, writable=True)
        n = min(max_msgs, self.capacity, size // slot_bytes, len(lengths), len(sources))
        if n <= 0:
            return 0
        rx = self._rx
        layout = (addr, slot_bytes)
        if layout != self._rx_layout:
            np.multiply(self._index, slot_bytes, out=rx.iov_base)
            rx.iov_base += addr
            rx.iov_len[:] = slot_bytes
            self._rx_layout = layout
        retried = False
        while True:
            # the kernel writes back each address's length: restore the room
            rx.msg_namelen[:n] = _SOCKADDR_IN_SIZE
            got = self._recvmmsg(fd, rx.address, n, MSG_DONTWAIT, None)
            if got >= 0:
                break
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            if err in (errno.EAGAIN, errno.EWOULDBLOCK):
                return 0
            if err in _ICMP_ERRORS:
                if retried:
                    return 0
                retried = True
                continue
            raise OSError(err, f"recvmmsg: {os.strerror(err)}")
        if got == 0:
            return 0
        out = lengths[:got]
        np.copyto(out, rx.msg_len[:got], casting="unsafe")
        out[(rx.msg_flags[:got] & MSG_TRUNC) != 0] = -1
        src = sources[:got]
        np.copyto(src, rx.sin_addr[:got], casting="unsafe")
        src <<= 16
        src |= rx.sin_port[:got]
        return got
