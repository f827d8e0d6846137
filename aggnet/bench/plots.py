"""``aggnet plot``: the figures of docs/benchmarks.md, drawn from the JSON
the benchmarks write (``--json``), so that a figure is redrawn from a new
run by the same command. People would rather look at a benchmark over
link rates, sizes or α than read its table.

    aggnet plot rack rack-*.json --out rack.png       # aggnet emulate bench, over rates and sizes
    aggnet plot udp udp.json --out udp.png            # aggnet bench-udp
    aggnet plot sparse sparse.json --out sparse.png   # aggnet bench-sparse
    aggnet plot racks racks.json --out racks.png      # aggnet emulate --topology ... bench
    aggnet plot compare cmp.json --out cmp.png        # aggnet compare: each pair's ratio beside the peers'
    aggnet plot transport t.json --out t.png          # aggnet bench-transport: rate and CPU per GB over sizes
"""

from __future__ import annotations

import json
import sys

KINDS = ("rack", "udp", "sparse", "racks", "compare", "transport")


def add_arguments(p) -> None:
    p.add_argument("kind", choices=KINDS, help="which benchmark's JSON: rack (emulate bench, one file per rate and "
                                               "size), udp (bench-udp), sparse (bench-sparse), racks (emulate "
                                               "--topology ... bench), compare (aggnet compare), transport "
                                               "(bench-transport)")
    p.add_argument("files", nargs="+", help="the JSON files the benchmark wrote with --json")
    p.add_argument("--out", required=True, help="the PNG to write")


def main(args) -> int:
    try:
        import matplotlib
    except ImportError:
        print("aggnet plot: matplotlib is not installed: pip install 'aggnet[plot]'", file=sys.stderr)
        return 2
    matplotlib.use("Agg")
    runs = []
    for path in args.files:
        try:
            with open(path) as f:
                runs.append(json.load(f))
        except (OSError, ValueError) as exc:
            print(f"aggnet plot: cannot read {path}: {exc}", file=sys.stderr)
            return 2
    try:
        fig = {"rack": rack, "udp": udp, "sparse": sparse, "racks": racks, "compare": compare,
               "transport": transport}[args.kind](runs)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        print(f"aggnet plot: {args.files[0]} and the rest are not {args.kind} results ({type(exc).__name__}: "
              f"{exc}); give the JSON of the matching benchmark", file=sys.stderr)
        return 2
    fig.savefig(args.out, dpi=110, bbox_inches="tight")
    print(f"wrote {args.out}")
    return 0


def _mib(n: float) -> str:
    return f"{n / 2**20:g} MiB"


def rack(runs: list[dict]):
    """aggnet against gloo's ring in one emulated rack, over link rates and
    sizes: time per GB, and the ratio beside the bandwidth limit (each
    worker moves S up and S down where the ring moves 2S(N-1)/N each way),
    with the floor (a plain-socket parameter server) where the runs have it."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    rates = sorted({r["rate_mbit"] or 0 for r in runs}, key=lambda x: x or float("inf"))
    xpos = {rate: i for i, rate in enumerate(rates)}
    labels = [f"{rate:g} Mbit/s" if rate else "unshaped" for rate in rates]
    workers = {r["workers"] for r in runs}
    for size in sorted({r["bytes"] for r in runs}):
        points = sorted((r for r in runs if r["bytes"] == size), key=lambda r: xpos[r["rate_mbit"] or 0])
        x = [xpos[r["rate_mbit"] or 0] for r in points]
        by = [{rec["system"]: rec["median_s"] for rec in r["records"]} for r in points]
        for system, style in (("aggnet", "o-"), ("gloo", "s--"), ("floor", "^:")):
            if all(system in b for b in by):  # the floor: runs since it was added
                left.plot(x, [b[system] / (size / 1e9) for b in by], style, label=f"{system}, {_mib(size)}")
        right.plot(x, [b["aggnet"] / b["gloo"] for b in by], "o-", label=f"aggnet, {_mib(size)}")
        if all("floor" in b for b in by):
            right.plot(x, [b["floor"] / b["gloo"] for b in by], "^:", label=f"floor, {_mib(size)}")
    for n in sorted(workers):
        right.axhline(n / (2 * (n - 1)), color="grey", ls=":", label=f"bandwidth limit, {n} workers")
    left.set(yscale="log", ylabel="seconds per GB all-reduced", title="time per GB (lower is better)")
    right.set(ylabel="time / gloo time", title="aggnet (and the floor) relative to gloo's ring", ylim=(0, None))
    for ax in (left, right):
        ax.set_xticks(range(len(rates)), labels)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"one emulated rack, {', '.join(map(str, sorted(workers)))} workers (aggnet emulate bench)")
    return fig


def udp(runs: list[dict]):
    """The switch-protocol client's all-reduce rate beside the ceilings of
    a raw Python UDP loop, plain and with GSO, per values per datagram (the
    raw loops move each byte one way; the client's all-reduce every byte up
    and back down)."""
    import matplotlib.pyplot as plt

    from aggnet.protocol.wire import HEADER_SIZE

    records = [r for run in runs for r in (run if isinstance(run, list) else run["records"])]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for system, io in sorted({(r["system"], r["io"]) for r in records}):
        rows = sorted((r for r in records if (r["system"], r["io"]) == (system, io)),
                      key=lambda r: r["datagram_bytes"])
        label = f"aggnet all-reduce ({io} I/O)" if system == "aggnet" else f"{system} loop, one way"
        ax.plot([(r["datagram_bytes"] - HEADER_SIZE) // 4 for r in rows], [r["buffer_bytes_per_s"] / 1e6 for r in rows],
                "o-" if system == "aggnet" else "s--", label=label)
    ax.set(xscale="log", yscale="log", xlabel="int32 values per datagram", ylabel="MB of buffer per second",
           title="switch-protocol client beside raw UDP loops (aggnet bench-udp)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def transport(runs: list[dict]):
    """Each message transport's point-to-point rate and the CPU both ends
    spend per GB, over message sizes: where plain TCP gains on ZeroMQ (many
    small messages) and where both are the kernel's copies."""
    import matplotlib.pyplot as plt

    records = [r for run in runs for r in run]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name in dict.fromkeys(r["transport"] for r in records):
        rows = sorted((r for r in records if r["transport"] == name), key=lambda r: r["bytes"])
        x = [r["bytes"] for r in rows]
        left.errorbar(x, [r["median_gb_per_s"] for r in rows],
                      yerr=[[r["median_gb_per_s"] - r["min_gb_per_s"] for r in rows],
                            [r["max_gb_per_s"] - r["median_gb_per_s"] for r in rows]], fmt="o-", capsize=3, label=name)
        if all("cpu_s_per_gb" in r for r in rows):
            right.plot(x, [r["cpu_s_per_gb"] for r in rows], "o-", label=name)
    left.set(xscale="log", xlabel="message bytes", ylabel="GB/s (median, min-max)",
             title="point to point on one host (aggnet bench-transport)")
    right.set(xscale="log", yscale="log", xlabel="message bytes", ylabel="CPU s per GB, sender + receiver")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def sparse(runs: list[dict]):
    """An embedding table's step time and bytes per worker over α, the
    fraction of rows one worker's batch touches."""
    import matplotlib.pyplot as plt

    records = [r for run in runs for r in run["records"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for workers in sorted({r["workers"] for r in records}):
        for system in sorted({r["system"] for r in records}):
            rows = sorted((r for r in records if r["system"] == system and r["workers"] == workers),
                          key=lambda r: r["alpha"])
            if not rows:
                continue
            a = [100 * r["alpha"] for r in rows]
            left.plot(a, [r["step_s"] for r in rows], "o-", label=f"{system}, N={workers}")
            right.plot(a, [r["bytes_per_worker"] / 1e6 for r in rows], "o-", label=f"{system}, N={workers}")
    left.set(ylabel="step time (s)", title="step time")
    right.set(ylabel="MB sent + received per worker per step", title="bytes per worker")
    for ax in (left, right):
        ax.set(xscale="log", yscale="log", xlabel="α: % of the table's rows a worker's batch touches")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("a sharded embedding table (aggnet bench-sparse)")
    return fig


def racks(runs: list[dict]):
    """Racks under a root against gloo's ring across the racks: the time
    of one all-reduce and the bytes that crossed the racks' uplinks."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    names, times, cross = [], [], []
    for run in runs:
        links = (f"{run['host_mbit']:g}/{run['uplink_mbit']:g} Mbit/s" if run.get("host_mbit") and
                 run.get("uplink_mbit") else "unshaped")
        for rec in run["records"]:
            names.append(f"{rec['system']}\n{links}")
            times.append(rec["median_s"])
            c = rec["cross_rack_bytes"]
            cross.append((c["up"] + c["down"]) / run["bytes"])
    colors = ["tab:blue" if n.startswith("aggnet") else "tab:orange" for n in names]
    left.bar(range(len(names)), times, color=colors)
    right.bar(range(len(names)), cross, color=colors)
    left.set(ylabel="seconds per all-reduce", title="time (lower is better)")
    right.set(ylabel="bytes over the uplinks, up + down / S", title="cross-rack bytes, in buffer sizes S")
    for ax in (left, right):
        ax.set_xticks(range(len(names)), names, fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    shapes = sorted({f"{run['racks']} racks of {run['workers']} workers, {_mib(run['bytes'])}" for run in runs})
    fig.suptitle(f"racks under a root beside gloo's ring: {'; '.join(shapes)} (aggnet emulate --topology ... bench)")
    return fig


def compare(runs: list[dict]):
    """Each arm's ratio to the first, pair by pair (the median a dot, the
    range a bar), for every row of a comparison's time and worker CPU;
    the peers' bars, grey, are the machine's noise to read aggnet's
    against."""
    import matplotlib.pyplot as plt

    from aggnet.bench.compare import is_peer

    run = runs[0]
    arms = [a["name"] for a in run["arms"]]
    measures = [m for m in ("median_s", "worker_cpu_s_per_gb", "worker_cpu_s_per_step")
                if any(e["measure"] == m for e in run["paired"])]
    if not measures or len(arms) < 2:
        raise ValueError("no paired times of two arms")
    rows = [e["label"] for e in run["paired"] if e["measure"] == measures[0]]
    height = 1.2 + 0.35 * len(rows) * (len(arms) - 1)
    fig, axes = plt.subplots(1, len(measures), figsize=(5 + 3 * len(measures), height), sharey=True, squeeze=False)
    for ax, measure in zip(axes[0], measures):
        entries = {e["label"]: e for e in run["paired"] if e["measure"] == measure}
        named = set()
        for i, label in enumerate(rows):
            e = entries.get(label)
            for j, arm in enumerate(arms[1:]):
                ratios = e["arms"][arm]["ratios"] if e else []
                if not ratios:
                    continue
                y = i + j / len(arms)
                peer = is_peer(e["row"])
                color = "0.6" if peer else f"C{j}"
                ax.plot([min(ratios), max(ratios)], [y, y], "-", color=color, lw=2)
                ax.plot([e["arms"][arm]["median_ratio"]], [y], "o", color=color,
                        label=f"{arm}/{arms[0]}" if not peer and arm not in named else None)
                named |= set() if peer else {arm}
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set(xlabel=f"{measure}: each arm over {arms[0]}, pair by pair", title=measure)
        ax.grid(alpha=0.3, axis="x")
    axes[0][0].set_yticks(range(len(rows)), rows, fontsize=7)
    axes[0][0].invert_yaxis()
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{' '.join(run['command'])}: {run['pairs']} pairs (grey: peers, the machine's noise)", fontsize=8)
    return fig
