"""An emulated rack in network namespaces: N workers, a top-of-rack switch,
an aggregator.

Each worker is a namespace with one interface, cabled by a veth pair to a
port of the ToR: a Linux bridge in the ToR's namespace (or, for the P4
program, BMv2 attached to the same port interfaces). Every worker link is
shaped to the same rate in both directions (tc tbf on both veth ends, as a
switch port is), and the aggregator host's link to N times that rate (a
PBox with N NICs), so it is never the single-link bottleneck. Random drop
and duplication of the aggregation protocol's datagrams come from iptables
``statistic`` (and ``TEE``) inside the worker namespaces; netem is absent
from this kernel.

Everything is torn down on exit, on error and on SIGTERM. Each run owns
its prefix: it holds a lock on it (a file in LOCK_DIR, flock'ed for the
run's life, so the kernel lets go of it when the run dies however it
dies). A second run with the same prefix is refused, naming the first;
namespaces under a prefix nobody holds were left by a run that died, and
are removed when the next one starts.
"""

from __future__ import annotations

import abc
import atexit
import contextlib
import fcntl
import logging
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass

from aggnet.protocol.limits import SWITCH_PORT

from aggnet.processes import keeps_fork_server

from aggnet.emulation.nsprocess import NETNS_ETC, popen_in

log = logging.getLogger("aggnet.emulation")

SUBNET = "10.77.0"
AGG_HOST = 254
#: where each running emulation's prefix lock lives
LOCK_DIR = "/run/aggnet-emulation"


class EmulationError(RuntimeError):
    pass


def can_emulate() -> tuple[bool, str]:
    """Whether namespaces can be made here, and if not, why."""
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("ethtool", "ethtool"), ("iptables", "iptables")):
        if shutil.which(tool) is None:
            return False, f"`{tool}` is not installed (apt-get install {package})"
    probe = f"aggnet-probe-{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return False, f"cannot create a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return True, ""


def sh(*cmd: str, check: bool = True, ns: str | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    """``cmd`` (in namespace ``ns``) to its end, its output captured. An
    aggnet command there (``python -m aggnet switch``, ``... stats``) forks
    from the fork server where this process keeps one: a fabric's set-up
    runs dozens, each an interpreter and aggnet's imports when exec'd."""
    full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
    if ns is None:
        r = subprocess.run(full, capture_output=True, text=True, timeout=timeout)
    else:
        p = popen_in(ns, list(cmd), fork=keeps_fork_server(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                     text=True)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            raise
        r = subprocess.CompletedProcess(full, p.returncode, out, err)
    if check and r.returncode != 0:
        raise EmulationError(f"`{' '.join(full)}` failed ({r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
    return r


#: tbf's bucket: one whole GSO or TSO packet as tbf counts it (64 KiB of
#: payload plus every segment's headers). A smaller bucket makes tbf cut
#: such a packet into frames in software, and each frame then crosses the
#: bridge and the receiver's stack on its own: with 1500-byte frames (44
#: datagrams or 45 TCP segments per packet, 66-68 KB counted) that cost
#: both aggnet and gloo twice the CPU per byte of jumbo frames (7 per
#: packet, under 64 KiB), a cost real NICs, segmenting in hardware and
#: coalescing on receive, do not put on the hosts.
TBF_BURST = 96 << 10


def shape(ns: str, dev: str, rate_mbit: float, mtu: int = 9000, queue_bytes: int = 4 << 20) -> None:
    """Shape what ``dev`` sends to ``rate_mbit`` (tbf: the rate, a burst of
    one GSO packet, and a queue deep enough for a window of in-flight
    packets, as a switch port's buffer)."""
    burst = max(TBF_BURST, 4 * mtu)
    sh("tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst),
       "limit", str(queue_bytes), ns=ns)


def name_hosts(hosts: list) -> None:
    """Give every namespace of ``hosts`` an /etc/hosts that names them all:
    torch's rendezvous looks up the name of each peer's address and warns
    that it cannot ("The hostname of the client socket cannot be
    retrieved") where nothing names the emulation's addresses."""
    # torch's store listens on IPv6 too, so a peer's address arrives
    # IPv4-mapped (::ffff:a.b.c.d), which glibc looks up as written
    lines = ["127.0.0.1 localhost", "::1 localhost"] + [f"{h.ip} {h.name}" for h in hosts] + \
        [f"::ffff:{h.ip} {h.name}" for h in hosts]
    for h in hosts:
        os.makedirs(os.path.join(NETNS_ETC, h.name), exist_ok=True)
        with open(os.path.join(NETNS_ETC, h.name, "hosts"), "w") as f:
            f.write("\n".join(lines) + "\n")


def remove_namespaces(names: list[str]) -> None:
    """Kill whatever runs in the namespaces, then delete them (which
    deletes their interfaces and the veth ends cabled to them) and the
    files aggnet left for them in /etc/netns."""
    for n in names:
        for pid in sh("ip", "netns", "pids", n, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    for n in names:
        sh("ip", "netns", "del", n, check=False)
        shutil.rmtree(os.path.join(NETNS_ETC, n), ignore_errors=True)


def own_prefix(prefix: str) -> int:
    """Take the lock on ``prefix`` for this run (its descriptor); raises
    EmulationError naming the run that holds it."""
    os.makedirs(LOCK_DIR, exist_ok=True)
    fd = os.open(os.path.join(LOCK_DIR, f"{prefix}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise EmulationError(f"the namespaces named {prefix}-* belong to a running emulation (pid {holder}); give "
                             f"this run another --prefix, or wait for that one") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def free_prefix(base: str) -> str:
    """``base``, or ``base`` and a letter (``agnb``, ``agnc``...): the first
    prefix no running emulation holds (the caller takes it with
    own_prefix when it builds). Letters, not digits: a fabric's racks are
    its prefix and a digit."""
    for suffix in ("", *"bcdefghi"):
        name = base + suffix
        try:
            fd = os.open(os.path.join(LOCK_DIR, f"{name}.lock"), os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return name
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return name
        except BlockingIOError:
            continue
        finally:
            os.close(fd)
    raise EmulationError(f"9 emulations with prefixes {base}, {base}b .. {base}i are running; give --prefix")


@dataclass
class Host:
    name: str  #: namespace
    ip: str
    dev: str  #: its interface inside the namespace
    port: str  #: the ToR-side end of its cable


class Emulated(abc.ABC):
    """A piece of emulated network that stands only inside a ``with``: built
    on enter; torn down on exit, when building fails, on SIGTERM and at
    interpreter exit, so no namespace outlives the run that made it.
    Subclasses give ``_clear_stale`` (what an earlier, killed run left),
    ``_build`` and ``teardown``, which ends with ``_released``."""

    what = "a network"
    _old_term = None
    _lock_fd: int | None = None
    prefix: str

    @abc.abstractmethod
    def _clear_stale(self) -> None:
        """Remove what an earlier run of the same names left behind."""

    @abc.abstractmethod
    def _build(self) -> None:
        """Create the namespaces, links and processes."""

    @abc.abstractmethod
    def teardown(self) -> None:
        """Remove everything built; safe to call twice."""

    def __enter__(self):
        ok, why = can_emulate()
        if not ok:
            raise EmulationError(f"cannot emulate {self.what} here: {why}")
        self._lock_fd = own_prefix(self.prefix)
        self._clear_stale()
        atexit.register(self.teardown)
        self._old_term = signal.signal(signal.SIGTERM, self._on_term)
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def _on_term(self, *_):
        self.teardown()
        raise SystemExit(143)

    def _released(self) -> None:
        """The end of a teardown: the exit hook, the SIGTERM handler and
        the prefix's lock go."""
        atexit.unregister(self.teardown)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        if self._old_term is not None:
            with contextlib.suppress(ValueError, TypeError):  # ValueError: not the main thread
                signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None


class Rack(Emulated):
    """The rack; use as a context manager (``with Rack(4, rate_mbit=100) as rack``)."""

    def __init__(self, workers: int, rate_mbit: float | None = None, *, mtu: int = 9000, prefix: str = "agn",
                 aggregator: bool = True, queue_bytes: int = 4 << 20, bridge: bool = True,
                 subnet: str = SUBNET, gateway: int | None = None):
        """``bridge=False`` leaves the ToR's ports unconnected, for BMv2 to
        attach to (emulation.bmv2). ``subnet`` (three octets) and
        ``gateway`` (a host number in it) let racks of a fabric tell their
        hosts apart and reach each other: every host routes what is not in
        its rack through ``subnet.gateway``, a router the fabric plugs into
        the ToR (emulation.fabric)."""
        if not 1 <= workers <= 32:
            raise ValueError(f"a rack holds 1 to 32 workers, got {workers}")
        if gateway is not None and not workers < gateway < AGG_HOST:
            raise ValueError(f"gateway must be a host number of {subnet}.0/24 that no worker or aggregator "
                             f"has ({workers + 1}..{AGG_HOST - 1}), got {gateway}")
        self.prefix = prefix
        self.subnet = subnet
        self.gateway = None if gateway is None else f"{subnet}.{gateway}"
        self.rate_mbit = rate_mbit
        self.mtu = mtu
        self.queue_bytes = queue_bytes
        self.tor = f"{prefix}-tor"
        self.workers = [Host(f"{prefix}-w{i}", f"{subnet}.{i + 1}", "eth0", f"p{i}") for i in range(workers)]
        self.aggregator = Host(f"{prefix}-agg", f"{subnet}.{AGG_HOST}", "eth0", "pagg") if aggregator else None
        self.bridge = bridge
        self._up = False
        self._procs: list[subprocess.Popen] = []

    @property
    def hosts(self) -> list[Host]:
        return self.workers + ([self.aggregator] if self.aggregator else [])

    # -- build and tear down ------------------------------------------------------

    what = "a rack"

    def _clear_stale(self) -> None:
        self.teardown(stale=True)

    def _build(self) -> None:
        self._up = True
        sh("ip", "netns", "add", self.tor)
        sh("ip", "link", "set", "lo", "up", ns=self.tor)
        if self.bridge:
            sh("ip", "link", "add", "br0", "type", "bridge", ns=self.tor)
            sh("ip", "link", "set", "br0", "mtu", str(self.mtu), ns=self.tor)
        for i, h in enumerate(self.hosts):
            sh("ip", "netns", "add", h.name)
            sh("ip", "link", "set", "lo", "up", ns=h.name)
            # both ends are created in the ToR namespace, then one moves
            sh("ip", "link", "add", h.port, "mtu", str(self.mtu), "type", "veth", "peer", "name", f"tmp{i}",
               "mtu", str(self.mtu), ns=self.tor)
            sh("ip", "link", "set", f"tmp{i}", "netns", h.name, ns=self.tor)
            sh("ip", "link", "set", f"tmp{i}", "name", h.dev, ns=h.name)
            sh("ip", "addr", "add", f"{h.ip}/24", "dev", h.dev, ns=h.name)
            sh("ip", "link", "set", h.dev, "up", ns=h.name)
            if self.gateway:
                sh("ip", "route", "add", "default", "via", self.gateway, "dev", h.dev, ns=h.name)
            if self.bridge:
                sh("ip", "link", "set", h.port, "master", "br0", ns=self.tor)
            else:
                # a switch program sees every frame: no IPv6 chatter from its ports
                sh("sysctl", "-qw", f"net.ipv6.conf.{h.port}.disable_ipv6=1", ns=self.tor)
                # and it sees them as sent: a checksum left to the NIC (veth
                # offload) or a segment left to GSO would arrive broken
                for ns, dev in ((h.name, h.dev), (self.tor, h.port)):
                    sh("ethtool", "-K", dev, "tx", "off", "rx", "off", "tso", "off", "gso", "off", "gro", "off",
                       ns=ns, check=False)
            sh("ip", "link", "set", h.port, "up", ns=self.tor)
            if self.rate_mbit:
                rate = self.rate_mbit * (len(self.workers) if h is self.aggregator else 1)
                self._shape(h.name, h.dev, rate)
                self._shape(self.tor, h.port, rate)
        if self.bridge:
            sh("ip", "link", "set", "br0", "up", ns=self.tor)
        name_hosts(self.hosts)
        log.info("rack %s: %d workers%s, links %s", self.prefix, len(self.workers),
                 " + aggregator host" if self.aggregator else "",
                 f"{self.rate_mbit:g} Mbit/s" if self.rate_mbit else "unshaped")

    def _shape(self, ns: str, dev: str, rate_mbit: float) -> None:
        shape(ns, dev, rate_mbit, self.mtu, self.queue_bytes)

    def teardown(self, stale: bool = False) -> None:
        """Stop what runs in the rack and delete its namespaces."""
        for p in self._procs:
            if p.poll() is None:
                p.kill()
        self._procs = []
        names = sh("ip", "netns", "list", check=False).stdout.split()
        mine = [n for n in names if n.startswith(f"{self.prefix}-")]
        if stale and mine:
            log.info("removing namespaces left by an earlier run: %s", mine)
        if mine:
            remove_namespaces(mine)
        self._up = False
        if not stale:
            self._released()

    # -- running things inside -------------------------------------------------------

    def popen(self, host: Host | str, cmd: list[str], env: dict | None = None, **kw) -> subprocess.Popen:
        p = popen_in(host.name if isinstance(host, Host) else host, cmd, env, **kw)
        self._procs.append(p)
        return p

    def run(self, host: Host | str, cmd: list[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        ns = host.name if isinstance(host, Host) else host
        return sh(*cmd, ns=ns, timeout=timeout, **kw)

    def mac(self, host: Host) -> str:
        return sh("cat", f"/sys/class/net/{host.dev}/address", ns=host.name).stdout.strip()

    def counters(self) -> dict[str, dict[str, int]]:
        """Bytes and packets each worker's interface sent and received."""
        out = {}
        for h in self.workers:
            vals = {}
            for key in ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets"):
                vals[key] = int(sh("cat", f"/sys/class/net/{h.dev}/statistics/{key}", ns=h.name).stdout)
            out[h.name] = vals
        return out

    # -- impairments ------------------------------------------------------------------

    def impair(self, drop: float = 0.0, duplicate: float = 0.0, port: int = SWITCH_PORT, ports: int = 1) -> None:
        """Drop (both directions) and duplicate (worker to aggregator) the
        aggregation protocol's datagrams at random, in every worker; a
        sharded aggregator listens on ``ports`` consecutive ports."""
        port = f"{port}:{port + ports - 1}" if ports > 1 else port
        if (drop or duplicate) and shutil.which("iptables") is None:
            raise EmulationError("impairments need iptables (apt-get install iptables)")
        for h in self.workers:
            if drop:
                for chain, direction in (("OUTPUT", "--dport"), ("INPUT", "--sport")):
                    sh("iptables", "-A", chain, "-p", "udp", direction, str(port), "-m", "statistic", "--mode",
                       "random", "--probability", f"{drop:.6f}", "-j", "DROP", ns=h.name)
            if duplicate and self.aggregator is not None:
                sh("iptables", "-t", "mangle", "-A", "OUTPUT", "-p", "udp", "--dport", str(port), "-m", "statistic",
                   "--mode", "random", "--probability", f"{duplicate:.6f}", "-j", "TEE", "--gateway",
                   self.aggregator.ip, ns=h.name)

    def impairment_counts(self) -> dict[str, int]:
        """Datagrams the iptables rules dropped and duplicated, summed."""
        dropped = duplicated = 0
        for h in self.workers:
            for table in ("filter", "mangle"):
                out = sh("iptables", "-t", table, "-L", "-v", "-n", "-x", ns=h.name, check=False).stdout
                for line in out.splitlines():
                    parts = line.split()
                    if len(parts) > 3 and parts[2] in ("DROP", "TEE"):
                        if parts[2] == "DROP":
                            dropped += int(parts[0])
                        else:
                            duplicated += int(parts[0])
        return {"dropped": dropped, "duplicated": duplicated}

    def wait_reachable(self, timeout: float = 10) -> None:
        """ARP and links settle: ping the aggregator from every worker (the
        protocol's own retries cover this too, so without ping it is skipped)."""
        if shutil.which("ping") is None:
            return
        target = self.aggregator.ip if self.aggregator else self.workers[0].ip
        deadline = time.monotonic() + timeout
        for h in self.workers:
            while True:
                r = sh("ping", "-c", "1", "-W", "1", target, ns=h.name, check=False)
                if r.returncode == 0:
                    break
                if time.monotonic() > deadline:
                    raise EmulationError(f"{h.name} cannot reach {target}: {r.stdout.strip()} {r.stderr.strip()}")
