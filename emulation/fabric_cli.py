"""``aggnet emulate --topology FILE allreduce|bench|demo``: the racks of a
topology file in network namespaces under a spine, something run across
them, and everything torn down after."""

from __future__ import annotations

import json
import logging
import sys
import time

from aggnet.client.config import format_size, parse_size
from aggnet.protocol.topology import TopologyError

from aggnet.bench import rounds
from aggnet.emulation import fabric_runs
from aggnet.emulation.fabric import Fabric
from aggnet.emulation.fabric_plan import Plan, PlanError, plan
from aggnet.progress import Progress
from aggnet.emulation.netns import EmulationError, free_prefix
from aggnet.emulation.nsprocess import EMULATION_WORKER_PRELOAD
from aggnet.processes import fork_server

DEFAULT_SIZE = "32MiB"
#: chaos: the all-reduce size and how many make a checked batch
CHAOS_SIZE = "4MiB"
CHAOS_REPS = 5
#: what ``aggnet emulate`` can do across racks (bench-ddp and BMv2 are one-rack runs)
WHATS = ("allreduce", "bench", "bench-hybrid", "chaos", "demo")


def main(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s aggnet %(levelname)s %(message)s", stream=sys.stderr)
    refused = _refused(args)
    if refused:
        print(f"aggnet emulate --topology: {refused}", file=sys.stderr)
        return 2
    args.batch = args.batch or 64  # bench-hybrid's global batch
    try:
        pl = plan(args.topology, racks=args.racks, workers=args.workers, host_mbit=args.rate,
                  uplink_mbit=args.uplink_rate, mtu=args.mtu)
    except (TopologyError, PlanError) as exc:
        print(f"aggnet emulate: {exc}", file=sys.stderr)
        return 2
    p4 = [rp.name for rp in pl.racks if rp.aggregator.kind == "p4"]
    if p4 and args.what == "bench-hybrid":
        print(f"aggnet emulate: bench-hybrid's stages all-reduce in groups that are jobs of their own, which the P4 "
              f"switches of {', '.join(p4)} would need installed one by one; use host-switch racks "
              f"(examples/topologies/two-racks.toml)", file=sys.stderr)
        return 2
    switched = sorted({rp.name for rp in pl.racks if rp.aggregator.kind != "service"})
    if args.codec in ("fp16", "bf16") and (switched or (pl.root is not None and pl.root.kind != "service")):
        print(f"aggnet emulate: --codec {args.codec} cannot travel the switch protocol (it adds int32) of "
              f"{', '.join(switched) or 'the root'}; use float32 or int32, or racks of services "
              f"(examples/topologies/service-racks.toml)", file=sys.stderr)
        return 2
    nbytes = parse_size(args.size or (CHAOS_SIZE if args.what == "chaos" else DEFAULT_SIZE))
    if args.what == "chaos" and not (args.minutes > 0 and args.every > 0):
        print(f"aggnet emulate chaos: --minutes and --every must be positive, got {args.minutes:g} and "
              f"{args.every:g}", file=sys.stderr)
        return 2
    # the namespaces' Python workers and aggregators fork from one server
    fork_server(EMULATION_WORKER_PRELOAD)
    try:
        with Fabric(pl, prefix=args.prefix or free_prefix("agf")) as fabric:
            fabric.start_aggregators(restart=args.what == "chaos")
            fabric.wait_reachable()
            fabric.impair(args.drop)
            if args.what == "chaos":
                return _chaos(args, pl, fabric, nbytes)
            if args.what == "bench-hybrid":
                return _bench_hybrid(args, pl, fabric)
            if args.what == "demo":
                more = ["--hidden", str(args.hidden)] if args.hidden else []
                fabric_runs.run_demo(fabric, args.epochs, args.codec, extra=more,
                                     on_line=lambda line: print(line, flush=True))
                return 0
            if args.what == "allreduce":
                result = fabric_runs.run_system(fabric, "aggnet", nbytes, args.reps, dtype="int32",
                                                progress=args.reps > 1)
                drops = fabric.impairment_counts() if args.drop else None
                return _report_allreduce(pl, nbytes, args.reps, result, drops)
            floor = not args.no_floor and all(r.aggregator.kind != "p4" for r in pl.racks)
            systems = ["aggnet", "gloo"] + (["floor"] if floor else [])

            def run_one(s: str) -> dict:
                if s != "floor":
                    return fabric_runs.run_system(fabric, s, nbytes, args.reps, progress=args.reps > 1)
                with fabric_runs.start_floors(fabric) as floors:
                    return fabric_runs.run_system(fabric, s, nbytes, args.reps, floors=floors, progress=args.reps > 1)

            with Progress("aggnet emulate bench", len(systems) * args.rounds) as progress:
                results, per_round = rounds.run_rounds(
                    systems, run_one, args.rounds,
                    lambda r, s: progress.step(f"{s}: {args.reps} x {format_size(nbytes)}"
                                               + rounds.label(r, args.rounds)))
            drops = fabric.impairment_counts() if args.drop else None
    except EmulationError as exc:
        print(f"aggnet emulate: {exc}", file=sys.stderr)
        return 1
    _report_bench(args, pl, nbytes, results, drops, per_round)
    return 0


def _refused(args) -> str | None:
    if args.what not in WHATS:
        return f"{args.what} runs in one rack; across racks: {', '.join(WHATS)}"
    if args.switch != "host":
        return ("--switch bmv2 puts BMv2 in one rack's ToR; with a topology file each rack's kind says it "
                "(kind = \"p4\" runs BMv2 in that rack's ToR, examples/topologies/p4-racks.toml)")
    if args.duplicate:
        return "--duplicate is a one-rack impairment; across racks use --drop"
    if args.shards is not None or args.elements is not None:
        return "--shards and --elements come from the topology file (shards, elements of each aggregator)"
    return None


def _links(pl: Plan) -> str:
    host = f"{pl.host_mbit:g} Mbit/s" if pl.host_mbit else "unshaped"
    up = f"{pl.uplink_mbit:g} Mbit/s each way" if pl.uplink_mbit else "unshaped"
    return f"host links {host}, uplinks {up}, MTU {pl.mtu}"


def _drops(drops: dict | None) -> str:
    if drops is None:
        return ""
    return f"; datagrams dropped: {drops['rack_links']} on rack links, {drops['spine_links']} on spine links"


def _report_allreduce(pl: Plan, nbytes: int, reps: int, r: dict, drops: dict | None) -> int:
    print(f"fabric: {pl.shape} under {'a root' if pl.root else 'no root (one rack)'}, {_links(pl)}")
    rs = len(pl.racks) * nbytes
    retrans = sum(s.get("retransmissions", 0) for s in r["client_stats"])
    print(f"{format_size(nbytes)} int32 all-reduce x {reps}: median {r['median_s']:.3f} s, cross-rack "
          f"{r['cross_rack_bytes']['up'] / max(rs, 1):.3f} x R*S up, {r['cross_rack_bytes']['down'] / max(rs, 1):.3f} "
          f"down, {retrans} retransmissions{_drops(drops)}")
    exact = all(r["exact"])
    print(f"every worker holds the exact int32 sum: {'yes' if exact else 'NO'}")
    return 0 if exact else 1


def _report_bench(args, pl: Plan, nbytes: int, results: list[dict], drops: dict | None,
                  per_round: list[dict]) -> None:
    racks = len(pl.racks)
    rs = racks * nbytes
    each = f" in each of {len(per_round)} rounds" if len(per_round) > 1 else ""
    print(f"fabric: {pl.shape}, {_links(pl)}; {format_size(nbytes)} float32 all-reduce, "
          f"{args.reps} repetition(s){each}{_drops(drops)}")
    print(f"{'system':>7} {'median s':>9} {'cross-rack up':>14} {'down':>11} {'up/(R*S)':>9} {'down/(R*S)':>10} "
          f"{'cpu s/GB':>9}")
    for r in results:
        up, down = r["cross_rack_bytes"]["up"], r["cross_rack_bytes"]["down"]
        print(f"{r['system']:>7} {r['median_s']:9.3f} {up / 2**20:11.1f}MiB {down / 2**20:8.1f}MiB "
              f"{up / max(rs, 1):9.3f} {down / max(rs, 1):10.3f} {r['worker_cpu_s_per_gb']:9.2f}")
    print("cpu s/GB: a worker's CPU-seconds (user + system, every thread) per GB of buffer over its timed all-reduces")
    a, g = results[:2]
    print(f"aggnet time / gloo time = {a['median_s'] / g['median_s']:.3f}; aggnet sends each rack's partial up "
          f"and its result down once (R*S each way), gloo's ring crosses racks R times with 2S(N-1)/N")
    if len(results) > 2:
        f = results[2]
        print(f"floor (parameter servers in plain TCP sockets on the same hosts, the same bytes): aggnet time / "
              f"floor time = {a['median_s'] / f['median_s']:.3f}; floor time / gloo time = "
              f"{f['median_s'] / g['median_s']:.3f}, what any parameter server reaches here")
    for line in rounds.ratio_lines(per_round, [("aggnet", "gloo"), ("aggnet", "floor"), ("floor", "gloo")]):
        print(line)
    same = all(len({tuple(c) for c in r["checksums"]}) == 1 for r in results)
    named = ", ".join(f"{r['system']} {r['checksums'][0][0]:.6g}" for r in results)
    print(f"every worker holds the same result: {'yes' if same else 'NO'}; sum of the result: {named}")
    if args.json:
        sizes = [r.workers for r in pl.racks]
        with open(args.json, "w") as f:
            json.dump({"racks": racks, "workers": sizes[0] if len(set(sizes)) == 1 else sizes, "world": pl.world,
                       "bytes": nbytes, "host_mbit": pl.host_mbit, "uplink_mbit": pl.uplink_mbit, "mtu": pl.mtu,
                       "topology": pl.source, "time": time.strftime("%FT%T"), "drops": drops,
                       "records": [{k: v for k, v in r.items() if k not in ("client_stats", "exact")}
                                   for r in results], "rounds": per_round}, f, indent=1)


def _chaos(args, pl: Plan, fabric: Fabric, nbytes: int) -> int:
    """Checked all-reduces through faults; the report, and 1 when the run
    failed (a wrong result, a fault that could not be injected, an
    aggregator that grew)."""
    from aggnet.emulation import chaos

    print(f"fabric: {pl.shape}, {_links(pl)}; chaos for {args.minutes:g} min, a fault every {args.every:g} s, "
          f"{format_size(nbytes)} int32 all-reduces in checked batches of {CHAOS_REPS}", flush=True)
    record = chaos.run(fabric, args.minutes * 60, args.every, nbytes, CHAOS_REPS, seed=args.seed,
                       on_event=lambda line: print(line, file=sys.stderr, flush=True))
    record.update({"racks": len(pl.racks), "world": pl.world, "host_mbit": pl.host_mbit,
                   "uplink_mbit": pl.uplink_mbit, "topology": pl.source, "time": time.strftime("%FT%T")})
    found = chaos.problems(record)
    record["problems"], record["unjudged"] = found, chaos.unjudged(record)
    print(f"{record['allreduces']} all-reduces in {record['seconds']:.0f} s, {record['wrong_results']} wrong; "
          f"{len(record['faults'])} faults:")
    for f in record["faults"]:
        print(f"  {f['what']:<36} {f['seconds']:6.1f} s  {f['counted']}")
    print("aggregators (supervisor and shards; settled: once every shard it lost was replaced once)")
    print(f"{'':>10} {'RSS MB start':>12} {'settled':>8} {'end':>7} {'max':>7} {'fds start':>9} {'settled':>8} "
          f"{'end':>4} {'max':>4}")
    mb = lambda kb: "-" if kb is None else f"{kb / 1024:.1f}"  # noqa: E731
    for name, a in record["aggregators"].items():
        rss, fds = a["rss_kb"], a["fds"]
        print(f"{name:>10} {mb(rss['start']):>12} {mb(rss['settled']):>8} {mb(rss['end']):>7} {mb(rss['max']):>7} "
              f"{fds['start']:9d} {'-' if fds['settled'] is None else fds['settled']:>8} {fds['end']:4d} "
              f"{fds['max']:4d}")
    late = chaos.unjudged(record)
    if late:
        print(f"growth not judged for {', '.join(late)}: not every shard was replaced yet (run longer)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    for p in found:
        print(f"aggnet emulate chaos: {p}", file=sys.stderr)
    print("chaos run: " + ("FAILED" if found else "every all-reduce exact, every fault survived, aggregators flat"))
    return 1 if found else 0


def _bench_hybrid(args, pl: Plan, fabric: Fabric) -> int:
    """Each model: the hybrid placement beside data parallelism through
    aggnet's racks and through gloo's ring, measured and predicted."""
    from aggnet.emulation import hybrid_runs

    if len(pl.racks) < 2:
        print("aggnet emulate bench-hybrid: a stage per rack needs two racks or more (--racks)", file=sys.stderr)
        return 2
    models = ["narrow-cut", "wide-activation"] if args.model == "both" else [args.model]
    print(f"fabric: {pl.shape}, {_links(pl)}; global batch {args.batch}, {args.steps} timed steps after 2 warm-up, "
          f"{args.micro_batches} micro-batch(es)")
    records = []
    for model in models:
        prof, predicted = hybrid_runs.predict(model, fabric, args.batch, args.micro_batches)
        by_name = {a.name: a for a in predicted.alternatives}
        rows = []
        for i, system in enumerate(hybrid_runs.SYSTEMS):
            print(f"{model}: {system} ...", file=sys.stderr, flush=True)
            r = hybrid_runs.run(fabric, system, model, args.batch, args.steps, micro_batches=args.micro_batches,
                                port=hybrid_runs.BASE_PORT + len(records) + i)
            alt = by_name[hybrid_runs.SYSTEMS[system]]
            r["predicted_step_s"] = alt.step_seconds
            r["predicted_cross_rack_bytes"] = alt.cross_rack_bytes
            rows.append(r)
        gloo = next(r for r in rows if r["system"] == "gloo")
        fastest = min(rows, key=lambda r: r["step_s"])
        pick = next(s for s, name in hybrid_runs.SYSTEMS.items() if name == predicted.pick.name) \
            if predicted.pick.name in hybrid_runs.SYSTEMS.values() else predicted.pick.name
        print(f"\n{model}: {len(prof.layers)} layers, {prof.param_bytes / 1e6:.2f} MB of parameters")
        print(f"{'system':>7} {'step s':>8} {'/gloo':>6} {'uplink bytes/step':>18} {'predicted':>12} "
              f"{'measured/pred.':>14} {'pred. step s':>12}")
        for r in rows:
            ratio = r["cross_rack_bytes"] / r["predicted_cross_rack_bytes"] if r["predicted_cross_rack_bytes"] else 0
            print(f"{r['system']:>7} {r['step_s']:8.3f} {r['step_s'] / gloo['step_s']:6.3f} "
                  f"{r['cross_rack_bytes'] / 1e6:15.3f} MB {r['predicted_cross_rack_bytes'] / 1e6:9.3f} MB "
                  f"{ratio:14.3f} {r['predicted_step_s']:12.3f}")
        placement = {"hybrid": "a stage per rack", "aggnet": "data parallelism", "gloo": "data parallelism"}
        same = placement.get(pick) == placement[fastest["system"]]
        print(f"aggnet plan picks {pick} ({placement.get(pick, pick)}); fastest measured: {fastest['system']} "
              f"({placement[fastest['system']]}){'' if fastest['system'] == pick else '  (the plan missed)' if not same else '  (the same placement)'}")
        print(f"the plan: {predicted.reason}")
        records.append({"model": model, "pick": pick, "fastest": fastest["system"], "reason": predicted.reason,
                        "rows": rows})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"racks": len(pl.racks), "world": pl.world, "host_mbit": pl.host_mbit,
                       "uplink_mbit": pl.uplink_mbit, "mtu": pl.mtu, "batch": args.batch, "steps": args.steps,
                       "micro_batches": args.micro_batches, "time": time.strftime("%FT%T"), "models": records},
                      f, indent=1)
    return 0
