"""``aggnet up TOPOLOGY``: bring up the aggregators a topology places on
this machine, and its job on the P4 switches it names.

Run on every machine of a topology (or once, where it all sits on one),
it starts each host aggregator placed here as a detached ``aggnet serve``
(the root first, since racks join it on their first job), waits until it
answers, and records it; for one placed elsewhere it prints the command
to run there. Running it again changes only what differs from the record,
so it can be repeated after a crash or an edit of the file. ``aggnet
down`` undoes exactly what was recorded.
"""

from __future__ import annotations

import ipaddress
import os
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from aggnet.deploy import state as up_state
from aggnet.protocol.address import Address, parse
from aggnet.protocol.topology import Aggregator, Rack, Topology, TopologyError

READY_TIMEOUT = 30.0


def add_arguments(p) -> None:
    p.add_argument("topology", help="the topology file (TOML; examples/topologies/ has some)")
    p.add_argument("--host", default=None,
                   help="this machine's name in the topology (default: its host name); aggregators whose host "
                        "is this name, the host name or localhost are started here")
    p.add_argument("--state-dir", default=None,
                   help="where what was started is recorded (default: $XDG_RUNTIME_DIR/aggnet or "
                        "/tmp/aggnet-UID)")
    p.add_argument("--dry-run", action="store_true", help="say what would be done; change nothing")
    p.add_argument("--timeout", type=float, default=READY_TIMEOUT,
                   help="seconds each aggregator may take to answer once started (default %(default)g)")


@dataclass
class Row:
    """One line of the summary."""

    role: str
    kind: str
    address: str
    host: str
    state: str


class StartFailed(RuntimeError):
    pass


# -- where things run --------------------------------------------------------------------


def roles(topo: Topology):
    """(role, rack, aggregator) in start order: the root, then each rack's
    aggregator and fallback."""
    if topo.root is not None and len(topo.racks) > 1:
        yield "root", None, topo.root
    for rack in topo.racks:
        yield f"rack {rack.name}", rack, rack.aggregator
        if rack.fallback is not None:
            yield f"fallback {rack.name}", rack, rack.fallback


def _this_machine_has(ip: str) -> bool:
    """An address assigned to one of this machine's interfaces binds."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((ip, 0))
    except OSError:
        return False
    return True


def is_local(agg: Aggregator, names: set[str]) -> bool:
    """Whether ``agg`` runs on this machine: its host is one of ``names``;
    with no host, its address is loopback, a path, or one of this machine's."""
    if agg.host is not None:
        return agg.host in names
    a = parse(agg.address)
    if a.path:
        return True
    if a.host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(a.host)
    except ValueError:
        return a.host in names
    return ip.is_loopback or _this_machine_has(str(ip))


def serve_argv(topo: Topology, rack: Rack | None, agg: Aggregator) -> list[str]:
    if rack is None:
        return agg.serve_argv()
    return agg.serve_argv(topo.parent_of(rack), rack.index, len(topo.racks))


def probe_address(agg: Aggregator) -> str:
    """Where to ask an aggregator that listens on every interface."""
    a = parse(agg.address)
    wildcard = {"0.0.0.0": "127.0.0.1", "::": "::1", "*": "127.0.0.1"}
    if a.host in wildcard:
        return str(Address(a.scheme, wildcard[a.host], a.port))
    return agg.address


# -- starting and waiting ---------------------------------------------------------------------


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return "(no log)"
    out = text.strip().splitlines()[-lines:]
    return "\n".join(f"    {line}" for line in out) if out else "    (the log is empty)"


def start(argv: list[str], log: str) -> subprocess.Popen:
    """Start ``argv`` in a session of its own, so that it outlives this
    command and its terminal, with its output in ``log``."""
    with open(log, "w", encoding="utf-8") as out:
        out.write(f"# aggnet up, {time.strftime('%Y-%m-%d %H:%M:%S')}: {shlex.join(argv)}\n")
        out.flush()
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True)


def wait_ready(proc: subprocess.Popen, agg: Aggregator, log: str, timeout: float) -> None:
    """Return once ``proc`` says it serves and answers STATS; raise
    StartFailed naming why not. Both are needed: STATS alone could be
    answered by another process holding the port."""
    from aggnet.errors import AggnetError
    from aggnet.client.stats import query

    address = probe_address(agg)
    deadline = time.monotonic() + timeout
    serving = f"pid={proc.pid}"
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            raise StartFailed(f"it exited with status {code}")
        try:
            with open(log, encoding="utf-8", errors="replace") as f:
                said = any("aggnet serving" in line and line.rstrip().endswith(serving) for line in f)
        except OSError:
            said = False
        if said:
            try:
                query(address, timeout=min(1.0, max(0.1, deadline - time.monotonic())))
                return
            except AggnetError:
                pass
        time.sleep(0.1)
    raise StartFailed(f"it did not answer STATS at {address} within {timeout:g}s")


def _advice(log: str, agg: Aggregator) -> str:
    try:
        with open(log, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        text = ""
    if "in use" in text:
        return (f"something else listens at {agg.address}: stop it (aggnet down, for one aggnet up started), or "
                f"give this aggregator another port in the topology file")
    return "read its log above, fix the cause, and run aggnet up again"


# -- the command ------------------------------------------------------------------------------


def _names(host: str | None) -> set[str]:
    names = {"localhost", socket.gethostname()}
    if host:
        names.add(host)
    return names


def _bring_up_one(role: str, agg: Aggregator, argv: list[str], args, state_file: str,
                  state: dict) -> Row | subprocess.Popen:
    """Start, restart or leave alone one local aggregator; returns its row,
    or the process this run started (recorded, not yet ready)."""
    records = state["aggregators"]
    full = [sys.executable, "-m", "aggnet", *argv]
    rec = records.get(role)

    def row(text: str) -> Row:
        return Row(role, agg.kind, agg.address, agg.host or "this machine", text)

    if rec is not None and up_state.running(rec["pid"], rec["argv"]):
        if rec["argv"] == full:
            print(f"{role}: already running (pid {rec['pid']})")
            return row("already running")
        if args.dry_run:
            return row("would restart (its settings changed)")
        print(f"{role}: its settings changed; restarting it (pid {rec['pid']}: "
              f"{up_state.stop(rec['pid'], rec['argv'])})")
    elif rec is not None:
        if args.dry_run:
            return row("would start (it had stopped)")
        print(f"{role}: pid {rec['pid']} had stopped; the end of its log ({rec['log']}):\n{_tail(rec['log'], 5)}")
    if args.dry_run:
        return row(f"would start: {shlex.join(full)}")
    records.pop(role, None)
    up_state.save(state_file, state)
    log = up_state.log_path(state_file, role)
    proc = start(full, log)
    # recorded before it is waited for: an interrupted run leaves it to down
    records[role] = {"pid": proc.pid, "argv": full, "kind": agg.kind, "address": agg.address, "log": log,
                     "started": time.time()}
    up_state.save(state_file, state)
    return proc


def _bring_up(topo: Topology, args, state_file: str, state: dict, rows: dict) -> int:
    """Start or leave alone each aggregator placed here, one at a time;
    returns the exit status. ``state`` is saved after every change."""
    names = _names(args.host)
    records = state["aggregators"]
    started_now: list[str] = []
    local = set()
    try:
        for role, rack, agg in roles(topo):
            if agg.kind == "p4":
                continue
            argv = serve_argv(topo, rack, agg)
            if not is_local(agg, names):
                command = shlex.join(["aggnet", *argv])
                where = f" on {agg.host}" if agg.host else f" on the machine with {parse(agg.address).host}"
                rows[role] = Row(role, agg.kind, agg.address, agg.host or "-", f"elsewhere: run `{command}`{where}")
                print(f"{role}: placed{where}; run there: {command}  (or aggnet up {args.topology} --host "
                      f"{agg.host or 'NAME'})")
                continue
            local.add(role)
            was_running = role in records and up_state.running(records[role]["pid"], records[role]["argv"])
            proc = _bring_up_one(role, agg, argv, args, state_file, state)
            if isinstance(proc, Row):
                rows[role] = proc
                continue
            started_now.append(role)
            rec = records[role]
            try:
                wait_ready(proc, agg, rec["log"], args.timeout)
            except StartFailed as exc:
                print(f"aggnet up: {role} ({agg.kind} at {agg.address}) failed to start: {exc}. The end of its log "
                      f"({rec['log']}):\n{_tail(rec['log'])}\n{_advice(rec['log'], agg)}", file=sys.stderr)
                raise
            word = "restarted" if was_running else "started"
            rows[role] = Row(role, agg.kind, agg.address, agg.host or "this machine", word)
            print(f"{role}: {word} (pid {proc.pid}, log {rec['log']})")
    except BaseException as exc:
        recs = [records.pop(role) for role in started_now]
        for role, rec, outcome in zip(started_now, recs, up_state.stop_all([(r["pid"], r["argv"]) for r in recs])):
            print(f"aggnet up: stopping {role} (pid {rec['pid']}), started by this run: {outcome}", file=sys.stderr)
        up_state.save(state_file, state)
        if isinstance(exc, StartFailed):
            return 1
        raise
    # what an earlier run started that the topology no longer places here
    for role in [r for r in records if r not in local]:
        rec = records[role]
        if args.dry_run:
            rows[role] = Row(role, rec.get("kind", "?"), rec.get("address", "?"), "this machine",
                             "would stop: no longer placed here")
            continue
        outcome = up_state.stop(rec["pid"], rec["argv"])
        del records[role]
        rows[role] = Row(role, rec.get("kind", "?"), rec.get("address", "?"), "this machine",
                         f"stopped: no longer placed here ({outcome})")
    if not args.dry_run:
        up_state.save(state_file, state)
    return 0


def _switches(topo: Topology, args, state_file: str, state: dict, rows: dict) -> int:
    from aggnet.deploy import switches as up_switches

    status = 0
    jobs = state["switch_jobs"]
    p4 = set()
    for role, rack, agg in roles(topo):
        if agg.kind != "p4":
            continue
        p4.add(role)
        old = jobs.get(role)
        if old is not None and (old["p4runtime"], old["job"]) != (agg.p4runtime, topo.job) and not args.dry_run:
            print(f"{role}: its switch or job changed; {up_switches.remove(jobs.pop(role))}")
        outcome = up_switches.install(topo, rack, dry_run=args.dry_run)
        if outcome.record is not None:
            jobs[role] = outcome.record
        if outcome.detail:
            print(f"{role}: {outcome.detail}", file=sys.stderr if outcome.failed else sys.stdout)
        status |= outcome.failed
        rows[role] = Row(role, "p4", agg.address, agg.p4runtime, outcome.state)
    for role in [r for r in jobs if r not in p4]:
        if not args.dry_run:
            print(f"{role}: no longer a P4 rack; {up_switches.remove(jobs.pop(role))}")
    if not args.dry_run:
        up_state.save(state_file, state)
    return status


def summary(rows: list[Row]) -> str:
    head = Row("role", "kind", "address", "host", "state")
    table = [head, *rows]
    widths = [max(len(getattr(r, f)) for r in table) for f in ("role", "kind", "address", "host")]
    lines = []
    for r in table:
        cells = [getattr(r, f).ljust(w) for f, w in zip(("role", "kind", "address", "host"), widths)]
        lines.append("  ".join([*cells, r.state]).rstrip())
    return "\n".join(lines)


def main(args) -> int:
    from aggnet.protocol import topology

    try:
        topo = topology.load(args.topology)
    except TopologyError as exc:
        print(f"aggnet up: {exc}", file=sys.stderr)
        return 2
    try:
        state_dir = up_state.ensure_dir(args.state_dir or up_state.default_dir())
        state_file = up_state.state_path(state_dir, topo.job, args.topology)
        earlier = up_state.find_state(state_dir, args.topology)
        if earlier is not None and earlier != state_file and not os.path.exists(state_file):
            # the job was renamed in the file: what ran under the old name is still ours
            if args.dry_run:
                state_file = earlier
            else:
                os.replace(earlier, state_file)
        with up_state.locked(state_file):
            state = up_state.load(state_file)
            state["topology"] = os.path.abspath(args.topology)
            state["job"] = topo.job
            rows: dict = {}
            status = _bring_up(topo, args, state_file, state, rows)
            if status == 0:
                status = _switches(topo, args, state_file, state, rows)
            if not state["aggregators"] and not state["switch_jobs"] and not args.dry_run:
                up_state.remove(state_file)
    except up_state.StateError as exc:
        print(f"aggnet up: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("aggnet up: interrupted; what this run started is stopped again", file=sys.stderr)
        return 130
    order = [role for role, _, _ in roles(topo)]
    ordered = [rows[r] for r in order if r in rows] + [row for r, row in rows.items() if r not in order]
    if ordered:
        print()
        print(summary(ordered))
    if status == 0 and not args.dry_run and (state["aggregators"] or state["switch_jobs"]):
        print(f"\nworkers: AGGNET_TOPOLOGY={os.path.abspath(args.topology)} places each rank in its rack; "
              f"aggnet down {args.topology} stops what this started")
    return status
