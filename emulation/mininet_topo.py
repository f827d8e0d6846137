"""A topology file's racks as a Mininet network: the same emulation as
``aggnet emulate --topology`` (emulation.fabric), for Mininet's users.

From the command line (``--switch``/``--link`` are set per node here;
Mininet still wants to be told there is no controller)::

    mn --custom emulation/mininet_topo.py --topo aggnet,examples/topologies/two-racks.toml --controller none

From Mininet's Python API::

    net = Mininet(topo=AggnetTopo("two-racks.toml"), controller=None)
    net.start()
    procs = start_aggregators(net, net.topo)
    results = check_allreduce(net, net.topo, 8 << 20)

or all of it at once, under Debian's interpreter (which runs Mininet)::

    python3 emulation/mininet_topo.py examples/topologies/two-racks.toml --workers 2 --size 8MiB

Each rack is a ``LinuxBridge`` with its workers and its aggregator host,
``TCLink`` at the topology's ``host_mbit`` (the aggregator's at N times
that, unshaped past Mininet's 1000 Mbit/s limit); a spine host routes
between the racks from address ``.250`` of each, over ``TCLink`` uplinks at
``uplink_mbit``, and holds the root aggregator at ``10.77.0.1``.

Mininet runs under the system's Python, which cannot import aggnet and its
dependencies; the aggregators and workers run in the Mininet hosts under
the project's interpreter (``python=``, ``AGGNET_PYTHON``, or the
``.venv`` beside this file), which also turns the topology file into the
plan this module builds (``python -m aggnet.emulation.fabric_plan``), so
both emulations read topologies the same way. Nothing aggnet is imported
here: ``mn --custom`` runs this file under its own interpreter and keeps
every name it defines.
"""

import argparse
import inspect
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import uuid

from mininet.link import TCLink
from mininet.node import Node
from mininet.nodelib import LinuxBridge
from mininet.topo import Topo

#: this file, also when ``mn --custom`` runs it without a ``__file__``
_THIS_FILE = os.path.abspath(inspect.getsourcefile(lambda: None) or sys.argv[0])
#: Mininet's TCLink shapes up to this many Mbit/s (TCIntf.bwParamMax)
MININET_MAX_MBIT = 1000


class AggnetError(RuntimeError):
    """Something the Mininet emulation could not do; says what to do."""


def find_python(python=None):
    """The interpreter that has aggnet: ``python``, ``AGGNET_PYTHON``, or
    the repository's ``.venv`` (this file sits in ``emulation/``)."""
    repo = os.path.dirname(os.path.dirname(_THIS_FILE))
    tried = []
    # one that was named must work: falling back would hide the mistake
    named = python or os.environ.get("AGGNET_PYTHON")
    for candidate in [named] if named else [os.path.join(repo, ".venv", "bin", "python")]:
        tried.append(candidate)
        try:
            r = subprocess.run([candidate, "-c", "import aggnet.emulation.fabric_plan"], capture_output=True,
                               timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0:
            return candidate
    raise AggnetError(f"no interpreter with aggnet found (tried {', '.join(tried) or 'nothing'}); pass python=... "
                      f"or set AGGNET_PYTHON to the project's virtual environment's python (./dev setup makes .venv)")


def load_plan(path, python, racks=None, workers=None, host_mbit=None, uplink_mbit=None, prefix="a"):
    """The emulation plan of topology file ``path`` (JSON from the
    project's interpreter; a bad file fails here with the file's line)."""
    cmd = [python, "-m", "aggnet.emulation.fabric_plan", os.path.abspath(path), "--style", "mininet",
           "--prefix", prefix]
    for flag, value in (("--racks", racks), ("--workers", workers), ("--host-mbit", host_mbit),
                        ("--uplink-mbit", uplink_mbit)):
        if value is not None:
            cmd += [flag, str(value)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise AggnetError(r.stderr.strip() or f"`{' '.join(cmd)}` failed ({r.returncode})")
    return json.loads(r.stdout)


class Router(Node):
    """The spine: forwards between racks and holds the root's address."""

    def config(self, **params):
        result = super().config(**params)
        self.cmd("sysctl -qw net.ipv4.ip_forward=1")
        self.cmd("ip addr add %s/32 dev lo" % self.params["root_ip"])
        return result


def _mbit(value):
    """Mininet's bw: None (unshaped) past what TCLink can shape."""
    return value if value and value <= MININET_MAX_MBIT else None


class AggnetTopo(Topo):
    """The racks of a topology file under a spine; ``self.plan`` holds the
    addresses, host names and ``aggnet serve`` arguments."""

    def build(self, path, python=None, racks=None, workers=None, host_mbit=None, uplink_mbit=None, prefix="a"):
        self.python = find_python(python)
        self.plan = plan = load_plan(path, self.python, racks, workers, host_mbit, uplink_mbit, prefix)
        host, up = plan["host_mbit"], plan["uplink_mbit"]
        first = plan["racks"][0]
        spine = self.addHost(f"{prefix}spine", cls=Router, ip=first["gateway"] + "/24", root_ip="10.77.0.1")
        for rack in plan["racks"]:
            switch = self.addSwitch(rack["switch"], cls=LinuxBridge)
            for w in rack["workers"]:
                h = self.addHost(w["host"], ip=w["ip"] + "/24", defaultRoute="via " + rack["gateway"])
                self.addLink(h, switch, cls=TCLink, bw=_mbit(host), use_tbf=True)
            agg = rack["aggregator"]
            a = self.addHost(agg["host"], ip=agg["ip"] + "/24", defaultRoute="via " + rack["gateway"])
            self.addLink(a, switch, cls=TCLink, bw=_mbit(host and host * len(rack["workers"])), use_tbf=True)
            self.addLink(spine, switch, cls=TCLink, bw=_mbit(up), use_tbf=True, params1={"ip": rack["gateway"] + "/24"})


#: ``mn --custom emulation/mininet_topo.py --topo aggnet,FILE``
topos = {"aggnet": AggnetTopo}


def set_mtu(net, mtu):
    """Every interface (and bridge) at the plan's MTU; Mininet's links
    come up at 1500."""
    for link in net.links:
        for intf in (link.intf1, link.intf2):
            intf.node.cmd("ip link set dev %s mtu %d" % (intf.name, mtu))
    for switch in net.switches:
        switch.cmd("ip link set dev %s mtu %d" % (switch.name, mtu))


def _serving(proc, what, timeout):
    """Wait for ``aggnet serve``'s "aggnet serving ADDRESS" line."""
    deadline = time.monotonic() + timeout
    line = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        byte = os.read(proc.stdout.fileno(), 1)
        if not byte:
            raise AggnetError(f"the {what} exited ({proc.wait()}) while starting; its log is above")
        line += byte
        if byte == b"\n":
            if line.startswith(b"aggnet serving "):
                return line.decode().split()[2]
            line = b""
    proc.kill()
    raise AggnetError(f"the {what} did not start within {timeout:g}s")


def _env():
    # an AGGNET_ADDRESS of the caller's would override the topology
    return {**os.environ, "AGGNET_ADDRESS": "", "OMP_NUM_THREADS": "1"}


def start_aggregators(net, topo, timeout=60.0):
    """``aggnet serve`` on the spine (the root) and on each rack's
    aggregator host, under the project's interpreter; returns the
    processes (stop them, or ``net.stop()`` takes their hosts down)."""
    plan, procs = topo.plan, []
    serving = [] if plan["root"] is None else [("root", plan["root"])]
    serving += [(f"aggregator of {r['name']}", r["aggregator"]) for r in plan["racks"]]
    try:
        for what, agg in serving:
            node = net.get(agg["host"])
            cmd = [topo.python, "-m", "aggnet", "serve", "--listen", agg["address"], "--log-level", "WARNING",
                   *agg["serve"]]
            p = node.popen(cmd, stdout=subprocess.PIPE, stderr=None, stdin=subprocess.DEVNULL, env=_env())
            procs.append(p)
            _serving(p, what, timeout)
    except BaseException:
        stop(procs)
        raise
    return procs


def stop(procs, timeout=10.0):
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def check_allreduce(net, topo, nbytes=4 << 20, timeout=600.0):
    """One int32 all-reduce of ``nbytes`` from every worker through the
    racks and the root; returns each worker's record (``exact``: its
    result is the sum, bit for bit) and raises if any is not."""
    plan = topo.plan
    fd, path = tempfile.mkstemp(prefix="aggnet-mininet-", suffix=".toml")
    with os.fdopen(fd, "w") as f:
        f.write(plan["topology"])
    job = "mininet-" + uuid.uuid4().hex[:8]
    procs = []
    try:
        for rack in plan["racks"]:
            for w in rack["workers"]:
                cmd = [topo.python, "-m", "aggnet.emulation.worker", "aggnet", "--rank", str(w["rank"]),
                       "--world", str(plan["world"]), "--bytes", str(nbytes), "--topology", path, "--job", job,
                       "--dtype", "int32"]
                procs.append(net.get(w["host"]).popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                      env=_env()))
        deadline = time.monotonic() + timeout
        records = []
        for p in procs:
            try:
                out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AggnetError(f"the all-reduce did not finish within {timeout:g}s") from None
            if p.returncode != 0:
                raise AggnetError(f"a worker failed ({p.returncode}): {err.decode()[-2000:]}")
            records.append(json.loads(out.decode().strip().splitlines()[-1]))
    finally:
        stop(procs, 5.0)
        os.unlink(path)
    if not all(r["exact"] for r in records):
        raise AggnetError(f"ranks {[r['rank'] for r in records if not r['exact']]} do not hold the exact sum")
    return records


def _ping_all(net, plan, timeout=15.0):
    """Every worker reaches its aggregator; rank 0 reaches every rack's
    first worker through the spine; every aggregator reaches the root."""
    pairs = []
    first = plan["racks"][0]["workers"][0]["host"]
    for rack in plan["racks"]:
        pairs += [(w["host"], rack["aggregator"]["ip"]) for w in rack["workers"]]
        pairs.append((first, rack["workers"][0]["ip"]))
        if plan["root"] is not None:
            pairs.append((rack["aggregator"]["host"], plan["root"]["ip"]))
    for host, ip in pairs:
        deadline = time.monotonic() + timeout
        while "1 received" not in net.get(host).cmd("ping -c 1 -W 1 %s" % ip):
            if time.monotonic() > deadline:
                raise AggnetError(f"{host} cannot reach {ip} within {timeout:g}s")


def _size(text):
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for suffix, mult in units.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * mult)
    return int(text)


def main(argv=None):
    """Build the network, start the aggregators, check one all-reduce,
    print a JSON summary, tear everything down (on errors and SIGTERM too)."""
    from mininet.log import setLogLevel
    from mininet.net import Mininet

    p = argparse.ArgumentParser(description="a topology file's racks in Mininet, with one all-reduce checked")
    p.add_argument("topology")
    p.add_argument("--python", default=None, help="the interpreter with aggnet (default: AGGNET_PYTHON or .venv)")
    p.add_argument("--racks", type=int, default=None)
    p.add_argument("--workers", type=int, default=None, help="workers per rack")
    p.add_argument("--host-mbit", type=float, default=None, help="worker links (0: unshaped)")
    p.add_argument("--uplink-mbit", type=float, default=None, help="rack uplinks (0: unshaped)")
    p.add_argument("--size", default="4MiB", help="all-reduce size (int32)")
    p.add_argument("--prefix", default="a", help="prefix of the node names (interfaces are NAME-ethN)")
    p.add_argument("--cli", action="store_true", help="open Mininet's CLI after the check")
    args = p.parse_args(argv)
    setLogLevel("warning")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    net, procs = None, []
    try:
        topo = AggnetTopo(args.topology, python=args.python, racks=args.racks, workers=args.workers,
                          host_mbit=args.host_mbit, uplink_mbit=args.uplink_mbit, prefix=args.prefix)
        net = Mininet(topo=topo, controller=None, switch=LinuxBridge, link=TCLink, build=False)
        net.build()
        net.start()
        set_mtu(net, topo.plan["mtu"])
        _ping_all(net, topo.plan)
        procs = start_aggregators(net, topo)
        t0 = time.monotonic()
        records = check_allreduce(net, topo, _size(args.size))
        summary = {"racks": len(topo.plan["racks"]), "world": topo.plan["world"], "bytes": _size(args.size),
                   "exact": all(r["exact"] for r in records), "seconds": round(time.monotonic() - t0, 3),
                   "median_s": sorted(max(r["times"]) for r in records)[len(records) // 2]}
        print(json.dumps(summary), flush=True)
        if args.cli:
            from mininet.cli import CLI

            CLI(net)
    except AggnetError as exc:
        print(f"aggnet mininet: {exc}", file=sys.stderr)
        return 1
    finally:
        stop(procs)
        if net is not None:
            net.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
