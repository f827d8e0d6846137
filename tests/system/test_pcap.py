"""Captures of aggnet traffic decode: every header field and payload of
messages written to a pcap come back, on the switch port and off it, one
datagram or a GSO batch; and a capture of a real switch-protocol job in an
emulated rack shows its pushes and the sums the aggregator sent back."""

from __future__ import annotations

import json
import select
import shutil
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

pytest.importorskip("scapy", reason="decoding captures needs scapy (pip install aggnet[pcap])")

from hypothesis import given, settings, strategies as st  # noqa: E402
from scapy.layers.inet import IP, TCP, UDP  # noqa: E402
from scapy.layers.l2 import Ether  # noqa: E402
from scapy.packet import Raw  # noqa: E402
from scapy.utils import wrpcap  # noqa: E402

from aggnet.protocol import wire  # noqa: E402
from aggnet.cli import main as cli
from aggnet.protocol import pcap
from aggnet.protocol.wire import job_id_of  # noqa: E402
from aggnet.emulation.netns import Rack, can_emulate  # noqa: E402
from aggnet.protocol.limits import SWITCH_PORT  # noqa: E402
from aggnet.protocol.wire import DType, Flag, Header, MsgType  # noqa: E402

NUMERIC = {DType.FLOAT32: np.float32, DType.INT32: np.int32, DType.FLOAT16: np.float16, DType.INT16: np.int16}


def message(h: Header, values) -> bytes:
    """Header and payload as a worker or an aggregator sends them."""
    if h.dtype == DType.NONE:
        payload = values.encode()
    else:
        order = "<" if h.flags & Flag.LITTLE_ENDIAN else ">"
        if h.dtype == DType.BFLOAT16:  # the top half of a float32
            payload = (np.asarray(values, np.float32).view(np.uint32) >> 16).astype(order + "u2").tobytes()
        else:
            payload = np.asarray(values, NUMERIC[h.dtype]).astype(np.dtype(NUMERIC[h.dtype]).newbyteorder(order)).tobytes()
    h.count = len(payload) // wire.ITEMSIZE[h.dtype]
    return h.pack() + payload


def header_fields(h: Header) -> dict:
    return {name: getattr(h, name) for name, _ in wire.HEADER_FIELDS if name not in ("magic", "version", "reserved")}


def udp(src: str, dst: str, sport: int, dport: int, data: bytes, t: float):
    pkt = Ether() / IP(src=src, dst=dst) / UDP(sport=sport, dport=dport) / Raw(data)
    pkt.time = t
    return pkt


SAMPLES = [
    (Header(MsgType.JOIN, job_id=job_id_of("j"), sender=1, world=2), json.dumps({"name": "j", "elements": 64})),
    (Header(MsgType.PUSH, job_id=0xDEADBEEF, round=7, index=3, sender=1, flags=Flag.VERSION | Flag.RETRANSMIT,
            dtype=DType.INT32, exponent=-20, next_exponent=5, world=2, ref=9, offset=2**40 + 5),
     [2**31 - 1, -(2**31), 0, 5]),
    (Header(MsgType.RESULT, job_id=0xDEADBEEF, round=7, index=3, dtype=DType.INT32, nsum=2, world=2, ref=9),
     np.arange(-3, 61)),
    (Header(MsgType.PUSH, job_id=1, flags=Flag.LITTLE_ENDIAN, dtype=DType.FLOAT32), [1.5, -2.25, 3e38]),
    (Header(MsgType.PUSH, job_id=1, flags=Flag.LITTLE_ENDIAN, dtype=DType.FLOAT16), [0.5, -65504.0]),
    (Header(MsgType.PUSH, job_id=1, dtype=DType.BFLOAT16), [1.0, -2.5, 2.0**100]),
    (Header(MsgType.RESULT, job_id=1, flags=Flag.LITTLE_ENDIAN | Flag.OP_MAX, dtype=DType.INT16, nsum=3),
     [-32768, 32767]),
    (Header(MsgType.ERROR, job_id=1), wire.error_payload(wire.ErrorCode.STALL, "rank 1 is missing").decode()),
]


def test_every_field_and_value_of_a_capture_round_trips(tmp_path):
    raws = [message(h, v) for h, v in SAMPLES]
    pkts = [udp("10.0.0.1", "10.0.0.254", 40000, SWITCH_PORT + i % 3, raw, 100 + i) for i, raw in enumerate(raws)]
    # off the switch port (DNS's, which scapy would dissect as DNS) and a
    # GSO batch of two messages in one datagram: found by the magic
    pkts.append(udp("10.0.0.254", "10.0.0.2", SWITCH_PORT, 53, raws[2], 200))
    pkts.append(udp("10.0.0.2", "10.0.0.254", 41000, SWITCH_PORT + 5, raws[1] + raws[2], 201))
    # not aggnet: skipped
    pkts.append(udp("10.0.0.3", "10.0.0.4", 5000, 5001, b"\xa6\x6e not a header", 202))
    pkts.append(Ether() / IP() / TCP(dport=SWITCH_PORT) / Raw(raws[1]))
    wrpcap(str(tmp_path / "c.pcap"), pkts)

    got = pcap.decode_pcap(tmp_path / "c.pcap")
    want = [*SAMPLES, SAMPLES[2], SAMPLES[1], SAMPLES[2]]
    assert len(got) == len(want)
    for rec, (h, values) in zip(got, want):
        assert {k: rec[k] for k in header_fields(h)} == header_fields(h)
        assert rec["magic"] == wire.MAGIC and rec["version"] == wire.VERSION and rec["reserved"] == 0
        if h.dtype == DType.NONE:
            assert rec["values"] == values
        else:
            want_values = np.asarray(values, np.float32 if h.dtype == DType.BFLOAT16 else NUMERIC[h.dtype])
            np.testing.assert_array_equal(rec["values"], want_values)
            assert rec["values"].dtype == want_values.dtype and rec["values"].dtype.isnative
    assert [(r["src"], r["dst"], r["sport"], r["dport"], r["time"]) for r in got[:2]] == [
        ("10.0.0.1", "10.0.0.254", 40000, SWITCH_PORT, 100.0), ("10.0.0.1", "10.0.0.254", 40000, SWITCH_PORT + 1, 101.0)]
    assert got[1]["msg_type"] is MsgType.PUSH and got[1]["dtype"] is DType.INT32
    assert got[-1]["sport"] == got[-2]["sport"] == 41000


@settings(max_examples=60, deadline=None)
@given(
    fields=st.fixed_dictionaries({
        "msg_type": st.sampled_from(list(MsgType)), "job_id": st.integers(0, 2**32 - 1),
        "round": st.integers(0, 2**32 - 1), "index": st.integers(0, 2**32 - 1), "sender": st.integers(0, 2**16 - 1),
        "flags": st.integers(0, 255).map(lambda f: f & ~Flag.SHM), "exponent": st.integers(-(2**15), 2**15 - 1),
        "next_exponent": st.integers(-(2**15), 2**15 - 1), "nsum": st.integers(0, 2**16 - 1),
        "world": st.integers(0, 2**16 - 1), "ref": st.integers(0, 2**32 - 1), "offset": st.integers(0, 2**64 - 1)}),
    values=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=40),
)
def test_the_layer_reads_and_writes_what_wire_does(fields, values):
    h = Header(dtype=DType.INT32, **fields)
    raw = message(h, values)
    (msg,) = pcap.messages(raw)
    assert {k: getattr(msg, k) for k in header_fields(h)} == header_fields(h)
    np.testing.assert_array_equal(msg.values(), np.asarray(values, np.int32))
    # and the layer builds what wire parses, counting the payload itself
    built = pcap.Aggnet(**{**fields, "dtype": "INT32", "data": raw[wire.HEADER_SIZE:]})
    assert wire.unpack_message(bytes(built))[0] == h


def test_bound_ports_dissect_in_scapy():
    pcap.bind_ports()
    raw = message(*SAMPLES[2])
    for sport, dport in ((40000, SWITCH_PORT + 63), (SWITCH_PORT, 40000)):
        pkt = Ether(bytes(Ether() / IP() / UDP(sport=sport, dport=dport) / Raw(raw)))
        assert pkt.haslayer(pcap.Aggnet) and pkt[pcap.Aggnet].index == 3
    assert "RESULT" in pkt[pcap.Aggnet].mysummary()


def test_the_command_prints_messages_and_a_summary(tmp_path, capsys):
    pkts = [udp("10.0.0.1", "10.0.0.254", 40000, SWITCH_PORT, message(h, v), 100 + i) for i, (h, v) in enumerate(SAMPLES)]
    wrpcap(str(tmp_path / "c.pcap"), pkts)
    assert cli.main(["pcap", str(tmp_path / "c.pcap")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["1.000000", "10.0.0.1:40000", ">", f"10.0.0.254:{SWITCH_PORT}", "PUSH", "job=deadbeef",
                                "round=7", "index=3", "count=4", "nsum=0", "world=2", "flags=VERSION|RETRANSMIT"]
    assert f"{len(SAMPLES)} aggnet messages" in lines[len(SAMPLES) + 1]
    assert cli.main(["pcap", "--summary", str(tmp_path / "c.pcap")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{len(SAMPLES)} aggnet messages") and out[2:4] == lines[-4:-2]
    # four pushes of 16, 12, 4 and 6 bytes, one resent; two results
    assert [line.split() for line in out[2:4]] == [["PUSH", "4", "38", "1"], ["RESULT", "2", "260", "0"]]


def test_the_command_says_what_is_wrong(tmp_path, capsys, monkeypatch):
    (tmp_path / "x.pcap").write_bytes(b"not a capture")
    assert cli.main(["pcap", str(tmp_path / "x.pcap")]) == 1
    assert "cannot read" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "scapy.utils", None)
    assert cli.main(["pcap", str(tmp_path / "x.pcap")]) == 2
    assert "pip install aggnet[pcap]" in capsys.readouterr().err


# -- a capture of a real job ---------------------------------------------------------------

OK, WHY = can_emulate()
K = 128
N = 16 * K + 5  # a short tail block, padded with zeros

WORKER = """
import json, sys, numpy as np
from aggnet import Client
rank, address, job, k, n = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
x = np.random.default_rng(rank).integers(-2**31, 2**31, n, dtype=np.int64).astype(np.int32)
with Client(address, job=job, rank=rank, world_size=2, elements=k, timeout=60, connect_timeout=60) as c:
    y = c.allreduce(x).result(60)
    print(json.dumps({"elements": c.elements, "result": y.tolist()}))
"""

#: a capture without tcpdump: scapy on the interface, every UDP frame
SNIFFER = """
import sys
from scapy.layers.inet import UDP
from scapy.sendrecv import sniff
from scapy.utils import PcapWriter
out = PcapWriter(sys.argv[2], sync=True)
sniff(iface=sys.argv[1], lfilter=lambda p: UDP in p, prn=out.write,
      started_callback=lambda: print("listening", file=sys.stderr, flush=True))
out.close()
"""


def inputs(rank: int) -> np.ndarray:
    return np.random.default_rng(rank).integers(-(2**31), 2**31, N, dtype=np.int64).astype(np.int32)


def wrapped_sum(arrays) -> np.ndarray:
    """int32 sum as the aggregator computes it: modulo 2**32."""
    return sum(a.astype(np.int64) for a in arrays).astype(np.int32)


def start_capture(rack: Rack, host, path) -> subprocess.Popen:
    """tcpdump (or scapy) on ``host``'s interface, returned once it listens."""
    if shutil.which("tcpdump"):
        cmd = ["tcpdump", "-i", host.dev, "-U", "--immediate-mode", "-Z", "root", "-w", str(path), "udp"]
    else:
        cmd = [sys.executable, "-c", SNIFFER, host.dev, str(path)]
    p = rack.popen(host, cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ready, _, _ = select.select([p.stderr], [], [], 1)
        if ready:
            line = p.stderr.readline()
            if "listening" in line:
                return p
            if not line:
                break
    p.kill()
    pytest.fail(f"`{' '.join(cmd[:2])}` did not start capturing: {p.stderr.read() if p.poll() is not None else ''}")


def stop_capture(p: subprocess.Popen, path) -> None:
    """Stop once the capture has written what it saw: on a loaded machine
    a capture may lag behind the traffic."""
    size, still_since, deadline = -1, time.monotonic(), time.monotonic() + 15
    while time.monotonic() < deadline and time.monotonic() - still_since < 1.0:
        time.sleep(0.1)
        now = path.stat().st_size if path.exists() else -1
        if now != size:
            size, still_since = now, time.monotonic()
    p.send_signal(signal.SIGINT)
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        # a sniffer blocked in its read can miss the signal; both captures
        # write packet by packet, so nothing is lost by stopping it harder
        p.kill()
        p.wait(10)


@pytest.mark.requires_netns
@pytest.mark.slow
@pytest.mark.skipif(not OK, reason=f"no network namespaces here: {WHY}")
def test_a_capture_of_a_rack_job_decodes(tmp_path):
    from aggnet.emulation import rack_runs

    job = f"pcap-{uuid.uuid4().hex[:6]}"
    path = tmp_path / "rack.pcap"
    with Rack(2, prefix="agc") as rack:
        agg = rack_runs.start_aggregator(rack)
        try:
            cap = start_capture(rack, rack.aggregator, path)
            workers = [rack.popen(h, [sys.executable, "-c", WORKER, str(rank), rack_runs.aggregator_address(rack), job,
                                      str(K), str(N)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                       for rank, h in enumerate(rack.workers)]
            outs = []
            for w in workers:
                out, err = w.communicate(timeout=90)
                assert w.returncode == 0, err[-2000:]
                outs.append(json.loads(out.splitlines()[-1]))
            stop_capture(cap, path)
        finally:
            agg.stop()

    total = wrapped_sum(inputs(r) for r in range(2))
    assert [o["elements"] for o in outs] == [K, K]
    assert all(np.array_equal(np.asarray(o["result"], np.int32), total) for o in outs)

    msgs = [m for m in pcap.decode_pcap(path) if m["job_id"] == job_id_of(job)]
    pushes = [m for m in msgs if m["msg_type"] is MsgType.PUSH]
    results = [m for m in msgs if m["msg_type"] is MsgType.RESULT]
    assert pushes and results, sorted({m["msg_type"].name for m in msgs})
    assert {m["sender"] for m in pushes} == {0, 1}
    for m in pushes + results:
        assert m["count"] == K and m["dtype"] is DType.INT32 and not m["flags"] & Flag.LITTLE_ENDIAN, m
        assert m["values"].shape == (K,)
    # each result is the sum of the pushes of its slot's use...
    pushed = {(m["round"], m["index"], m["ref"], m["sender"]): m["values"] for m in pushes}
    for m in results:
        key = (m["round"], m["index"], m["ref"])
        assert m["nsum"] == m["world"] == 2
        np.testing.assert_array_equal(m["values"], wrapped_sum(pushed[(*key, r)] for r in range(2)))
    # ...and together they carry the workers' sum, block by block
    padded = np.zeros(-(-N // K) * K, np.int32)
    padded[:N] = total
    by_offset = {}
    for m in results:
        by_offset.setdefault(m["offset"], []).append(m["values"])
    for start in range(0, N, K):
        assert any(np.array_equal(v, padded[start:start + K]) for v in by_offset.get(start, [])), start
