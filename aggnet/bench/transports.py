"""``aggnet bench-transport``: point-to-point throughput of the message
transports (UCX, ZeroMQ tcp, ZeroMQ ipc) in one run, for messages from
32 KiB to 64 MiB (the largest message a listener takes).

A sender process streams messages of one size with a window of four
unacknowledged ones; the receiver answers each with a bare header. The
rate is payload bytes over the time until the last acknowledgement; the
CPU is what both processes spent on the point, per GB moved.
"""

from __future__ import annotations

import json
import queue
import statistics
import sys
import tempfile
import time

import numpy as np

from aggnet.bench.args import at_least_one, one_size, size_list
from aggnet.client.config import format_size, parse_size
from aggnet.processes import NUMPY_WORKER_PRELOAD, fork_server
from aggnet.progress import Progress
from aggnet.protocol.limits import MAX_MESSAGE_BYTES

WINDOW = 4
#: seconds either side waits for the other before it gives up on the point
SILENCE = 60.0


def add_arguments(p) -> None:
    p.add_argument("--transports", default="tcp,zmq+tcp,zmq+ipc,ucx",
                   help="message transports to compare on loopback (default %(default)s)")
    p.add_argument("--sizes", type=size_list, default="32KiB,256KiB,1MiB,16MiB,64MiB",
                   help="message sizes (default %(default)s)")
    p.add_argument("--volume", type=one_size, default="512MiB",
                   help="bytes moved per point (at least 8 messages; default %(default)s)")
    p.add_argument("--reps", type=at_least_one, default=3, help="timed repetitions per point (default %(default)s)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the records here")


def _receiver(listen_addr: str, report, plan) -> None:
    from aggnet.processes import die_with_parent

    die_with_parent()
    from aggnet.protocol import wire
    from aggnet.transport import listen

    lst = listen(listen_addr)
    report.put(str(lst.address))
    ack = wire.Header(wire.MsgType.RESULT).pack()
    cpu = []  # CPU-seconds of each point, from its first message to its last
    for _, count in plan:
        for i in range(count):
            m = lst.recv(SILENCE)
            if m is None:
                report.put(cpu)
                return  # the sender gave up and says why
            if i == 0:
                c0 = time.process_time()
            lst.send(m.peer, ack)
            del m
        cpu.append(time.process_time() - c0)
    report.put(cpu)
    time.sleep(0.5)
    lst.close()


def _sender(address: str, plan, out) -> None:
    from aggnet.processes import die_with_parent

    die_with_parent()
    from aggnet.protocol import wire
    from aggnet.transport import connect

    conn = connect([address])
    results = []
    try:
        for size, count in plan:
            data = np.ones(size, np.uint8)
            h = wire.Header(wire.MsgType.PUSH, count=size).pack()
            t0, c0 = time.perf_counter(), time.process_time()
            sent = acked = 0
            while acked < count:
                while sent < count and sent - acked < WINDOW:
                    conn.send(0, h, data)
                    sent += 1
                if conn.recv(SILENCE) is None:
                    raise RuntimeError(f"{format_size(size)} messages: no acknowledgement from {address} within "
                                       f"{SILENCE:g}s")
                acked += 1
            results.append((size, count, time.perf_counter() - t0, time.process_time() - c0))
    except Exception as exc:  # the parent says it, in one line
        out.put(str(exc))
        return
    finally:
        conn.close()
    out.put(results)


def _answer(out, sender, limit: float = 3600.0):
    """The sender's timings or its one-line error; a sender that died
    without either is said at once, not after ``limit``."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            return out.get(timeout=1.0)
        except queue.Empty:
            if not sender.is_alive():
                try:  # what it put just before it ended
                    return out.get(timeout=1.0)
                except queue.Empty:
                    return f"the sender ended (exit code {sender.exitcode}) without a result; its error is above"
    return f"no result within {limit:g}s"


def run_transport(scheme: str, sizes: list[int], volume: int, reps: int) -> list[dict]:
    plan = []
    for size in sizes:
        count = max(8, volume // size)
        plan += [(size, count)] * reps
    if scheme == "zmq+ipc":
        listen_addr = f"zmq+ipc://{tempfile.mkdtemp(prefix='agb-')}/p2p.sock"
    else:
        listen_addr = f"{scheme}://127.0.0.1:0"
    ctx = fork_server(NUMPY_WORKER_PRELOAD)
    report, out = ctx.Queue(), ctx.Queue()
    rx = ctx.Process(target=_receiver, args=(listen_addr, report, plan), daemon=True)
    rx.start()
    address = report.get(timeout=60)
    tx = ctx.Process(target=_sender, args=(address, plan, out), daemon=True)
    tx.start()
    try:
        timings = _answer(out, tx)
        rx_cpu = report.get(timeout=SILENCE) if not isinstance(timings, str) else []
    finally:
        tx.join(30)
        rx.join(30)
    if isinstance(timings, str):
        raise RuntimeError(f"{scheme}: {timings}")
    records = []
    for size in sizes:
        points = [(c, t, tx_cpu + rx) for (s, c, t, tx_cpu), rx in zip(timings, rx_cpu) if s == size]
        rates = [size * c / t for c, t, _ in points]
        cpu = [busy / (size * c / 1e9) for c, _, busy in points]
        records.append({"transport": scheme, "bytes": size, "median_gb_per_s": statistics.median(rates) / 1e9,
                        "min_gb_per_s": min(rates) / 1e9, "max_gb_per_s": max(rates) / 1e9, "reps": len(rates),
                        "cpu_s_per_gb": statistics.median(cpu), "min_cpu_s_per_gb": min(cpu),
                        "max_cpu_s_per_gb": max(cpu)})
    return records


def main(args) -> int:
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    volume = parse_size(args.volume)
    if max(sizes) > MAX_MESSAGE_BYTES:
        print(f"aggnet bench-transport: {format_size(max(sizes))} is over the largest message a listener takes "
              f"({format_size(MAX_MESSAGE_BYTES)}); give --sizes up to that", file=sys.stderr)
        return 2
    records = []
    schemes = [t.strip() for t in args.transports.split(",") if t.strip()]
    with Progress("aggnet bench-transport", len(schemes)) as progress:
        for scheme in schemes:
            try:
                records += run_transport(scheme, sizes, volume, args.reps)
            except ImportError as exc:
                print(f"skipping {scheme}: {exc}")
            except RuntimeError as exc:
                progress.close()
                print(f"aggnet bench-transport: {exc}", file=sys.stderr)
                return 1
            progress.step(scheme)
    by = {(r["transport"], r["bytes"]): r for r in records}
    schemes = list(dict.fromkeys(r["transport"] for r in records))
    # each transport against ZeroMQ over tcp, the default service path
    ratios = [(s, "zmq+tcp") for s in schemes if s in ("tcp", "ucx") and "zmq+tcp" in schemes]
    ratios += [("ucx", "zmq+ipc")] if "ucx" in schemes and "zmq+ipc" in schemes else []
    print(f"{'size':>8} " + " ".join(f"{s + ' GB/s':>14}" for s in schemes)
          + "".join(f"  {a + '/' + b:>11}" for a, b in ratios)
          + "  " + " ".join(f"{s + ' CPU s/GB':>17}" for s in schemes))
    for size in sizes:
        rate = {s: by[(s, size)]["median_gb_per_s"] for s in schemes if (s, size) in by}
        row = f"{format_size(size):>8} " + " ".join(f"{rate.get(s, float('nan')):14.2f}" for s in schemes)
        row += "".join(f"  {rate[a] / rate[b]:11.2f}" if a in rate and b in rate else "  " + " " * 11
                       for a, b in ratios)
        row += "  " + " ".join(f"{by[(s, size)]['cpu_s_per_gb'] if (s, size) in by else float('nan'):17.3f}"
                               for s in schemes)
        print(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0
