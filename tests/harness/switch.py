"""Two aggregators behind one interface, for differential tests: the P4
program on BMv2 (frames in and out of veth ports) and the aggregator host
in switch mode (datagrams in and out of UDP sockets). Both see the same
workers and the same parent, and report what each endpoint received."""

from __future__ import annotations

import select
import socket
import struct
import time
import uuid

from aggnet.protocol import wire
from aggnet.protocol.wire import job_id_of
from aggnet.processes import ServiceProcess
from aggnet.protocol.limits import SWITCH_PORT
from aggnet.protocol.wire import HEADER_SIZE, Header, MsgType
from harness.helpers import free_ports

K = 64
WORKERS = 4
PARENT = "parent"
FOREIGN = "foreign"
#: every protocol, for the packet sockets that capture what BMv2 sends
ETH_P_ALL = 0x0003
#: worker 0's address at another UDP port: another process on its host
MOVED = "moved"
SWITCH_IP = "10.78.0.253"
SWITCH_MAC = "02:a6:6e:00:00:fe"
PARENT_IP = "10.78.0.200"
PARENT_MAC = "02:00:00:00:00:c8"


def endpoints():
    return list(range(WORKERS)) + [PARENT, FOREIGN]


#: seconds a collection waits for packets beyond those it expects
EXTRA_WAIT = 0.05


def gather(socks: dict, wait: float, read, expected: dict | None = None) -> dict:
    """What each endpoint's socket received within ``wait`` seconds;
    ``read(sock)`` returns the aggnet bytes of one packet, or None to skip it.
    Once ``expected`` (endpoint -> packets, not empty) have all arrived, it
    waits EXTRA_WAIT more for any the other side sent beyond them; silence
    is only ever confirmed by the whole ``wait``."""
    got = {ep: [] for ep in socks}
    owner = {s: ep for ep, s in socks.items()}
    deadline = time.monotonic() + wait
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select(list(socks.values()), [], [], left)
        for s in ready:
            data = read(owner[s], s)
            if data is not None:
                got[owner[s]].append(data)
        if expected and all(len(got[ep]) >= n for ep, n in expected.items()):
            deadline = min(deadline, time.monotonic() + EXTRA_WAIT)
            expected = None
    return got


def _drain_join(data) -> bool:
    return len(data) >= HEADER_SIZE and data[3] == MsgType.JOIN


class HostAggregator:
    """hosts/switch.py in a real `aggnet serve --mode switch` process;
    workers, a foreign host and a parent are UDP sockets on 127.0.0.x."""

    kind = "host"

    def __init__(self):
        self.socks = {}
        for ep, ip in [(i, f"127.0.0.{10 + i}") for i in range(WORKERS)] + [(PARENT, "127.0.0.200"),
                                                                                (FOREIGN, "127.0.0.99"),
                                                                                (MOVED, "127.0.0.10")]:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind((ip, 0))
            self.socks[ep] = s
        self.flat = ServiceProcess("udp://127.0.0.1:0", args=["--mode", "switch", "--elements", str(K), "--shards", "1"])
        parent_addr = self.socks[PARENT].getsockname()
        self.rack = ServiceProcess("udp://127.0.0.1:0", args=[
            "--mode", "switch", "--elements", str(K), "--shards", "1", "--parent", f"udp://{parent_addr[0]}:{parent_addr[1]}",
            "--rack-id", "1", "--racks", "2"])
        self.target = None

    def install(self, name: str, world: int, slots: int, uplink: bool) -> None:
        svc = self.rack if uplink else self.flat
        host, port = svc.address[len("udp://"):].rsplit(":", 1)
        self.target = (host, int(port))
        self.job = name
        self.world = world
        # a host aggregator installs a job when its members JOIN: each
        # worker joins now (the test then sends JOINs of its own too)
        for rank in range(world):
            h = Header(MsgType.JOIN, job_id=job_id_of(name), sender=rank, world=world)
            payload = wire.json_payload({"name": name, "slots": slots, "elements": K})
            self._send_raw(rank, h.pack_for(payload) + payload)
            if uplink and rank == 0:
                self._answer_parent_join()
        if not uplink:
            # every member's JOIN answered before the test's first packet (a
            # slow first answer would otherwise land among its outputs); a
            # rack's members hear only once the parent, played by the test
            # with one answer, took the job: those are drained below
            for rank in range(world):
                self._await_join_ok(rank)
        self.collect(0.3)

    def _await_join_ok(self, rank: int, timeout: float = 10.0) -> None:
        s = self.socks[rank]
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            r, _, _ = select.select([s], [], [], max(0.0, left))
            assert r, f"rank {rank}'s JOIN was not answered within {timeout:g}s"
            data, _ = s.recvfrom(65536)
            if wire.unpack_header(data).msg_type in (MsgType.JOIN_OK, MsgType.ERROR):
                return

    def _answer_parent_join(self) -> None:
        s = self.socks[PARENT]
        r, _, _ = select.select([s], [], [], 5)
        assert r, "the rack did not ask its parent to join"
        data, src = s.recvfrom(65536)
        h = wire.unpack_header(data)
        assert h.msg_type == MsgType.JOIN
        reply = Header(MsgType.JOIN_OK, job_id=h.job_id, sender=h.sender, world=h.world)
        s.sendto(reply.pack_for(b"{}") + b"{}", src)

    def remove(self) -> None:
        for rank in range(self.world):
            self._send_raw(rank, Header(MsgType.LEAVE, job_id=job_id_of(self.job), sender=rank).pack())
        time.sleep(0.1)

    def _send_raw(self, ep, data: bytes) -> None:
        self.socks[ep].sendto(data, self.target)

    def send(self, ep, data: bytes) -> None:
        if ep == PARENT:
            # the parent talks to the rack's aggregation port
            self.socks[PARENT].sendto(data, self.target)
        else:
            self._send_raw(ep, data)

    def collect(self, wait: float = 0.3, expected: dict | None = None) -> dict:
        def read(ep, s):
            data, _ = s.recvfrom(65536)
            if ep == PARENT and _drain_join(data):
                return None  # the rack asking its parent in: not a data packet
            return bytes(data)

        return gather(self.socks, wait, read, expected)

    def drops(self) -> dict:
        from aggnet.client.switch import query_stats

        out = {}
        for svc in (self.flat, self.rack):
            for k, v in query_stats(svc.address)["totals"].items():
                if k.startswith("dropped_"):
                    out[k[len("dropped_"):]] = out.get(k[len("dropped_"):], 0) + v
        return out

    def close(self) -> None:
        self.flat.stop()
        self.rack.stop()
        for s in self.socks.values():
            s.close()


def _mac_bytes(mac: str) -> bytes:
    return bytes(int(x, 16) for x in mac.split(":"))


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def frame(src_mac: str, dst_mac: str, src_ip: str, dst_ip: str, sport: int, dport: int, payload: bytes) -> bytes:
    udp_len = 8 + len(payload)
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + udp_len, 0, 0x4000, 64, 17, 0,
                     socket.inet_aton(src_ip), socket.inet_aton(dst_ip))
    ip = ip[:10] + struct.pack("!H", _checksum(ip)) + ip[12:]
    udp = struct.pack("!HHHH", sport, dport, udp_len, 0)
    return _mac_bytes(dst_mac) + _mac_bytes(src_mac) + b"\x08\x00" + ip + udp + payload


class Bmv2Aggregator:
    """The P4 program on BMv2: worker i on port i, the parent on port
    WORKERS, a foreign host on port WORKERS + 1; frames injected and
    captured on the veth peers."""

    kind = "bmv2"

    def __init__(self):
        from aggnet.emulation.bmv2 import Bmv2Switch, veth_pairs
        from aggnet.p4.control import SwitchControl

        self.ifaces = [f"agx{i}" for i in range(WORKERS + 2)]
        self.switch = self.ctl = None
        self.socks = {}
        try:
            self._start(Bmv2Switch, veth_pairs, SwitchControl)
        except BaseException:
            # a switch left running holds its ports and this run's interfaces,
            # and the control plane's threads keep the test process alive
            self.close()
            raise

    def _start(self, Bmv2Switch, veth_pairs, SwitchControl) -> None:
        veth_pairs(self.ifaces)
        grpc_port, thrift_port = free_ports(2)
        self.switch = Bmv2Switch({i: n for i, n in enumerate(self.ifaces)}, grpc_port=grpc_port,
                                 thrift_port=thrift_port)
        self.ctl = SwitchControl(self.switch.grpc_addr, switch_ip=SWITCH_IP, switch_mac=SWITCH_MAC,
                                 thrift_port=thrift_port).connect(load_pipeline=True)
        self.port_of = {i: i for i in range(WORKERS)}
        self.port_of[PARENT] = WORKERS
        self.port_of[FOREIGN] = WORKERS + 1
        self.addr = {i: (f"10.78.0.{i + 1}", f"02:00:00:00:00:{i + 1:02x}", 40000 + i) for i in range(WORKERS)}
        self.addr[PARENT] = (PARENT_IP, PARENT_MAC, SWITCH_PORT)
        self.addr[FOREIGN] = ("10.78.0.99", "02:00:00:00:00:63", 40099)
        self.addr[MOVED] = (self.addr[0][0], self.addr[0][1], 40050)  # sent from worker 0's port, read by no one
        for ep, p in self.port_of.items():
            # protocol 0 until bound: a packet socket made for every protocol
            # takes frames of every interface (loopback's aggnet traffic of
            # the other pytest worker too) until bind() names its one
            s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
            s.bind((f"{self.ifaces[p]}p", ETH_P_ALL))
            self.socks[ep] = s
        self.job = None
        self.ctl.set_flood(list(range(len(self.ifaces))))
        self._wait_forwarding()

    def _wait_forwarding(self, timeout: float = 10.0) -> None:
        """BMv2 takes a moment to attach to fresh interfaces: flood a frame
        from port 0 until it shows up on port 1."""
        probe = b"\xff" * 6 + bytes.fromhex("020000000001") + b"\x88\xb5" + b"aggnet-ready" + bytes(40)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.socks[0].send(probe)
            r, _, _ = select.select([self.socks[1]], [], [], 0.2)
            while r:
                data, info = self.socks[1].recvfrom(65536)
                if info[2] != socket.PACKET_OUTGOING and b"aggnet-ready" in data:
                    self.collect(0.2)  # drain the other copies
                    return
                r, _, _ = select.select([self.socks[1]], [], [], 0.05)
        raise RuntimeError("BMv2 did not forward a frame within 10s")

    def install(self, name: str, world: int, slots: int, uplink: bool) -> None:
        from aggnet.p4.control import Member, Uplink

        members = [Member(self.addr[i][0], self.addr[i][1], self.port_of[i]) for i in range(world)]
        up = Uplink(PARENT_IP, PARENT_MAC, self.port_of[PARENT], rack_id=1) if uplink else None
        self.ctl.install_job(name, members, slots=slots, uplink=up)
        self.job = name
        # a member's PUSH and PROBE are admitted from the UDP port it joined
        # from: each joins now, as on the host aggregator (the test then
        # sends JOINs of its own too)
        for rank in range(world):
            h = Header(MsgType.JOIN, job_id=job_id_of(name), sender=rank, world=world)
            payload = wire.json_payload({"name": name, "slots": slots, "elements": K})
            self.send(rank, h.pack_for(payload) + payload)
        self.collect(0.3)

    def remove(self) -> None:
        self.ctl.remove_job(self.job)

    def send(self, ep, data: bytes) -> None:
        ip, mac, port = self.addr[ep]
        self.socks[0 if ep == MOVED else ep].send(frame(mac, SWITCH_MAC, ip, SWITCH_IP, port, SWITCH_PORT, data))

    def collect(self, wait: float = 0.3, expected: dict | None = None) -> dict:
        def read(ep, s):
            data, info = s.recvfrom(65536)
            if info[2] == socket.PACKET_OUTGOING:
                return None  # our own injection
            if info[0] != f"{self.ifaces[self.port_of[ep]]}p":
                return None  # another interface's frame
            if len(data) < 42 or data[12:14] != b"\x08\x00" or data[23] != 17:
                return None  # not UDP over IPv4
            udp = 14 + (data[14] & 0xF) * 4
            body = data[udp + 8:]
            if len(body) < 2 or body[:2] != b"\xa6\x6e":
                return None
            dst_ip = socket.inet_ntoa(data[30:34])
            dport = struct.unpack("!H", data[udp + 2:udp + 4])[0]
            # results must be addressed to the endpoint that receives them
            assert dst_ip == self.addr[ep][0] and dport == self.addr[ep][2], (ep, dst_ip, dport)
            return bytes(body)

        return gather(self.socks, wait, read, expected)

    def drops(self) -> dict:
        return dict(self.ctl.counters()["drops"])

    def close(self) -> None:
        from aggnet.emulation.bmv2 import delete_veths

        try:
            if self.ctl is not None:
                self.ctl.close()
        finally:
            if self.switch is not None:
                self.switch.stop()
            for s in self.socks.values():
                s.close()
            delete_veths(self.ifaces)


def job_name() -> str:
    return f"diff-{uuid.uuid4().hex[:6]}"
