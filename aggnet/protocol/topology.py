"""Racks and the root above them, read from one TOML file.

A topology says which workers sit in which rack, what aggregates each rack
(a P4 top-of-rack switch, a host in switch mode, or the sharded service),
and what reduces across racks (the root). Clients find their aggregator in
it (``Client(topology=..., rank=...)``, ``AGGNET_TOPOLOGY``), ``aggnet up``
starts what it places on this machine, and ``aggnet emulate --topology``
builds it in network namespaces; all three read it through this module.

The file (examples in ``examples/topologies/``)::

    job = "two-racks"              # the job's name (optional)
    procs_per_host = 1             # worker processes per host (optional)

    [root]                         # reduces across racks (none: one rack)
    kind = "host-switch"           # host-switch | p4 | service
    address = "udp://10.0.0.100:42606"
    host = "spine"

    [[racks]]
    name = "rack0"
    hosts = ["r0w0", "r0w1"]       # or ranks = "0-1" on one machine
    [racks.aggregator]
    kind = "host-switch"
    address = "udp://10.0.1.100:42606"
    host = "r0agg"

Ranks are numbered rack by rack, host by host, ``procs_per_host`` per host
(torchrun's order when hosts are listed by node rank). Both protocols can be
stacked but not mixed: racks of the switch protocol (``p4``, ``host-switch``)
need a root of the switch protocol, racks of the service need a service.
Every mistake fails the load with the line it is on and what to change.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field

from aggnet.protocol.address import AddressError, parse
from aggnet.protocol.limits import SWITCH_PORT

#: aggregator kinds, with the protocol family they speak
KINDS = {"p4": "switch", "host-switch": "switch", "service": "service"}
_FAMILY_TEXT = {"switch": "the switch protocol over UDP", "service": "chunks over messages"}
#: address schemes each kind can be reached at
_SCHEMES = {
    "p4": ("udp",),
    "host-switch": ("udp",),
    "service": ("tcp", "zmq+tcp", "zmq+ipc", "shm", "ucx"),
}
#: schemes a service root can take its racks' partials over (shard to shard)
_ROOT_SERVICE_SCHEMES = ("tcp", "zmq+tcp", "zmq+ipc")

_TOP_KEYS = {"job", "procs_per_host", "root", "racks", "hosts", "links"}
_RACK_KEYS = {"name", "hosts", "ranks", "aggregator", "fallback"}
_AGG_KEYS = {
    "kind", "address", "host", "shards", "pool", "elements", "slots",
    # a P4 switch's control plane and ports
    "p4runtime", "device_id", "thrift_port", "ports", "uplink_port", "switch_ip", "switch_mac",
}
_P4_ONLY = {"p4runtime", "device_id", "thrift_port", "ports", "uplink_port", "switch_ip", "switch_mac"}
_HOST_KEYS = {"ip", "mac"}
_LINK_KEYS = {"host_mbit", "uplink_mbit", "mtu"}


class TopologyError(ValueError):
    """A topology file that cannot be used; the message names the file,
    the line and the fix."""


@dataclass(frozen=True)
class Aggregator:
    """One aggregator of a topology: a rack's, a rack's fallback or the root."""

    kind: str
    address: str
    #: the machine it runs on (``aggnet up`` starts those on its own host)
    host: str | None = None
    shards: int | None = None
    pool: int | None = None
    elements: int | None = None
    slots: int | None = None
    p4runtime: str | None = None
    device_id: int = 0
    thrift_port: int = 9090
    #: P4: the switch port of each member of the rack, in member order
    ports: tuple = ()
    uplink_port: int | None = None
    switch_ip: str | None = None
    switch_mac: str | None = None
    where: str = ""  #: "FILE:LINE", for messages

    @property
    def family(self) -> str:
        return KINDS[self.kind]

    def serve_argv(self, parent: "Aggregator | None" = None, rack_id: int = 0, racks: int = 1) -> list[str]:
        """``aggnet serve`` arguments that run this aggregator (host kinds)."""
        if self.kind == "p4":
            raise TopologyError(f"{self.where}: a P4 switch is not started with aggnet serve; "
                                f"aggnet switch installs its jobs")
        argv = ["serve", "--listen", self.address, "--mode", "switch" if self.kind == "host-switch" else "service"]
        for name in ("shards", "pool", "elements"):
            value = getattr(self, name)
            if value is not None and not (name != "shards" and self.kind == "service"):
                argv += [f"--{name}", str(value)]
        if parent is not None:
            argv += ["--parent", parent.address, "--rack-id", str(rack_id), "--racks", str(racks)]
        return argv


@dataclass(frozen=True)
class Rack:
    index: int
    name: str
    #: global ranks of the rack's workers, in member order
    ranks: tuple
    #: the host of each member (None for ``ranks =`` racks on one machine)
    hosts: tuple
    aggregator: Aggregator
    #: where the rack's workers go when a P4 switch has no room or is dead
    fallback: Aggregator | None = None

    @property
    def members(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class Placement:
    """Where one rank of a topology sits: what a client needs to join."""

    rank: int
    world: int
    rack: Rack
    member_rank: int  #: this worker's place among its rack's workers
    #: None when this is a one-rack topology (no parent above the rack)
    parent: Aggregator | None

    @property
    def members(self) -> int:
        return self.rack.members

    @property
    def address(self) -> str:
        return self.rack.aggregator.address


@dataclass(frozen=True)
class Links:
    """Link rates (Mbit/s; None: not given): emulation shapes its links to
    them, and service racks' workers cut chunks to suit ``uplink_mbit``."""

    host_mbit: float | None = None
    uplink_mbit: float | None = None
    mtu: int | None = None


@dataclass(frozen=True)
class Topology:
    racks: tuple
    root: Aggregator | None
    job: str = "default"
    procs_per_host: int = 1
    links: Links = field(default_factory=Links)
    #: host name -> {"ip": ..., "mac": ...} (P4 racks need them)
    hosts: dict = field(default_factory=dict)
    source: str = "<topology>"

    @property
    def world(self) -> int:
        return sum(r.members for r in self.racks)

    @property
    def root_uplink_mbit(self) -> float | None:
        """Mbit/s of a rack's uplink to the root, where there is a root and
        the file gives the rate (the chunks that suit it: ClientConfig)."""
        return self.links.uplink_mbit if self.root is not None else None

    def place(self, rank: int) -> Placement:
        """The rack of ``rank`` and its place there."""
        if not isinstance(rank, int) or not 0 <= rank < self.world:
            raise TopologyError(f"{self.source}: rank {rank!r} is not in this topology, whose {len(self.racks)} "
                                f"rack(s) hold ranks 0..{self.world - 1}; check RANK and the topology file")
        for rack in self.racks:
            if rank in rack.ranks:
                return Placement(rank, self.world, rack, rack.ranks.index(rank),
                                 self.root if len(self.racks) > 1 else None)
        raise AssertionError("validated topologies cover every rank")

    def rack(self, name: str) -> Rack:
        for r in self.racks:
            if r.name == name:
                return r
        raise TopologyError(f"{self.source}: no rack named {name!r}; racks: {[r.name for r in self.racks]}")

    def host_ranks(self, host: str) -> list[int]:
        return [rank for r in self.racks for rank, h in zip(r.ranks, r.hosts) if h == host]

    def aggregators(self):
        """(role, rack or None, aggregator) of everything that aggregates."""
        for r in self.racks:
            yield "rack", r, r.aggregator
            if r.fallback is not None:
                yield "fallback", r, r.fallback
        if self.root is not None and len(self.racks) > 1:
            yield "root", None, self.root

    def parent_of(self, rack: Rack) -> Aggregator | None:
        return self.root if len(self.racks) > 1 else None


# -- loading -------------------------------------------------------------------------


def load(source) -> Topology:
    """A :class:`Topology` from a path, TOML text (``text=``-like strings
    holding a newline) or an already loaded one."""
    if isinstance(source, Topology):
        return source
    source = os.fspath(source)
    if "\n" in source:
        return loads(source, "<topology>")
    try:
        with open(source, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise TopologyError(f"cannot read topology file {source}: {exc.strerror}; give the path of a TOML "
                            f"file (examples/topologies/ has some)") from None
    return loads(text, source)


def loads(text: str, name: str = "<topology>") -> Topology:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TopologyError(f"{name}: not valid TOML: {exc}") from None
    return _Reader(name, text).topology(data)


class _Lines:
    """Best-effort line numbers for keys of a TOML text (tomllib keeps
    none): tables by header, keys by the table they are in."""

    _HEADER = re.compile(r"^\s*(\[\[?)\s*([A-Za-z0-9_.\-\" ]+?)\s*\]\]?")
    _KEY = re.compile(r"^\s*([A-Za-z0-9_\-]+)\s*=")

    def __init__(self, text: str):
        self.index: dict = {}
        table, rack = "", None
        racks = -1
        for no, line in enumerate(text.splitlines(), 1):
            m = self._HEADER.match(line)
            if m:
                table = m.group(2).replace(" ", "")
                if m.group(1) == "[[" and table == "racks":
                    racks += 1
                rack = racks if table.startswith("racks") else None
                self.index.setdefault((rack, table, None), no)
                continue
            k = self._KEY.match(line)
            if k:
                self.index.setdefault((rack, table, k.group(1)), no)

    def find(self, rack: int | None, table: str, key: str | None = None) -> int | None:
        for probe in ((rack, table, key), (rack, table.rsplit(".", 1)[0], table.rsplit(".", 1)[-1]),
                      (rack, table, None), (rack, "racks", None)):
            if probe in self.index:
                return self.index[probe]
        return None


class _Reader:
    def __init__(self, name: str, text: str):
        self.name = name
        self.lines = _Lines(text)

    def where(self, rack: int | None = None, table: str = "", key: str | None = None) -> str:
        line = self.lines.find(rack, table, key)
        return f"{self.name}:{line}" if line else self.name

    def fail(self, text: str, rack: int | None = None, table: str = "", key: str | None = None):
        raise TopologyError(f"{self.where(rack, table, key)}: {text}")

    def unknown_keys(self, data: dict, allowed: set, what: str, rack=None, table="") -> None:
        for k in data:
            if k not in allowed:
                self.fail(f"unknown key {k!r} in {what}; allowed: {', '.join(sorted(allowed))}", rack, table, k)

    def integer(self, data, key, what, lo, hi, rack=None, table="", default=None):
        value = data.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            self.fail(f"{what}: {key} must be an integer from {lo} to {hi}, got {value!r}", rack, table, key)
        return value

    # -- the parts ----------------------------------------------------------------------

    def topology(self, data: dict) -> Topology:
        self.unknown_keys(data, _TOP_KEYS, "the topology")
        job = data.get("job", "default")
        if not isinstance(job, str) or not job:
            self.fail(f"job must be a non-empty name, got {job!r}", None, "", "job")
        pph = self.integer(data, "procs_per_host", "the topology", 1, 1024, default=1)
        hosts = self.hosts(data.get("hosts", {}))
        links = self.links(data.get("links", {}))
        racks_data = data.get("racks")
        if not isinstance(racks_data, list) or not racks_data:
            self.fail("a topology needs at least one [[racks]] table, each with hosts (or ranks) and an "
                      "[racks.aggregator]")
        racks = self.racks(racks_data, pph)
        root = None
        if "root" in data:
            if not isinstance(data["root"], dict):
                self.fail("root must be a table: [root] with kind and address", None, "", "root")
            root = self.aggregator(data["root"], "the root", None, "root")
        elif len(racks) > 1:
            self.fail(f"{len(racks)} racks need a [root] that reduces across them (kind = \"host-switch\" for "
                      f"switch-protocol racks, \"service\" for service racks)")
        if root is not None and len(racks) > 1:
            self.check_root(root, racks)
        for r in racks:
            if r.aggregator.kind == "p4":
                self.check_p4_rack(r, hosts, root if len(racks) > 1 else None)
        self.check_addresses(racks, root if len(racks) > 1 else None)
        return Topology(tuple(racks), root, job, pph, links, hosts, self.name)

    def hosts(self, data) -> dict:
        if not isinstance(data, dict):
            self.fail("hosts must be a table of host name -> {ip, mac}", None, "hosts")
        out = {}
        for name, info in data.items():
            table = f"hosts.{name}"
            if not isinstance(info, dict):
                self.fail(f"host {name!r} must be a table with ip (and mac for P4 racks)", None, table)
            self.unknown_keys(info, _HOST_KEYS, f"host {name!r}", None, table)
            out[name] = dict(info)
        return out

    def links(self, data) -> Links:
        if not isinstance(data, dict):
            self.fail("links must be a table: host_mbit, uplink_mbit, mtu", None, "links")
        self.unknown_keys(data, _LINK_KEYS, "links", None, "links")
        rates = {}
        for key in ("host_mbit", "uplink_mbit"):
            v = data.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
                self.fail(f"links: {key} must be a positive number of Mbit/s, got {v!r}", None, "links", key)
            rates[key] = None if v is None else float(v)
        mtu = self.integer(data, "mtu", "links", 576, 65535, None, "links")
        return Links(rates["host_mbit"], rates["uplink_mbit"], mtu)

    def racks(self, racks_data: list, pph: int) -> list[Rack]:
        racks: list[Rack] = []
        names: dict = {}
        host_rack: dict = {}
        rank_rack: dict = {}
        next_rank = 0
        by_hosts = None
        for i, rd in enumerate(racks_data):
            if not isinstance(rd, dict):
                self.fail("each [[racks]] entry must be a table", i, "racks")
            self.unknown_keys(rd, _RACK_KEYS, f"rack {i}", i, "racks")
            name = rd.get("name", f"rack{i}")
            if not isinstance(name, str) or not name:
                self.fail(f"rack {i}: name must be a non-empty string, got {name!r}", i, "racks", "name")
            if name in names:
                self.fail(f"rack name {name!r} is used twice (also {names[name]}); give each rack its own name",
                          i, "racks", "name")
            names[name] = self.where(i, "racks", "name")
            has_hosts, has_ranks = "hosts" in rd, "ranks" in rd
            if has_hosts == has_ranks:
                self.fail(f"rack {name!r} needs either hosts = [\"host\", ...] (one entry per machine) or "
                          f"ranks = \"0-3\" (workers on one machine), not {'both' if has_hosts else 'neither'}",
                          i, "racks")
            if by_hosts is None:
                by_hosts = has_hosts
            elif by_hosts != has_hosts:
                self.fail(f"rack {name!r} lists {'hosts' if has_hosts else 'ranks'} but an earlier rack lists "
                          f"{'ranks' if has_hosts else 'hosts'}; use one form for every rack", i, "racks")
            if has_hosts:
                hl = rd["hosts"]
                if not isinstance(hl, list) or not hl or not all(isinstance(h, str) and h for h in hl):
                    self.fail(f"rack {name!r}: hosts must be a non-empty list of host names", i, "racks", "hosts")
                ranks, hosts = [], []
                for h in hl:
                    if h in host_rack:
                        self.fail(f"host {h!r} is in rack {host_rack[h]!r} and in rack {name!r}; a worker "
                                  f"belongs to one rack", i, "racks", "hosts")
                    host_rack[h] = name
                    for _ in range(pph):
                        ranks.append(next_rank)
                        hosts.append(h)
                        next_rank += 1
            else:
                ranks = self.rank_list(rd["ranks"], name, i)
                hosts = [None] * len(ranks)
                for r in ranks:
                    if r in rank_rack:
                        self.fail(f"rank {r} is in rack {rank_rack[r]!r} and in rack {name!r}; a worker "
                                  f"belongs to one rack", i, "racks", "ranks")
                    rank_rack[r] = name
            if len(ranks) > 32:
                self.fail(f"rack {name!r} has {len(ranks)} workers; an aggregator takes at most 32 per rack: "
                          f"split it into racks", i, "racks")
            agg_data = rd.get("aggregator")
            if not isinstance(agg_data, dict):
                self.fail(f"rack {name!r} needs an [racks.aggregator] table with kind and address", i, "racks")
            agg = self.aggregator(agg_data, f"the aggregator of rack {name!r}", i, "racks.aggregator")
            fallback = None
            if "fallback" in rd:
                if not isinstance(rd["fallback"], dict):
                    self.fail(f"rack {name!r}: fallback must be a table with kind and address", i, "racks", "fallback")
                fallback = self.aggregator(rd["fallback"], f"the fallback of rack {name!r}", i, "racks.fallback")
                if fallback.kind != "host-switch" or agg.kind != "p4":
                    self.fail(f"rack {name!r}: a fallback stands in for a P4 switch and is a host in switch mode "
                              f"(kind = \"host-switch\"); this rack's aggregator is {agg.kind!r} and its fallback "
                              f"{fallback.kind!r}", i, "racks.fallback", "kind")
            racks.append(Rack(i, name, tuple(ranks), tuple(hosts), agg, fallback))
        if rank_rack:
            world = len(rank_rack)
            missing = sorted(set(range(world)) - set(rank_rack))
            if missing:
                self.fail(f"ranks must run from 0 to {world - 1} with each in one rack; none holds "
                          f"{_ranges(missing)} (the racks hold {_ranges(sorted(rank_rack))})")
        return racks

    def rank_list(self, value, name: str, i: int) -> list[int]:
        if isinstance(value, str):
            out = []
            for part in value.split(","):
                m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
                if not m:
                    self.fail(f"rack {name!r}: ranks {value!r} is not like \"0-3\" or \"0,2,4-5\"",
                              i, "racks", "ranks")
                lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
                if hi < lo:
                    self.fail(f"rack {name!r}: rank range {part.strip()!r} runs backwards", i, "racks", "ranks")
                out.extend(range(lo, hi + 1))
        elif isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                             for v in value):
            out = list(value)
        else:
            self.fail(f"rack {name!r}: ranks must be \"0-3\" or a list of ranks, got {value!r}", i, "racks", "ranks")
        if not out:
            self.fail(f"rack {name!r} has no ranks", i, "racks", "ranks")
        if len(set(out)) != len(out):
            self.fail(f"rack {name!r} lists a rank twice: {value!r}", i, "racks", "ranks")
        return out

    def aggregator(self, data: dict, what: str, rack: int | None, table: str) -> Aggregator:
        self.unknown_keys(data, _AGG_KEYS, what, rack, table)
        kind = data.get("kind")
        if kind not in KINDS:
            self.fail(f"{what}: kind must be one of {', '.join(KINDS)}, got {kind!r}", rack, table, "kind")
        address = data.get("address")
        if not isinstance(address, str):
            example = "udp://10.0.1.100:42606" if KINDS[kind] == "switch" else "zmq+tcp://10.0.1.100:5555"
            self.fail(f"{what}: address is missing (e.g. address = \"{example}\")", rack, table, "address")
        try:
            scheme = parse(address).scheme
        except AddressError as exc:
            self.fail(f"{what}: {exc}", rack, table, "address")
        if scheme not in _SCHEMES[kind]:
            self.fail(f"{what}: a {kind} aggregator is reached at {' or '.join(s + '://' for s in _SCHEMES[kind])}"
                      f", not {address!r}", rack, table, "address")
        if kind != "p4":
            extra = sorted(set(data) & _P4_ONLY)
            if extra:
                self.fail(f"{what}: {', '.join(extra)} belong to P4 switches (kind = \"p4\"), not {kind!r}",
                          rack, table, extra[0])
        host = data.get("host")
        if host is not None and (not isinstance(host, str) or not host):
            self.fail(f"{what}: host must be a host name", rack, table, "host")
        values = {
            "shards": self.integer(data, "shards", what, 1, 64, rack, table),
            "pool": self.integer(data, "pool", what, 1, 1 << 20, rack, table),
            "elements": self.integer(data, "elements", what, 1, 16384, rack, table),
            "slots": self.integer(data, "slots", what, 1, 65536, rack, table),
            "device_id": self.integer(data, "device_id", what, 0, 1 << 62, rack, table, default=0),
            "thrift_port": self.integer(data, "thrift_port", what, 1, 65535, rack, table, default=9090),
            "uplink_port": self.integer(data, "uplink_port", what, 0, 511, rack, table),
        }
        if kind == "service" and (values["pool"] or values["elements"] or values["slots"]):
            self.fail(f"{what}: pool, elements and slots are switch-protocol settings; a service takes shards",
                      rack, table, "pool")
        ports = data.get("ports", [])
        if not isinstance(ports, list) or not all(isinstance(p, int) and not isinstance(p, bool) and 0 <= p < 512
                                                  for p in ports):
            self.fail(f"{what}: ports must be a list of switch port numbers (0..511), one per worker",
                      rack, table, "ports")
        p4rt = data.get("p4runtime")
        if kind == "p4" and not (isinstance(p4rt, str) and re.fullmatch(r"[^:\s]+:\d{1,5}", p4rt)):
            self.fail(f"{what}: a P4 switch needs p4runtime = \"host:port\" (its P4Runtime server, e.g. "
                      f"\"10.0.1.1:9559\"), got {p4rt!r}", rack, table, "p4runtime")
        for key in ("switch_ip", "switch_mac"):
            v = data.get(key)
            if v is not None and not isinstance(v, str):
                self.fail(f"{what}: {key} must be a string", rack, table, key)
        return Aggregator(kind, address, host, p4runtime=p4rt, ports=tuple(ports),
                          switch_ip=data.get("switch_ip"), switch_mac=data.get("switch_mac"),
                          where=self.where(rack, table, "kind"), **values)

    def check_root(self, root: Aggregator, racks: list[Rack]) -> None:
        for r in racks:
            if r.aggregator.family != root.family:
                self.fail(f"rack {r.name!r} is aggregated by a {r.aggregator.kind} ({_FAMILY_TEXT[r.aggregator.family]}) "
                          f"but the root is a {root.kind} ({_FAMILY_TEXT[root.family]}); a root reduces racks of its "
                          f"own protocol: make the root kind = "
                          f"\"{'host-switch' if r.aggregator.family == 'switch' else 'service'}\" or change the rack's",
                          r.index, "racks.aggregator", "kind")
        if root.family == "service":
            if parse(root.address).scheme not in _ROOT_SERVICE_SCHEMES:
                self.fail(f"the root service takes racks' partials over tcp:// or zmq+tcp:// (or zmq+ipc:// on one "
                          f"host), not {root.address!r}", None, "root", "address")
            # unset means one per core of each machine, which need not agree
            given = {"the root": root.shards, **{f"rack {r.name!r}": r.aggregator.shards for r in racks}}
            if len(set(given.values())) > 1 or None in given.values():
                text = ", ".join(f"{k} {'unset (one per core of its machine)' if v is None else v}"
                                 for k, v in given.items())
                self.fail(f"a service root and its service racks must have the same number of shards (chunk i of "
                          f"rack shard s goes to root shard s); the file gives {text}: set shards = N, the same "
                          f"N, on the root and every rack", None, "root", "shards")
        if len(racks) > 32:
            self.fail(f"{len(racks)} racks under one root; a root takes at most 32 racks")

    def check_addresses(self, racks: list[Rack], root: Aggregator | None) -> None:
        """Two aggregators of one machine on one address: the second could
        not bind (a switch-mode host with N shards takes N ports)."""
        places = [(f"the aggregator of rack {r.name!r}", r.aggregator, r.index, "racks.aggregator") for r in racks]
        places += [(f"the fallback of rack {r.name!r}", r.fallback, r.index, "racks.fallback")
                   for r in racks if r.fallback]
        if root is not None:
            places.append(("the root", root, None, "root"))
        taken: dict = {}
        for what, agg, rack, table in places:
            a = parse(agg.address)
            if a.path:
                keys = [(agg.host, a.path)]
            else:
                ports = agg.shards if agg.kind == "host-switch" and agg.shards else 1
                keys = [(agg.host, a.scheme == "udp", a.host, a.port + i) for i in range(ports)]
            for key in keys:
                if key in taken:
                    other, other_where = taken[key]
                    self.fail(f"{what} ({agg.address}) and {other} ({other_where}) both need "
                              f"{'path' if a.path else 'port'} {key[-1]}; give each aggregator its own (a "
                              f"host-switch with shards = N listens on N ports from its address's)",
                              rack, table, "address")
            where = self.where(rack, table, "address")
            for key in keys:
                taken[key] = (what, where)

    def check_p4_rack(self, r: Rack, hosts: dict, root: Aggregator | None = None) -> None:
        agg = r.aggregator
        if agg.ports and len(agg.ports) != r.members:
            self.fail(f"rack {r.name!r}: its P4 switch lists {len(agg.ports)} ports for {r.members} workers; give "
                      f"one port per worker, in rank order", r.index, "racks.aggregator", "ports")
        # the program takes and sends the switch protocol on one UDP port
        # only (AGG_UDP_PORT in p4/aggnet/wire.p4)
        address = parse(agg.address)
        if address.port != SWITCH_PORT:
            self.fail(f"rack {r.name!r}: a P4 switch takes the switch protocol on UDP port {SWITCH_PORT} only; make "
                      f"its address udp://{address.host}:{SWITCH_PORT}", r.index, "racks.aggregator", "address")
        if root is not None and parse(root.address).port != SWITCH_PORT:
            self.fail(f"the P4 switch of rack {r.name!r} sends the rack's partial sums to UDP port {SWITCH_PORT} of "
                      f"the root; make the root's address udp://{parse(root.address).host}:{SWITCH_PORT}",
                      None, "root", "address")


def _ranges(values: list[int]) -> str:
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ",".join(out)


def from_env(environ=None) -> Topology | None:
    """The topology named by ``AGGNET_TOPOLOGY`` (a path), or None."""
    env = os.environ if environ is None else environ
    path = env.get("AGGNET_TOPOLOGY")
    return load(path) if path else None
