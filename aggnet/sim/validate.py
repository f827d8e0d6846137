"""The model against the emulated fabric: ``aggnet sim calibrate`` measures
this machine into a parameter file, ``aggnet sim validate`` runs
``aggnet emulate bench`` at points the calibration never saw and puts the
model's prediction beside each measurement.

Calibration uses one rack of four workers on unshaped links, where the
machine's CPU is the bottleneck: CPU-seconds per byte of aggnet's client,
of an aggregator host and of gloo's ring, from the processes themselves;
and a small all-reduce for the fixed costs (a ring step, a round trip),
in one rack and in two racks under a root (what a second level adds).
Validation shapes the links (100 to 1000 Mbit/s, oversubscribed uplinks,
drops), so what it checks is how the model combines those numbers with
link rates, the protocol's bytes, the window and loss, not the numbers
themselves. Every host of an emulation shares this machine's cores, which
the parameter file says (``machine_cores``); on a real fabric each host
has its own.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from aggnet.client.config import format_size, parse_size
from aggnet.progress import Progress
from aggnet.sim import hardware, model

MBIT = 1e6 / 8
#: the emulation's aggregation packets (``aggnet emulate``'s host in switch mode, jumbo frames)
EMULATED_ELEMENTS = 2048
CALIBRATION_WORKERS = 4
#: seconds one emulated point may take
EMULATION_TIMEOUT = 1800
#: a P4 rack's buffer: BMv2 in the ToR's place sums about 1,200 packets a
#: second, so its points all-reduce this much whatever --size says
P4_BYTES = 256 << 10


@dataclass(frozen=True)
class Point:
    """One emulated fabric: R racks of W workers, host links and uplinks in
    Mbit/s (0: unshaped), random drops of aggregation datagrams; racks
    aggregated by hosts in switch mode, or by the P4 program on BMv2."""

    racks: int
    workers: int
    host_mbit: float
    uplink_mbit: float = 0.0
    drop: float = 0.0
    p4: bool = False

    @classmethod
    def parse(cls, text: str) -> "Point":
        """``RxW@HOST[/UPLINK][~DROP][:p4]``, e.g. ``1x4@100``, ``2x4@400/100``,
        ``1x4@100~0.01``, ``2x2@1000/0:p4``."""
        try:
            text_, _, kind = text.partition(":")
            if kind not in ("", "p4"):
                raise ValueError(kind)
            shape, _, rest = text_.partition("@")
            r, w = (int(v) for v in shape.split("x"))
            rest, _, drop = rest.partition("~")
            host, _, up = rest.partition("/")
            p = cls(r, w, float(host), float(up or 0), float(drop or 0), kind == "p4")
        except ValueError:
            raise ValueError(f"a point is RACKSxWORKERS@HOST_MBIT[/UPLINK_MBIT][~DROP][:p4] (e.g. "
                             f"2x4@400/100~0.01, 2x2@1000/0:p4), got {text!r}") from None
        if p.racks < 1 or p.workers < 2 or p.host_mbit <= 0 or p.uplink_mbit < 0 or not 0 <= p.drop < 1:
            raise ValueError(f"{text!r}: needs a rack or more of 2 workers or more, shaped host links "
                             f"(Mbit/s > 0) and a drop probability in [0, 1)")
        return p

    def __str__(self) -> str:
        up = f"/{self.uplink_mbit:g}" if self.racks > 1 else ""
        return f"{self.racks}x{self.workers}@{self.host_mbit:g}{up}" + (f"~{self.drop:g}" if self.drop else "") \
            + (":p4" if self.p4 else "")


#: the default validation grid: link rates where the link binds and where the CPU
#: starts to, lossy racks, two and four racks under an oversubscribed spine and
#: two without one; P4 racks where BMv2 is installed
DEFAULT_POINTS = ("1x4@100", "1x4@400", "1x4@1000", "1x4@100~0.01", "1x4@1000~0.01", "2x4@400/100",
                  "2x4@400/100~0.01", "2x4@100/0", "2x2@1000/0", "4x4@400/100")
P4_POINTS = ("1x2@1000:p4", "2x2@1000/0:p4")


def topology_toml(racks: int, p4: bool = False) -> str:
    """A topology of ``racks`` racks aggregated by hosts in switch mode (or
    by P4 switches) under a switch-mode root: the emulation gives it
    addresses and link rates of its own."""
    lines = ['job = "sim-validate"', "", "[root]", 'kind = "host-switch"', 'host = "spine"',
             'address = "udp://10.77.0.1:42606"']
    for r in range(racks):
        lines += ["", "[[racks]]", f'name = "rack{r}"', f'hosts = ["r{r}w0"]', "[racks.aggregator]"]
        if p4:
            lines += ['kind = "p4"', f'address = "udp://10.77.{r + 1}.253:42606"',
                      f'p4runtime = "10.77.{r + 1}.253:9559"', "device_id = 0"]
        else:
            lines += ['kind = "host-switch"', f'host = "r{r}agg"', f'address = "udp://10.77.{r + 1}.254:42606"']
    return "\n".join(lines) + "\n"


def can_run_p4() -> bool:
    """Whether BMv2 is installed to put in a ToR's place."""
    from aggnet.p4.tools import find_tool

    return find_tool("simple_switch_grpc") is not None


def run_emulation(point: Point, nbytes: int, reps: int, workdir: str) -> dict:
    """``aggnet emulate bench`` at ``point`` (host links of 0 Mbit/s:
    unshaped): its JSON record."""
    out = os.path.join(workdir, f"{point}-{nbytes}.json".replace("/", "-"))
    cmd = [sys.executable, "-m", "aggnet", "emulate", "bench", "--workers", str(point.workers),
           "--rate", f"{point.host_mbit:g}", "--size", str(nbytes), "--reps", str(reps), "--json", out]
    if point.racks > 1:
        topo = os.path.join(workdir, f"racks-{point.racks}{'-p4' if point.p4 else ''}.toml")
        with open(topo, "w") as f:
            f.write(topology_toml(point.racks, point.p4))
        cmd += ["--topology", topo, "--racks", str(point.racks), "--uplink-rate", f"{point.uplink_mbit:g}"]
    elif point.p4:
        cmd += ["--switch", "bmv2"]
    if point.drop:
        cmd += ["--drop", f"{point.drop:g}"]
    try:
        run = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "AGGNET_PROGRESS": "0"}, timeout=EMULATION_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"aggnet emulate bench at {point}, {format_size(nbytes)}, took over "
                           f"{EMULATION_TIMEOUT} s: try a smaller --size or fewer --reps") from None
    if run.returncode != 0:
        tail = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"aggnet emulate bench at {point}, {format_size(nbytes)}, failed "
                           f"(exit {run.returncode}): {tail[0]}")
    with open(out) as f:
        return json.load(f)


def _by_system(record: dict) -> dict:
    return {r["system"]: r for r in record["records"]}


def calibrate(size: str = "32MiB", reps: int = 3, small: str = "64KiB", small_reps: int = 25) -> dict:
    """Measure this machine: returns the parameter file's fields, each with
    its source."""
    w = CALIBRATION_WORKERS
    nbytes, small_bytes = parse_size(size), parse_size(small)
    with tempfile.TemporaryDirectory(prefix="aggnet-calibrate-") as tmp:
        with Progress("calibrate", 4) as bar:
            unshaped = Point(1, w, 0.0)
            big = _by_system(run_emulation(unshaped, nbytes, reps, tmp))
            bar.step(f"{format_size(nbytes)} unshaped")
            tiny = _by_system(run_emulation(unshaped, small_bytes, small_reps, tmp))
            bar.step(f"{format_size(small_bytes)} unshaped")
            rooted = _by_system(run_emulation(Point(2, w // 2, 0.0), small_bytes, small_reps, tmp))
            bar.step(f"{format_size(small_bytes)} unshaped, two racks under a root")
            p4 = _by_system(run_emulation(Point(1, w, 1000.0, p4=True), P4_BYTES, reps, tmp)) \
                if can_run_p4() else None
            bar.step(f"{format_size(P4_BYTES)}, BMv2 in the ToR's place" if p4 else "no BMv2 installed")
    ring_share = 2 * (w - 1) / w
    client = big["aggnet"]["worker_cpu_s_per_gb"] / 1e9
    agg = (big["aggnet"].get("aggregator_cpu_s_per_gb") or 0.0) / 1e9 / w  # per byte a member sends
    ring_cpu = big["gloo"]["worker_cpu_s_per_gb"] / 1e9 / ring_share
    step = tiny["gloo"]["median_s"] / (2 * (w - 1))
    hop = max(1e-6, (tiny["aggnet"]["median_s"] - step) / 2)
    # a small buffer is one window: its all-reduce is one round trip, so a
    # root's share is the two-level round trip less the one-level one
    root = max(0.0, rooted["aggnet"]["median_s"] - tiny["aggnet"]["median_s"])
    cores = os.cpu_count() or 1
    when = time.strftime("%Y-%m-%d")
    bmv2 = _bmv2_fields(p4, w, platform.node(), when)
    how = (f"aggnet sim calibrate on {platform.node()} ({cores} cores), {when}: aggnet emulate bench, one rack of "
           f"{w}, unshaped links")
    return {
        "base": "emulation", "name": f"emulation on {platform.node()}",
        "client_cpu_s_per_byte": client, "host_agg_cpu_s_per_byte": agg, "ring_cpu_s_per_byte": ring_cpu,
        "host_agg_packets_per_s": 1.0 / (agg * 4 * EMULATED_ELEMENTS) if agg else 1.0e6,
        "host_agg_shards": cores, "machine_cores": cores, "step_latency": step, "hop_latency": hop,
        "root_latency": root, **bmv2.pop("fields"),
        "sources": {
            "client_cpu_s_per_byte": f"{how}, {format_size(nbytes)}: a worker's CPU-seconds per byte of buffer",
            "host_agg_cpu_s_per_byte": f"{how}, {format_size(nbytes)}: the aggregator's CPU-seconds per byte "
                                       f"its members sent",
            "ring_cpu_s_per_byte": f"{how}, {format_size(nbytes)}: a gloo worker's CPU-seconds per byte its ring "
                                   f"moved",
            "host_agg_packets_per_s": "one core's datagrams per second at the aggregator's measured CPU per byte",
            "machine_cores": "every process of an emulation shares this machine's cores (os.cpu_count)",
            "step_latency": f"{how}, {format_size(small_bytes)}: gloo's time over its 2(N-1) ring steps",
            "hop_latency": f"{how}, {format_size(small_bytes)}: half of aggnet's round trip beyond a step",
            "root_latency": f"{how}, {format_size(small_bytes)}: aggnet's round trip through two racks of "
                            f"{w // 2} under a root less its round trip in one rack",
            **bmv2.pop("sources"),
        },
        "measured": {"bytes": nbytes, "small_bytes": small_bytes,
                     "records": {k: {"median_s": v["median_s"], "worker_cpu_s_per_gb": v["worker_cpu_s_per_gb"],
                                     "aggregator_cpu_s_per_gb": v.get("aggregator_cpu_s_per_gb")}
                                 for k, v in big.items()},
                     "small": {k: v["median_s"] for k, v in tiny.items()},
                     "small_under_a_root": {k: v["median_s"] for k, v in rooted.items()}},
    }


def _bmv2_fields(p4: dict | None, w: int, node: str, when: str) -> dict:
    """BMv2's pipeline passes per second, from a rack of ``w`` workers
    behind it: each slot takes W packets in and multicasts W copies."""
    if p4 is None:
        return {"fields": {}, "sources": {}}
    passes = 2 * w * P4_BYTES / (4 * hardware.PRESETS["emulation"].switch_elements)
    return {"fields": {"switch_passes_per_s": passes / p4["aggnet"]["median_s"]},
            "sources": {"switch_passes_per_s": f"aggnet sim calibrate on {node}, {when}: aggnet emulate bench "
                                               f"--switch bmv2, one rack of {w}, {format_size(P4_BYTES)}: 2 W "
                                               f"packets per slot over the all-reduce's time"}}


def hardware_at(hw: hardware.Hardware, point: Point) -> hardware.Hardware:
    """The calibrated machine with ``point``'s links: an emulated rack's
    aggregator host has a link of W host links (``aggnet emulate``)."""
    return hw.replace(host_rate=point.host_mbit * MBIT, host_agg_link_factor=float(point.workers))


def predict(hw: hardware.Hardware, point: Point, nbytes: int) -> dict:
    """aggnet (hosts in switch mode) and gloo's ring with ranks in rack
    order, as the emulation runs them."""
    at = hardware_at(hw, point)
    # an unshaped uplink: as good as none (Shape needs a positive ratio)
    over = point.workers * point.host_mbit / point.uplink_mbit if point.uplink_mbit else 1e-9
    shape = model.Shape(point.racks, point.workers, oversubscription=over, loss=point.drop)
    if point.p4:
        # gloo's frames cross BMv2 as plain forwarding, which no term here describes
        return {"aggnet": model.predict("aggnet-switch", at, shape, nbytes), "gloo": None}
    return {"aggnet": model.predict("aggnet-host", at, shape, nbytes),
            "gloo": model.ring(at, shape, nbytes, rack_aware=True)}


def validate(hw: hardware.Hardware, points: list[Point], nbytes: int, reps: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="aggnet-validate-") as tmp, \
            Progress("validate", len(points)) as bar:
        for point in points:
            size = P4_BYTES if point.p4 else nbytes
            measured = _by_system(run_emulation(point, size, reps, tmp))
            predicted = predict(hw, point, size)
            row = {"point": str(point), "racks": point.racks, "workers": point.workers, "bytes": size,
                   "host_mbit": point.host_mbit, "uplink_mbit": point.uplink_mbit, "drop": point.drop}
            for system in ("aggnet", "gloo"):
                m, p = measured[system]["median_s"], predicted[system]
                row[system] = {"measured_s": m, "times": measured[system]["times"]}
                if p is not None:
                    row[system].update({"predicted_s": p.seconds, "error": (p.seconds - m) / m,
                                        "bottleneck": p.bottleneck, "terms": p.terms})
            rows.append(row)
            bar.step(f"{point}: " + ", ".join(f"{s} {row[s]['error']:+.0%}" for s in ("aggnet", "gloo")
                                              if "error" in row[s]))
    return rows


def _cells(got: dict, width: int) -> str:
    if "error" not in got:
        return f"{got['measured_s']:8.3f} {'-':>8} {'-':>7} {'not modelled':>{width}}"
    return (f"{got['measured_s']:8.3f} {got['predicted_s']:8.3f} {got['error']:+7.1%} "
            f"{got['bottleneck']:>{width}}")


def print_rows(rows: list[dict], nbytes: int) -> None:
    print(f"{format_size(nbytes)} all-reduce ({format_size(P4_BYTES)} at :p4 points, BMv2 in the ToR's place); "
          f"point RxW@host[/uplink] Mbit/s[~drop]; seconds, median of the emulation's repetitions")
    print(f"{'point':>16} {'aggnet':>8} {'model':>8} {'error':>7} {'bound by':>24} {'gloo':>8} {'model':>8} "
          f"{'error':>7} {'bound by':>12}")
    for r in rows:
        print(f"{r['point']:>16} {_cells(r['aggnet'], 24)} {_cells(r['gloo'], 12)}")
    for system, bound in (("aggnet", 0.10), ("gloo", 0.15)):
        errs = [abs(r[system]["error"]) for r in rows if "error" in r[system]]
        if not errs:
            continue
        within = sum(e <= bound for e in errs)
        print(f"{system}: {within} of {len(errs)} points within {bound:.0%}; mean |error| "
              f"{statistics.fmean(errs):.1%}, largest {max(errs):.1%}")


def plot(rows: list[dict], path: str) -> None:
    """Predicted against measured, one mark per point and system, on the
    diagonal where the model is right, a band of ±10% around it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter

    fig, ax = plt.subplots(figsize=(6.4, 5.2))
    seen = [r[s][k] for r in rows for s in ("aggnet", "gloo") for k in ("measured_s", "predicted_s")
            if "error" in r[s]]
    line = [min(seen) * 0.8, max(seen) * 1.25]
    ax.plot(line, line, color="grey", lw=0.8, label="model = emulation")
    ax.fill_between(line, [x * 0.9 for x in line], [x * 1.1 for x in line], color="grey", alpha=0.15, label="±10%")
    for system, marker in (("aggnet", "o"), ("gloo", "s")):
        modelled = [r for r in rows if "error" in r[system]]
        xs = [r[system]["measured_s"] for r in modelled]
        ys = [r[system]["predicted_s"] for r in modelled]
        ax.scatter(xs, ys, marker=marker, label=system, zorder=3)
        for r, x, y in zip(modelled, xs, ys):
            ax.annotate(r["point"], (x, y), fontsize=6, xytext=(4, -8 if system == "gloo" else 3),
                        textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(FormatStrFormatter("%g"))
        axis.set_minor_formatter(FormatStrFormatter("%g"))
    ax.tick_params(which="minor", labelsize=7)
    ax.set_xlabel("measured in the emulated fabric (s)")
    ax.set_ylabel("predicted by aggnet sim (s)")
    ax.set_title("aggnet sim against aggnet emulate (points RxW@host/uplink Mbit/s)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["Point", "DEFAULT_POINTS", "P4_POINTS", "P4_BYTES", "can_run_p4", "calibrate", "validate", "predict", "hardware_at", "topology_toml"]
