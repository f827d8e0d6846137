"""``aggnet emulate --topology FILE chaos``: int32 all-reduces across the
racks of a fabric, each checked bit for bit, while faults hit it in turn
(``emulation.faults``): a rack aggregator's shard and a root shard killed
and restarted, a worker's cable pulled, a burst of loss on a spine link.
Every aggregator's memory and descriptors are sampled as it goes; a long
run (30 minutes) shows whether any of them grows.

The faults take turns in a fixed order, one every ``every`` seconds, so a
run of a few minutes has each kind several times; which rack, shard and
worker is drawn from ``seed``. Shard kills need services started with
``--restart`` (the chaos run starts them so); switch-mode racks restart
no shard, so there the kills are left out, and a cable stays out for less
than their heartbeat lapse (longer reads as a dead worker, by design).
"""

from __future__ import annotations

import random
import threading
import time

from aggnet.emulation import faults, fabric_runs
from aggnet.emulation.fabric import Fabric

#: seconds a worker's cable stays out (service racks; TCP rides it out)
CABLE_SECONDS = 2.0
#: switch-mode racks: shorter than their default heartbeat lapse (3 s)
SWITCH_CABLE_SECONDS = 0.8
#: the loss of a burst on a spine link, and how long it lasts
BURST_DROP = 0.10
BURST_SECONDS = 3.0
#: seconds between samples of the aggregators' memory and descriptors
SAMPLE_EVERY = 5.0
#: seconds a fault may take beyond ``every`` (a shard's restart, a cable's
#: time down) before a run that still lacks a kind of fault stops anyway
FAULT_ALLOWANCE = 30.0
#: what an aggregator's memory may grow by, and its descriptors, from when
#: every shard it loses has been replaced once to the end of the run
MAX_RSS_GROWTH_MB = 32.0
MAX_FD_GROWTH = 8


def _kinds(fabric: Fabric) -> list[str]:
    kinds = {rp.aggregator.kind for rp in fabric.plan.racks}
    out = []
    if kinds == {"service"}:
        out.append("rack shard")
    out += ["cable", "burst"]
    if fabric.plan.root is not None and fabric.plan.root.kind == "service":
        out.append("root shard")
    return out


class Injector:
    """Injects the faults in turn on a thread of its own until stopped,
    and samples the aggregators between them."""

    def __init__(self, fabric: Fabric, every: float, seed: int, on_event=None):
        self.fabric = fabric
        self.every = every
        self.rng = random.Random(seed)
        self.on_event = on_event or (lambda line: None)
        self.kinds = _kinds(fabric)
        self.switch_racks = any(rp.aggregator.kind == "host-switch" for rp in fabric.plan.racks)
        self.faults: list[faults.Fault] = []
        self.samples: list[dict] = []
        #: aggregator -> shard indices killed so far, and when the last of
        #: its shards was replaced for the first time (its memory's baseline:
        #: a successor is a fresh interpreter, spawned, some MB larger than
        #: the forked shard it replaces)
        self.replaced: dict[str, set] = {}
        self.settled: dict[str, float] = {}
        self._shards: dict[str, int] = {}  #: aggregator -> its shard count
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="aggnet-chaos", daemon=True)

    def services(self) -> dict:
        out = {f"rack {i}": agg for i, agg in enumerate(self.fabric.aggregators) if agg is not None}
        if self.fabric.root is not None:
            out["root"] = self.fabric.root
        return out

    def sample(self) -> None:
        from aggnet.bench.soak import _sample_groups

        self.samples.append({"at": time.monotonic(), "aggregators": _sample_groups(self.services())})

    def start(self) -> "Injector":
        self.sample()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)
        self.sample()

    def _run(self) -> None:
        turn = 0
        next_fault = time.monotonic() + self.every
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_fault:
                    fault = self._inject(self.kinds[turn % len(self.kinds)])
                    self.faults.append(fault)
                    self.on_event(f"fault {len(self.faults)}: {fault.what} ({fault.seconds:.1f} s; {fault.counted})")
                    turn += 1
                    next_fault = time.monotonic() + self.every
                if not self.samples or now - self.samples[-1]["at"] >= SAMPLE_EVERY:
                    self.sample()
                self._stop.wait(max(0.0, min(next_fault, self.samples[-1]["at"] + SAMPLE_EVERY) - time.monotonic()))
        except BaseException as exc:  # the run reports it
            self.error = exc

    def _inject(self, kind: str) -> faults.Fault:
        f = self.fabric
        if kind in ("rack shard", "root shard"):
            rack = self.rng.randrange(len(f.racks)) if kind == "rack shard" else None
            name = "root" if rack is None else f"rack {rack}"
            # shards not yet replaced first, so that every aggregator settles early
            done = self.replaced.setdefault(name, set())
            shards = self._shards.setdefault(name, len(f.stats(rack)["shards"]))
            fresh = [i for i in range(shards) if i not in done]
            shard = self.rng.choice(fresh or range(shards))
            fault = faults.kill_shard(f, rack, shard)
            done.add(shard)
            if len(done) == shards and name not in self.settled:
                self.settled[name] = time.monotonic()
            return fault
        if kind == "cable":
            seconds = SWITCH_CABLE_SECONDS if self.switch_racks else CABLE_SECONDS
            return faults.pull_cable(f, self.rng.randrange(len(f.workers)), seconds, self._stop)
        return faults.loss_burst(f, self.rng.randrange(len(f.racks)), BURST_DROP, BURST_SECONDS, self._stop)


def run(fabric: Fabric, seconds: float, every: float, nbytes: int, reps: int, seed: int = 0,
        on_event=None) -> dict:
    """All-reduces in batches of ``reps`` until ``seconds`` have passed
    (the batch under way finishes), faults every ``every`` seconds;
    returns the run's record (``problems`` says what makes it a failure)."""
    on_event = on_event or (lambda line: None)
    # a warm-up batch: the aggregators' memory after it is the baseline
    fabric_runs.run_system(fabric, "aggnet", nbytes, 1, dtype="int32")
    injector = Injector(fabric, every, seed, on_event).start()
    t0 = time.monotonic()
    batches, allreduces, wrong = 0, 0, 0
    times: list[float] = []
    try:
        # at least one fault of each kind, however slowly a loaded machine
        # runs the batches (bounded: a kind's turn comes every len(kinds) faults)
        longest = seconds + len(injector.kinds) * (every + FAULT_ALLOWANCE)

        def going_on() -> bool:
            elapsed = time.monotonic() - t0
            return elapsed < longest and (elapsed < seconds or len(injector.faults) < len(injector.kinds))

        while injector.error is None and going_on():
            r = fabric_runs.run_system(fabric, "aggnet", nbytes, reps, dtype="int32")
            batches += 1
            allreduces += reps
            wrong += sum(1 for e in r["exact"] if not e)
            times += r["times"]
            on_event(f"batch {batches}: {reps} x {nbytes} B, median {r['median_s']:.3f} s, "
                     f"{'exact' if all(r['exact']) else 'WRONG'}; {time.monotonic() - t0:.0f} of {seconds:g} s")
    finally:
        injector.stop()
    wall = time.monotonic() - t0
    samples = injector.samples
    aggregators = {}
    for name in samples[0]["aggregators"]:
        # judged from when every shard it will lose has been replaced once
        # (at once where none is killed); None: that never happened
        killed = "root shard" if name == "root" else "rack shard"
        since = injector.settled.get(name) if killed in injector.kinds else samples[0]["at"]
        base = next((x for x in samples if since is not None and x["at"] >= since), None)
        aggregators[name] = {k: {"start": samples[0]["aggregators"][name][k],
                                 "settled": base["aggregators"][name][k] if base else None,
                                 "end": samples[-1]["aggregators"][name][k],
                                 "max": max(x["aggregators"][name][k] for x in samples)}
                             for k in ("rss_kb", "fds", "threads")}
    return {"seconds": wall, "every": every, "bytes": nbytes, "batches": batches, "allreduces": allreduces,
            "wrong_results": wrong, "times": times, "faults": [x.as_dict() for x in injector.faults],
            "fault_kinds": injector.kinds, "error": None if injector.error is None else str(injector.error),
            "aggregators": aggregators, "samples": len(injector.samples)}


def unjudged(record: dict) -> list[str]:
    """The aggregators whose growth a run was too short to judge."""
    return [name for name, row in record["aggregators"].items() if row["rss_kb"]["settled"] is None]


def problems(record: dict) -> list[str]:
    """What makes a chaos run a failure."""
    out = []
    if record["error"]:
        out.append(f"a fault could not be injected: {record['error']}")
    if record["wrong_results"]:
        out.append(f"{record['wrong_results']} worker result(s) were not the exact int32 sum")
    if not record["allreduces"]:
        out.append("no all-reduce ran")
    injected = {f["what"].split(" ")[0] for f in record["faults"]}
    if len(record["faults"]) < len(record["fault_kinds"]):
        out.append(f"only {len(record['faults'])} fault(s) injected ({sorted(injected)}); run longer than "
                   f"{len(record['fault_kinds'])} x --every")
    for name, row in record["aggregators"].items():
        if row["rss_kb"]["settled"] is None:
            continue  # not every shard was replaced yet: nothing to judge against (see unjudged)
        growth = (row["rss_kb"]["end"] - row["rss_kb"]["settled"]) / 1024
        if growth > MAX_RSS_GROWTH_MB:
            out.append(f"{name} (supervisor and shards) RSS grew {growth:.1f} MB after every shard it lost was "
                       f"replaced once (> {MAX_RSS_GROWTH_MB:g})")
        if row["fds"]["end"] > row["fds"]["settled"] + MAX_FD_GROWTH:
            out.append(f"{name} holds {row['fds']['end']} descriptors, {row['fds']['settled']} once settled")
    return out


__all__ = ["Injector", "run", "problems"]
