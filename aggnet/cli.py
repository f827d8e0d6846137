"""``aggnet`` command line: serve, stats, bench, demo."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys


def _serve(args) -> int:
    from aggnet.hosts import service

    logging.basicConfig(level=getattr(logging, args.log_level), stream=sys.stderr,
                        format="%(asctime)s aggnet %(levelname)s %(message)s")
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
    return 0


def _stats(args) -> int:
    from aggnet import wire
    from aggnet.transport import connect

    h = wire.Header(wire.MsgType.STATS).pack()
    with connect([args.address]) as conn:
        conn.send(0, h)
        msg = conn.recv(args.timeout)
    if msg is None:
        print(f"aggnet stats: no answer from {args.address} within {args.timeout:g}s", file=sys.stderr)
        return 1
    print(json.dumps(wire.parse_json(msg.payload), indent=2))
    return 0


def _bench(args) -> int:
    from aggnet.bench import allreduce

    return allreduce.main(args)


def _bench_ddp(args) -> int:
    from aggnet.bench import ddp

    return ddp.main(args)


def _demo(args) -> int:
    from aggnet import demo

    return demo.main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="aggnet", description="Gradient aggregation as a network service.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run an aggregator service")
    s.add_argument("--listen", default="zmq+tcp://0.0.0.0:5555",
                   help="control address (zmq+tcp://host:port, zmq+ipc:///path); default %(default)s")
    s.add_argument("--shards", type=int, default=None, help="shard processes (default: one per core)")
    s.add_argument("--parent-pid", type=int, default=None, help="stop when this process is gone")
    s.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    s.set_defaults(func=_serve)

    st = sub.add_parser("stats", help="print a running service's counters")
    st.add_argument("address")
    st.add_argument("--timeout", type=float, default=5.0)
    st.set_defaults(func=_stats)

    from aggnet.bench import allreduce

    b = sub.add_parser("bench", help="all-reduce benchmark: aggnet beside gloo and memory copy")
    allreduce.add_arguments(b)
    b.set_defaults(func=_bench)

    from aggnet.bench import ddp

    bd = sub.add_parser("bench-ddp", help="DDP step time with the aggnet hook beside gloo")
    ddp.add_arguments(bd)
    bd.set_defaults(func=_bench_ddp)

    from aggnet import demo

    d = sub.add_parser("demo", help="train a small model with DDP through aggnet")
    demo.add_arguments(d)
    d.set_defaults(func=_demo)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
