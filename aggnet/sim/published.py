"""The model beside what in-network aggregation's papers published.

SwitchML and ATP evaluated on testbeds no lab here owns. What of their
evaluations is publicly reachable from here is the headline each abstract
states, not the figures behind it, so this module does the closest real
thing: it puts the model, run with each paper's own parameters (100 Gbit/s
links, a Tofino pool, the packet sizes SwitchML's library offers), beside
each headline, draws the curve the headline summarises, and says where
the two agree and what the model would need to agree where they do not.
A headline is a training speed-up; the model predicts all-reduces, whose
speed-up bounds a training step's from above (compute does not speed up).
"""

from __future__ import annotations

from dataclasses import dataclass

from aggnet.client.config import format_size
from aggnet.sim import hardware, model

MiB = 1 << 20
#: a large model's gradients: where the bandwidth, not the latency, decides
BUFFER = 100 * MiB


@dataclass(frozen=True)
class Claim:
    paper: str
    statement: str
    #: the claimed speed-up, as a factor (1.66 for 66% more throughput)
    factor: float
    source: str


SWITCHML = Claim("SwitchML (NSDI'21)", "speeds up training by up to 5.5x for a number of real-world benchmark "
                 "models", 5.5, "arXiv 1903.06701, abstract; 5.55x on 8 DNN benchmarks on the project page, "
                 "sands.kaust.edu.sa/project/switchml")
ATP = Claim("ATP (NSDI'21)", "outperforms existing systems accelerating training throughput by up to 38% - 66% "
            "in a cluster shared by multiple DT jobs", 1.66, "usenix.org/conference/nsdi21/presentation/lao, "
            "abstract")
#: values per packet SwitchML's library offers: 64 in one pipeline pass, up
#: to 256 with recirculation (p4lang/p4app-switchML, client_lib's packet_numel)
SWITCHML_ELEMENTS = (64, 256)
SWITCHML_WORKERS = (2, 4, 8, 16, 32, 64)


def switchml_speedups(hw: hardware.Hardware, workers=SWITCHML_WORKERS, nbytes: float = BUFFER) -> dict:
    """In-switch aggregation's all-reduce speed-up over a line-rate ring in
    one rack, per worker count and packet size."""
    out = {}
    for k in SWITCHML_ELEMENTS:
        at = hw.replace(switch_elements=k)
        out[k] = {n: model.ring(at, model.Shape(1, n), nbytes).seconds
                  / model.aggnet_switch(at, model.Shape(1, n), nbytes).seconds for n in workers}
    return out


def switchml_verdict(speedups: dict, claim: Claim = SWITCHML) -> dict:
    """Where the model meets the headline: its largest speed-up over a ring
    at line rate, and the share of line rate the ring must have moved for
    an all-reduce speed-up as large as the claimed training one."""
    ceiling = max(max(by_n.values()) for by_n in speedups.values())
    return {"claim": claim.factor, "model_ceiling": ceiling, "ring_share_of_line_rate": ceiling / claim.factor,
            "agrees": ceiling >= claim.factor}


def partitioned_pool(hw: hardware.Hardware, shape: model.Shape, nbytes: float, jobs: int) -> dict:
    """Jobs sharing a pool split evenly among them (each job a fixed share
    of the slots, SwitchML-style): every job aggregates in the switch,
    with a window of pool / jobs slots; all share the uplinks."""
    window = max(1, hw.switch_pool // jobs)
    alone = model.aggnet_switch(hw.replace(switch_window=min(window, hw.switch_window)), shape, nbytes)
    eff = hw.switch_efficiency()
    uplink = jobs * nbytes / (eff * shape.uplink_rate(hw)) if shape.racks > 1 else 0.0
    seconds = max(alone.seconds, uplink)
    return {"jobs": jobs, "seconds": [seconds] * jobs, "goodput": jobs * nbytes / seconds}


def hosts_only(hw: hardware.Hardware, shape: model.Shape, nbytes: float, jobs: int) -> dict:
    """Every job on the racks' aggregator hosts (no switch aggregation):
    the fallback of :func:`model.shared_pool` for all of them."""
    return model.shared_pool(hw.replace(switch_pool=0), shape, nbytes, jobs)


def atp_gains(hw: hardware.Hardware, shape: model.Shape, jobs_list, nbytes: float = BUFFER) -> list[dict]:
    """Aggregate all-reduce goodput of jobs sharing the switches ATP-style
    (best effort, spilling to hosts) against an evenly split pool and
    against hosts alone."""
    rows = []
    for jobs in jobs_list:
        best = model.shared_pool(hw, shape, nbytes, jobs)
        split = partitioned_pool(hw, shape, nbytes, jobs)
        hosts = hosts_only(hw, shape, nbytes, jobs)
        rows.append({"jobs": jobs, "best_effort": best["goodput"], "partitioned": split["goodput"],
                     "hosts": hosts["goodput"], "over_partitioned": best["goodput"] / split["goodput"],
                     "over_hosts": best["goodput"] / hosts["goodput"]})
    return rows


def report(hw: hardware.Hardware | None = None, shape: model.Shape | None = None, jobs_list=None) -> dict:
    """Everything ``aggnet sim published`` prints and writes."""
    hw = hw or hardware.load("tofino-100g")
    shape = shape or model.Shape(4, 32)  # uplinks at full rate: the pool, not the spine, is compared
    jobs_list = jobs_list or (1, 4, 16, 32, 64, 128, 256)
    speedups = switchml_speedups(hw)
    gains = atp_gains(hw, shape, jobs_list)
    best = max(gains, key=lambda r: r["over_partitioned"])
    return {"hardware": hw.name, "switchml": {"claim": SWITCHML.__dict__, "speedups": speedups,
                                              "verdict": switchml_verdict(speedups)},
            "atp": {"claim": ATP.__dict__, "racks": shape.racks, "workers_per_rack": shape.workers_per_rack,
                    "oversubscription": shape.oversubscription, "rows": gains,
                    "largest_gain_over_partitioned": best["over_partitioned"], "at_jobs": best["jobs"]}}


def print_report(r: dict) -> None:
    sw, atp = r["switchml"], r["atp"]
    v = sw["verdict"]
    print(f"{SWITCHML.paper}: \"{SWITCHML.statement}\" ({SWITCHML.source})")
    print(f"  the model, {r['hardware']}, one rack, {format_size(BUFFER)}: in-switch all-reduce over a ring at line "
          f"rate, by workers")
    workers = list(next(iter(sw["speedups"].values())))
    print(f"  {'values/packet':>14} " + " ".join(f"{n:>6}" for n in workers))
    for k, by_n in sw["speedups"].items():
        print(f"  {k:>14} " + " ".join(f"{by_n[n]:6.2f}" for n in workers))
    print(f"  the model's largest speed-up is {v['model_ceiling']:.2f}x (the ring's 2(N-1)/N of S and its 2(N-1) "
          f"steps against S in the protocol's packets): {'it reaches' if v['agrees'] else 'short of'} the claimed {v['claim']:g}x; an "
          f"all-reduce that much faster needs a ring at {v['ring_share_of_line_rate']:.0%} of line rate or less")
    print(f"{ATP.paper}: \"{ATP.statement}\" ({ATP.source})")
    print(f"  the model, {r['hardware']}, {atp['racks']} racks of {atp['workers_per_rack']}, uplinks "
          f"{atp['oversubscription']:g}:1, {format_size(BUFFER)}: all jobs' all-reduce goodput, GB/s")
    print(f"  {'jobs':>6} {'best effort':>12} {'split pool':>11} {'hosts only':>11} {'over split':>11} "
          f"{'over hosts':>11}")
    for g in atp["rows"]:
        print(f"  {g['jobs']:>6} {g['best_effort'] / 1e9:12.1f} {g['partitioned'] / 1e9:11.1f} "
              f"{g['hosts'] / 1e9:11.2f} {g['over_partitioned']:10.2f}x {g['over_hosts']:10.1f}x")
    print(f"  best effort's largest gain over an evenly split pool: {atp['largest_gain_over_partitioned']:.2f}x "
          f"(at {atp['at_jobs']} jobs), against the claimed up to {ATP.factor:g}x")


def plot(r: dict, path: str) -> None:
    """SwitchML's curve: the model's speed-up over a ring as workers grow,
    per packet size, under the claimed training speed-up."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for k, by_n in r["switchml"]["speedups"].items():
        ns = [int(n) for n in by_n]
        ax.plot(ns, list(by_n.values()), marker="o", label=f"model, {k} values per packet")
    ax.axhline(SWITCHML.factor, color="grey", ls="--", lw=1, label=f"SwitchML's claim, up to {SWITCHML.factor:g}x")
    ax.axhline(2.0, color="grey", ls=":", lw=1, label="a ring's bytes over the switch's: 2(N-1)/N -> 2")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("workers in the rack")
    ax.set_ylabel("all-reduce speed-up over a line-rate ring")
    ax.set_title(f"In-switch aggregation against a ring, {r['hardware']}, {format_size(BUFFER)}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["Claim", "SWITCHML", "ATP", "switchml_speedups", "switchml_verdict", "partitioned_pool", "hosts_only",
           "atp_gains", "report", "print_report", "plot"]
