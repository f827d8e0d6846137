"""``aggnet pcap FILE``: the aggnet messages of a packet capture, one line
each, and what they add up to per message type, to see on the wire what a
job's workers and its aggregator said to each other (a capture of an
emulated rack, ``tcpdump -w`` on a worker or an aggregator)."""

from __future__ import annotations

import sys
from collections import defaultdict

from aggnet.protocol.wire import ITEMSIZE, Flag


def add_arguments(p) -> None:
    p.add_argument("file", help="a pcap or pcapng capture")
    p.add_argument("--summary", action="store_true", help="only the totals per message type")


def _name(value) -> str:
    return getattr(value, "name", None) or str(value)


def _flags(flags: Flag) -> str:
    return "|".join(f.name for f in Flag if f and f in flags) or "-"


def format_message(m: dict, t0: float) -> str:
    return (f"{m['time'] - t0:10.6f} {m['src']}:{m['sport']} > {m['dst']}:{m['dport']} {_name(m['msg_type']):<8} "
            f"job={m['job_id']:08x} round={m['round']} index={m['index']} count={m['count']} nsum={m['nsum']} "
            f"world={m['world']} flags={_flags(m['flags'])}")


def main(args) -> int:
    from aggnet.protocol.pcap import decode_pcap

    try:
        msgs = decode_pcap(args.file)
    except ImportError as exc:
        print(f"aggnet pcap: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"aggnet pcap: cannot read {args.file}: {exc}", file=sys.stderr)
        return 1
    totals = defaultdict(lambda: [0, 0, 0])  # messages, payload bytes, retransmissions
    t0 = msgs[0]["time"] if msgs else 0.0
    for m in msgs:
        if not args.summary:
            print(format_message(m, t0))
        row = totals[_name(m["msg_type"])]
        row[0] += 1
        row[1] += m["count"] * ITEMSIZE.get(m["dtype"], 1)
        row[2] += bool(m["flags"] & Flag.RETRANSMIT)
    if not args.summary and msgs:
        print()
    print(f"{len(msgs)} aggnet messages in {args.file}")
    if totals:
        print(f"{'type':<10}{'messages':>10}{'bytes':>14}{'resent':>8}")
        for name, (n, nbytes, resent) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
            print(f"{name:<10}{n:>10}{nbytes:>14}{resent:>8}")
    return 0
