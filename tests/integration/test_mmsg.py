"""sendmmsg/recvmmsg batches over real sockets on 127.0.0.1."""

import ctypes
import errno
import select
import socket
import time

import numpy as np
import pytest

from aggnet.transport import mmsg
from aggnet.transport.udp import addr_key

pytestmark = pytest.mark.skipif(not mmsg.available(), reason="libc has no sendmmsg/recvmmsg (not Linux)")

SEG = 304
SLOT = 512


@pytest.fixture
def sockets():
    """Factory of UDP sockets bound to 127.0.0.1, closed after the test."""
    made = []

    def make(buffer_bytes=4 << 20):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        made.append(s)
        for force, opt in ((33, socket.SO_RCVBUF), (32, socket.SO_SNDBUF)):  # SO_*BUFFORCE need root
            try:
                s.setsockopt(socket.SOL_SOCKET, force, buffer_bytes)
            except OSError:
                s.setsockopt(socket.SOL_SOCKET, opt, buffer_bytes)
        s.bind(("127.0.0.1", 0))
        return s

    yield make
    for s in made:
        s.close()


def payload(count, seg=SEG, seed=0):
    """count segments, each distinct: its index up front, random bytes after."""
    data = np.random.default_rng(seed).integers(0, 256, count * seg, dtype=np.uint8)
    for i in range(count):
        data[i * seg:i * seg + 4] = np.frombuffer(np.uint32(i).tobytes(), np.uint8)
    return data


def receive_all(mm, sock, want, slot=SLOT, timeout=5.0):
    """(datagrams, sources) of up to ``want`` datagrams, by MMsg.recv."""
    arena = np.zeros(mm.capacity * slot, np.uint8)
    lengths = np.zeros(mm.capacity, np.int32)
    sources = np.zeros(mm.capacity, np.int64)
    got, srcs = [], []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        n = mm.recv(sock.fileno(), arena, slot, want - len(got), lengths, sources)
        if n == 0:
            select.select([sock], [], [], 0.1)
            continue
        for i in range(n):
            size = int(lengths[i])
            got.append(None if size < 0 else arena[i * slot:i * slot + size].tobytes())
            srcs.append(int(sources[i]))
    return got, srcs


def test_layout_matches_x86_64_linux():
    if ctypes.sizeof(ctypes.c_void_p) != 8:
        pytest.skip("the checked layout is the 64-bit one")
    assert ctypes.sizeof(mmsg._MsgHdr) == 56
    assert ctypes.sizeof(mmsg._MMsgHdr) == 64
    assert [getattr(mmsg._MsgHdr, f).offset for f in
            ("msg_name", "msg_namelen", "msg_iov", "msg_iovlen", "msg_control", "msg_controllen", "msg_flags")] \
        == [0, 8, 16, 24, 32, 40, 48]
    assert mmsg._MMsgHdr.msg_len.offset == 56


def test_many_datagrams_in_one_send_arrive_intact_and_in_order(sockets):
    tx, rx = sockets(), sockets()
    mm = mmsg.MMsg(64)
    data = payload(200)
    assert mm.send(tx.fileno(), data, SEG, data.size, rx.getsockname()) == 200
    got, srcs = receive_all(mm, rx, 200)
    assert len(got) == 200
    for i, d in enumerate(got):
        assert d == data[i * SEG:(i + 1) * SEG].tobytes(), f"datagram {i}"
    assert set(srcs) == {addr_key(tx.getsockname())}


def test_plain_socket_receives_the_same_datagrams(sockets):
    tx, rx = sockets(), sockets()
    data = payload(200, seed=1)
    assert mmsg.MMsg(64).send(tx.fileno(), data, SEG, data.size, rx.getsockname()) == 200
    rx.settimeout(5.0)
    for i in range(200):
        d, addr = rx.recvfrom(2048)
        assert d == data[i * SEG:(i + 1) * SEG].tobytes(), f"datagram {i}"
        assert addr == tx.getsockname()


def test_last_segment_shorter(sockets):
    tx, rx = sockets(), sockets()
    mm = mmsg.MMsg(4)
    data = payload(10)
    nbytes = 6 * SEG + 100  # 7 datagrams over two calls, the last 100 bytes
    assert mm.send(tx.fileno(), data, SEG, nbytes, rx.getsockname()) == 7
    got, _ = receive_all(mm, rx, 7)
    assert [len(d) for d in got] == [SEG] * 6 + [100]
    assert b"".join(got) == data[:nbytes].tobytes()


def test_sources_are_each_senders_key(sockets):
    a, b, rx = sockets(), sockets(), sockets()
    mm = mmsg.MMsg(8)
    data = payload(3)
    assert mm.send(a.fileno(), data, SEG, data.size, rx.getsockname()) == 3
    assert mm.send(b.fileno(), data, SEG, SEG, rx.getsockname()) == 1
    _, srcs = receive_all(mm, rx, 4)
    assert srcs == [addr_key(a.getsockname())] * 3 + [addr_key(b.getsockname())]


def test_recv_on_empty_socket_returns_zero_at_once(sockets):
    rx = sockets()
    mm = mmsg.MMsg(64)
    arena = np.zeros(64 * SLOT, np.uint8)
    lengths, sources = np.zeros(64, np.int32), np.zeros(64, np.int64)
    start = time.monotonic()
    assert mm.recv(rx.fileno(), arena, SLOT, 64, lengths, sources) == 0
    assert time.monotonic() - start < 0.1


def test_truncated_datagram_is_flagged(sockets):
    tx, rx = sockets(), sockets()
    tx.sendto(b"x" * (SLOT + 100), rx.getsockname())
    tx.sendto(b"y" * 100, rx.getsockname())
    got, _ = receive_all(mmsg.MMsg(8), rx, 2)
    assert got == [None, b"y" * 100]


def test_recv_stops_at_arena_and_max_msgs(sockets):
    tx, rx = sockets(), sockets()
    mm = mmsg.MMsg(64)
    data = payload(10)
    assert mm.send(tx.fileno(), data, SEG, data.size, rx.getsockname()) == 10
    arena = np.zeros(3 * SLOT + 10, np.uint8)  # room for 3 slots only
    lengths, sources = np.zeros(64, np.int32), np.zeros(64, np.int64)
    select.select([rx], [], [], 5.0)
    assert mm.recv(rx.fileno(), arena, SLOT, 64, lengths, sources) == 3
    assert mm.recv(rx.fileno(), arena, SLOT, 2, lengths, sources) == 2
    assert arena[:SEG].tobytes() == data[3 * SEG:4 * SEG].tobytes()
    # a slice of the arena (another address) gets its own I/O vectors
    assert mm.recv(rx.fileno(), arena[SLOT:], SLOT, 64, lengths, sources) == 2
    assert arena[SLOT:SLOT + SEG].tobytes() == data[5 * SEG:6 * SEG].tobytes()


def test_int_key_destination(sockets):
    tx, rx = sockets(), sockets()
    mm = mmsg.MMsg(16)
    data = payload(5)
    assert mm.send(tx.fileno(), data, SEG, data.size, addr_key(rx.getsockname())) == 5
    got, srcs = receive_all(mm, rx, 5)
    assert b"".join(got) == data.tobytes()
    assert srcs == [addr_key(tx.getsockname())] * 5


def test_destination_changes_between_sends(sockets):
    tx, rx1, rx2 = sockets(), sockets(), sockets()
    mm = mmsg.MMsg(16)
    data = payload(2)
    assert mm.send(tx.fileno(), data, SEG, data.size, rx1.getsockname()) == 2
    assert mm.send(tx.fileno(), data, SEG, SEG, addr_key(rx2.getsockname())) == 1
    assert len(receive_all(mm, rx1, 2)[0]) == 2
    assert receive_all(mm, rx2, 1)[0] == [data[:SEG].tobytes()]
    with pytest.raises(BlockingIOError):
        rx1.recv(2048, socket.MSG_DONTWAIT)  # the second send went to rx2 only


def test_connected_socket_and_bytes_buffer(sockets):
    tx, rx = sockets(), sockets()
    tx.connect(rx.getsockname())
    mm = mmsg.MMsg(8)
    data = bytes(range(250)) * 4
    assert mm.send(tx.fileno(), data, 300, len(data), None) == 4
    got, _ = receive_all(mm, rx, 4)
    assert b"".join(got) == data


def test_refused_port_does_not_raise(sockets):
    tx, closed = sockets(), sockets()
    dest = closed.getsockname()
    closed.close()  # nothing listens there now: each datagram earns an ICMP port unreachable
    tx.connect(dest)
    mm = mmsg.MMsg(8)
    data = payload(4)
    for _ in range(5):
        assert mm.send(tx.fileno(), data, SEG, data.size, None) in range(5)
    arena = np.zeros(8 * SLOT, np.uint8)
    assert mm.recv(tx.fileno(), arena, SLOT, 8, np.zeros(8, np.int32), np.zeros(8, np.int64)) == 0


def test_oversized_datagram_raises(sockets):
    tx, rx = sockets(), sockets()
    data = np.zeros(70000, np.uint8)
    with pytest.raises(OSError) as info:
        mmsg.MMsg(4).send(tx.fileno(), data, data.size, data.size, rx.getsockname())
    assert info.value.errno == errno.EMSGSIZE


def test_bad_arguments():
    mm = mmsg.MMsg(4)
    with pytest.raises(ValueError):
        mm.send(0, np.zeros(10, np.uint8), 0, 10, ("127.0.0.1", 1))
    with pytest.raises(ValueError):
        mm.send(0, np.zeros(10, np.uint8), 4, 11, ("127.0.0.1", 1))
    with pytest.raises(ValueError):
        mm.recv(0, np.zeros(10, np.uint8)[::2], 4, 1, np.zeros(1, np.int32), np.zeros(1, np.int64))
    assert mm.send(0, np.zeros(10, np.uint8), 4, 0, ("127.0.0.1", 1)) == 0
