"""``aggnet`` command line: serve, stats, bench, demo."""

from __future__ import annotations

import argparse
import importlib
import sys


#: commands whose module provides add_arguments(parser) and main(args):
#: (name, module, help); imported when the parser is built
MODULE_COMMANDS = (
    ("serve", "aggnet.cli.serve", "run an aggregator (service or switch mode)"),
    ("stats", "aggnet.cli.stats", "print a running aggregator's counters"),
    ("up", "aggnet.deploy.up", "start the aggregators a topology file places on this machine; install its P4 jobs"),
    ("down", "aggnet.deploy.down", "stop what aggnet up started for a topology file"),
    ("k8s", "aggnet.deploy.k8s", "a topology's aggregators as Kubernetes manifests (needs aggnet[k8s])"),
    ("job", "aggnet.cli.jobs", "job keys: aggnet job create NAME --keys FILE"),
    ("bench", "aggnet.bench.allreduce", "all-reduce benchmark: aggnet beside gloo and memory copy"),
    ("bench-ddp", "aggnet.bench.ddp", "DDP step time with the aggnet hook beside gloo"),
    ("bench-gpu", "aggnet.bench.gpu", "the device codec's kernels beside a device-to-device copy (needs a CUDA GPU)"),
    ("bench-udp", "aggnet.bench.udp", "switch-protocol client datagram rate beside a raw Python UDP loop"),
    ("bench-sparse", "aggnet.bench.sparse",
     "an embedding table's step time and bytes per worker: aggnet PS and all-reduce tables beside gloo"),
    ("bench-spectrain", "aggnet.bench.spectrain",
     "SpecTrain in small: weight prediction error, pipeline modes, stale-gradient data parallelism"),
    ("soak", "aggnet.bench.soak", "many all-reduces at a loss rate: RSS and open fds of every process, start to end"),
    ("bench-transport", "aggnet.bench.transports", "point-to-point throughput: UCX beside ZeroMQ tcp and ipc"),
    ("switch", "aggnet.p4.cli", "the P4 switch's control plane (P4Runtime; needs aggnet[p4])"),
    ("emulate", "aggnet.emulation.cli", "run inside an emulated rack (network namespaces; needs root)"),
    ("demo", "aggnet.demo", "train a small model with DDP through aggnet"),
    ("plan", "aggnet.cli.plan",
     "place a model on a topology: hybrid pipeline stages or data parallelism, by bytes and predicted step time"),
    ("tune", "aggnet.cli.tune", "pick a sparse table's partition count: Parallax's cost model over measured steps"),
    ("pcap", "aggnet.cli.pcap", "decode the aggnet messages of a packet capture (needs aggnet[pcap])"),
    ("fuzz", "aggnet.cli.fuzz", "send hostile datagrams or messages at an aggregator, then show its drop counters"),
    ("sim", "aggnet.sim.cli",
     "predict all-reduce and step times for aggnet and its peers on fabrics of thousands of workers"),
    ("compare", "aggnet.bench.compare",
     "one benchmark under two or more settings or revisions, alternated, with the ratio of each pair of runs"),
    ("plot", "aggnet.bench.plots", "draw a benchmark's figure from the JSON it wrote (needs aggnet[plot])"),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="aggnet", description="Gradient aggregation as a network service.")
    sub = p.add_subparsers(dest="command", required=True)

    for name, module_name, text in MODULE_COMMANDS:
        module = importlib.import_module(module_name)
        cmd = sub.add_parser(name, help=text)
        module.add_arguments(cmd)
        cmd.set_defaults(func=module.main)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        # Ctrl-C is the user's own doing: what was stopped, not a traceback
        print(f"aggnet {args.command}: interrupted", file=sys.stderr)
        return 130
