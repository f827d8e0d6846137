"""``aggnet switch ...``: the switch's control plane from the command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from aggnet.protocol.limits import SWITCH_PORT

from aggnet.p4.control import Member, SwitchControl, SwitchControlError, Uplink, _one_line
from aggnet.p4.parent import ParentJoinError, RackAtParent, job_key_from_env, join_parent, keep_joined


def _switch_options(p, defaults: bool = True) -> None:
    """The options naming the switch; on each subcommand too (without
    defaults, so one given before the subcommand stands), since people put
    them after it as often as before."""
    d = (lambda v: v) if defaults else (lambda v: argparse.SUPPRESS)
    p.add_argument("--grpc", default=d("127.0.0.1:9559"), help="the switch's P4Runtime server (default 127.0.0.1:9559)")
    p.add_argument("--device-id", type=int, default=d(0), help="the switch's P4Runtime device id (default 0)")
    p.add_argument("--thrift-port", type=int, default=d(9090), help="BMv2 runtime CLI port, for register resets "
                                                                     "(default 9090)")
    p.add_argument("--switch-ip", default=d("10.77.0.253"), help="the address results come from")
    p.add_argument("--switch-mac", default=d("02:a6:6e:00:00:fe"), help="the MAC results come from")


def add_arguments(p) -> None:
    _switch_options(p)
    sub = p.add_subparsers(dest="switch_command", required=True)
    sub.add_parser("load", help="load the aggnet pipeline (the committed BMv2 JSON and P4Info)")
    a = sub.add_parser("add-job", help="install a job: slice, admission, multicast group, uplink")
    a.add_argument("name", help="the job's name, as its workers give it (job=..., AGGNET_JOB)")
    a.add_argument("--member", action="append", required=True, metavar="IP,MAC,PORT",
                   help="a worker, in rank order (its bit is its position)")
    a.add_argument("--slots", type=int, default=128, help="the job's slice of the pool (default %(default)s)")
    a.add_argument("--base", type=int, default=None, help="first slot of the slice (default: first free run)")
    a.add_argument("--uplink", default=None, metavar="PARENT_IP,PARENT_MAC,PORT,RACK_ID",
                   help="send this rack's partial sums to a parent aggregator")
    _parent_options(a, required=False)
    j = sub.add_parser("join-parent", help="join an installed job at the parent for the switch (again after the "
                                           "root restarted)")
    j.add_argument("name", help="the job's name")
    j.add_argument("--slots", type=int, default=128, help="the job's slice on the switch (default %(default)s)")
    j.add_argument("--rack-id", type=int, required=True, help="this rack's number at the root (0..racks-1)")
    j.add_argument("--keep", type=float, default=None, metavar="SECONDS",
                   help="stay, joining again every SECONDS (a restarted root forgot the job) until stopped")
    _parent_options(j, required=True)
    r = sub.add_parser("remove-job", help="remove a job")
    r.add_argument("name", help="the job's name")
    sub.add_parser("jobs", help="list installed jobs")
    sub.add_parser("counters", help="drops by reason, events, completions per job")
    h = sub.add_parser("add-host", help="ordinary forwarding: frames to MAC leave on PORT")
    h.add_argument("mac", help="a host's MAC address, like 02:a6:6e:00:00:01")
    h.add_argument("port", type=int, help="the switch port it is on")
    f = sub.add_parser("flood", help="ports broadcasts are flooded to")
    f.add_argument("ports", type=lambda s: [int(x) for x in s.split(",")], help="switch ports, comma-separated")
    rs = sub.add_parser("reset", help="clear the slot registers of a slice")
    rs.add_argument("--base", type=int, required=True, help="the slice's first slot")
    rs.add_argument("--slots", type=int, required=True, help="the slice's slots")
    for command in sub.choices.values():
        _switch_options(command, defaults=False)


def _parent_options(p, required: bool) -> None:
    p.add_argument("--parent", required=required, default=None, metavar=f"udp://IP:{SWITCH_PORT}",
                   help="the root (a switch-mode aggregator): join the job there on the switch's behalf"
                        + ("" if required else " (with --uplink)"))
    p.add_argument("--racks", type=int, required=required, default=None, help="racks under the root")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the root (default 10)")


def _join_parent(args, name: str, rack_id: int, slots: int) -> dict:
    """Join at the root for the switch (with AGGNET_JOB_KEY's key, where set)."""
    rack = RackAtParent(args.parent, rack_id, args.racks, args.switch_ip)
    return _joined(args, rack_id, join_parent(name, rack, slots, key=job_key_from_env(), timeout=args.timeout))


def _joined(args, rack_id: int, ok) -> dict:
    """What a join printed: where, as which rack, the root's base."""
    return {"parent": args.parent, "rack_id": rack_id, "racks": args.racks, "parent_base": ok.base}


def _keep(args) -> None:
    """Join every --keep seconds until SIGTERM or Ctrl-C (a root not up yet
    is waited for); the first answer is printed as a one-shot join's is."""
    import signal
    import threading

    if args.keep <= 0:
        raise ValueError(f"--keep wants a positive number of seconds, got {args.keep:g}")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    rack = RackAtParent(args.parent, args.rack_id, args.racks, args.switch_ip)
    first = []

    def joined(ok) -> None:
        if not first:
            first.append(ok)
            print(json.dumps({"job": args.name, **_joined(args, args.rack_id, ok)}), flush=True)

    keep_joined(args.name, rack, args.slots, key=job_key_from_env(), every=args.keep, stop=stop, joined=joined,
                say=lambda line: print(f"aggnet switch join-parent: {line}", file=sys.stderr, flush=True))


def _member(text: str) -> Member:
    try:
        ip, mac, port = text.split(",")
        return Member(ip, mac, int(port))
    except ValueError:
        raise SystemExit(f"aggnet switch: --member wants IP,MAC,PORT, got {text!r}") from None


def _uplink(text: str | None) -> Uplink | None:
    if text is None:
        return None
    try:
        ip, mac, port, rack = text.split(",")
        return Uplink(ip, mac, int(port), int(rack))
    except ValueError:
        raise SystemExit(f"aggnet switch: --uplink wants PARENT_IP,PARENT_MAC,PORT,RACK_ID, got {text!r}") from None


class _QuietShell(logging.Filter):
    """p4runtime-shell logs its failures (CRITICAL, on the root logger)
    before the one-line error this command prints about them."""

    def filter(self, record) -> bool:
        return "p4runtime_sh" not in record.pathname


def main(args) -> int:
    logging.getLogger().addFilter(_QuietShell())
    ctl = SwitchControl(args.grpc, args.device_id, switch_ip=args.switch_ip, switch_mac=args.switch_mac,
                        thrift_port=args.thrift_port)
    cmd = args.switch_command
    if cmd == "join-parent":  # the root only: the switch's control plane is not needed
        try:
            if args.keep is not None:
                _keep(args)
            else:
                print(json.dumps({"job": args.name, **_join_parent(args, args.name, args.rack_id, args.slots)}))
        except (ParentJoinError, ValueError) as exc:
            print(f"aggnet switch {cmd}: {exc}", file=sys.stderr)
            return 1
        return 0
    try:
        ctl.connect(load_pipeline=cmd == "load")
        try:
            if cmd == "load":
                print(f"aggnet pipeline loaded into {args.grpc}")
            elif cmd == "add-job":
                uplink = _uplink(args.uplink)
                if (args.parent is None) != (args.racks is None) or (args.parent and uplink is None):
                    raise ValueError("--parent and --racks go together, with --uplink (where the switch sends the "
                                     "rack's partials)")
                if args.parent:
                    RackAtParent(args.parent, uplink.rack_id, args.racks, args.switch_ip).check()
                job = ctl.install_job(args.name, [_member(m) for m in args.member], args.slots, base=args.base,
                                      uplink=uplink)
                out = {"job": job.name, "id": f"{job.job_id:08x}", "row": job.row, "base": job.base,
                       "slots": job.slots, "world": job.world, "group": job.group}
                if args.parent:
                    try:
                        out.update(_join_parent(args, job.name, uplink.rack_id, job.slots))
                    except ParentJoinError:
                        ctl.remove_job(job.name)  # all or nothing: a job the root lacks cannot complete
                        raise
                print(json.dumps(out))
            elif cmd == "remove-job":
                print(json.dumps({"job": args.name, "entries_removed": ctl.remove_job(args.name)}))
            elif cmd == "jobs":
                print(json.dumps([{"id": f"{j.job_id:08x}", "row": j.row, "base": j.base, "slots": j.slots,
                                   "world": j.world} for j in ctl.jobs()], indent=1))
            elif cmd == "counters":
                print(json.dumps(ctl.counters(), indent=1))
            elif cmd == "add-host":
                ctl.add_host(args.mac, args.port)
            elif cmd == "flood":
                ctl.set_flood(args.ports)
            elif cmd == "reset":
                ctl.reset_slice(args.base, args.slots)
        finally:
            ctl.close()
    except (SwitchControlError, ParentJoinError, ValueError) as exc:
        print(f"aggnet switch {cmd}: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # a P4Runtime or gRPC error the checks above did not foresee
        print(f"aggnet switch {cmd}: the switch refused it ({type(exc).__name__}: {_one_line(exc)}); "
              f"`aggnet switch jobs` shows what is installed", file=sys.stderr)
        return 1
    return 0
