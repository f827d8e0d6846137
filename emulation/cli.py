"""``aggnet emulate``: all-reduce, benchmark or DDP demo inside an emulated
rack (network namespaces, shaped links, optional loss), torn down after;
with ``--topology FILE``, across the racks of a topology file under a spine
(emulation.fabric_cli)."""

from __future__ import annotations

import json
import logging
import sys
import time

from aggnet.client.config import format_size, parse_size

from aggnet.bench import rounds
from aggnet.emulation import rack_runs
from aggnet.emulation.netns import EmulationError, Rack, free_prefix
from aggnet.progress import Progress
from aggnet.emulation.nsprocess import EMULATION_WORKER_PRELOAD
from aggnet.processes import fork_server


def add_arguments(p) -> None:
    p.add_argument("what", choices=["allreduce", "bench", "bench-ddp", "bench-hybrid", "chaos", "demo"],
                   help="allreduce: one all-reduce, checked; bench: aggnet beside gloo, bytes and times; "
                        "bench-ddp: DDP step time with the aggnet hook beside gloo; "
                        "bench-hybrid: a stage per rack beside data parallelism (--topology); "
                        "chaos: checked all-reduces while shards are killed, cables pulled and spine links lose "
                        "packets (--topology); demo: DDP training, one worker per namespace")
    p.add_argument("--topology", default=None, metavar="FILE",
                   help="emulate the racks of this topology file under a spine (allreduce, bench, demo); "
                        "--racks, --workers, --rate, --uplink-rate and --mtu replace what it says")
    p.add_argument("--racks", type=int, default=None, help="with --topology: number of racks")
    p.add_argument("--workers", type=int, default=None, help="workers (per rack with --topology; default 4)")
    p.add_argument("--rate", type=float, default=None,
                   help="Mbit/s of every worker link (0: unshaped; default 100, or the topology's host_mbit)")
    p.add_argument("--uplink-rate", type=float, default=None,
                   help="with --topology: Mbit/s of every rack uplink, each way (0: unshaped; default: uplink_mbit)")
    p.add_argument("--prefix", default=None,
                   help="prefix of the namespaces' names, owned by this run while it lasts (default: agn, or agf "
                        "with --topology; agnb, agnc... while another run holds it)"),
    p.add_argument("--size", default=None, help="all-reduce size (allreduce, bench; default 16MiB, 32MiB with "
                                                "--topology)")
    p.add_argument("--reps", type=int, default=1,
                   help="all-reduces per system (allreduce, bench; the median is reported; default %(default)s)")
    p.add_argument("--rounds", type=int, default=1,
                   help="bench: run every system this many times, alternating (each round rotates the order), "
                        "and give each round's time ratios: systems run side by side share the machine's drift "
                        "(default %(default)s)")
    p.add_argument("--drop", type=float, default=0.0, help="random drop probability of aggregation datagrams")
    p.add_argument("--duplicate", type=float, default=0.0, help="random duplication probability")
    p.add_argument("--epochs", type=int, default=3, help="demo epochs")
    p.add_argument("--codec", default="float32", choices=["float32", "int32", "fp16", "bf16"],
                   help="demo: how gradients travel (default %(default)s). The switch protocol (one rack, "
                        "host-switch racks) adds int32: float32 is quantized on the way, fp16/bf16 cannot travel it; "
                        "service racks (--topology examples/topologies/service-racks.toml) carry all four")
    p.add_argument("--json", default=None, help="bench: write the records here")
    p.add_argument("--switch", choices=["host", "bmv2"], default="host",
                   help="host: a Linux bridge ToR and an aggregator host in switch mode (link N x rate); "
                        "bmv2: the P4 program on BMv2 in the ToR's place")
    p.add_argument("--hidden", type=int, default=None, help="demo: hidden width (BMv2 is slow: try 32)")
    p.add_argument("--mtu", type=int, default=None,
                   help="MTU of every link (default 9000, jumbo frames; 1500 for a plain Ethernet rack); the "
                        "aggregator's packets are sized to fit it")
    p.add_argument("--shards", type=int, default=None, help="aggregator host's shard processes (default: cores)")
    p.add_argument("--no-floor", action="store_true",
                   help="bench: skip the floor, a parameter server in plain TCP sockets on the aggregator "
                        "host (with --topology, one per rack under one on the spine): the same bytes over the "
                        "same links, what any parameter server pays here")
    p.add_argument("--elements", type=int, default=None,
                   help="int32 values per packet (default: the host's 2048, or what the MTU fits; BMv2: 64)")
    p.add_argument("--steps", type=int, default=10, help="bench-ddp: timed steps per system")
    p.add_argument("--model", default="both", choices=["narrow-cut", "wide-activation", "both"],
                   help="bench-hybrid: the model (aggnet.parallel.models)")
    p.add_argument("--batch", type=int, default=None,
                   help="bench-hybrid: global batch (default 64); bench-ddp: batch per worker (default 8)")
    p.add_argument("--systems", default="gloo,aggnet-int32",
                   help="bench-ddp: what to time, in one run (aggnet bench-ddp's systems: gloo, aggnet-CODEC, "
                        "aggnet-CODEC-staleS[-predict], compute, comm-CODEC[-buckets|-pipelined]; "
                        "default %(default)s)")
    p.add_argument("--minutes", type=float, default=2.0,
                   help="chaos: how long the all-reduces go on, at least until each kind of fault has come once "
                        "(30 for the long form; default %(default)g)")
    p.add_argument("--every", type=float, default=15.0,
                   help="chaos: seconds between faults, which take turns (default %(default)g)")
    p.add_argument("--seed", type=int, default=0, help="chaos: which rack, shard and worker each fault hits")
    p.add_argument("--micro-batches", type=int, default=1, help="bench-hybrid: micro-batches per replica and step")
    p.add_argument("--width", type=int, default=4096, help="bench-ddp: hidden width of the MLP (4096: 25M parameters)")


def main(args) -> int:
    if args.rounds < 1:
        print(f"aggnet emulate: --rounds must be at least 1, got {args.rounds}", file=sys.stderr)
        return 2
    if args.topology is not None:
        from aggnet.emulation import fabric_cli

        return fabric_cli.main(args)
    if args.what in ("bench-hybrid", "chaos"):
        print(f"aggnet emulate {args.what} runs across the racks of a topology: add --topology FILE (for "
              f"example examples/topologies/service-racks.toml)", file=sys.stderr)
        return 2
    if args.codec in ("fp16", "bf16"):
        print(f"aggnet emulate: --codec {args.codec} cannot travel one rack's switch protocol (it adds int32); use "
              f"float32 or int32, or racks of services: --topology examples/topologies/service-racks.toml",
              file=sys.stderr)
        return 2
    if args.racks is not None or args.uplink_rate is not None:
        print("aggnet emulate: --racks and --uplink-rate shape the racks of a --topology FILE", file=sys.stderr)
        return 2
    if args.what == "bench-ddp":
        from aggnet.bench.ddp import check_system

        for name in args.systems.split(","):
            check_system(name.strip())  # before any namespace exists
    # the namespaces' Python workers and aggregators fork from one server
    fork_server(EMULATION_WORKER_PRELOAD)
    args.workers = 4 if args.workers is None else args.workers
    args.rate = 100.0 if args.rate is None else args.rate
    args.size = args.size or "16MiB"
    args.mtu = args.mtu or 9000
    logging.basicConfig(level=logging.INFO, format="%(asctime)s aggnet %(levelname)s %(message)s", stream=sys.stderr)
    nbytes = parse_size(args.size)
    bmv2 = args.switch == "bmv2"
    switch_stats = None
    try:
        prefix = args.prefix or free_prefix("agn")
        with Rack(args.workers, rate_mbit=args.rate or None, aggregator=not bmv2, bridge=not bmv2, prefix=prefix,
                  mtu=args.mtu) as rack:
            agg = rack_runs.RackSwitch(rack) if bmv2 else rack_runs.start_aggregator(rack, shards=args.shards)
            rack.wait_reachable()
            switch = agg if bmv2 else None
            extra = {"elements": 64} if bmv2 else ({"elements": args.elements} if args.elements else {})
            try:
                if args.drop or args.duplicate:
                    rack.impair(drop=args.drop, duplicate=args.duplicate, ports=1 if bmv2 else agg.shards)
                if args.what == "bench-ddp":
                    records = rack_runs.run_ddp_bench(rack, args.steps, args.width, args.systems, switch=switch,
                                                      batch=args.batch or 8)
                    _report_ddp(args, records)
                    return 0
                if args.what == "demo":
                    more = ["--hidden", str(args.hidden)] if args.hidden else []
                    # rank 0's lines as it prints them: an epoch at a time
                    rack_runs.run_demo(rack, args.epochs, args.codec, switch=switch, extra=more,
                                       on_line=lambda line: print(line, flush=True))
                    return 0
                systems = ["aggnet"] + (["gloo"] if args.what == "bench" else [])
                if args.what == "bench" and not bmv2 and not args.no_floor:
                    systems.append("floor")
                pids = None if bmv2 else [agg.pid]
                with Progress(f"aggnet emulate {args.what}", len(systems) * args.rounds) as progress:
                    results, per_round = rounds.run_rounds(
                        systems, lambda s: _run_one(rack, s, nbytes, args, switch, pids, extra), args.rounds,
                        lambda r, s: progress.step(f"{s}: {args.reps} x {format_size(nbytes)}"
                                                   + rounds.label(r, args.rounds)))
                impaired = rack.impairment_counts() if (args.drop or args.duplicate) else None
                if bmv2:
                    switch_stats = agg.counters()
            finally:
                agg.stop()
    except EmulationError as exc:
        print(f"aggnet emulate: {exc}", file=sys.stderr)
        return 1
    _report(args, nbytes, results, impaired, per_round)
    if switch_stats is not None:
        ev = switch_stats["events"]
        t = results[0]["median_s"] * args.reps * args.rounds
        print(f"BMv2: {ev.get('received', 0)} aggregation packets in, {ev.get('completed', 0)} results multicast, "
              f"{ev.get('results_resent', 0)} resent; about {ev.get('received', 0) / max(t, 1e-9):,.0f} packets/s "
              f"while all-reducing; drops {switch_stats['drops']}")
    return 0


def _run_one(rack, system: str, nbytes: int, args, switch, pids, extra: dict) -> dict:
    """One system's run; the floor gets shards of its own on the aggregator
    host, as many as the aggregator has, while the aggregator idles."""
    if system != "floor":
        return rack_runs.run_system(rack, system, nbytes, args.reps, switch=switch, aggregator_pids=pids,
                                    progress=args.reps > 1, **extra)
    floor = rack_runs.FloorProcess.in_rack(rack, args.shards)
    try:
        return rack_runs.run_system(rack, "floor", nbytes, args.reps, address=floor.address,
                                    aggregator_pids=[floor.pid], progress=args.reps > 1)
    finally:
        floor.stop()


def _report_ddp(args, records: list[dict]) -> None:
    n = args.workers
    links = f"links {args.rate:g} Mbit/s, MTU {args.mtu}" if args.rate else f"unshaped links, MTU {args.mtu}"
    print(f"rack: {n} workers, {links}; DDP step time of a {records[0]['parameters']:,}-parameter MLP "
          f"(batch {records[0]['batch']} per worker), median of {args.steps} steps")
    gloo = next((r["median_s"] for r in records if r["system"] == "gloo"), None)
    by = {r["system"]: r["median_s"] for r in records}
    sync = next((t for name, t in by.items() if name.startswith("aggnet") and "stale" not in name), None)
    comm = next((t for name, t in by.items() if name.startswith("comm-") and name.count("-") == 1), None)
    bound = max(by["compute"], comm) if "compute" in by and comm is not None else None
    print(f"{'system':>28} {'step s':>8} {'min':>7} {'max':>7} {'this/gloo':>9} {'this/aggnet sync':>16} "
          f"{'this/max(compute,comm)':>22}")
    for r in records:
        t = r["median_s"]
        cols = [f"{t / d:.3f}" if d else "" for d in (gloo, sync, bound)]
        print(f"{r['system']:>28} {t:8.3f} {r['min_s']:7.3f} {r['max_s']:7.3f} {cols[0]:>9} {cols[1]:>16} "
              f"{cols[2]:>22}")
    if bound is not None:
        print(f"a step's halves alone: compute {by['compute']:.3f} s, communication {comm:.3f} s "
              f"({'communication' if comm > by['compute'] else 'compute'} the larger, by "
              f"{bound / min(comm, by['compute']):.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workers": n, "rate_mbit": args.rate, "mtu": args.mtu, "time": time.strftime("%FT%T"),
                       "batch": args.batch or 8, "width": args.width, "records": records}, f, indent=1)


def _report(args, nbytes: int, results: list[dict], impaired, per_round: list[dict]) -> None:
    n = args.workers
    links = (f"links {args.rate:g} Mbit/s each way (aggregator host: {n * args.rate:g})" if args.rate
             else "unshaped links")
    where = "BMv2 in the ToR's place" if args.switch == "bmv2" else "aggregator host in switch mode"
    print(f"rack: {n} workers, {links}, MTU {args.mtu}, {where}, {format_size(nbytes)} float32 all-reduce, "
          f"{args.reps} repetition(s)" + (f" in each of {len(per_round)} rounds" if len(per_round) > 1 else ""))
    for r in results:
        cs = (r.get("client_stats") or [{}])[0]
        if "elements" in cs:
            print(f"aggnet packets: {cs['elements']} int32 values ({48 + 4 * cs['elements']}-byte datagrams), "
                  f"{cs['slots']} slots in flight, UDP I/O {cs['io']}")
    if impaired:
        print(f"impairments: {impaired['dropped']} datagrams dropped, {impaired['duplicated']} duplicated")
    # every worker of a system holds the same result; systems differ by
    # gloo's float rounding and aggnet's quantization only
    same_everywhere = all(len({tuple(c) for c in r["checksums"]}) == 1 for r in results)
    sums = [r["checksums"][0][0] for r in results]
    spread = (max(sums) - min(sums)) / max(1.0, max(abs(x) for x in sums))
    print(f"{'system':>7} {'median s':>9} {'sent/worker':>12} {'recv/worker':>12} {'x S up':>7} {'x S down':>9} "
          f"{'cpu s/GB':>9} {'agg s/GB':>9}")
    for r in results:
        tx = sum(v["tx_bytes"] for v in r["per_worker"].values()) / n
        rx = sum(v["rx_bytes"] for v in r["per_worker"].values()) / n
        agg = r.get("aggregator_cpu_s_per_gb")
        print(f"{r['system']:>7} {r['median_s']:9.3f} {tx / 2**20:9.1f}MiB {rx / 2**20:9.1f}MiB "
              f"{tx / nbytes:7.3f} {rx / nbytes:9.3f} {r['worker_cpu_s_per_gb']:9.2f} "
              f"{'' if agg is None else f'{agg:.2f}':>9}")
    print("cpu s/GB: a worker's CPU-seconds (user + system, every thread) per GB of buffer over its timed "
          "all-reduces; agg s/GB: the aggregator host's over the whole run")
    ring = 2 * (n - 1) / n
    print(f"gloo ring moves 2S(N-1)/N = {ring:.3f} S each way; aggnet S each way plus headers")
    by = {r["system"]: r["median_s"] for r in results}
    if "gloo" in by:
        ratio = by["aggnet"] / by["gloo"]
        print(f"aggnet time / gloo time = {ratio:.3f} (bandwidth-bound limit N/(2(N-1)) = {n / (2 * (n - 1)):.3f})")
    if "floor" in by:
        print(f"floor (a parameter server in plain TCP sockets on the aggregator host, the same bytes): aggnet time "
              f"/ floor time = {by['aggnet'] / by['floor']:.3f}"
              + (f"; floor time / gloo time = {by['floor'] / by['gloo']:.3f}, what any parameter server reaches "
                 f"here" if "gloo" in by else ""))
    for line in rounds.ratio_lines(per_round, [("aggnet", "gloo"), ("aggnet", "floor"), ("floor", "gloo")]):
        print(line)
    named = ", ".join(f"{r['system']} {x:.6g}" for r, x in zip(results, sums))
    print(f"every worker holds the same result: {'yes' if same_everywhere else 'NO'}; "
          f"sum of the result: {named} (relative spread {spread:.1e})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workers": n, "rate_mbit": args.rate, "mtu": args.mtu, "bytes": nbytes,
                       "time": time.strftime("%FT%T"),
                       "records": [{k: v for k, v in r.items() if k != "client_stats"} for r in results],
                       "rounds": per_round, "impairments": impaired}, f, indent=1)
