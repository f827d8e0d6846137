"""``aggnet bench-udp``: datagrams/s and MB/s the switch-protocol client
sustains, beside a raw Python UDP socket loop, on this machine, in one run.

The raw loop is the ceiling Python sockets allow: one process sends
datagrams of the same size as fast as it can, another receives them with
``recv_into`` into one buffer. The aggnet client all-reduces a float32
buffer alone (world size 1) through a switch-mode aggregator on loopback,
so each block makes one round trip: quantize, send, aggregator, receive,
dequantize. Its rate counts the datagrams it sent plus those it received.
"""

from __future__ import annotations

import json
import multiprocessing
import socket
import time

import numpy as np

from aggnet.config import format_size, parse_size


def add_arguments(p) -> None:
    p.add_argument("--elements", default="64,1024,2048", help="int32 elements per packet to try")
    p.add_argument("--size", default="64MiB", help="all-reduce size for the aggnet client")
    p.add_argument("--seconds", type=float, default=3.0, help="raw loop duration")
    p.add_argument("--json", default=None)


def _raw_receiver(port_q, size: int, seconds: float, out) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
    s.bind(("127.0.0.1", 0))
    port_q.put(s.getsockname()[1])
    buf = bytearray(65536)
    s.settimeout(5)
    n = 0
    s.recv_into(buf)
    t0 = time.perf_counter()
    end = t0 + seconds
    while True:
        try:
            s.recv_into(buf)
        except socket.timeout:
            break
        n += 1
        if n & 1023 == 0 and time.perf_counter() > end:
            break
    out.put((n, time.perf_counter() - t0))


def _raw_sender(port: int, size: int, seconds: float) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 << 20)
    data = bytes(size)
    dest = ("127.0.0.1", port)
    end = time.perf_counter() + seconds + 1
    i = 0
    while True:
        try:
            s.sendto(data, dest)
        except OSError:
            pass
        i += 1
        if i & 1023 == 0 and time.perf_counter() > end:
            break


def raw_loop(size: int, seconds: float) -> dict:
    ctx = multiprocessing.get_context("fork")
    q, out = ctx.Queue(), ctx.Queue()
    r = ctx.Process(target=_raw_receiver, args=(q, size, seconds, out))
    r.start()
    port = q.get(timeout=10)
    s = ctx.Process(target=_raw_sender, args=(port, size, seconds))
    s.start()
    n, dt = out.get(timeout=seconds + 30)
    s.join(10)
    r.join(10)
    return {"system": "raw-python-udp", "datagram_bytes": size, "datagrams_per_s": n / dt,
            "mb_per_s": n * size / dt / 1e6}


def aggnet_client(elements: int, nbytes: int) -> dict:
    from aggnet import Client
    from aggnet.hosts.process import ServiceProcess
    from aggnet.wire import HEADER_SIZE

    with ServiceProcess("udp://127.0.0.1:0", args=["--mode", "switch", "--elements", str(elements),
                                                    "--pool", "1024"]) as agg:
        with Client(agg.address, job="bench-udp", rank=0, world_size=1, elements=elements, slots=256) as c:
            x = np.ones(nbytes // 4, np.float32)
            c.allreduce(x).result(600)  # warm-up
            sent0, recv0 = c.stats.chunks_sent, c.stats.results
            t0 = time.perf_counter()
            c.allreduce(x).result(600)
            dt = time.perf_counter() - t0
            sent, recv = c.stats.chunks_sent - sent0, c.stats.results - recv0
    size = HEADER_SIZE + 4 * elements
    return {"system": "aggnet-client", "datagram_bytes": size, "datagrams_per_s": (sent + recv) / dt,
            "mb_per_s": (sent + recv) * size / dt / 1e6, "allreduce_s": dt, "buffer_bytes": nbytes,
            "goodput_mb_per_s": nbytes / dt / 1e6}


def main(args) -> int:
    from aggnet.wire import HEADER_SIZE

    nbytes = parse_size(args.size)
    records = []
    for k in [int(e) for e in args.elements.split(",")]:
        size = HEADER_SIZE + 4 * k
        raw = raw_loop(size, args.seconds)
        ours = aggnet_client(k, nbytes)
        ours["ratio_to_raw"] = ours["datagrams_per_s"] / raw["datagrams_per_s"]
        records += [raw, ours]
    print(f"{'system':>15} {'datagram':>9} {'datagrams/s':>12} {'MB/s':>8} {'aggnet/raw':>10}")
    for r in records:
        ratio = f"{r['ratio_to_raw']:10.2f}" if "ratio_to_raw" in r else ""
        print(f"{r['system']:>15} {format_size(r['datagram_bytes']):>9} {r['datagrams_per_s']:12,.0f} "
              f"{r['mb_per_s']:8.1f} {ratio}")
    for r in records:
        if r["system"] == "aggnet-client":
            print(f"  aggnet {format_size(r['buffer_bytes'])} all-reduce with {format_size(r['datagram_bytes'])} "
                  f"datagrams: {r['allreduce_s']:.3f}s ({r['goodput_mb_per_s']:.0f} MB/s of buffer)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0
