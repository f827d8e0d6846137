"""Which placement to train with: bytes across racks and step time of each.

Four ways to run one training step of a profiled layer chain on a
topology's racks, each predicted from the link rates and the profile:

* ``gloo ring``: data parallelism with torch's ring all-reduce over every
  rank (ranks rack by rack, so the ring crosses each rack's uplink once
  each way): every uplink carries ``2(N-1)/N`` times the model each way;
* ``aggnet racks``: data parallelism through each rack's aggregator and
  the root: one partial up and one result down per rack, the model once
  each way per uplink (PHub's rack aggregation);
* ``hybrid stage-per-rack`` (the UNIST paper's placement, K = racks): only
  activations and their gradients cross racks, the global batch's worth
  at every cut, each way; gradients stay in their rack;
* ``hybrid pipeline-in-rack``: activations stay in the rack; each stage's
  gradients cross racks as in ``aggnet racks``.

Times are bandwidth times on the slowest link each transfer crosses, plus
compute scaled from the profile (linear in samples), with no overlap of
communication and compute: an upper bound that ranks the alternatives by
what the network makes them pay. A pipelined step of M micro-batches
takes the fill and drain of every stage plus M - 1 times the slowest one.
Wire bytes include the framing each system adds on Ethernet (TCP/IP
headers and acknowledgements for gloo and activations, the switch
protocol's packet headers for aggnet racks); :func:`framing` has the
numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aggnet.protocol import topology as topo
from aggnet.protocol.limits import DEFAULT_HOST_ELEMENTS, IP_UDP_OVERHEAD, auto_slots, elements_for_mtu
from aggnet.protocol.wire import HEADER_SIZE

from aggnet.parallel import layout as lay
from aggnet.parallel.partition import PartitionError, partition
from aggnet.parallel.profile import Profile

ETHERNET = 14  #: bytes of an Ethernet header (what a link counter adds to each frame)
TCP_IP = 52  #: IPv4 + TCP with timestamps
DEFAULT_MTU = 9000

#: bytes a gloo message adds on an uplink beyond its payload's framing:
#: its send/receive handshake and acknowledgements (measured in the
#: emulated fabric: about 700-800 bytes a message, the ring's and the
#: pipeline's alike; it decides the bytes of small transfers only)
GLOO_MESSAGE_BYTES = 750

ALTERNATIVES = ("gloo ring", "aggnet racks", "hybrid stage-per-rack", "hybrid pipeline-in-rack")


def framing(system: str, mtu: int) -> float:
    """Wire bytes per payload byte, each way, on a link's counters.

    TCP (gloo, activations): a full segment carries ``mtu - 52`` payload
    bytes in ``mtu + 14``, and the other direction acknowledges every
    second segment (66 bytes). The switch protocol: a packet of K int32
    values (K from the MTU) carries its header and UDP/IP/Ethernet."""
    if system == "udp":
        k = _elements(mtu)
        return (4 * k + HEADER_SIZE + IP_UDP_OVERHEAD + ETHERNET) / (4 * k)
    mss = mtu - TCP_IP
    return (mss + TCP_IP + ETHERNET) / mss + (TCP_IP + ETHERNET) / (2 * mss)


def _elements(mtu: int) -> int:
    """Values per packet a host aggregator agrees on at this MTU."""
    return min(DEFAULT_HOST_ELEMENTS, elements_for_mtu(mtu))


def switch_allreduce_extra(nbytes: float, mtu: int) -> float:
    """Wire bytes an all-reduce of ``nbytes`` puts on an uplink beyond its
    packets, on the switch protocol: about one more packet per slot the
    all-reduce uses, and one (measured in the emulated fabric: priming
    each slot of the job's window and agreeing the exponent)."""
    k = _elements(mtu)
    packets = -(-int(nbytes) // (4 * k))
    return (min(auto_slots(k), packets) + 1) * (4 * k + HEADER_SIZE + IP_UDP_OVERHEAD + ETHERNET)


def ddp_buckets(param_bytes) -> list[float]:
    """The bucket sizes DDP all-reduces (parameters in reverse order, the
    first bucket closed at 1 MiB, the others at 25 MiB)."""
    buckets, size, cap = [], 0.0, 1 << 20
    for b in reversed(list(param_bytes)):
        if not b:
            continue
        size += b
        if size >= cap:
            buckets.append(size)
            size, cap = 0.0, 25 << 20
    if size:
        buckets.append(size)
    return buckets


def _gradient_wire(t: topo.Topology, param_bytes, mtu: int) -> float:
    """Wire bytes per uplink, each way, of one step's gradients through
    the racks' aggregators and the root."""
    total = float(sum(param_bytes))
    if _wire(t) == "tcp":
        return total * framing("tcp", mtu)
    return total * framing("udp", mtu) + sum(switch_allreduce_extra(b, mtu) for b in ddp_buckets(param_bytes))


@dataclass(frozen=True)
class Links:
    host_mbit: float
    uplink_mbit: float
    mtu: int = DEFAULT_MTU

    def rate(self, mbit: float) -> float:
        return mbit * 1e6 / 8  # bytes per second

    @property
    def host(self) -> float:
        return self.rate(self.host_mbit)

    @property
    def uplink(self) -> float:
        return self.rate(self.uplink_mbit)


@dataclass
class Alternative:
    name: str
    feasible: bool
    step_seconds: float = float("inf")
    compute_seconds: float = 0.0
    comm_seconds: float = 0.0
    #: wire bytes per step on each rack's uplink, (up, down)
    uplinks: list = field(default_factory=list)
    #: the cut: each stage's (first layer, end) and the layout (hybrid only)
    stages: tuple = ()
    layout: "lay.Layout | None" = None
    why: str = ""  #: why not feasible

    @property
    def cross_rack_bytes(self) -> float:
        """Wire bytes per step up all uplinks (down is the same)."""
        return sum(u for u, _ in self.uplinks)


@dataclass
class PlanResult:
    alternatives: list
    pick: Alternative
    reason: str
    stages: int
    batch: int
    micro_batches: int
    links: Links


def links_of(t: topo.Topology, host_mbit=None, uplink_mbit=None, mtu=None) -> Links:
    host = host_mbit or t.links.host_mbit
    up = uplink_mbit or t.links.uplink_mbit
    if not host or not up:
        raise ValueError(f"{t.source}: give the link rates ([links] host_mbit and uplink_mbit in the file, or "
                         f"--host-mbit and --uplink-mbit): the plan weighs bytes by them")
    return Links(float(host), float(up), int(mtu or t.links.mtu or DEFAULT_MTU))


def plan(profile: Profile, topology, *, batch: int, stages: int | None = None, micro_batches: int = 1,
         links: Links | None = None, memory_limit: float | None = None) -> PlanResult:
    """Every alternative's predicted step and cross-rack bytes for a global
    batch of ``batch`` samples, and the fastest."""
    t = topo.load(topology)
    links = links or links_of(t)
    racks = len(t.racks)
    k = stages or racks
    if batch < t.world:
        raise ValueError(f"a global batch of {batch} cannot feed {t.world} ranks; give a batch of {t.world} or more")
    alts = [_ring(profile, t, batch, links), _aggnet(profile, t, batch, links)]
    for placement in lay.PLACEMENTS:
        alts.append(_hybrid(profile, t, placement, k, batch, micro_batches, links, memory_limit))
    feasible = [a for a in alts if a.feasible]
    pick = min(feasible, key=lambda a: a.step_seconds)
    ring = alts[0]
    reason = (f"fastest predicted step: {pick.step_seconds * 1e3:.1f} ms, {pick.step_seconds / ring.step_seconds:.2f} "
              f"of gloo's ring; {pick.cross_rack_bytes / 1e6:.2f} MB up the uplinks per step against "
              f"{ring.cross_rack_bytes / 1e6:.2f} MB")
    runner_up = min((a for a in feasible if a is not pick), key=lambda a: a.step_seconds, default=None)
    if runner_up is not None and runner_up.step_seconds < 1.2 * pick.step_seconds:
        # the model leaves out per-all-reduce latency and compute sharing
        # a host's cores: a close call is the emulation's to decide
        reason += (f"; {runner_up.name} is predicted within "
                   f"{(runner_up.step_seconds / pick.step_seconds - 1) * 100:.0f}%: a close call, measure both "
                   f"(aggnet emulate --topology FILE bench-hybrid)")
    return PlanResult(alts, pick, reason, k, batch, micro_batches, links)


def _ring(profile: Profile, t: topo.Topology, batch: int, links: Links) -> Alternative:
    n, racks, p = t.world, len(t.racks), profile.param_bytes
    compute = float(profile.compute(batch / n).sum())
    moved = 2 * (n - 1) / n * p
    slowest = min(links.host, links.uplink) if racks > 1 else links.host
    comm = moved * framing("tcp", links.mtu) / slowest
    # the ring's 2(N-1) steps each send one message over every boundary
    per = moved * framing("tcp", links.mtu) + 2 * (n - 1) * GLOO_MESSAGE_BYTES if racks > 1 else 0.0
    return Alternative("gloo ring", True, compute + comm, compute, comm, [(per, per)] * racks)


def _wire(t: topo.Topology) -> str:
    """How the racks' aggregators carry gradients: the switch protocol's
    datagrams, or the service's chunks over TCP."""
    return "udp" if all(r.aggregator.family == "switch" for r in t.racks) else "tcp"


def _aggnet(profile: Profile, t: topo.Topology, batch: int, links: Links) -> Alternative:
    n, racks = t.world, len(t.racks)
    compute = float(profile.compute(batch / n).sum())
    wire = _gradient_wire(t, profile.params(), links.mtu)
    slowest = min(links.host, links.uplink) if racks > 1 else links.host
    comm = wire / slowest
    per = wire if racks > 1 else 0.0
    return Alternative("aggnet racks", True, compute + comm, compute, comm, [(per, per)] * racks)


def _hybrid(profile: Profile, t: topo.Topology, placement: str, k: int, batch: int, m: int, links: Links,
            memory_limit) -> Alternative:
    name = f"hybrid {placement}"
    if k < 2:
        return Alternative(name, False, why="one stage is data parallelism")
    try:
        layout = lay.build(t, k, placement)
    except lay.LayoutError as exc:
        return Alternative(name, False, why=str(exc))
    d = layout.replicas
    if batch % (d * m):
        return Alternative(name, False, why=f"a batch of {batch} does not split into {d} replicas x {m} micro-batches")
    b = batch // (d * m)
    tcp = framing("tcp", links.mtu)
    across = placement == "stage-per-rack"
    # one micro-batch's activation at each cut, over the link it crosses:
    # across racks the D replicas share each uplink
    act = profile.out_bytes(b) * tcp
    per_cut = act * (max(d / links.uplink, 1 / links.host) if across else 1 / links.host)
    cut_transfer = 2 * per_cut  # forward activation, backward gradient
    try:
        part = partition(profile.compute(b), cut_transfer, k, objective="sum" if m == 1 else "max",
                         memory=profile.memory(), memory_limit=memory_limit)
    except PartitionError as exc:
        return Alternative(name, False, why=str(exc), layout=layout)
    compute_each = [float(profile.compute(b)[a:e].sum()) for a, e in part.stages]
    cuts = [float(cut_transfer[e - 1]) for _, e in part.stages[:-1]]
    slowest_stage = max(part.stage_costs) if m > 1 else 0.0
    pipeline = sum(compute_each) + sum(cuts) + (m - 1) * slowest_stage
    stage_params = profile.stage_params(part.stages)
    grad_framing = framing(_wire(t), links.mtu)
    if across:
        # each stage's gradients all-reduced in its own rack, all at once
        grads = max(stage_params) * grad_framing / links.host
        up = []
        for s in range(k):
            out_act = batch * profile.layers[part.stages[s][1] - 1].out_bytes_per_sample if s < k - 1 else 0
            back_grad = batch * profile.layers[part.stages[s][0] - 1].out_bytes_per_sample if s > 0 else 0
            # one message a micro-batch and replica each way it crosses
            messages = d * m * ((s < k - 1) + (s > 0))
            up.append((out_act + back_grad) * tcp + messages * GLOO_MESSAGE_BYTES)
        uplinks = [(u, u) for u in up]
    else:
        racks = len(t.racks)
        slowest = min(links.host, links.uplink) if racks > 1 else links.host
        # every stage's gradients, each its own job and DDP's buckets
        wire = sum(_gradient_wire(t, profile.params()[a:e], links.mtu) for a, e in part.stages)
        grads = wire / slowest
        per = wire if racks > 1 else 0.0
        uplinks = [(per, per)] * racks
    # compute on the critical path: fill and drain, then the slowest stage
    # once per further micro-batch (the rest of the step is the network)
    compute = sum(compute_each) + (m - 1) * max(compute_each)
    step = pipeline + grads
    return Alternative(name, True, step, compute, step - compute, uplinks, part.stages, layout)
