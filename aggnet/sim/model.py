"""How long one all-reduce takes on a fabric, for aggnet and its peers: a
flow-level model.

Each system moves known bytes through known resources (a worker's link,
a rack's uplink, an aggregator's link and packet rate, a worker's CPU)
and waits known latencies (a ring's steps, a tree's depth, the switch
protocol's window per round trip). Its time is the busiest resource's
bytes over its rate, pipelined (the resources work at once, as they do
for every system here), plus what cannot overlap: filling the pipeline,
the steps that are pure latency. Flow level keeps the cost independent of
the worker count: 16,384 workers take as long to predict as 16.

The systems, on R racks of W workers (N = R W), buffer S:

* ``aggnet-switch``: ToR switches add (the P4 program), a root switch adds
  their partials: each worker sends S and receives S once; each uplink
  carries S each way. A job's window of slots bounds it too, at one
  window per round trip, and a lost packet holds its slot for a timeout.
* ``aggnet-host``: aggregator hosts per rack and at the root (the
  service, switch mode): the same bytes, plus each aggregator's link and
  datagram rate, which W workers (R racks at the root) share.
* ``ring``: gloo's ring over ranks placed without regard to racks: 2(N-1)
  steps of S/N; a rack's uplink carries the ring's edges that leave it.
* ``ring-rack-aware``: NCCL's two-level ring: reduce-scatter in the rack,
  W rings across racks of S/W each, all-gather in the rack.
* ``tree``: a pipelined binary tree (an inner node takes two children's
  streams), its depth in latency.
* ``ps``: a parameter server sharded over one host per rack: every worker
  sends S and receives S, across racks for (R-1)/R of it.
* ``sharp``: in-switch reduction with a hardware transport (SHARP-like):
  aggnet-switch's bytes without a window, a timeout or a worker's CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from aggnet.protocol.limits import RTO_MAX, auto_slots
from aggnet.sim.hardware import Hardware

SYSTEMS = ("aggnet-switch", "aggnet-host", "ring", "ring-rack-aware", "tree", "ps", "sharp")
#: a pipelined tree's chunk (NCCL's default is of this order)
TREE_CHUNK = 512 * 1024


@dataclass(frozen=True)
class Shape:
    """R racks of W workers; the uplinks oversubscribed by ``oversubscription``
    (a rack's W host links over its uplink's rate), loss per link crossed."""

    racks: int
    workers_per_rack: int
    oversubscription: float = 1.0
    loss: float = 0.0

    def __post_init__(self):
        if self.racks < 1 or self.workers_per_rack < 1:
            raise ValueError(f"a fabric needs racks and workers, got {self.racks} x {self.workers_per_rack}")
        if not self.oversubscription > 0:
            raise ValueError(f"oversubscription must be positive, got {self.oversubscription}")
        if not 0 <= self.loss < 1:
            raise ValueError(f"loss is a fraction of packets, 0 to 1, got {self.loss}")

    @property
    def workers(self) -> int:
        return self.racks * self.workers_per_rack

    def uplink_rate(self, hw: Hardware) -> float:
        return self.workers_per_rack * hw.host_rate / self.oversubscription


@dataclass(frozen=True)
class Prediction:
    system: str
    seconds: float
    #: the resource whose time sets the pace
    bottleneck: str
    #: payload bytes one rack's uplink carries each way
    cross_rack_bytes: float
    #: every resource's time, seconds
    terms: dict = field(default_factory=dict)


def _paced(system: str, terms: dict, fixed: float, cross: float, tail: float = 0.0) -> Prediction:
    """The busiest resource sets the pace; ``fixed`` is latency no resource
    hides (named the bottleneck where it is the larger part), ``tail`` the
    wait for the last losses' retransmissions."""
    name, busiest = max(terms.items(), key=lambda kv: kv[1])
    extra = {"loss tail": tail} if tail else {}
    return Prediction(system, busiest + fixed + tail, name if busiest >= fixed else "latency", cross,
                      {**terms, "latency": fixed, **extra})


def _machine_cpu(hw: Hardware, cpu_seconds: float) -> dict:
    """Where every host of the fabric shares one machine (an emulation),
    all their CPU-seconds share its cores: a term of its own."""
    if not hw.machine_cores or not cpu_seconds:
        return {}
    return {"machine cpu": cpu_seconds / hw.machine_cores}


def _hops(shape: Shape) -> int:
    """Link crossings of one packet's round trip: up and down in the rack,
    and through the uplinks too under a root."""
    return 4 if shape.racks > 1 else 2


def _window(hw: Hardware, shape: Shape, nbytes: float, passes: int, stack: float, elements: int,
            window: int) -> tuple[float, float]:
    """(window-limited time, round trip) of the switch protocol: a slot
    carries ``elements`` values per round trip through one level of
    aggregators (``passes`` switch passes, ``stack`` a host's software
    path) or two; a use lost on any of its link crossings holds its slot
    for a timeout."""
    packet = 4 * elements
    wire = packet / hw.switch_efficiency(elements)
    hops = _hops(shape)
    rtt = 2 * (hw.hop_latency + wire / hw.host_rate) + passes * hw.switch_latency + stack
    if hops > 2:
        root = 2 * hw.hop_latency + 2 * passes * hw.switch_latency + stack if hw.root_latency is None \
            else hw.root_latency
        rtt += 2 * wire / hw.host_rate + root
    lost = 1 - (1 - shape.loss) ** hops
    per_use = rtt + lost * hw.rto
    return nbytes * per_use / (window * packet), rtt


def _loss_tail(hw: Hardware, shape: Shape, nbytes: float, hops: int, packet: int, window: int,
               busiest: float) -> float:
    """The wait for the last losses: a packet lost while the buffer's last
    window is in flight has nothing behind it to hide its timeout, and the
    all-reduce ends only when every worker has its retransmission back.

    aggnet's client adapts its timeout to the round trips it measures
    (twice the smoothed round trip, at least ``hw.rto``, at most
    ``RTO_MAX``), and a job that fills its bottleneck has a round trip of
    its whole window queued there: ``window`` packets at the paced rate.
    That, not the timeout's floor, is what a lossy shaped link waits."""
    if not shape.loss:
        return 0.0
    lost = 1 - (1 - shape.loss) ** hops
    loaded_rtt = window * packet * busiest / nbytes
    rto = min(RTO_MAX, max(hw.rto, 2 * loaded_rtt))
    last = shape.workers * min(window, math.ceil(nbytes / packet))
    return (1 - (1 - lost) ** last) * rto


def aggnet_switch(hw: Hardware, shape: Shape, nbytes: float, *, sharp: bool = False) -> Prediction:
    eff = hw.switch_efficiency()
    two_level = shape.racks > 1
    lost = 1 - (1 - shape.loss) ** (4 if two_level else 2)
    terms = {"host link": nbytes * (1 + lost) / (eff * hw.host_rate)}
    if two_level:
        terms["uplink"] = nbytes * (1 + lost) / (eff * shape.uplink_rate(hw))
    if hw.switch_passes_per_s:
        # a ToR takes W packets per slot and multicasts W copies; under a
        # root it also sends the partial up and takes the final back
        packets = nbytes / (4 * hw.switch_elements)
        passes = 2 * shape.workers_per_rack * packets + (2 * packets if two_level else 0)
        terms["switch packets"] = passes / hw.switch_passes_per_s
    hops = _hops(shape)
    if sharp:
        rtt = hops * hw.hop_latency + (3 if two_level else 1) * hw.switch_latency
        return _paced("sharp", terms, rtt, nbytes if two_level else 0.0)
    terms["window"], rtt = _window(hw, shape, nbytes, 1, 0.0, hw.switch_elements, hw.switch_window)
    if hw.client_cpu_s_per_byte:
        terms["worker cpu"] = nbytes * hw.client_cpu_s_per_byte
    terms.update(_machine_cpu(hw, shape.workers * nbytes * hw.client_cpu_s_per_byte))
    tail = _loss_tail(hw, shape, nbytes, hops, 4 * hw.switch_elements, hw.switch_window, max(terms.values()))
    return _paced("aggnet-switch", terms, rtt, nbytes if two_level else 0.0, tail)


def aggnet_host(hw: Hardware, shape: Shape, nbytes: float) -> Prediction:
    """Aggregator hosts: each takes its members' S each and sends each its
    result, through its own link and its shards' datagram rate."""
    k = hw.host_agg_elements
    eff = hw.switch_efficiency(k)
    agg_link = hw.host_rate * hw.host_agg_link_factor
    agg_packets = hw.host_agg_shards * hw.host_agg_packets_per_s
    two_level = shape.racks > 1
    lost = 1 - (1 - shape.loss) ** (4 if two_level else 2)
    w = shape.workers_per_rack
    # under a root the rack aggregator's own link also carries its partial
    # up and the final down: W + 1 buffers each way, not W
    terms = {"host link": nbytes * (1 + lost) / (eff * hw.host_rate),
             "rack aggregator link": (w + (1 if shape.racks > 1 else 0)) * nbytes / (eff * agg_link),
             "rack aggregator packets": w * nbytes / (4 * k * agg_packets)}
    if two_level:
        terms["uplink"] = nbytes * (1 + lost) / (eff * shape.uplink_rate(hw))
        terms["root link"] = shape.racks * nbytes / (eff * agg_link)
        terms["root packets"] = shape.racks * nbytes / (4 * k * agg_packets)
    hops = _hops(shape)
    window = auto_slots(k)  # what a host gives a job that asks for no window
    terms["window"], rtt = _window(hw, shape, nbytes, 0, hw.step_latency, k, window)
    if hw.client_cpu_s_per_byte:
        terms["worker cpu"] = nbytes * hw.client_cpu_s_per_byte
    # a rack aggregator takes its W members' S (and, under a root, sends a
    # partial up and takes the final back), the root its R racks' S
    taken = shape.workers * nbytes + (2 * shape.racks * nbytes if two_level else 0)
    terms.update(_machine_cpu(hw, shape.workers * nbytes * hw.client_cpu_s_per_byte
                              + taken * hw.host_agg_cpu_s_per_byte))
    tail = _loss_tail(hw, shape, nbytes, hops, 4 * k, window, max(terms.values()))
    return _paced("aggnet-host", terms, rtt, nbytes if two_level else 0.0, tail)


def ring_crossings(shape: Shape, rack_aware: bool) -> float:
    """Edges of a ring over all workers that leave one rack, each way: one
    when ranks follow racks; placed at random, each of a rack's W workers'
    successors is elsewhere with probability (N - W) / (N - 1)."""
    if shape.racks == 1:
        return 0.0
    if rack_aware:
        return 1.0
    n, w = shape.workers, shape.workers_per_rack
    return w * (n - w) / (n - 1)


def ring(hw: Hardware, shape: Shape, nbytes: float, *, rack_aware: bool = False) -> Prediction:
    """gloo's ring: 2(N-1) steps, each moving S/N over every ring edge."""
    n = shape.workers
    if n == 1:
        return Prediction("ring", 0.0, "none", 0.0, {})
    eff = hw.tcp_efficiency()
    moved = 2 * (n - 1) / n * nbytes
    crossings = ring_crossings(shape, rack_aware)
    terms = {"host link": moved / (eff * hw.host_rate)}
    if crossings:
        terms["uplink"] = crossings * moved / (eff * shape.uplink_rate(hw))
    if hw.ring_cpu_s_per_byte:
        terms["worker cpu"] = moved * hw.ring_cpu_s_per_byte
    terms.update(_machine_cpu(hw, n * moved * hw.ring_cpu_s_per_byte))
    return _paced("ring", terms, 2 * (n - 1) * hw.step_latency, crossings * moved)


def ring_rack_aware(hw: Hardware, shape: Shape, nbytes: float) -> Prediction:
    """NCCL's two-level ring: in the rack over W, across racks W rings of
    S/W over R, in the rack again."""
    r, w = shape.racks, shape.workers_per_rack
    eff = hw.tcp_efficiency()
    inside = 2 * (w - 1) / w * nbytes
    across = 2 * (r - 1) / r * nbytes  # a rack's uplink carries all W rings' edges
    terms = {"host link": (inside + across / w) / (eff * hw.host_rate)}
    if r > 1:
        terms["uplink"] = across / (eff * shape.uplink_rate(hw))
    if hw.ring_cpu_s_per_byte:
        terms["worker cpu"] = (inside + across / w) * hw.ring_cpu_s_per_byte
    steps = 2 * (w - 1) + 2 * (r - 1)
    return _paced("ring-rack-aware", terms, steps * hw.step_latency, across if r > 1 else 0.0)


def tree(hw: Hardware, shape: Shape, nbytes: float) -> Prediction:
    """A pipelined binary tree over ranks in rack order: an inner node's
    link takes two children's S up and sends S to each down; a rack's
    subtree reaches the rest through one edge."""
    n = shape.workers
    if n == 1:
        return Prediction("tree", 0.0, "none", 0.0, {})
    eff = hw.tcp_efficiency()
    terms = {"host link": 2 * nbytes / (eff * hw.host_rate)}
    if shape.racks > 1:
        terms["uplink"] = nbytes / (eff * shape.uplink_rate(hw))
    depth = math.ceil(math.log2(n))
    chunk = min(TREE_CHUNK, nbytes)
    fixed = 2 * depth * (hw.step_latency + chunk / (eff * hw.host_rate))
    return _paced("tree", terms, fixed, nbytes if shape.racks > 1 else 0.0)


def ps(hw: Hardware, shape: Shape, nbytes: float) -> Prediction:
    """A parameter server sharded over one host per rack: each server takes
    N S / R and sends as much back."""
    r, w, n = shape.racks, shape.workers_per_rack, shape.workers
    eff = hw.tcp_efficiency()
    server = hw.host_rate * hw.host_agg_link_factor
    terms = {"host link": nbytes / (eff * hw.host_rate), "server link": n * nbytes / (r * eff * server)}
    cross = w * nbytes * (r - 1) / r
    if r > 1:
        terms["uplink"] = cross / (eff * shape.uplink_rate(hw))
    return _paced("ps", terms, 2 * hw.step_latency, cross)


def predict(system: str, hw: Hardware, shape: Shape, nbytes: float) -> Prediction:
    if system == "aggnet-switch":
        return aggnet_switch(hw, shape, nbytes)
    if system == "sharp":
        return aggnet_switch(hw, shape, nbytes, sharp=True)
    if system == "aggnet-host":
        return aggnet_host(hw, shape, nbytes)
    if system == "ring":
        return ring(hw, shape, nbytes)
    if system == "ring-rack-aware":
        return ring_rack_aware(hw, shape, nbytes)
    if system == "tree":
        return tree(hw, shape, nbytes)
    if system == "ps":
        return ps(hw, shape, nbytes)
    raise ValueError(f"unknown system {system!r}; known: {', '.join(SYSTEMS)}")


def step_seconds(compute: float, comm: float, overlap: float) -> float:
    """A training step: compute, and the communication that backward does
    not hide (``overlap``: the share of compute it can run under)."""
    return compute + max(0.0, comm - overlap * compute)


def fair_shares(capacity: float, demands: list[float]) -> list[float]:
    """Max-min fair rates on one link: a flow that wants less than an equal
    share keeps what it wants, the rest split what it leaves."""
    rates = [0.0] * len(demands)
    left, open_ = capacity, sorted(range(len(demands)), key=lambda i: demands[i])
    while open_:
        share = left / len(open_)
        i = open_[0]
        if demands[i] > share:
            for j in open_:
                rates[j] = share
            break
        rates[i] = demands[i]
        left -= demands[i]
        open_.pop(0)
    return rates


def shared_pool(hw: Hardware, shape: Shape, nbytes: float, jobs: int) -> dict:
    """``jobs`` jobs, each on workers of its own in every rack, sharing the
    switches' pool (ATP-style best effort): as many as the pool holds
    windows for aggregate in the switch, the rest fall back to the racks'
    aggregator hosts; all share the uplinks, max-min fairly (a job its
    hosts hold back takes only what it can use). Per-job seconds and the
    aggregate all-reduce goodput (bytes of buffer per second, all jobs)."""
    on_switch = min(jobs, hw.switch_pool // hw.switch_window)
    fallback = jobs - on_switch
    switch_s = aggnet_switch(hw, shape, nbytes).seconds
    host_s = 0.0
    if fallback:
        alone = aggnet_host(hw, shape, nbytes)
        # the fallback jobs share each rack's aggregator host
        shared = {k: v * (fallback if "aggregator" in k or "root" in k else 1) for k, v in alone.terms.items()
                  if k not in ("latency", "loss tail")}
        host_s = max(shared.values()) + alone.terms["latency"] + alone.terms.get("loss tail", 0.0)
    times = [switch_s] * on_switch + [host_s] * fallback
    if shape.racks > 1:
        capacity = hw.switch_efficiency() * shape.uplink_rate(hw)
        rates = fair_shares(capacity, [nbytes / t for t in times])
        times = [max(t, nbytes / r) for t, r in zip(times, rates)]
    return {"jobs": jobs, "on_switch": on_switch, "fallback": fallback, "seconds": times,
            "goodput": sum(nbytes / t for t in times if t > 0)}


__all__ = ["SYSTEMS", "Shape", "Prediction", "predict", "step_seconds", "shared_pool", "fair_shares", "ring_crossings"]
