"""``aggnet bench-udp``: the switch path's all-reduce rate beside what
Python can move over loopback UDP on this machine, in one run.

Every row reports the same quantity, **buffer bytes per second**:

* ``raw`` / ``raw-gso``: a plain Python loop, one process sending datagrams
  of the same size as aggnet's as fast as it can and another receiving
  them; one datagram per system call (``raw``) or UDP GSO on send and GRO
  on receive (``raw-gso``). Its buffer rate is the payload (datagram minus
  aggnet's header) received per second, one way: an all-reduce needs at
  least that much in each direction, so this is its ceiling.
* ``aggnet``: one worker all-reducing a float32 buffer (quantized to
  int32) through a switch-mode aggregator on loopback: the buffer's size
  over the all-reduce's time, while the same bytes went up and came back
  down (plus headers).

CPU seconds per GB of buffer are measured for the client (this process)
and the aggregator (its processes, all shards).
"""

from __future__ import annotations

import json
import multiprocessing
import socket
import time

import numpy as np

from aggnet.bench.args import at_least_one, count_list, one_size, positive_seconds
from aggnet.bench.cpu import own_cpu_seconds, tree_cpu_seconds

from aggnet.client.config import format_size, parse_size
from aggnet.progress import Progress

SOL_UDP, UDP_SEGMENT, UDP_GRO = 17, 103, 104


def _element_counts(text: str) -> str:
    """Values per datagram, each as many as a datagram holds at most."""
    import argparse

    from aggnet.protocol.limits import MAX_ELEMENTS

    count_list(text)
    for part in text.split(","):
        if int(part) > MAX_ELEMENTS:
            raise argparse.ArgumentTypeError(f"{part}: a datagram holds at most {MAX_ELEMENTS} values")
    return text


def add_arguments(p) -> None:
    p.add_argument("--elements", type=_element_counts, default="64,2048",
                   help="int32 values per packet to try (64: the P4 program's; 2048: a host's default)")
    p.add_argument("--size", type=one_size, default="64MiB", help="all-reduce size for the aggnet client")
    p.add_argument("--reps", type=at_least_one, default=5,
                   help="timed all-reduces per setting (the median is reported)")
    p.add_argument("--seconds", type=positive_seconds, default=2.0, help="duration of each raw loop")
    p.add_argument("--io", default="auto", help="UDP I/O of the aggnet rows: auto, or a list of gso,mmsg,plain")
    p.add_argument("--shards", type=at_least_one, default=1,
                   help="aggregator shard processes (default 1: on 2 cores the client needs the other)")
    p.add_argument("--json", default=None, help="write the records here")


# -- the raw loops -------------------------------------------------------------------


def _raw_receiver(port_q, gso: bool, seconds: float, out) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 << 20)
    if gso:
        s.setsockopt(SOL_UDP, UDP_GRO, 1)
    s.bind(("127.0.0.1", 0))
    port_q.put(s.getsockname()[1])
    buf = bytearray(1 << 16)
    s.settimeout(5)
    got = 0
    try:
        s.recv_into(buf)
    except socket.timeout:
        out.put((0, 1.0))
        return
    t0 = time.perf_counter()
    end = t0 + seconds
    calls = 0
    while True:
        try:
            got += s.recvmsg_into([buf], 64)[0] if gso else s.recv_into(buf)
        except socket.timeout:
            break
        calls += 1
        if calls & 255 == 0 and time.perf_counter() > end:
            break
    out.put((got, time.perf_counter() - t0))


def _raw_sender(port: int, size: int, gso: bool, seconds: float) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 << 20)
    s.connect(("127.0.0.1", port))
    if gso:
        s.setsockopt(SOL_UDP, UDP_SEGMENT, size)
        data = bytes(size * max(1, min(64, 65507 // size)))
    else:
        data = bytes(size)
    end = time.perf_counter() + seconds + 1
    i = 0
    while True:
        try:
            s.send(data)
        except OSError:
            pass
        i += 1
        if i & 255 == 0 and time.perf_counter() > end:
            break


def raw_loop(size: int, gso: bool, seconds: float, header: int) -> dict:
    ctx = multiprocessing.get_context("fork")
    q, out = ctx.Queue(), ctx.Queue()
    r = ctx.Process(target=_raw_receiver, args=(q, gso, seconds, out))
    r.start()
    port = q.get(timeout=10)
    s = ctx.Process(target=_raw_sender, args=(port, size, gso, seconds))
    s.start()
    got, dt = out.get(timeout=seconds + 30)
    s.join(10)
    r.join(10)
    datagrams = got / size
    return {"system": "raw-gso" if gso else "raw", "io": "gso" if gso else "plain", "datagram_bytes": size,
            "elements": (size - header) // 4, "datagrams_per_s": datagrams / dt,
            "buffer_bytes_per_s": datagrams * (size - header) / dt, "direction": "one way"}


# -- aggnet ------------------------------------------------------------------------


def aggnet_client(elements: int, nbytes: int, reps: int, io: str | None, shards: int) -> dict:
    from aggnet import Client
    from aggnet.processes import ServiceProcess
    from aggnet.protocol.wire import HEADER_SIZE

    args = ["--mode", "switch", "--elements", str(elements), "--shards", str(shards)]
    if io:
        args += ["--io", io]
    with ServiceProcess("udp://127.0.0.1:0", args=args) as agg:
        with Client(agg.address, job="bench-udp", rank=0, world_size=1, elements=elements, udp_io=io) as c:
            x = np.random.default_rng(0).standard_normal(nbytes // 4).astype(np.float32)
            c.allreduce(x.copy()).result(600)  # warm-up
            times = []
            client_cpu = aggregator_cpu = 0.0
            sent0, recv0 = c.stats.chunks_sent, c.stats.results
            y = np.empty_like(x)  # one buffer, refilled: as DDP reuses its buckets
            for _ in range(reps):
                np.copyto(y, x)  # neither timed nor counted
                cpu0, agg0 = own_cpu_seconds(), tree_cpu_seconds([agg.pid])
                t0 = time.perf_counter()
                c.allreduce(y).result(600)
                times.append(time.perf_counter() - t0)
                cpu1, agg1 = own_cpu_seconds(), tree_cpu_seconds([agg.pid])
                client_cpu += cpu1 - cpu0
                aggregator_cpu += agg1 - agg0
            sent, recv = c.stats.chunks_sent - sent0, c.stats.results - recv0
            retrans = c.stats.retransmissions
            used_io, slots = c.io, c.slots
    dt = float(np.median(times))
    gb = nbytes * reps / 1e9
    return {"system": "aggnet", "io": used_io, "elements": elements, "datagram_bytes": HEADER_SIZE + 4 * elements,
            "slots": slots, "shards": shards, "buffer_bytes": nbytes, "allreduce_s": dt, "times_s": times,
            "buffer_bytes_per_s": nbytes / dt, "direction": "up and down",
            "datagrams_per_s": (sent + recv) / sum(times), "retransmissions": retrans,
            "client_cpu_s_per_gb": client_cpu / gb, "aggregator_cpu_s_per_gb": aggregator_cpu / gb}


def main(args) -> int:
    from aggnet.protocol.wire import HEADER_SIZE

    nbytes = parse_size(args.size)
    ios = [None] if args.io == "auto" else [m.strip() for m in args.io.split(",")]
    records = []
    ks = [int(e) for e in args.elements.split(",")]
    with Progress("aggnet bench-udp", len(ks) * (2 + len(ios))) as progress:
        for k in ks:
            size = HEADER_SIZE + 4 * k
            raw = raw_loop(size, False, args.seconds, HEADER_SIZE)
            progress.step(f"raw loop, {k} values")
            gso = raw_loop(size, True, args.seconds, HEADER_SIZE)
            progress.step(f"raw GSO loop, {k} values")
            records += [raw, gso]
            for io in ios:
                ours = aggnet_client(k, nbytes, args.reps, io, args.shards)
                ours["ratio_to_raw"] = ours["buffer_bytes_per_s"] / raw["buffer_bytes_per_s"]
                ours["ratio_to_raw_gso"] = ours["buffer_bytes_per_s"] / gso["buffer_bytes_per_s"]
                records.append(ours)
                progress.step(f"aggnet {ours['io']}, {k} values: {ours['buffer_bytes_per_s'] / 1e6:.0f} MB/s")
    print(f"buffer bytes per second (raw loops: payload received one way, the ceiling; aggnet: a "
          f"{format_size(nbytes)} float32 all-reduce, every byte up and back down)")
    print(f"{'system':>8} {'io':>6} {'values':>6} {'datagram':>9} {'MB/s':>8} {'/raw':>6} {'/raw-gso':>8} "
          f"{'client s/GB':>11} {'agg s/GB':>9}")
    for r in records:
        extra = ""
        if r["system"] == "aggnet":
            extra = (f"{r['ratio_to_raw']:6.2f} {r['ratio_to_raw_gso']:8.2f} {r['client_cpu_s_per_gb']:11.2f} "
                     f"{r['aggregator_cpu_s_per_gb']:9.2f}")
        print(f"{r['system']:>8} {r['io']:>6} {r['elements']:>6} {r['datagram_bytes']:>9} "
              f"{r['buffer_bytes_per_s'] / 1e6:8.1f} {extra}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0
