"""``aggnet sim``: predicted all-reduce (and training step) times for
aggnet and its peers on fabrics of 1,024 to 16,384 workers and more, and
the goodput of jobs sharing a switch's pool; a table, plots and JSON.

    aggnet sim                                   # 1,024 .. 16,384 workers, racks of 32, 100 MiB, Tofino at 100G
    aggnet sim --oversubscription 4 --plot docs/figures/sim
    aggnet sim --workers 4096 --jobs 1,2,4,8,16,32
    aggnet sim --hardware params.json --set loss=0.01
    aggnet sim calibrate --out emulation.json    # this machine, measured in aggnet emulate (root)
    aggnet sim validate --hardware emulation.json --plot docs/figures/sim-validation.png
    aggnet sim published --plot docs/figures/sim-switchml.png
"""

from __future__ import annotations

import json
import os
import sys
import time

from aggnet.bench.args import one_size
from aggnet.client.config import format_size, parse_size
from aggnet.sim import hardware, model, published, validate

DEFAULT_WORKERS = "1024,2048,4096,8192,16384"


def add_arguments(p) -> None:
    p.add_argument("what", nargs="?", default="predict", choices=("predict", "calibrate", "validate", "published"),
                   help="predict (default): the tables below; calibrate: measure this machine in aggnet emulate "
                        "into a parameter file (--out; needs root); validate: the model beside aggnet emulate "
                        "bench at --points, with the error of each; published: the model beside SwitchML's and "
                        "ATP's published speed-ups, with their parameters")
    p.add_argument("--out", default="emulation.json", help="calibrate: the parameter file to write "
                                                            "(default %(default)s)")
    p.add_argument("--points", default=None,
                   help="validate: emulated fabrics, RACKSxWORKERS@HOST_MBIT[/UPLINK_MBIT][~DROP][:p4] (:p4: BMv2 "
                        f"in each ToR's place), comma-separated (default {','.join(validate.DEFAULT_POINTS)}, and "
                        f"{','.join(validate.P4_POINTS)} where BMv2 is installed)")
    p.add_argument("--reps", type=int, default=3, help="calibrate, validate: all-reduces per system and point "
                                                        "(the median counts; default %(default)s)")
    p.add_argument("--hardware", default="tofino-100g",
                   help=f"a preset ({', '.join(hardware.PRESETS)}) or a JSON file of parameters (its 'base' names "
                        f"the preset it changes; default %(default)s)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="change one hardware parameter (e.g. host_rate=1.25e9, switch_window=128); repeatable")
    p.add_argument("--workers", default=DEFAULT_WORKERS,
                   help="worker counts to predict, comma-separated (default %(default)s)")
    p.add_argument("--workers-per-rack", type=int, default=32, help="workers per rack (default %(default)s)")
    p.add_argument("--oversubscription", type=float, default=1.0,
                   help="a rack's host links over its uplink (1: non-blocking; default %(default)g)")
    p.add_argument("--loss", type=float, default=0.0, help="packet loss per link crossed (default 0)")
    p.add_argument("--size", type=one_size, default=None,
                   help="all-reduce buffer (default 100MiB; validate: 16MiB; calibrate: 32MiB)")
    p.add_argument("--systems", default=",".join(model.SYSTEMS),
                   help="what to predict, comma-separated (default: all of them)")
    p.add_argument("--compute", type=float, default=None, metavar="SECONDS",
                   help="also predict a training step of this much compute per step")
    p.add_argument("--overlap", type=float, default=0.5,
                   help="with --compute: the share of compute communication can hide under (default %(default)g)")
    p.add_argument("--jobs", default="1,2,4,8,16,32,64",
                   help="jobs sharing the switches' pool, for the goodput table (default %(default)s)")
    p.add_argument("--plot", default=None, metavar="PREFIX",
                   help="draw PREFIX-time.png (time per all-reduce over workers) and PREFIX-jobs.png (goodput of "
                        "jobs sharing a pool); validate: a PNG of predicted against measured; needs aggnet[plot]")
    p.add_argument("--json", default=None, help="write every prediction here")


class _BadArgs(ValueError):
    pass


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise _BadArgs(f"{what} must be whole numbers separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise _BadArgs(f"{what} must be positive whole numbers, got {text!r}")
    return values


def _overrides(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise _BadArgs(f"--set takes NAME=VALUE, got {pair!r}")
        try:
            out[name.strip()] = int(value) if value.strip().lstrip("-").isdigit() else float(value)
        except ValueError:
            raise _BadArgs(f"--set {name}: {value!r} is not a number") from None
    return out


def main(args) -> int:
    if args.what == "calibrate":
        return _calibrate(args)
    if args.what == "validate":
        return _validate(args)
    if args.what == "published":
        return _published(args)
    try:
        hw = hardware.load(args.hardware, _overrides(args.set))
        counts = _ints(args.workers, "--workers")
        jobs = _ints(args.jobs, "--jobs")
        systems = [s.strip() for s in args.systems.split(",") if s.strip()]
        unknown = [s for s in systems if s not in model.SYSTEMS]
        if unknown:
            raise _BadArgs(f"unknown system(s) {unknown}; known: {', '.join(model.SYSTEMS)}")
        w = args.workers_per_rack
        ragged = [n for n in counts if n % w]
        if ragged:
            raise _BadArgs(f"worker counts {ragged} are not whole racks of {w} (--workers-per-rack)")
        shapes = [model.Shape(n // w, w, args.oversubscription, args.loss) for n in counts]
        nbytes = parse_size(args.size or "100MiB")
    except (_BadArgs, ValueError) as exc:
        print(f"aggnet sim: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    rows = [{"workers": s.workers, "racks": s.racks,
             "predictions": {name: model.predict(name, hw, s, nbytes) for name in systems}} for s in shapes]
    pool = [model.shared_pool(hw, shapes[0], nbytes, j) for j in jobs]
    took = time.perf_counter() - t0
    _print(hw, args, nbytes, systems, rows, pool, shapes[0])
    print(f"({sum(len(r['predictions']) for r in rows)} predictions in {took * 1000:.1f} ms: flow level, "
          f"independent of the worker count)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_record(hw, args, nbytes, rows, pool), f, indent=1)
    if args.plot:
        return _plot(args.plot, hw, nbytes, systems, rows, pool, shapes[0])
    return 0


def _needs_root(what: str) -> str | None:
    if os.geteuid() != 0:
        return f"aggnet sim {what} runs aggnet emulate, which needs root (network namespaces): run it with sudo"
    return None


def _calibrate(args) -> int:
    refused = _needs_root("calibrate")
    if refused:
        print(refused, file=sys.stderr)
        return 2
    try:
        fields = validate.calibrate(size=args.size or "32MiB", reps=args.reps)
    except RuntimeError as exc:
        print(f"aggnet sim calibrate: {exc}", file=sys.stderr)
        return 1
    with open(args.out, "w") as f:
        json.dump(fields, f, indent=1)
    print(f"wrote {args.out}: " + ", ".join(f"{k} {fields[k]:.3g}" for k in (
        "client_cpu_s_per_byte", "host_agg_cpu_s_per_byte", "ring_cpu_s_per_byte", "step_latency", "hop_latency",
        "root_latency", "switch_passes_per_s", "machine_cores") if k in fields))
    print(f"next: aggnet sim validate --hardware {args.out}")
    return 0


def _points(text: str | None) -> list[str]:
    if text is not None:
        return text.split(",")
    return list(validate.DEFAULT_POINTS) + (list(validate.P4_POINTS) if validate.can_run_p4() else [])


def _validate(args) -> int:
    refused = _needs_root("validate")
    try:
        hw = hardware.load(args.hardware, _overrides(args.set))
        points = [validate.Point.parse(p.strip()) for p in _points(args.points) if p.strip()]
        nbytes = parse_size(args.size or "16MiB")
        if not points:
            raise _BadArgs("--points names no point")
        if hw.machine_cores == 0:
            raise _BadArgs(f"--hardware {args.hardware} describes hosts with cores of their own, not this machine's "
                           f"emulation: run aggnet sim calibrate first and pass its file")
        if any(p.p4 for p in points) and not (validate.can_run_p4() and hw.switch_passes_per_s):
            raise _BadArgs(":p4 points need BMv2 (simple_switch_grpc) on PATH and a calibration made with it "
                           "(its switch_passes_per_s): install it and run aggnet sim calibrate again")
    except (_BadArgs, ValueError) as exc:
        refused = refused or f"aggnet sim validate: {exc}"
    if refused:
        print(refused, file=sys.stderr)
        return 2
    try:
        rows = validate.validate(hw, points, nbytes, args.reps)
    except RuntimeError as exc:
        print(f"aggnet sim validate: {exc}", file=sys.stderr)
        return 1
    validate.print_rows(rows, nbytes)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"hardware": dict(hw.__dict__), "bytes": nbytes, "reps": args.reps,
                       "time": time.strftime("%FT%T"), "rows": rows}, f, indent=1)
    if args.plot:
        try:
            validate.plot(rows, args.plot)
        except ImportError:
            print("aggnet sim: --plot needs matplotlib: pip install 'aggnet[plot]'", file=sys.stderr)
            return 1
        print(f"wrote {args.plot}")
    return 0


def _published(args) -> int:
    r = published.report()
    published.print_report(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    if args.plot:
        try:
            published.plot(r, args.plot)
        except ImportError:
            print("aggnet sim: --plot needs matplotlib: pip install 'aggnet[plot]'", file=sys.stderr)
            return 1
        print(f"wrote {args.plot}")
    return 0


def _print(hw, args, nbytes, systems, rows, pool, last) -> None:
    rate = hw.host_rate * 8 / 1e9
    print(f"{hw.name}: {rate:g} Gbit/s host links, racks of {args.workers_per_rack}, uplinks oversubscribed "
          f"{args.oversubscription:g}:1, loss {args.loss:g}; {format_size(nbytes)} all-reduce")
    print(f"{'workers':>8} " + " ".join(f"{s:>15}" for s in systems) + f" {'ring/aggnet':>12}")
    for r in rows:
        p = r["predictions"]
        cells = " ".join(f"{p[s].seconds * 1e3:12.2f} ms" for s in systems)
        ratio = (f"{p['ring'].seconds / p['aggnet-switch'].seconds:12.2f}"
                 if "ring" in p and "aggnet-switch" in p else f"{'':>12}")
        print(f"{r['workers']:>8} {cells} {ratio}")
    print("bottleneck at " + f"{rows[-1]['workers']} workers: " +
          ", ".join(f"{s} {rows[-1]['predictions'][s].bottleneck}" for s in systems))
    if args.compute is not None:
        print(f"training step, {args.compute * 1e3:g} ms compute, {args.overlap:.0%} of it overlapped:")
        for r in rows:
            steps = {s: model.step_seconds(args.compute, r["predictions"][s].seconds, args.overlap)
                     for s in systems}
            print(f"{r['workers']:>8} " + " ".join(f"{steps[s] * 1e3:12.2f} ms" for s in systems))
    print(f"jobs sharing the switches' pool ({hw.switch_pool} slots, {hw.switch_window} per job), each on "
          f"{last.workers} workers of its own in {last.racks} racks (the rest fall back to the racks' aggregator "
          f"hosts):")
    print(f"{'jobs':>6} {'on switch':>10} {'fallback':>9} {'goodput GB/s':>13} {'slowest job':>12}")
    for j in pool:
        print(f"{j['jobs']:>6} {j['on_switch']:>10} {j['fallback']:>9} {j['goodput'] / 1e9:13.2f} "
              f"{max(j['seconds']) * 1e3:9.2f} ms")


def _record(hw, args, nbytes, rows, pool) -> dict:
    return {"hardware": {k: v for k, v in hw.__dict__.items()}, "bytes": nbytes,
            "workers_per_rack": args.workers_per_rack, "oversubscription": args.oversubscription, "loss": args.loss,
            "time": time.strftime("%FT%T"),
            "rows": [{"workers": r["workers"], "racks": r["racks"],
                      "predictions": {s: {"seconds": p.seconds, "bottleneck": p.bottleneck,
                                          "cross_rack_bytes": p.cross_rack_bytes, "terms": p.terms}
                                      for s, p in r["predictions"].items()}} for r in rows],
            "shared_pool": pool}


def _plot(prefix, hw, nbytes, systems, rows, pool, last) -> int:
    try:
        import matplotlib
    except ImportError:
        print("aggnet sim: --plot needs matplotlib: pip install 'aggnet[plot]'", file=sys.stderr)
        return 1
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    xs = [r["workers"] for r in rows]
    for s in systems:
        ax.plot(xs, [r["predictions"][s].seconds * 1e3 for r in rows], marker="o", label=s)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("workers")
    ax.set_ylabel("time per all-reduce (ms)")
    ax.set_title(f"{format_size(nbytes)} all-reduce, {hw.name}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(f"{prefix}-time.png", dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot([j["jobs"] for j in pool], [j["goodput"] / 1e9 for j in pool], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("jobs sharing the pool")
    ax.set_ylabel("all-reduce goodput, all jobs (GB/s)")
    ax.set_title(f"{last.workers} workers, pool {hw.switch_pool} slots, {hw.switch_window} per job")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(f"{prefix}-jobs.png", dpi=120)
    plt.close(fig)
    print(f"wrote {prefix}-time.png and {prefix}-jobs.png")
    return 0
