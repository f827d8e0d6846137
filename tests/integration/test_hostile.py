"""An aggregator nobody can crash or hijack: hostile control messages,
members that leave mid-chunk, buffers that disagree, clients that keep
their heads. Every test here runs against real `aggnet serve` processes
over real sockets."""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest

from aggnet import Client
from aggnet.protocol import keys, wire
from aggnet.errors import AggregationError, AggregationTimeout, JobMismatch
from aggnet.processes import ServiceProcess
from aggnet.client.stats import query, stats_request
from aggnet.transport import connect
from aggnet.protocol.wire import Header, MsgType
from harness.helpers import peak_rss

pytestmark = pytest.mark.timeout(180)


def _job() -> str:
    return f"h-{uuid.uuid4().hex[:8]}"


def _ask(address: str, h: Header, payload: bytes = b"", timeout: float = 5.0):
    """One control message to ``address``; (header, payload) of the reply."""
    with connect([address]) as conn:
        conn.send(0, h.pack_for(payload) if payload else h.pack(), payload or None)
        msg = conn.recv(timeout)
    assert msg is not None, f"no reply from {address}"
    return wire.unpack_header(msg.header), bytes(msg.payload)


def _shards(address: str) -> list[str]:
    h, payload = _ask(address, Header(MsgType.HELLO))
    return json.loads(payload)["shards"]


def _allreduce_pair(address: str, job: str, size=(1000, 1000), **opts):
    """Two ranks all-reduce int32 buffers; each rank's result or error."""
    def run(rank):
        with Client(address, job=job, rank=rank, world_size=2, **opts) as c:
            buf = np.full(size[rank], rank + 1, np.int32)
            try:
                c.allreduce(buf).result(timeout=60)
            except Exception as exc:  # the test looks at what each rank got
                return exc
            return buf
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return list(pool.map(run, range(2)))


@pytest.fixture
def service(shared_service):
    return shared_service("zmq+tcp")


def _alive_and_serving(address: str) -> None:
    r = _allreduce_pair(address, _job())
    assert all(isinstance(b, np.ndarray) and (b == 3).all() for b in r), r


# -- one schema for control messages ----------------------------------------------------


@pytest.mark.parametrize("fields, field", [
    ({"name": "x", "timeout": "abc"}, "timeout"),
    ({"name": "x", "timeout": float("nan")}, "timeout"),
    ({"name": "x", "timeout": 0}, "timeout"),
    ({"name": 7}, "name"),
    ({"name": "x", "shm": {"window": 2 ** 70, "chunk_bytes": 1024}}, "window"),
    ({"name": "x", "shm": {"window": 4, "chunk_bytes": "big"}}, "chunk_bytes"),
    ({"name": "x", "shm": [1, 2]}, "shm"),
    ({"name": "x", "auth": {"nonce": "zz", "ts": 1, "mac": "00"}}, "nonce"),
])
def test_a_malformed_join_is_refused_naming_the_field_and_the_service_goes_on(service, fields, field):
    shard = _shards(service.address)[0]
    payload = json.dumps(fields).encode() if "nan" not in str(fields) else \
        b'{"name": "x", "timeout": NaN}'
    h, reply = _ask(shard, Header(MsgType.JOIN, job_id=99, sender=0, world=2), payload)
    assert h.msg_type == MsgType.ERROR
    code, text = wire.parse_error(reply)
    assert code == "malformed" and field in text, text
    assert service.alive()
    counts = service.new_counts()
    assert counts[f"dropped_field_{field}"] == 1, counts


def test_a_huge_shared_memory_join_leaves_no_file_and_no_crash():
    with ServiceProcess(f"shm://{os.path.join(_tmpdir(), 'h.sock')}", shards=1) as svc:
        shard = _shards(svc.address)[0]
        # this shard's segments only (named after its pid): other tests'
        # processes come and go in /dev/shm meanwhile
        mine = f"aggnet-{query(svc.address)['shards'][0]['pid']}-"
        with connect([shard]) as conn:
            def ask(h, payload=b""):
                conn.send(0, h.pack_for(payload) if payload else h.pack(), payload or None)
                msg = conn.recv(5.0)
                return wire.unpack_header(msg.header), bytes(msg.payload)
            for window, chunk in ((1024, 256 << 20), (1, 64)):
                payload = json.dumps({"name": "big", "shm": {"window": window, "chunk_bytes": chunk}}).encode()
                h, reply = ask(Header(MsgType.JOIN, job_id=5, sender=0, world=32), payload)
                if window == 1024:
                    assert h.msg_type == MsgType.ERROR and "exceed" in wire.parse_error(reply)[1]
                else:
                    assert h.msg_type == MsgType.JOIN_OK
            assert svc.alive()
            # the small one joined; leaving removes its rings too
            ask(Header(MsgType.LEAVE, job_id=5, sender=0, world=32))
        deadline = time.monotonic() + 5
        while [f for f in os.listdir("/dev/shm") if f.startswith(mine)] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [f for f in os.listdir("/dev/shm") if f.startswith(mine)] == []


def _tmpdir() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="agh-")


def test_the_control_endpoint_counts_what_it_drops(service):
    with connect([service.address]) as conn:
        conn.send(0, b"\x00" * 7)
        conn.send(0, Header(MsgType.PUSH).pack())
        for _ in range(2):
            assert conn.recv(5.0) is not None
    counts = service.new_counts()
    assert counts["dropped_malformed_short"] >= 1 and counts["dropped_unexpected_type"] >= 1, counts


def test_an_internal_error_is_counted_and_the_shard_goes_on():
    from aggnet.hosts import service as service_mod

    svc = service_mod.start(f"inproc://boom-{uuid.uuid4().hex[:6]}", 1)
    try:
        shard = svc.in_process_shards[0]
        real = shard._on_leave
        shard._on_leave = lambda *a: (_ for _ in ()).throw(RuntimeError("injected"))
        h, reply = _ask(svc.shards[0].address, Header(MsgType.LEAVE, job_id=1))
        assert h.msg_type == MsgType.ERROR and "goes on" in wire.parse_error(reply)[1]
        shard._on_leave = real
        assert shard.counters["internal_error"] == 1
        _alive_and_serving(svc.address)
    finally:
        svc.stop()


# -- members that leave, buffers that disagree ------------------------------------------


def test_a_worker_leaving_with_a_chunk_open_fails_the_others_not_the_service(service):
    job = _job()
    c0 = Client(service.address, job=job, rank=0, world_size=2, timeout=20)
    c1 = Client(service.address, job=job, rank=1, world_size=2, timeout=20)
    try:
        pending = c0.allreduce(np.ones(300_000, np.float32))
        time.sleep(0.3)  # its chunks reach the shards; rank 1 sends nothing yet
        c0.close()
        with pytest.raises(Exception):
            pending.result(timeout=5)
        t0 = time.monotonic()
        with pytest.raises(AggregationTimeout) as err:
            c1.allreduce(np.ones(300_000, np.float32)).result(timeout=30)
        assert time.monotonic() - t0 < 10, "the departure is told at once, not after the stall timeout"
        assert "rank(s) [0] left" in str(err.value) or "rank 0 left" in str(err.value), str(err.value)
    finally:
        c0.close()
        c1.close()
    assert service.alive()
    _alive_and_serving(service.address)


@pytest.mark.parametrize("sizes", [(1000, 1500), (600_000, 300_000)])
def test_buffers_of_different_sizes_are_a_job_mismatch_on_every_rank(service, sizes):
    results = _allreduce_pair(service.address, _job(), sizes, timeout=20)
    for r in results:
        assert isinstance(r, JobMismatch), results
        assert "same" in str(r)
    _alive_and_serving(service.address)


def test_a_failed_allreduce_leaves_the_client_usable(service):
    """An ERROR fails the request it names: the next all-reduce works."""
    job = _job()

    def run(rank):
        with Client(service.address, job=job, rank=rank, world_size=2, timeout=20) as c:
            with pytest.raises(JobMismatch):
                c.allreduce(np.ones(100 + 50 * rank, np.int32)).result(timeout=30)
            buf = np.full(5000, rank + 1, np.int32)
            c.allreduce(buf).result(timeout=30)
            return buf
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for buf in pool.map(run, range(2)):
            assert (buf == 3).all()


# -- job keys -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed():
    path = os.path.join(_tmpdir(), "keys.json")
    key = keys.write_job_key(path, "secure")
    subprocess.run([sys.executable, "-m", "aggnet", "job", "admin", "--keys", path], check=True,
                   capture_output=True)
    with ServiceProcess("zmq+tcp://127.0.0.1:0", shards=2, args=["--keys", path]) as svc:
        yield svc, key, path


def test_a_keyed_service_takes_signed_joins_only(keyed):
    svc, key, _ = keyed
    r = _allreduce_pair(svc.address, "secure", job_key=key)
    assert all(isinstance(b, np.ndarray) and (b == 3).all() for b in r), r
    with pytest.raises(AggregationError, match="not signed"):
        Client(svc.address, job="secure", rank=0, world_size=2, connect_timeout=5)
    with pytest.raises(AggregationError, match="not signed with"):
        Client(svc.address, job="secure", rank=0, world_size=2, connect_timeout=5, job_key=keys.new_key())
    with pytest.raises(AggregationError, match="no key for job"):
        Client(svc.address, job="other", rank=0, world_size=2, connect_timeout=5, job_key=key)


def test_a_replayed_join_from_another_connection_is_refused(keyed):
    svc, key, _ = keyed
    shard = _shards(svc.address)[0]
    h = Header(MsgType.JOIN, job_id=12345, sender=0, world=2)
    fields = {"name": "secure", "timeout": 30.0}
    payload = wire.json_payload({**fields, "auth": keys.sign(bytes.fromhex(key), "JOIN", 12345, 0, 2, fields)})
    first, _ = _ask(shard, h, payload)
    assert first.msg_type == MsgType.JOIN_OK
    again, reply = _ask(shard, h, payload)  # a new connection: another peer
    assert again.msg_type == MsgType.ERROR and "replay" in wire.parse_error(reply)[1]
    # a forged rank: the signature covers the rank
    forged = Header(MsgType.JOIN, job_id=12345, sender=1, world=2)
    other, reply = _ask(shard, forged, payload)
    assert other.msg_type == MsgType.ERROR and "not signed with" in wire.parse_error(reply)[1]


def test_stats_show_a_job_only_to_its_key_or_the_admin_key(keyed):
    svc, key, path = keyed
    with Client(svc.address, job="secure", rank=0, world_size=1, job_key=key):
        anyone = query(svc.address)
        assert all(not s["jobs"] for s in anyone["shards"]), anyone
        mine = query(svc.address, payload=stats_request("secure", bytes.fromhex(key)))
        assert any("secure" in s["jobs"] for s in mine["shards"])
        admin = query(svc.address, payload=stats_request(admin_key=keys.Keyring.load(path).admin))
        assert any("secure" in s["jobs"] for s in admin["shards"])
        with pytest.raises(Exception, match="not signed with"):
            query(svc.address, payload=stats_request("secure", bytes.fromhex(keys.new_key())))


def test_serving_other_hosts_without_keys_says_so_and_bad_addresses_are_refused():
    r = subprocess.run([sys.executable, "-m", "aggnet", "serve", "--mode", "switch", "--listen", "foo://x:1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "foo" in r.stderr
    proc = subprocess.Popen([sys.executable, "-m", "aggnet", "serve", "--listen", "zmq+tcp://0.0.0.0:0",
                             "--shards", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("aggnet serving")
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "WITHOUT job keys" in err and "--keys" in err
    r = subprocess.run([sys.executable, "-m", "aggnet", "stats", "zmq+tcp://127.0.0.1:9", "--timeout", "0.5"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "no answer" in r.stderr


def test_serve_listens_on_this_machine_only_by_default():
    from aggnet.cli import serve

    import argparse

    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    assert p.parse_args([]).listen is None
    assert "127.0.0.1" in serve.DEFAULT_SERVICE_LISTEN


# -- CURVE ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_curve_protects_a_tcp_service():
    path = os.path.join(_tmpdir(), "curve")
    from aggnet.transport.zmq import make_curve_keys

    public = make_curve_keys(path)
    with ServiceProcess("zmq+tcp://127.0.0.1:0", shards=1, args=["--curve-secret-file", path]) as svc:
        r = _allreduce_pair(svc.address, _job(), server_key=public)
        assert all(isinstance(b, np.ndarray) and (b == 3).all() for b in r), r
        from aggnet.errors import AggregatorUnreachable

        # at once, not after the connect timeout: no wait makes a missing or wrong key work
        t0 = time.monotonic()
        with pytest.raises(AggregatorUnreachable, match="encrypts with CURVE .* AGGNET_SERVER_KEY"):
            Client(svc.address, job=_job(), rank=0, world_size=1, connect_timeout=30)
        assert time.monotonic() - t0 < 10
        wrong = make_curve_keys(path + "-other")
        t0 = time.monotonic()
        with pytest.raises(AggregatorUnreachable, match="server key is not the service's public key"):
            Client(svc.address, job=_job(), rank=0, world_size=1, connect_timeout=30, server_key=wrong)
        assert time.monotonic() - t0 < 10


def _zmtp_greeting() -> bytes:
    """ZMTP 3.0's greeting with the NULL mechanism, as a server."""
    return b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\0") + b"\x01" + bytes(31)


def _zmtp_ready() -> bytes:
    prop = b"Socket-Type"
    body = b"\x05READY" + bytes([len(prop)]) + prop + (6).to_bytes(4, "big") + b"ROUTER"
    return bytes([0x04, len(body)]) + body


def test_a_peer_that_drops_every_connection_before_a_word_is_named_at_once():
    """What a CURVE service can look like to a worker without its key when
    the close outruns the handshake's failure (a loaded machine): each
    connection taken and dropped before a word, which ZeroMQ reports only as
    a disconnection. The peer here completes ZMTP's handshake and hangs up.
    The worker says so within seconds instead of waiting out its connect
    timeout."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def drop_all():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(2)
                try:
                    conn.sendall(_zmtp_greeting())
                    got = b""
                    while len(got) < 64:  # the worker's greeting
                        got += conn.recv(64 - len(got)) or b"x" * 64
                    conn.sendall(_zmtp_ready())
                    conn.recv(256)  # the worker's READY
                except OSError:
                    pass

    t = threading.Thread(target=drop_all, daemon=True)
    t.start()
    try:
        from aggnet.errors import AggregatorUnreachable

        t0 = time.monotonic()
        with pytest.raises(AggregatorUnreachable, match="encrypts with CURVE .* closed 3 connections before answering"):
            Client(f"zmq+tcp://127.0.0.1:{listener.getsockname()[1]}", job=_job(), rank=0, world_size=1,
                   connect_timeout=30)
        assert time.monotonic() - t0 < 10
    finally:
        stop.set()
        t.join(5)
        listener.close()


def test_a_peer_that_dies_half_way_through_the_handshake_is_not_taken_for_a_refusal():
    """A shard killed while a worker connects to it dies half-way through
    ZeroMQ's handshake, which ZeroMQ reports as a handshake that failed
    without a reason, the same event as a wrong CURVE key's. Taken for a
    refusal, the worker's JOIN failed at once, before the shard's
    successor could take it (the worker died, and its job waited out the
    stall timeout for it). Once is a death, not a refusal: the connection
    goes on to whatever listens on the port next."""
    from aggnet.protocol.address import parse
    from aggnet.transport import listen

    dying = socket.create_server(("127.0.0.1", 0))
    port = dying.getsockname()[1]
    address = parse(f"zmq+tcp://127.0.0.1:{port}")
    conn = connect([address])
    try:
        dying.settimeout(5)
        peer, _ = dying.accept()
        with peer:
            peer.settimeout(5)
            peer.sendall(_zmtp_greeting()[:11])  # the greeting's first part, then the kill
            peer.recv(11)
        dying.close()
        deadline = time.monotonic() + 10
        gone = []
        while not gone and time.monotonic() < deadline:
            conn.recv(0.05)
            gone = conn.gone()
        assert gone == [0], "the worker never heard the connection close"
        assert conn.refused() == {}
        successor = listen(address)
        try:
            conn.send(0, Header(MsgType.HELLO).pack())
            msg = successor.recv(10)
            assert msg is not None and wire.unpack_header(msg.header).msg_type == MsgType.HELLO
            assert conn.refused() == {}
        finally:
            successor.close()
    finally:
        conn.close()


def test_a_refused_handshake_is_heard_by_a_worker_descheduled_after_its_connect(monkeypatch):
    """libzmq reports a refused handshake once and does not reconnect, and
    it can finish before the worker's next line runs on a loaded machine: a
    worker that began listening for it only after its connect waited out its
    whole connect timeout. The worker here stops for half a second right
    after each connect; the peer is a plain ZeroMQ socket with CURVE."""
    import zmq

    from aggnet.errors import AggregatorUnreachable

    public, secret = zmq.curve_keypair()
    ctx = zmq.Context.instance()
    server = ctx.socket(zmq.ROUTER)
    server.curve_server = True
    server.curve_publickey, server.curve_secretkey = public, secret
    port = server.bind_to_random_port("tcp://127.0.0.1")
    connect = zmq.Socket.connect

    def descheduled_after(sock, addr):
        out = connect(sock, addr)
        time.sleep(0.5)
        return out

    monkeypatch.setattr(zmq.Socket, "connect", descheduled_after)
    try:
        t0 = time.monotonic()
        with pytest.raises(AggregatorUnreachable, match="encrypts with CURVE .* AGGNET_SERVER_KEY"):
            Client(f"zmq+tcp://127.0.0.1:{port}", job=_job(), rank=0, world_size=1, connect_timeout=30)
        assert time.monotonic() - t0 < 10
    finally:
        server.close(linger=0)


# -- faults ---------------------------------------------------------------------------------


def test_a_killed_worker_is_named_and_its_job_freed(service):
    job = _job()
    code = f"""
import numpy as np, time
from aggnet import Client
c = Client({service.address!r}, job={job!r}, rank=1, world_size=2)
print("joined", flush=True)
time.sleep(60)
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "joined"
        with Client(service.address, job=job, rank=0, world_size=2, timeout=2) as c:
            proc.kill()
            proc.wait()
            # named by its closed connection where the transport tells (ZeroMQ),
            # else by the stall check
            with pytest.raises(AggregationTimeout, match=r"rank\(s\) \[1\]|rank 1 of job .* lost its connection"):
                c.allreduce(np.ones(1000, np.float32)).result(timeout=30)
    finally:
        proc.kill()
    # rank 0 left; rank 1 never will, but the job's slots are all given up
    stats = query(service.address)
    assert all(s["jobs"].get(job, {}).get("open_slots", 0) == 0 for s in stats["shards"])


# -- the embedded default ---------------------------------------------------------------------


RANK0 = """
import sys
import numpy as np
from aggnet import Client
c = Client(job=sys.argv[1], rank=0, world_size=2)
print(c.address, flush=True)
buf = np.full(1000, 1, np.int32)
c.allreduce(buf).result(timeout=30)
print(int(buf[0]), flush=True)
c.close()
"""


def test_the_embedded_aggregator_outlives_rank_0_and_leaves_no_files():
    from aggnet.client.embedded import key_path

    job = _job()
    rank0 = subprocess.Popen([sys.executable, "-c", RANK0, job], stdout=subprocess.PIPE, text=True)
    c1 = None
    try:
        address = rank0.stdout.readline().strip()
        sock = address.split("://", 1)[1]
        c1 = Client(job=job, rank=1, world_size=2)
        assert c1.address == address  # rank 1 found rank 0's process's service
        c1.allreduce(np.full(1000, 2, np.int32)).result(timeout=30)
        assert rank0.stdout.readline().strip() == "3"
        assert rank0.wait(30) == 0  # rank 0's process finished first
        assert os.path.exists(sock), "rank 0's exit stopped the aggregator under rank 1"
        # rank 1 alone cannot complete a world-2 all-reduce, but the
        # service is there to tell it who is missing
        c1.config = c1.config.replace(timeout=2.0)
        with pytest.raises((AggregationTimeout, AggregationError)) as err:
            c1.allreduce(np.ones(10, np.int32)).result(timeout=30)
        assert "0" in str(err.value)
    finally:
        if c1 is not None:
            c1.close()
        if rank0.poll() is None:
            rank0.kill()
            rank0.wait()
    deadline = time.monotonic() + 15
    left = [sock, sock + ".lock", key_path(job), sock[:-len(".sock")] + ".keys"]
    while time.monotonic() < deadline and any(os.path.exists(p) for p in left):
        time.sleep(0.1)
    assert not [p for p in left if os.path.exists(p)]


def test_jobs_of_one_process_share_its_embedded_aggregator():
    """Each process group of a run is a job: torch builds several, and each
    used to start a service of its own (about a second each)."""
    jobs = [_job() for _ in range(3)]
    clients = []
    try:
        t0 = time.monotonic()
        clients.append(Client(job=jobs[0], rank=0, world_size=1))
        first = time.monotonic() - t0
        t0 = time.monotonic()
        clients += [Client(job=j, rank=0, world_size=1) for j in jobs[1:]]
        later = (time.monotonic() - t0) / 2
        assert len({c.address for c in clients}) == 1
        # the service learned the later jobs' keys as they came: each sums
        for c in clients:
            buf = np.arange(100, dtype=np.int32)
            c.allreduce(buf).result(timeout=30)
            assert (buf == np.arange(100)).all()
        assert later < first, (first, later)
    finally:
        for c in clients:
            c.close()


def test_a_job_created_on_a_running_keyed_service_needs_no_restart(tmp_path):
    path = str(tmp_path / "keys.json")
    keys.write_job_key(path, "first")
    with ServiceProcess("zmq+tcp://127.0.0.1:0", shards=1, args=["--keys", path]) as svc:
        later = keys.write_job_key(path, "later")  # aggnet job create later --keys FILE
        with Client(svc.address, job="later", rank=0, world_size=1, job_key=later, connect_timeout=10) as c:
            buf = np.ones(10, np.int32)
            c.allreduce(buf).result(timeout=30)
            assert (buf == 1).all()


# -- the switch path ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def switch_keyed():
    path = os.path.join(_tmpdir(), "keys.json")
    key = keys.write_job_key(path, "sw")
    with ServiceProcess("udp://127.0.0.1:0", shards=1, args=["--mode", "switch", "--keys", path,
                                                              "--elements", "256"]) as svc:
        yield svc, key


def _switch_pair(address, job, sizes=(3000, 3000), dtype=np.int32, **opts):
    def run(rank):
        with Client(address, job=job, rank=rank, world_size=2, **opts) as c:
            buf = np.full(sizes[rank], rank + 1, dtype)
            try:
                c.allreduce(buf).result(timeout=60)
            except Exception as exc:
                return exc
            return buf
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return list(pool.map(run, range(2)))


def test_switch_mode_takes_signed_joins_only(switch_keyed):
    svc, key = switch_keyed
    r = _switch_pair(svc.address, "sw", job_key=key)
    assert all(isinstance(b, np.ndarray) and (b == 3).all() for b in r), r
    with pytest.raises(AggregationError, match="not signed"):
        Client(svc.address, job="sw", rank=0, world_size=2, connect_timeout=5)
    # a recorded JOIN sent again from another address is a replay
    h = Header(MsgType.JOIN, job_id=wire_job_id("sw"), sender=0, world=2)
    fields = {"name": "sw", "world": 2}
    payload = wire.json_payload({**fields, "auth": keys.sign(bytes.fromhex(key), "JOIN", h.job_id, 0, 2, fields)})
    host, port = svc.address.split("//")[1].rsplit(":", 1)
    replies = []
    for _ in range(2):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(3)
            s.sendto(h.pack_for(payload) + payload, (host, int(port)))
            replies.append(wire.unpack_header(s.recv(65536)))
    assert replies[0].msg_type == MsgType.JOIN_OK and replies[1].msg_type == MsgType.ERROR
    totals = query(svc.address)["totals"]
    assert totals.get("dropped_auth_replay", 0) >= 1 and totals.get("dropped_auth_missing", 0) >= 1


def wire_job_id(name: str) -> int:
    from aggnet.protocol.wire import job_id_of

    return job_id_of(name)


@pytest.mark.parametrize("sizes, dtype", [((3000, 4000), np.int32), ((2000, 2600), np.float32)])
def test_switch_buffers_of_different_sizes_are_a_job_mismatch_on_every_rank(switch_keyed, sizes, dtype):
    svc, key = switch_keyed
    results = _switch_pair(svc.address, "sw", sizes, dtype, job_key=key, timeout=10)
    for r in results:
        assert isinstance(r, JobMismatch), results


def test_switch_client_drops_results_from_anyone_but_the_aggregator(switch_keyed):
    svc, key = switch_keyed
    stop = threading.Event()
    forged = Header(MsgType.RESULT, job_id=wire_job_id("sw"), dtype=wire.DType.INT32, count=256, ref=2)

    def forge(clients):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            while not stop.is_set():
                for c in clients:
                    for slot in range(8):
                        forged.index = slot
                        for tag in range(1, 4):
                            forged.ref = tag
                            s.sendto(forged.pack() + np.full(256, 7 << 24, ">i4").tobytes(),
                                     ("127.0.0.1", c.dsock.address[1]))
                time.sleep(0.001)
    clients = [Client(svc.address, job="sw", rank=r, world_size=2, job_key=key) for r in range(2)]
    t = threading.Thread(target=forge, args=(clients,), daemon=True)
    t.start()
    try:
        for _ in range(20):
            bufs = [np.full(5000, r + 1, np.int32) for r in range(2)]
            for f in [c.allreduce(b) for c, b in zip(clients, bufs)]:
                f.result(timeout=30)
            assert all((b == 3).all() for b in bufs)
        assert sum(c.stats.dropped_replies for c in clients) > 0
    finally:
        stop.set()
        t.join()
        for c in clients:
            c.close()


def test_a_signed_udp_stats_draws_the_whole_answer_unpadded(tmp_path):
    from aggnet.client.switch import udp_request

    path = str(tmp_path / "keys.json")
    key = keys.write_job_key(path, "secure")
    with ServiceProcess("udp://127.0.0.1:0", shards=1, args=["--mode", "switch", "--keys", path]) as svc:
        host, port = svc.address[len("udp://"):].rsplit(":", 1)
        with Client(svc.address, job="secure", rank=0, world_size=1, job_key=key), \
                socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            payload = stats_request("secure", bytes.fromhex(key))
            reply = udp_request(s, (host, int(port)), MsgType.STATS, payload, MsgType.STATS_OK, 5.0, "STATS")
            assert "secure" in reply["jobs"]
            assert len(wire.json_payload(reply)) > len(payload)  # larger than the request, and not padded
            assert "padding_asked" not in reply["totals"]


def test_a_job_whose_members_went_silent_is_reclaimed_and_a_returning_member_joins_again():
    # workers killed without LEAVE (or junk JOINs) left their jobs behind
    # for the service's lifetime; a lease now reclaims them
    with ServiceProcess("zmq+tcp://127.0.0.1:0", shards=1, args=["--job-lease", "1"]) as svc:
        job = f"lease-{uuid.uuid4().hex[:6]}"
        with Client(svc.address, job=job, rank=0, world_size=1, timeout=10) as c:
            a = np.ones(1000, np.float32)
            c.allreduce(a).result(10)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                shard = query(svc.address)["shards"][0]
                if shard["counters"].get("jobs_reclaimed"):
                    break
                time.sleep(0.1)
            assert shard["counters"].get("jobs_reclaimed") == 1 and job not in shard["jobs"], shard
            b = np.full(1000, 2, np.float32)
            c.allreduce(b).result(10)  # told NOT_JOINED, it joined again and finished the round
            assert (b == 2).all() and c.stats.rejoins == 1
        with Client(svc.address, job=job, rank=0, world_size=1, timeout=10, resume=False) as c:
            c.allreduce(np.ones(1000, np.float32)).result(10)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and job in query(svc.address)["shards"][0]["jobs"]:
                time.sleep(0.1)
            with pytest.raises(AggregationError, match="not registered on this aggregator"):
                c.allreduce(np.ones(10, np.float32)).result(10)
            b = np.full(1000, 2, np.float32)
            c.allreduce(b).result(10)  # without resume: the next all-reduce joins again
            assert (b == 2).all()
    r = subprocess.run([sys.executable, "-m", "aggnet", "serve", "--listen", "zmq+tcp://127.0.0.1:0", "--job-lease",
                        "0"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "--job-lease must be a positive" in r.stderr and "Traceback" not in r.stderr


def test_a_frame_larger_than_any_message_is_refused_unbuffered():
    """A listener takes no frame over MAX_MESSAGE_BYTES: the sender is
    disconnected before the frame is buffered, and the shard goes on."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    from aggnet.protocol.limits import MAX_MESSAGE_BYTES
    from aggnet.transport.zmq import zmq_endpoint
    from aggnet.protocol.address import parse

    with ServiceProcess("zmq+tcp://127.0.0.1:0", shards=1) as svc:
        shard = _shards(svc.address)[0]
        pid = query(svc.address)["shards"][0]["pid"]
        before = peak_rss(pid)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            sock.connect(zmq_endpoint(parse(shard)))
            h = Header(MsgType.PUSH, job_id=1, count=(MAX_MESSAGE_BYTES >> 2) + 1024, dtype=wire.DType.FLOAT32)
            sock.send_multipart([h.pack(), bytes(MAX_MESSAGE_BYTES + 4096)], copy=False)
            assert monitor.poll(20_000), "the shard kept the connection of a peer sending an oversized frame"
            assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
        assert peak_rss(pid) - before < MAX_MESSAGE_BYTES // 2
        r = _allreduce_pair(svc.address, _job())
        assert all(isinstance(b, np.ndarray) and (b == 3).all() for b in r), r
        assert query(svc.address)["shards"][0]["pid"] == pid


def test_a_chunk_size_over_the_message_bound_is_refused_in_one_line():
    from aggnet.protocol.limits import MAX_MESSAGE_BYTES

    with pytest.raises(ValueError, match=r"chunk_bytes must be between 64 B and 64 MiB"):
        Client("zmq+tcp://127.0.0.1:9", job=_job(), chunk_bytes=MAX_MESSAGE_BYTES + 4)


def test_printed_keys_survive_a_paste_into_a_shell_and_a_job_key_is_not_replaced_by_accident(tmp_path):
    """Z85 CURVE keys hold shell metacharacters: the printed export line,
    run by a shell, sets exactly the key in the file. `job create` refuses a
    job that has a key (its workers hold it) unless told --replace, and
    `job show` prints the one there is."""
    secret = tmp_path / "curve"
    made = subprocess.run([sys.executable, "-m", "aggnet", "job", "curve-keys", str(secret)],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    from aggnet.transport.zmq import load_curve_secret

    public = load_curve_secret(str(secret)).public.decode()
    echoed = subprocess.run(["bash", "-c", made.stdout + 'printf %s "$AGGNET_SERVER_KEY"'], capture_output=True,
                            text=True, timeout=30)
    assert echoed.stdout == public
    keyfile = str(tmp_path / "keys.json")

    def job(*args):
        return subprocess.run([sys.executable, "-m", "aggnet", "job", *args, "--keys", keyfile], capture_output=True,
                              text=True, timeout=60)

    first = job("create", "train")
    assert first.returncode == 0, first.stderr
    again = job("create", "train")
    assert again.returncode == 1 and "has a key" in again.stderr and "Traceback" not in again.stderr
    assert job("show", "train").stdout == first.stdout
    replaced = job("create", "train", "--replace")
    assert replaced.returncode == 0 and replaced.stdout != first.stdout
    missing = job("show", "other")
    assert missing.returncode == 1 and "aggnet job create other" in missing.stderr


def _port_after_two_free(held: socket.socket) -> int:
    """Bind ``held`` to a port whose two below are free (a service that
    listens there takes them, and the port held: the collision this test
    wants); another test's service on one of them would be a different
    error."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port < 1026:
            continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port - 2))
                b.bind(("127.0.0.1", port - 1))
            held.bind(("127.0.0.1", port))
        except OSError:
            continue
        held.listen()
        return port
    raise AssertionError("no port with its two below free in 50 tries")


def test_a_second_service_on_a_port_in_use_is_named_as_such():
    """A second `aggnet serve` at a running service's address says a
    service runs there; one whose shard ports collide says which ports a
    service takes."""
    with ServiceProcess("zmq+tcp://127.0.0.1:0", shards=1) as svc:
        r = subprocess.run([sys.executable, "-m", "aggnet", "serve", "--listen", svc.address, "--shards", "1"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0
        assert f"an aggnet service already runs at {svc.address}" in r.stderr and "Traceback" not in r.stderr
    with socket.socket() as held:
        port = _port_after_two_free(held)
        r = subprocess.run([sys.executable, "-m", "aggnet", "serve", "--listen", f"zmq+tcp://127.0.0.1:{port - 2}",
                            "--shards", "4"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "a service takes its control port and the 4 after it" in r.stderr and "Traceback" not in r.stderr


def test_stats_reads_as_a_summary_and_as_json_on_request(service):
    job = _job()
    clients = []
    try:
        def join(rank):
            clients.append(Client(service.address, job=job, rank=rank, world_size=2))
        ts = [threading.Thread(target=join, args=(r,)) for r in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        for f in [c.allreduce(np.ones(1 << 16, np.float32)) for c in clients]:
            f.result(30)
        text = subprocess.run([sys.executable, "-m", "aggnet", "stats", service.address], capture_output=True,
                              text=True, timeout=60)
        assert text.returncode == 0, text.stderr
        assert text.stdout.startswith(f"aggnet service at {service.address}: 2 shard(s) at zmq+")
        assert f"  {job}: world 2, members [0, 1]" in text.stdout and "{" not in text.stdout
        assert len(text.stdout.splitlines()) < 20
        raw = subprocess.run([sys.executable, "-m", "aggnet", "stats", service.address, "--json"],
                             capture_output=True, text=True, timeout=60)
        assert any(job in s["jobs"] for s in json.loads(raw.stdout)["shards"])
    finally:
        for c in clients:
            c.close()


def test_a_job_name_used_again_in_one_process_joins_its_embedded_aggregator_again():
    job = _job()
    for value in (1, 2):
        with Client(job=job, rank=0, world_size=1, connect_timeout=10) as c:
            buf = np.full(10, value, np.int32)
            c.allreduce(buf).result(timeout=30)
            assert (buf == value).all()
