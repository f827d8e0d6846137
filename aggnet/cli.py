"""``aggnet`` command line: serve, stats, bench, demo."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import signal
import sys


def _serve(args) -> int:
    from aggnet.hosts import service

    logging.basicConfig(level=getattr(logging, args.log_level), stream=sys.stderr,
                        format="%(asctime)s aggnet %(levelname)s %(message)s")
    args.listen_given = args.listen is not None
    if args.listen is None:
        args.listen = "zmq+tcp://0.0.0.0:5555"
    if args.mode == "switch":
        if args.listen_given and not args.listen.startswith("udp://"):
            print(f"aggnet serve: switch mode listens on udp://host:port, not {args.listen}", file=sys.stderr)
            return 2
        return _serve_switch(args)
    if args.listen.startswith("udp://"):
        print("aggnet serve: udp:// addresses speak the switch protocol: add --mode switch", file=sys.stderr)
        return 2
    try:
        svc = service.start(args.listen, args.shards, getattr(logging, args.log_level))
    except Exception as exc:
        print(f"aggnet serve: {exc}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: svc.stop_event.set())
    signal.signal(signal.SIGINT, lambda *_: svc.stop_event.set())
    # one line on stdout says where it serves: launchers wait for it
    print(f"aggnet serving {svc.address} shards={len(svc.shards)} pid={__import__('os').getpid()}", flush=True)
    svc.run(parent_pid=args.parent_pid)
    logging.getLogger("aggnet").info("aggnet service stopped")
    logging.shutdown()
    sys.stdout.flush()
    # nothing is left to do: skip interpreter teardown, where transport
    # libraries' finalizers (UCX's) can block
    import os

    os._exit(0)


def _serve_switch(args) -> int:
    import os
    import threading

    from aggnet.hosts.service import default_shards
    from aggnet.hosts.switch import SwitchService
    from aggnet.protocol import DEFAULT_HOST_ELEMENTS, SWITCH_PORT

    listen = args.listen if args.listen_given else f"udp://0.0.0.0:{SWITCH_PORT}"
    shards = args.shards or default_shards()
    try:
        svc = SwitchService(listen, pool=args.pool, elements=args.elements or DEFAULT_HOST_ELEMENTS,
                            max_elements=args.max_elements, parent=args.parent, rack_id=args.rack_id,
                            racks=args.racks, reclaim_idle=args.reclaim_idle, shards=shards, io=args.io)
    except Exception as exc:
        print(f"aggnet serve: {exc}", file=sys.stderr)
        return 1
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    logging.getLogger("aggnet").info(
        "aggnet switch-mode aggregator at %s: %d shard(s) on ports %d..%d, pool %d slots, %d elements per packet "
        "by default (at most %d), UDP I/O %s%s", svc.address, svc.shards, svc.address.port,
        svc.address.port + svc.shards - 1, args.pool, svc.default_elements, svc.regs.max_elements, svc.io,
        f", rack {args.rack_id} of {args.racks} under {args.parent}" if args.parent else "")
    print(f"aggnet serving {svc.address} shards={svc.shards} pid={os.getpid()}", flush=True)
    parent_pid = args.parent_pid

    def should_stop() -> bool:
        if parent_pid is not None:
            try:
                os.kill(parent_pid, 0)
            except ProcessLookupError:
                return True
        return stop.is_set()

    try:
        svc.serve(should_stop)
    finally:
        svc.close()
    logging.getLogger("aggnet").info("aggnet switch-mode aggregator stopped")
    return 0


def _stats(args) -> int:
    from aggnet import wire
    from aggnet.transport import connect

    if args.address.startswith("udp://"):
        from aggnet.switch_client import query_stats

        try:
            print(json.dumps(query_stats(args.address, args.timeout), indent=2))
        except Exception as exc:
            print(f"aggnet stats: {exc}", file=sys.stderr)
            return 1
        return 0
    h = wire.Header(wire.MsgType.STATS).pack()
    with connect([args.address]) as conn:
        conn.send(0, h)
        msg = conn.recv(args.timeout)
    if msg is None:
        print(f"aggnet stats: no answer from {args.address} within {args.timeout:g}s", file=sys.stderr)
        return 1
    print(json.dumps(wire.parse_json(msg.payload), indent=2))
    return 0


#: commands whose module provides add_arguments(parser) and main(args):
#: (name, module, help); imported when the parser is built
MODULE_COMMANDS = (
    ("bench", "aggnet.bench.allreduce", "all-reduce benchmark: aggnet beside gloo and memory copy"),
    ("bench-ddp", "aggnet.bench.ddp", "DDP step time with the aggnet hook beside gloo"),
    ("bench-udp", "aggnet.bench.udp", "switch-protocol client datagram rate beside a raw Python UDP loop"),
    ("bench-transport", "aggnet.bench.transports", "point-to-point throughput: UCX beside ZeroMQ tcp and ipc"),
    ("switch", "aggnet.p4.cli", "the P4 switch's control plane (P4Runtime; needs aggnet[p4])"),
    ("emulate", "aggnet.emulation.cli", "run inside an emulated rack (network namespaces; needs root)"),
    ("demo", "aggnet.demo", "train a small model with DDP through aggnet"),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="aggnet", description="Gradient aggregation as a network service.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run an aggregator service")
    s.add_argument("--listen", default=None,
                   help="control address (zmq+tcp://host:port, zmq+ipc:///path, shm:///path; "
                        "udp://host:port with --mode switch); default zmq+tcp://0.0.0.0:5555, "
                        "or udp://0.0.0.0:42606 in switch mode")
    s.add_argument("--mode", choices=["service", "switch"], default="service",
                   help="service: sharded aggregator (chunks over messages); switch: the switch protocol "
                        "over UDP, standing in for a ToR switch or serving as a parent (docs/protocol.md)")
    s.add_argument("--pool", type=int, default=4096, help="switch mode: slots in the pool (default %(default)s)")
    s.add_argument("--elements", type=int, default=None,
                   help="switch mode: int32 elements per packet for jobs that do not ask (default 2048: 8240-byte "
                        "datagrams, for jumbo frames; a worker whose path MTU is smaller gets what fits it)")
    s.add_argument("--max-elements", type=int, default=None,
                   help="switch mode: the most elements per packet a job may ask for (default: 2048 or --elements)")
    s.add_argument("--io", choices=["gso", "mmsg", "plain"], default=None,
                   help="switch mode: batching of UDP I/O (default: the best the kernel offers; AGGNET_UDP_IO)")
    s.add_argument("--parent", default=None, help="switch mode: parent aggregator (udp://host:port) for racks")
    s.add_argument("--rack-id", type=int, default=0, help="switch mode: this rack's id at its parent")
    s.add_argument("--racks", type=int, default=1, help="switch mode: racks under the parent")
    s.add_argument("--reclaim-idle", type=float, default=300.0, metavar="SECONDS",
                   help="switch mode: when the pool is full, a new job takes the slices of jobs that sent "
                        "nothing for this long (workers killed without LEAVE); default %(default)g")
    s.add_argument("--shards", type=int, default=None, help="shard processes (default: one per core)")
    s.add_argument("--parent-pid", type=int, default=None, help="stop when this process is gone")
    s.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    s.set_defaults(func=_serve)

    st = sub.add_parser("stats", help="print a running service's counters")
    st.add_argument("address")
    st.add_argument("--timeout", type=float, default=5.0)
    st.set_defaults(func=_stats)

    for name, module_name, text in MODULE_COMMANDS:
        module = importlib.import_module(module_name)
        cmd = sub.add_parser(name, help=text)
        module.add_arguments(cmd)
        cmd.set_defaults(func=module.main)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
