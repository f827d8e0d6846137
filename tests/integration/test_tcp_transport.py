"""The plain TCP transport (tcp://) on real sockets: every message size
arrives whole and in order, replies reach their peer, a peer that is not up
yet or comes back is dialled, and what is not an aggnet stream is closed and
counted without stalling anybody else."""

from __future__ import annotations

import re
import socket
import struct
import threading
import time
import uuid

import numpy as np
import pytest

from aggnet import Client
from aggnet.errors import AggregatorUnreachable
from aggnet.client.stats import query
from aggnet.processes import ServiceProcess
from aggnet.protocol.address import parse
from aggnet.protocol import wire
from aggnet.protocol.limits import MAX_MESSAGE_BYTES
from aggnet.transport import connect, listen
from aggnet.transport import tcp
from harness.helpers import a_job_runs, free_port, peak_rss
from harness.raw_worker import RawWorker

HEADER = wire.Header(wire.MsgType.PUSH).pack()


def _recv(endpoint, timeout: float = 10.0, others=()):
    """The next message at ``endpoint``, moving ``others`` (a connection's
    sends go out while its owner polls it) in between."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for o in others:
            o.recv(0)
        m = endpoint.recv(0.01)
        if m is not None:
            return m
    raise AssertionError(f"nothing arrived at {endpoint} within {timeout}s")


@pytest.fixture
def listener():
    lst = listen("tcp://127.0.0.1:0")
    yield lst
    lst.close()


def test_every_size_arrives_whole_in_order_and_replies_reach_their_peer(listener):
    # around the small-payload copy, the read block and a frame split
    # over reads, up to the largest message a listener takes
    sizes = [0, 1, tcp.SMALL_PAYLOAD, tcp.SMALL_PAYLOAD + 1, tcp.READ_BLOCK - 56, tcp.READ_BLOCK + 1, 3 << 20,
             MAX_MESSAGE_BYTES]
    conns = [connect([str(listener.address)]) for _ in range(2)]
    try:
        sent = {}
        for c, conn in enumerate(conns):
            for i, n in enumerate(sizes):
                payload = np.random.default_rng(10 * c + i).integers(0, 256, n, dtype=np.uint8)
                h = wire.Header(wire.MsgType.PUSH, sender=c, index=i).pack()
                conn.send(0, h, payload if n else None)
                sent[(c, i)] = payload
        got = {}
        peers = {}
        while len(got) < len(sent):
            m = _recv(listener, others=conns)
            h = wire.unpack_header(bytes(m.header))
            # in order per connection
            assert h.index == sum(1 for c, _ in got if c == h.sender)
            got[(h.sender, h.index)] = np.frombuffer(m.payload, np.uint8).copy()
            peers[h.sender] = m.peer
        for key, payload in sent.items():
            np.testing.assert_array_equal(got[key], payload)
        # each reply goes back on the connection its peer came in on
        for c, conn in enumerate(conns):
            reply = np.full(1 << 20, c, np.uint8)
            assert listener.send(peers[c], wire.Header(wire.MsgType.RESULT, sender=c).pack(), reply)
        for c, conn in enumerate(conns):
            m = _recv(conn, others=[listener])
            assert m.peer == 0 and wire.unpack_header(bytes(m.header)).sender == c
            assert (np.frombuffer(m.payload, np.uint8) == c).all()
    finally:
        for conn in conns:
            conn.close()


def test_steady_state_reads_into_reused_buffers(listener):
    """A payload the owner let go of is read into again: no buffer per
    message once the first ones exist."""
    conn = connect([str(listener.address)])
    try:
        data = np.ones(1 << 20, np.uint8)
        for _ in range(5):
            conn.send(0, HEADER, data)
            _recv(listener, others=[conn])
        warm = listener._pool.allocated
        for _ in range(50):
            conn.send(0, HEADER, data)
            m = _recv(listener, others=[conn])
            assert len(m.payload) == data.size
            del m
        assert listener._pool.allocated == warm
    finally:
        conn.close()


def test_sends_before_the_listener_is_up_arrive_once_it_is():
    port = free_port()
    conn = connect([f"tcp://127.0.0.1:{port}"])
    try:
        conn.send(0, HEADER, np.arange(1000, dtype=np.int32))
        conn.recv(0.3)  # refused meanwhile: dialled again
        lst = listen(f"tcp://127.0.0.1:{port}")
        try:
            m = _recv(lst, others=[conn])
            np.testing.assert_array_equal(np.frombuffer(m.payload, np.int32), np.arange(1000))
        finally:
            lst.close()
    finally:
        conn.close()


def test_a_listener_that_goes_away_is_reported_and_its_successor_dialled():
    lst = listen("tcp://127.0.0.1:0")
    address = str(lst.address)
    conn = connect([address])
    try:
        conn.send(0, HEADER)
        _recv(lst, others=[conn])
        lst.close()
        deadline = time.monotonic() + 5
        gone = []
        while not gone:
            assert time.monotonic() < deadline, "the closed listener was never reported"
            conn.recv(0.05)
            gone = conn.gone()
        assert gone == [0]
        lst = listen(address)
        conn.send(0, wire.Header(wire.MsgType.PUSH, index=7).pack())
        m = _recv(lst, others=[conn])
        assert wire.unpack_header(bytes(m.header)).index == 7
    finally:
        conn.close()
        lst.close()


def test_a_peer_that_closes_is_reported_gone_by_the_listener(listener):
    conn = connect([str(listener.address)])
    conn.send(0, HEADER)
    peer = _recv(listener, others=[conn]).peer
    conn.close()
    deadline = time.monotonic() + 5
    while peer not in listener.gone():
        assert time.monotonic() < deadline, "the closed connection was never reported"
        listener.recv(0.05)
    assert not listener.send(peer, HEADER)


def test_a_peer_that_reads_nothing_costs_its_replies_not_the_listener(listener, monkeypatch):
    monkeypatch.setattr(tcp, "MAX_QUEUED_BYTES", 8 << 20)
    deaf = connect([str(listener.address)])
    other = connect([str(listener.address)])
    try:
        deaf.send(0, HEADER)
        deaf_peer = _recv(listener, others=[deaf]).peer
        other.send(0, HEADER)
        other_peer = _recv(listener, others=[other]).peer
        big = np.zeros(4 << 20, np.uint8)
        t0 = time.monotonic()
        results = [listener.send(deaf_peer, HEADER, big) for _ in range(16)]
        assert time.monotonic() - t0 < 2, "a send to a full peer waited"
        assert results[0] and not results[-1], results
        # the other peer is served as before
        assert listener.send(other_peer, HEADER, big)
        assert len(_recv(other, others=[listener]).payload) == big.size
    finally:
        deaf.close()
        other.close()


def _raw(address, data: bytes) -> socket.socket:
    host, port = address.host, address.port
    s = socket.create_connection((host, port), timeout=5)
    s.sendall(data)
    return s


def _closed_by_peer(s: socket.socket, listener, timeout: float = 5.0) -> bool:
    s.setblocking(False)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listener.recv(0.02)
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    return True
        except BlockingIOError:
            continue
        except ConnectionResetError:
            return True
    return False


@pytest.mark.parametrize("opening", [b"GET / HTTP/1.1\r\n\r\n", b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f",
                                     tcp.GREETING + struct.pack("<II", 64, MAX_MESSAGE_BYTES + 1),
                                     tcp.GREETING + struct.pack("<II", tcp.MAX_HEADER_BYTES + 1, 0)],
                         ids=["http", "zeromq", "payload-too-large", "header-too-large"])
def test_what_is_not_an_aggnet_stream_is_closed_and_counted(listener, opening):
    conn = connect([str(listener.address)])
    try:
        s = _raw(listener.address, opening)
        assert _closed_by_peer(s, listener), "the listener kept a stream it cannot frame"
        s.close()
        assert listener.bad_streams == 1
        # and the others are served as before
        conn.send(0, HEADER, np.ones(100_000, np.uint8))
        assert len(_recv(listener, others=[conn]).payload) == 100_000
    finally:
        conn.close()


def test_a_peer_that_never_greets_is_closed(listener, monkeypatch):
    monkeypatch.setattr(tcp, "GREETING_TIMEOUT", 0.3)
    listener._next_check = 0.0
    s = socket.create_connection((listener.address.host, listener.address.port), timeout=5)
    try:
        assert _closed_by_peer(s, listener)
        assert listener.bad_streams == 1
    finally:
        s.close()


def test_a_send_from_another_thread_goes_out_while_the_owner_waits_in_recv(listener):
    conn = connect([str(listener.address)])
    try:
        conn.send(0, HEADER)
        _recv(listener, others=[conn])
        stop = threading.Event()

        def owner():  # the client's I/O thread: it only receives
            while not stop.is_set():
                conn.recv(1.0)

        t = threading.Thread(target=owner)
        t.start()
        try:
            time.sleep(0.05)  # the owner is inside recv's wait
            for _ in range(3):
                conn.send(0, HEADER, np.ones(1 << 20, np.uint8))  # larger than the socket takes at once
            for _ in range(3):
                assert len(listener.recv(5.0).payload) == 1 << 20
        finally:
            stop.set()
            conn.wakeup()
            t.join(5)
        assert not t.is_alive(), "wakeup did not end the owner's recv"
    finally:
        conn.close()


def test_ipv6_and_wildcard_listeners():
    for listen_at, reach_at in [("tcp://[::1]:0", "::1"), ("tcp://0.0.0.0:0", "127.0.0.1"),
                                ("tcp://[::]:0", "127.0.0.1")]:
        try:
            lst = listen(listen_at)
        except Exception as exc:  # a machine without IPv6
            if "::" in listen_at:
                continue
            raise exc
        host = f"[{reach_at}]" if ":" in reach_at else reach_at
        conn = connect([f"tcp://{host}:{lst.address.port}"])
        try:
            conn.send(0, HEADER, b"x" * 100)
            assert bytes(_recv(lst, others=[conn]).payload) == b"x" * 100
        finally:
            conn.close()
            lst.close()


@pytest.mark.parametrize("serves, dialled, says", [
    ("zmq+tcp", "tcp", r"speaks ZeroMQ; use its zmq\+tcp:// address instead"),
    ("tcp", "zmq+tcp", r"serves plain tcp:// \(no ZeroMQ\): connect at tcp://127\.0\.0\.1:\d+ instead")])
def test_a_worker_that_dials_the_other_tcp_scheme_is_told_which_to_use(serves, dialled, says):
    with ServiceProcess(f"{serves}://127.0.0.1:0", shards=1) as svc:
        wrong = svc.address.replace(f"{serves}://", f"{dialled}://")
        t0 = time.monotonic()
        with pytest.raises(AggregatorUnreachable, match=says):
            Client(wrong, job=f"wrong-{uuid.uuid4().hex[:6]}", rank=0, world_size=1, connect_timeout=20)
        assert time.monotonic() - t0 < 5, "the worker waited out its connect timeout"


def test_a_tcp_service_sums_exactly_and_counts_the_streams_it_closed():
    with ServiceProcess("tcp://127.0.0.1:0", shards=2) as svc:
        assert svc.address.startswith("tcp://")
        shard = parse(query(svc.address)["service"]["shards"][1])
        for where in (parse(svc.address), shard):  # the control endpoint and a shard
            with socket.create_connection(("127.0.0.1", where.port), timeout=5) as s:
                s.sendall(b"GET / HTTP/1.1\r\n\r\n")
                s.settimeout(5)
                assert s.recv(64) == tcp.GREETING and s.recv(64) == b"", "the stream was not closed"
        a_job_runs(svc.address, f"tcp-{uuid.uuid4().hex[:6]}")
        stats = query(svc.address)
        assert stats["totals"]["dropped_bad_stream"] == 2
        assert stats["shards"][1]["counters"]["dropped_bad_stream"] == 1
        # each shard's memory and what its budgets hold, for a person
        import subprocess
        import sys

        shown = subprocess.run([sys.executable, "-m", "aggnet", "stats", svc.address], capture_output=True,
                               text=True, timeout=60).stdout
        assert re.search(r"1: tcp://\S+ pid \d+; .* resident [\d.]+ MiB \(peak [\d.]+ MiB\), reading 0 B of "
                         r"256\.0 MiB, unsent 0 B of 1\.0 GiB, streams \d+ of 4096", shown), shown


def test_random_frames_and_torn_streams_never_stop_the_listener(listener):
    """Frames of random lengths and bytes, streams cut off mid-frame, and
    garbage after a good greeting: each is delivered as framed (its owner
    judges the header), or closed and counted; the listener serves a
    proper connection afterwards."""
    rng = np.random.default_rng(5)
    delivered = 0
    for trial in range(30):
        s = socket.create_connection((listener.address.host, listener.address.port), timeout=5)
        blob = bytearray(tcp.GREETING if trial % 4 else b"")
        for _ in range(int(rng.integers(1, 6))):
            hlen = int(rng.integers(0, 100))
            plen = int(rng.choice([0, 1, 5000, 70_000, int(rng.integers(0, 1 << 31))]))
            body = rng.integers(0, 256, hlen + min(plen, 80_000), dtype=np.uint8).tobytes()
            blob += struct.pack("<II", hlen, plen) + body
        cut = int(rng.integers(1, len(blob) + 1))
        try:
            s.sendall(bytes(blob[:cut]))
        except OSError:
            pass  # closed already: it said something no stream holds
        s.close()
        # until this stream is done with: read to its end, or closed
        deadline = time.monotonic() + 5
        while listener._streams and time.monotonic() < deadline:
            delivered += listener.recv(0.01) is not None
        while listener.recv(0) is not None:
            delivered += 1
    # every stream ended; the listener still frames a proper connection
    conn = connect([str(listener.address)])
    try:
        conn.send(0, HEADER, np.arange(50_000, dtype=np.int32))
        m = _recv(listener, others=[conn])
        while len(m.payload) != 200_000:  # a last frame of the garbage
            m = _recv(listener, others=[conn])
        np.testing.assert_array_equal(np.frombuffer(m.payload, np.int32), np.arange(50_000))
    finally:
        conn.close()
    assert listener.bad_streams > 0 and delivered > 0
    assert not listener._streams or all(s.greeted for s in listener._streams.values())


@pytest.mark.parametrize("address, said", [("tcp://no-such-host.invalid:5555", "cannot resolve 'no-such-host.invalid'"),
                                           (None, "Connection refused")], ids=["unresolved", "refused"])
def test_a_worker_that_reaches_nothing_says_what_its_last_try_met(address, said):
    """A name that does not resolve (yet: a service's DNS entry may come
    after its workers) is tried again, not fatal at once; the timeout's
    error says what the last try met."""
    address = address or f"tcp://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(AggregatorUnreachable, match=f"within 1s .*; last try: .*{said}"):
        Client(address, job=f"none-{uuid.uuid4().hex[:6]}", rank=0, world_size=1, connect_timeout=1)
    assert time.monotonic() - t0 >= 1


# -- the listener's memory, whatever its peers send ------------------------------------------------

def _opening(nbytes: int) -> bytes:
    """A stream's greeting and the frame prefix and header of a payload of
    ``nbytes``: what a peer sends before the payload itself."""
    return tcp.GREETING + tcp.frame_head(HEADER, nbytes)


def _sending(s: socket.socket, *parts) -> threading.Thread:
    """Send ``parts`` on ``s`` from a thread of its own (the listener may
    leave it unread for a while); a send into a socket closed meanwhile ends
    it quietly."""
    def run():
        try:
            for p in parts:
                s.sendall(p)
        except OSError:
            pass
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_listener_reads_at_most_its_receive_budget_of_payloads_at_once_and_the_rest_in_turn():
    n = 40 << 20  # two of them do not fit a 64 MiB budget
    lst = tcp.TcpListener(parse("tcp://127.0.0.1:0"), receive_budget=MAX_MESSAGE_BYTES)
    socks = [socket.create_connection((lst.address.host, lst.address.port), timeout=30) for _ in range(4)]
    try:
        for i, s in enumerate(socks):
            _sending(s, _opening(n), np.full(n, i + 1, np.uint8))
        got, most = set(), 0
        deadline = time.monotonic() + 60
        while len(got) < len(socks) and time.monotonic() < deadline:
            m = lst.recv(0.05)
            most = max(most, lst.receiving)
            if m is not None:
                value = int(m.payload[0])
                assert len(m.payload) == n and (m.payload == value).all()
                got.add(value)
                del m  # its buffer goes back to the pool
        assert got == {1, 2, 3, 4}, f"only {sorted(got)} of 4 payloads arrived within 60s"
        assert most <= MAX_MESSAGE_BYTES and lst.receiving == 0
        assert lst.receive_waits >= 1 and lst.transport_counters()["receive_waits"] == lst.receive_waits
        # one payload read at a time: a buffer for it and one for the last delivered, never one per stream
        assert lst._pool.allocated <= 2
    finally:
        for s in socks:
            s.close()
        lst.close()


def test_a_stream_that_holds_the_budget_and_sends_nothing_is_closed_only_once_others_wait():
    n = 40 << 20
    lst = tcp.TcpListener(parse("tcp://127.0.0.1:0"), receive_budget=MAX_MESSAGE_BYTES, stall_timeout=1.0)
    stalled = _raw(lst.address, _opening(n) + bytes(1 << 20))
    other = socket.create_connection((lst.address.host, lst.address.port), timeout=30)
    try:
        deadline = time.monotonic() + 10
        while lst.receiving != n and time.monotonic() < deadline:
            lst.recv(0.05)
        assert lst.receiving == n, "the first payload was not taken in"
        # alone, a slow stream keeps its room for as long as it takes
        until = time.monotonic() + 2.5
        while time.monotonic() < until:
            assert lst.recv(0.05) is None
        assert lst.stalled_streams == 0 and lst.receiving == n
        # once another waits for room, the stream that sends nothing goes
        t0 = time.monotonic()
        _sending(other, _opening(n), np.full(n, 7, np.uint8))
        m = _recv(lst, timeout=15)
        assert len(m.payload) == n and (m.payload == 7).all()
        assert time.monotonic() - t0 < 1.0 + 3.0
        assert _closed_by_peer(stalled, lst)
        assert lst.transport_counters() == {"dropped_stalled_stream": 1, "receive_waits": 1}
        assert lst.receiving == 0
    finally:
        stalled.close()
        other.close()
        lst.close()


def test_a_connection_past_the_stream_limit_is_closed_at_once_and_the_others_served():
    lst = tcp.TcpListener(parse("tcp://127.0.0.1:0"), max_streams=3)
    conns = [connect([str(lst.address)]) for _ in range(3)]
    try:
        for i, c in enumerate(conns):
            c.send(0, HEADER, np.full(10, i, np.uint8))
        assert sorted(int(_recv(lst, others=conns).payload[0]) for _ in conns) == [0, 1, 2]
        extra = _raw(lst.address, tcp.GREETING)
        assert _closed_by_peer(extra, lst), "a connection past the limit was kept"
        extra.close()
        assert lst.transport_counters() == {"dropped_stream_over_limit": 1}
        conns[0].send(0, HEADER, np.full(10, 9, np.uint8))
        assert int(_recv(lst, others=conns).payload[0]) == 9
        # the limit counts open streams: one that closes makes room
        conns.pop().close()
        late = connect([str(lst.address)])
        conns.append(late)
        late.send(0, HEADER, np.full(10, 5, np.uint8))
        assert int(_recv(lst, others=conns).payload[0]) == 5
        assert lst.streams_over_limit == 1
    finally:
        for c in conns:
            c.close()
        lst.close()


def test_a_shard_s_memory_stays_within_its_budget_while_peers_flood_it_with_large_payloads():
    """Twelve streams announce the largest payload and send all but its
    last MiB: the shard reads four at a time (its 256 MiB budget); the rest
    wait in the kernel's buffers, not the shard's. A job runs once they go."""
    with ServiceProcess("tcp://127.0.0.1:0", shards=1) as svc:
        shard = parse(query(svc.address)["service"]["shards"][0])
        pid = query(svc.address)["shards"][0]["pid"]
        before = peak_rss(pid)
        n = MAX_MESSAGE_BYTES
        part = np.ones(n - (1 << 20), np.uint8)
        socks = [socket.create_connection(("127.0.0.1", shard.port), timeout=60) for _ in range(12)]
        try:
            senders = [_sending(s, _opening(n), part) for s in socks]
            fits = tcp.RECEIVE_BUDGET // n
            deadline = time.monotonic() + 60
            waits = 0
            while time.monotonic() < deadline:
                waits = query(svc.address)["shards"][0]["counters"].get("receive_waits", 0)
                done = sum(not t.is_alive() for t in senders)
                if done == len(socks) or (waits >= len(socks) - fits and done >= fits):
                    break
                time.sleep(0.1)
            grew = peak_rss(pid) - before
            assert grew < tcp.RECEIVE_BUDGET + (64 << 20), f"the shard grew {grew >> 20} MiB"
            assert waits >= len(socks) - fits, f"{waits} streams waited for room"
        finally:
            for s in socks:
                s.close()
        a_job_runs(svc.address, f"tcp-{uuid.uuid4().hex[:6]}")
        assert query(svc.address)["shards"][0]["pid"] == pid


def test_past_its_unsent_budget_a_listener_closes_the_peer_that_reads_none_of_its_replies():
    lst = tcp.TcpListener(parse("tcp://127.0.0.1:0"), unsent_budget=MAX_MESSAGE_BYTES)
    reader = connect([str(lst.address)])
    deaf = _raw(lst.address, tcp.GREETING + tcp.frame_head(HEADER, 0))
    deaf.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    try:
        reader.send(0, HEADER, b"hello")
        peers = {len(m.payload): m.peer for m in (_recv(lst, others=[reader]), _recv(lst, others=[reader]))}
        deaf_peer, reader_peer = peers[0], peers[5]
        reply = np.ones(8 << 20, np.uint8)
        got = 0
        for _ in range(12):  # 96 MiB to each: the deaf peer's pile passes the 64 MiB budget
            assert lst.send(reader_peer, HEADER, reply)
            lst.send(deaf_peer, HEADER, reply)
            while lst._peers[reader_peer].queued:  # the reader takes its reply
                lst.recv(0.01)
                while (m := reader.recv(0)) is not None:
                    got += len(m.payload) == len(reply)
        assert not lst.send(deaf_peer, HEADER, reply), "the peer that reads nothing was kept"
        assert _closed_by_peer(deaf, lst)
        assert lst.transport_counters() == {"dropped_unread_stream": 1}
        while got < 12:
            got += len(_recv(reader, others=[lst]).payload) == len(reply)
        assert lst.unsent <= MAX_MESSAGE_BYTES
        assert deaf_peer in lst.gone()
    finally:
        deaf.close()
        reader.close()
        lst.close()


def test_a_worker_that_reads_none_of_its_results_is_closed_and_its_job_told_why():
    """A member that sends its parts and reads none of the results piles
    them up at its shard: past the shard's --unsent-budget its stream is
    closed, and the rank that goes on hears why, not that a worker died."""
    with ServiceProcess("tcp://127.0.0.1:0", shards=1, args=["--unsent-budget", "64MiB"]) as svc:
        job = f"deaf-{uuid.uuid4().hex[:6]}"
        a = RawWorker(svc.address, job, rank=0, world=2, timeout=20)
        b = RawWorker(svc.address, job, rank=1, world=2, timeout=20)
        try:
            a.join()
            b.join()
            chunk = np.ones(1 << 20, np.float32)  # 4 MiB: b leaves 64 MiB unread within 16 chunks, and its buffers
            said = None
            for i in range(64):
                a.push(0, 1, i, i * chunk.size, chunk)
                b.push(0, 1, i, i * chunk.size, chunk)
                h, payload = None, None
                deadline = time.monotonic() + 20
                while h is None or h.index != i:
                    msg = a.conn.recv(max(0.0, deadline - time.monotonic()))
                    assert msg is not None, f"rank 0 heard nothing of chunk {i}"
                    h, payload = wire.unpack_header(msg.header), msg.payload
                if h.msg_type == wire.MsgType.ERROR:
                    said = wire.parse_error(payload)[1]
                    break
                assert h.msg_type == wire.MsgType.RESULT and (np.frombuffer(payload, np.float32) == 2).all()
            assert said is not None, "rank 1 read nothing of 256 MiB of results and was kept"
            # the round open when it went fails, or the next one: either way naming rank 1 and why
            assert "rank 1 of job" in said and "was disconnected by the aggregator: it left" in said, said
            counters = query(svc.address)["shards"][0]["counters"]
            assert counters["dropped_unread_stream"] == 1 and counters["members_disconnected"] == 1, counters
        finally:
            a.close()
            b.close()


@pytest.mark.parametrize("flags, says", [
    (["--listen", "tcp://127.0.0.1:0", "--receive-budget", "1MiB"], "--receive-budget must hold the largest message"),
    (["--listen", "tcp://127.0.0.1:0", "--unsent-budget", "lots"], "--unsent-budget: cannot read size 'lots'"),
    (["--listen", "zmq+tcp://127.0.0.1:0", "--receive-budget", "512MiB"], "bound a tcp:// service's streams")])
def test_a_stream_budget_the_service_cannot_take_is_refused_in_one_line(flags, says):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "aggnet", "serve", *flags], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
