"""``aggnet stats ADDRESS``: a running aggregator's counters.

With job keys, an aggregator shows a job's table only to a STATS signed
with that job's key (``--job NAME``, key from AGGNET_JOB_KEY) and every
job's to the admin key (``--admin-keys FILE``); anyone sees the totals.

A person gets a short summary (the aggregator, its totals and drops, one
line per job and per shard); ``--json`` prints the whole reply for
programs.
"""

from __future__ import annotations

import json
import os
import sys

from aggnet.client.stats import query, stats_request
from aggnet.errors import AggnetError
from aggnet.protocol import keys


def add_arguments(p) -> None:
    p.add_argument("address", help="the aggregator's address (its control endpoint; udp:// for switch mode)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the whole reply as JSON instead of a summary")
    p.add_argument("--job", default=None, help="show this job (signed with AGGNET_JOB_KEY)")
    p.add_argument("--admin-keys", default=None, metavar="FILE", help="keys file holding the admin key: all jobs")
    p.add_argument("--server-key", default=os.environ.get("AGGNET_SERVER_KEY"),
                   help="the service's CURVE public key (zmq+tcp with CURVE)")


def _size(n) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _counters(c: dict) -> str:
    """Counters as "name value" pairs, bytes readable, drops apart."""
    parts = []
    for k, v in sorted(c.items()):
        if k.startswith("dropped_") or k.endswith("_seconds"):
            continue
        parts.append(f"{k} {_size(v) if k.startswith('bytes') or k.endswith('_bytes') else v}")
    return ", ".join(parts) or "none"


def _drops(c: dict) -> str:
    drops = {k[len("dropped_"):]: v for k, v in c.items() if k.startswith("dropped_") and v}
    return ", ".join(f"{k} {v}" for k, v in sorted(drops.items())) or "none"


def _memory(m: dict) -> str:
    """A shard's memory, and what its tcp:// budgets hold, for a person."""
    parts = []
    if m.get("rss_bytes") is not None:
        parts.append(f"resident {_size(m['rss_bytes'])} (peak {_size(m.get('peak_rss_bytes', 0))})")
    if m.get("receive_budget"):
        parts.append(f"reading {_size(m.get('receiving_bytes', 0))} of {_size(m['receive_budget'])}, unsent "
                     f"{_size(m.get('unsent_bytes', 0))} of {_size(m.get('unsent_budget', 0))}, streams "
                     f"{m.get('streams', 0)} of {m.get('max_streams', 0)}")
    return "; " + ", ".join(parts) if parts else ""


def summary(address: str, r: dict) -> str:
    """A running aggregator's STATS reply, for a person."""
    lines = []
    totals = r.get("totals", {})
    if r.get("mode") == "switch":
        lines.append(f"aggnet switch-mode aggregator at {r.get('address', address)}: {r.get('shards', 1)} shard(s), "
                     f"pool {r.get('pool_used', 0)}/{r.get('pool')} slots used, {r.get('elements')} values per "
                     f"packet, UDP I/O {r.get('io')}")
        jobs = r.get("jobs", {})
    else:
        shards = [s for s in r.get("shards", []) if s]
        advertised = r.get("service", {}).get("shards") or []
        lines.append(f"aggnet service at {address}: {len(r.get('shards', []))} shard(s) at "
                     f"{', '.join(advertised) or '?'}; {r.get('restarts', 0)} restart(s)")
        jobs = {}
        for s in shards:
            for name, j in s.get("jobs", {}).items():
                agg = jobs.setdefault(name, {"world": j.get("world"), "members": set(), "open_slots": 0,
                                             "counters": {}})
                agg["members"].update(j.get("members", []))
                agg["open_slots"] += j.get("open_slots", 0)
                for k, v in j.get("counters", {}).items():
                    agg["counters"][k] = agg["counters"].get(k, 0) + v
        if totals.get("sum_seconds"):
            lines.append(f"summing: {totals.get('sum_bytes', 0) / totals['sum_seconds'] / 1e9:.2f} GB/s of "
                         f"contributions per CPU-second")
    lines.append(f"totals: {_counters(totals)}")
    lines.append(f"drops: {_drops(totals)}")
    if jobs:
        lines.append("jobs:")
        for name, j in sorted(jobs.items()):
            members = sorted(j.get("members", []))
            extra = (f", slots {j['base']}..{j['base'] + j['slots'] - 1}" if "base" in j and "slots" in j else
                     f", open slots {j.get('open_slots', 0)}")
            lines.append(f"  {name}: world {j.get('world')}, members {members}{extra}; "
                         f"{_counters(j.get('counters', {}))}")
    else:
        lines.append("jobs: none (or none this request may see: --job NAME, --admin-keys FILE)")
    if r.get("mode") != "switch":
        lines.append("shards:")
        for i, s in enumerate(r.get("shards", [])):
            if not s:
                lines.append(f"  {i}: not answering (restarting?)")
                continue
            c = s.get("counters", {})
            lines.append(f"  {s.get('shard', i)}: {s.get('address')} pid {s.get('pid')}; messages "
                         f"{c.get('messages', 0)}, results {c.get('results', 0)}, drops {_drops(c)}"
                         f"{_memory(s.get('memory') or {})}")
    lines.append("(--json: the whole reply)")
    return "\n".join(lines)


def main(args) -> int:
    try:
        admin = None
        if args.admin_keys:
            ring = keys.Keyring.load(args.admin_keys)
            if ring.admin is None:
                raise ValueError(f"{args.admin_keys} holds no admin key (aggnet job admin --keys FILE)")
            admin = ring.admin
        job_key = keys.parse_key(os.environ["AGGNET_JOB_KEY"]) if args.job and os.environ.get("AGGNET_JOB_KEY") \
            else None
        if args.job and job_key is None and admin is None:
            raise ValueError("--job needs the job's key in AGGNET_JOB_KEY")
        reply = query(args.address, args.timeout, stats_request(args.job, job_key, admin), args.server_key)
        print(json.dumps(reply, indent=2) if args.json else summary(args.address, reply))
    except (AggnetError, ValueError, OSError) as exc:
        print(f"aggnet stats: {exc}", file=sys.stderr)
        return 1
    return 0
