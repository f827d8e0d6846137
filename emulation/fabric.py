"""Racks under a spine in network namespaces: the multi-rack emulation.

Each rack is an ``emulation.netns.Rack`` on a subnet of its own (workers,
a Linux-bridge ToR, the aggregator host in switch mode). A spine namespace
is cabled to every ToR by an uplink veth whose spine end holds the rack's
gateway address: the spine routes between racks (so gloo's ring crosses
racks through it, as a real fabric's would) and runs the root aggregator
on an address of its own. Each uplink is shaped with tbf at the uplink
rate in both directions, and its spine end's counters are the rack's
cross-rack bytes.

::

    rack i:  w0..wN-1 ──┐ host_mbit
             agg ───────┤ N x host_mbit          spine (router, root at 10.77.0.1)
                        ToR (br0) ── uplink ═══ uplink_mbit both ways ═══ r<i>

A P4 rack (kind = "p4") has BMv2 in its ToR's place instead of the
bridge and no aggregator host: the switch's ports are the workers' cables
and the uplink, it forwards ordinary frames by MAC, and a job is
installed on it for each run (``switch_jobs``), with its uplink to the
root, which the control plane joins on the switch's behalf (from the
spine, where the root is reachable; aggnet/p4/parent.py).

Namespaces are named from one prefix (``agf0-w1``, ``agf0-tor``,
``agf-spine``); a crashed run's leftovers under the prefix are removed
when the next one starts, and everything goes on exit, error, Ctrl-C and
SIGTERM.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

from aggnet.protocol.address import parse
from aggnet.processes import ServiceProcess

from aggnet.protocol.limits import SWITCH_PORT

from aggnet.emulation.fabric_plan import GATEWAY_HOST, ROOT_IP, Names, Plan, RackPlan
from aggnet.emulation.netns import Emulated, EmulationError, Host, Rack, name_hosts, remove_namespaces, sh, shape
from aggnet.emulation.nsprocess import service_launcher

log = logging.getLogger("aggnet.emulation")


class Fabric(Emulated):
    """The plan built in namespaces; use as a context manager."""

    def __init__(self, plan: Plan, *, prefix: str = "agf", queue_bytes: int = 4 << 20):
        if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", prefix):
            raise ValueError(f"prefix must be 1-8 lowercase letters and digits, starting with a letter; got {prefix!r}")
        self.plan = plan
        self.prefix = prefix
        self.names = Names(prefix, "netns")
        self.queue_bytes = queue_bytes
        self.spine = self.names.spine()
        self.racks: list[Rack] = []
        #: rack aggregators, in rack order (None: a P4 rack's, its switch)
        self.aggregators: list[ServiceProcess | None] = []
        #: BMv2 of each P4 rack, by rack index
        self.switches: dict = {}
        self._keepers: list[subprocess.Popen] = []  #: control planes keeping jobs joined at the root
        self.root: ServiceProcess | None = None
        self.topology_path: str | None = None
        self._dir: str | None = None

    # -- who is where -------------------------------------------------------------

    @property
    def workers(self) -> list[tuple[int, Rack, Host]]:
        """(global rank, rack, host) of every worker, in rank order."""
        return [(rp.first_rank + j, rack, h) for rp, rack in zip(self.plan.racks, self.racks)
                for j, h in enumerate(rack.workers)]

    def uplink(self, index: int) -> str:
        """The spine end of rack ``index``'s uplink."""
        return f"r{index}"

    # -- build and tear down ------------------------------------------------------

    what = "racks"

    def _clear_stale(self) -> None:
        self._remove_namespaces(stale=True)

    def _build(self) -> None:
        p = self.plan
        sh("ip", "netns", "add", self.spine)
        sh("ip", "link", "set", "lo", "up", ns=self.spine)
        sh("ip", "addr", "add", f"{ROOT_IP}/32", "dev", "lo", ns=self.spine)
        sh("sysctl", "-qw", "net.ipv4.ip_forward=1", ns=self.spine)
        for rp in p.racks:
            # Rack.__enter__ also installs its own SIGTERM teardown; the
            # fabric's (below) replaces it once every rack stands
            p4 = rp.aggregator.kind == "p4"
            rack = Rack(rp.workers, rate_mbit=p.host_mbit, mtu=p.mtu, prefix=f"{self.prefix}{rp.index}",
                        queue_bytes=self.queue_bytes, subnet=rp.subnet, gateway=GATEWAY_HOST, aggregator=not p4,
                        bridge=not p4)
            self.racks.append(rack)
            rack.__enter__()
            self._cable_uplink(rp.index, rack, rp.gateway_ip)
            if p4:
                self._start_switch(rp, rack)
        # every host named in every namespace, across the racks
        name_hosts([h for rack in self.racks for h in rack.hosts])
        signal.signal(signal.SIGTERM, self._on_term)
        self._dir = tempfile.mkdtemp(prefix=f"aggnet-{self.prefix}-")
        self.topology_path = os.path.join(self._dir, "topology.toml")
        with open(self.topology_path, "w") as f:
            f.write(p.topology_toml(self.names))
        log.info("fabric %s: %s, host links %s, uplinks %s, topology for the workers in %s", self.prefix, p.shape,
                 _rate(p.host_mbit), _rate(p.uplink_mbit), self.topology_path)

    def _cable_uplink(self, index: int, rack: Rack, gateway_ip: str) -> None:
        """A veth from the ToR's bridge to the spine, whose end there is the
        rack's gateway."""
        spine_end = self.uplink(index)
        sh("ip", "link", "add", "uplink", "mtu", str(self.plan.mtu), "type", "veth", "peer", "name", "tmpup", "mtu",
           str(self.plan.mtu), ns=rack.tor)
        sh("ip", "link", "set", "tmpup", "netns", self.spine, ns=rack.tor)
        sh("ip", "link", "set", "tmpup", "name", spine_end, ns=self.spine)
        sh("ip", "addr", "add", f"{gateway_ip}/24", "dev", spine_end, ns=self.spine)
        sh("ip", "link", "set", spine_end, "up", ns=self.spine)
        if rack.bridge:
            sh("ip", "link", "set", "uplink", "master", "br0", ns=rack.tor)
        else:
            # BMv2's port: it sees frames as sent (see Rack._build)
            sh("sysctl", "-qw", "net.ipv6.conf.uplink.disable_ipv6=1", ns=rack.tor)
            for ns, dev in ((rack.tor, "uplink"), (self.spine, spine_end)):
                sh("ethtool", "-K", dev, "tx", "off", "rx", "off", "tso", "off", "gso", "off", "gro", "off", ns=ns,
                   check=False)
        sh("ip", "link", "set", "uplink", "up", ns=rack.tor)
        if self.plan.uplink_mbit:
            shape(rack.tor, "uplink", self.plan.uplink_mbit, self.plan.mtu, self.queue_bytes)
            shape(self.spine, spine_end, self.plan.uplink_mbit, self.plan.mtu, self.queue_bytes)

    def _start_switch(self, rp: RackPlan, rack: Rack) -> None:
        """BMv2 on the rack's ports and the uplink, forwarding by MAC; every
        host and the spine reach the switch's own address by a static
        neighbour entry (nothing answers ARP for it)."""
        from aggnet.emulation.bmv2 import Bmv2Switch

        agg = rp.aggregator
        ports = {i: h.port for i, h in enumerate(rack.workers)}
        ports[agg.uplink_port] = "uplink"
        self.switches[rp.index] = Bmv2Switch(ports, netns=rack.tor)
        self.switch_ctl(rp.index, "load")
        for i, h in enumerate(rack.workers):
            self.switch_ctl(rp.index, "add-host", rack.mac(h), str(i))
            sh("ip", "neigh", "replace", agg.switch_ip, "lladdr", agg.switch_mac, "dev", h.dev, "nud", "permanent",
               ns=h.name)
        self.switch_ctl(rp.index, "add-host", self._gateway_mac(rp.index), str(agg.uplink_port))
        self.switch_ctl(rp.index, "flood", ",".join(str(i) for i in sorted(ports)))
        sh("ip", "neigh", "replace", agg.switch_ip, "lladdr", agg.switch_mac, "dev", self.uplink(rp.index), "nud",
           "permanent", ns=self.spine)

    def _gateway_mac(self, index: int) -> str:
        return sh("cat", f"/sys/class/net/{self.uplink(index)}/address", ns=self.spine).stdout.strip()

    def switch_ctl(self, index: int, *args: str) -> str:
        """``aggnet switch ARGS`` for rack ``index``'s switch, run beside it
        (its P4Runtime and Thrift servers listen on the ToR's loopback)."""
        agg = self.plan.racks[index].aggregator
        cmd = [sys.executable, "-m", "aggnet", "switch", "--switch-ip", agg.switch_ip, "--switch-mac", agg.switch_mac,
               *args]
        r = sh(*cmd, ns=self.racks[index].tor, timeout=120, check=False)
        if r.returncode != 0:
            raise EmulationError(f"aggnet switch {' '.join(args)} (rack {index}) failed: {r.stderr.strip()[-1500:]}")
        return r.stdout

    @contextlib.contextmanager
    def switch_jobs(self, job: str):
        """``job`` installed on every P4 rack's switch, uplink to the root
        included, for the ``with`` block (a host aggregator installs a job
        when its workers join; a switch's control plane does it before)."""
        installed, keepers = [], []
        try:
            for rp in self.plan.racks:
                if rp.aggregator.kind != "p4":
                    continue
                self._install(rp, job)
                installed.append(rp.index)
                if self.plan.root is not None:
                    keepers.append(self._keep_joined(rp, job))
            yield
        finally:
            for keeper in keepers:
                keeper.terminate()
                try:
                    keeper.communicate(timeout=10)
                except subprocess.TimeoutExpired:
                    keeper.kill()
                    keeper.communicate()
                self._keepers.remove(keeper)
            for index in installed:
                with contextlib.suppress(EmulationError):
                    self.switch_ctl(index, "remove-job", job)

    def _install(self, rp: RackPlan, job: str) -> None:
        agg, rack = rp.aggregator, self.racks[rp.index]
        members = [f"{h.ip},{rack.mac(h)},{i}" for i, h in enumerate(rack.workers)]
        args = ["add-job", job, "--slots", str(agg.slots), *[x for m in members for x in ("--member", m)]]
        if self.plan.root is not None:
            args += ["--uplink", f"{ROOT_IP},{self._gateway_mac(rp.index)},{agg.uplink_port},{rp.index}"]
        self.switch_ctl(rp.index, *args)

    def _keep_joined(self, rp: RackPlan, job: str) -> subprocess.Popen:
        """The control plane joining the job at the root for the switch
        (once, failing the run if the root does not take it), then again
        every second while the run lasts (a restarted root forgot it);
        from the spine: the root is not reachable from the switch's
        namespace."""
        agg = rp.aggregator
        cmd = [sys.executable, "-m", "aggnet", "switch", "--switch-ip", agg.switch_ip, "join-parent", job, "--slots",
               str(agg.slots), "--rack-id", str(rp.index), "--racks", str(len(self.plan.racks)), "--parent",
               f"udp://{ROOT_IP}:{SWITCH_PORT}"]
        r = sh(*cmd, ns=self.spine, timeout=60, check=False)
        if r.returncode != 0:
            raise EmulationError(r.stderr.strip()[-1500:])
        keeper = subprocess.Popen(["ip", "netns", "exec", self.spine, *cmd, "--keep", "1"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self._keepers.append(keeper)  # a teardown kills it, whatever ends the run
        return keeper

    def start_aggregators(self, start_timeout: float = 60.0, restart: bool = False) -> None:
        """The root on the spine (with two racks or more) and each rack's
        aggregator host under it, started side by side; ``restart``: every
        service among them restarts a shard that dies (``--restart``)."""
        p = self.plan

        def args(rp):
            kind = (p.root if rp is None else rp.aggregator).kind
            return p.serve_args(rp) + (["--restart"] if restart and kind == "service" else [])

        # all at once: a rack asks its root only when a job arrives
        hosted = [(rp, rack) for rp, rack in zip(p.racks, self.racks) if rp.aggregator.kind != "p4"]
        wanted = [(rp.aggregator.address, rack.aggregator.name, args(rp)) for rp, rack in hosted]
        if p.root is not None:
            wanted.append((p.root.address, self.spine, args(None)))
        with ThreadPoolExecutor(len(wanted)) as pool:
            futures = [pool.submit(ServiceProcess, address, launch=service_launcher(ns), args=args,
                                   start_timeout=start_timeout) for address, ns, args in wanted]
        started = [f.result() for f in futures if f.exception() is None]
        failed = [f.exception() for f in futures if f.exception() is not None]
        if failed:
            _stop_all(started)
            raise failed[0]
        by_rack = iter(started[:len(hosted)])
        self.aggregators = [None if rp.aggregator.kind == "p4" else next(by_rack) for rp in p.racks]
        self.root = started[len(hosted)] if p.root is not None else None

    def restart_root(self, start_timeout: float = 60.0) -> None:
        """Stop the root and start it again at its address: it comes back
        without jobs, as after a crash, and each rack joins it again (a
        host rack by itself, a P4 rack through its control plane's keeper)."""
        if self.root is None:
            raise EmulationError("this fabric has no root: one rack reduces by itself")
        self.root.stop()
        self.root = ServiceProcess(self.plan.root.address, launch=service_launcher(self.spine),
                                   args=self.plan.serve_args(None), start_timeout=start_timeout)

    def stop_aggregators(self) -> None:
        _stop_all([a for a in self.aggregators if a is not None] + ([self.root] if self.root else []))
        self.aggregators, self.root = [], None

    def wait_reachable(self, timeout: float = 15.0) -> None:
        """Every worker reaches its rack's aggregator, and the first worker
        of every rack the first of every other (routes through the spine)."""
        for rack in self.racks:
            rack.wait_reachable(timeout)
        if shutil.which("ping") is None or len(self.racks) < 2:
            return
        first = self.racks[0].workers[0]
        for rack in self.racks[1:]:
            r = sh("ping", "-c", "1", "-W", str(max(1, int(timeout))), rack.workers[0].ip, ns=first.name, check=False)
            if r.returncode != 0:
                raise EmulationError(f"{first.name} cannot reach {rack.workers[0].name} ({rack.workers[0].ip}) "
                                     f"through the spine: {r.stdout.strip()} {r.stderr.strip()}")
        if self.plan.root is not None:
            for rack in self.racks:
                # a P4 rack's switch is reached by static entries: its first worker stands in
                host = rack.aggregator or rack.workers[0]
                r = sh("ping", "-c", "1", "-W", str(max(1, int(timeout))), ROOT_IP, ns=host.name, check=False)
                if r.returncode != 0:
                    raise EmulationError(f"{host.name} cannot reach the root at {ROOT_IP}: "
                                         f"{r.stdout.strip()} {r.stderr.strip()}")

    def teardown(self) -> None:
        """Stop the aggregators and delete every namespace of the fabric
        (and with them their veths, qdiscs and filter rules)."""
        for keeper in self._keepers:
            if keeper.poll() is None:
                keeper.kill()
                keeper.wait()
        self._keepers = []
        self.stop_aggregators()
        for switch in self.switches.values():
            switch.stop()
        self.switches = {}
        for rack in self.racks:
            rack.teardown()
        self.racks = []
        self._remove_namespaces(stale=False)
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = self.topology_path = None
        self._released()

    def _remove_namespaces(self, stale: bool) -> None:
        mine = re.compile(rf"{re.escape(self.prefix)}\d*-")
        names = [n for n in sh("ip", "netns", "list", check=False).stdout.split() if mine.match(n)]
        if names:
            if stale:
                log.info("removing namespaces left by an earlier run: %s", names)
            remove_namespaces(names)

    # -- measuring and impairing -------------------------------------------------------

    def stats(self, rack: int | None = None) -> dict:
        """The STATS of the root (None) or of rack ``rack``'s aggregator,
        asked from the namespace it serves in (``aggnet stats``); of a P4
        rack, its switch's counters (``aggnet switch counters``)."""
        if rack is not None and rack in self.switches:
            return json.loads(self.switch_ctl(rack, "counters"))
        agg = self.root if rack is None else self.aggregators[rack]
        if agg is None:
            raise EmulationError("this fabric has no root: one rack reduces by itself")
        ns = self.spine if rack is None else self.racks[rack].aggregator.name
        r = sh(sys.executable, "-m", "aggnet", "stats", agg.address, "--json", ns=ns, timeout=60, check=False)
        if r.returncode != 0:
            raise EmulationError(f"aggnet stats {agg.address} failed in {ns}: {r.stderr.strip()[-1000:]}")
        return json.loads(r.stdout)

    def uplink_counters(self) -> list[dict[str, int]]:
        """Bytes each rack's uplink carried so far: ``up`` (rack to spine)
        and ``down``, read at the spine end."""
        out = []
        for i in range(len(self.racks)):
            base = f"/sys/class/net/{self.uplink(i)}/statistics"
            rx, tx = sh("cat", f"{base}/rx_bytes", f"{base}/tx_bytes", ns=self.spine).stdout.split()
            out.append({"up": int(rx), "down": int(tx)})
        return out

    def impair(self, drop: float) -> None:
        """Drop aggregation datagrams at random, both directions, on every
        rack link (in the workers, as emulation.netns does for one rack)
        and on every spine link (at the root, for what it receives and
        sends)."""
        if not drop:
            return
        kinds = {rp.aggregator.kind for rp in self.plan.racks}
        if "service" in kinds:
            raise EmulationError(f"--drop drops the switch protocol's datagrams; this fabric's racks are "
                                 f"{', '.join(sorted(kinds))} (TCP): use host-switch or P4 racks")
        for rack, rp, agg in zip(self.racks, self.plan.racks, self.aggregators):
            rack.impair(drop=drop, port=parse(rp.aggregator.address).port, ports=agg.shards if agg else 1)
        if self.root is not None:
            top = parse(self.plan.root.address).port
            ports = f"{top}:{top + self.root.shards - 1}" if self.root.shards > 1 else str(top)
            for chain, direction in (("INPUT", "--dport"), ("OUTPUT", "--sport")):
                sh("iptables", "-A", chain, "-p", "udp", direction, ports, "-m", "statistic", "--mode", "random",
                   "--probability", f"{drop:.6f}", "-j", "DROP", ns=self.spine)

    def impairment_counts(self) -> dict[str, int]:
        """Datagrams dropped on rack links and on spine links."""
        racks = sum(rack.impairment_counts()["dropped"] for rack in self.racks)
        spine = 0
        out = sh("iptables", "-L", "-v", "-n", "-x", ns=self.spine, check=False).stdout
        for line in out.splitlines():
            parts = line.split()
            if len(parts) > 3 and parts[2] == "DROP":
                spine += int(parts[0])
        return {"rack_links": racks, "spine_links": spine}


def _stop_all(processes: list[ServiceProcess]) -> None:
    """Stop them side by side (each may wait out its grace period)."""
    if processes:
        with ThreadPoolExecutor(len(processes)) as pool:
            list(pool.map(lambda proc: proc.stop(), processes))


def _rate(mbit: float | None) -> str:
    return f"{mbit:g} Mbit/s" if mbit else "unshaped"
