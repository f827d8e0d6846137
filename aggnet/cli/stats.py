"""``aggnet stats ADDRESS``: a running aggregator's counters.

With job keys, an aggregator shows a job's table only to a STATS signed
with that job's key (``--job NAME``, key from AGGNET_JOB_KEY) and every
job's to the admin key (``--admin-keys FILE``); anyone sees the totals.
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
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--job", default=None, help="show this job (signed with AGGNET_JOB_KEY)")
    p.add_argument("--admin-keys", default=None, metavar="FILE", help="keys file holding the admin key: all jobs")
    p.add_argument("--server-key", default=os.environ.get("AGGNET_SERVER_KEY"),
                   help="the service's CURVE public key (zmq+tcp with CURVE)")


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
        print(json.dumps(query(args.address, args.timeout, stats_request(args.job, job_key, admin),
                               args.server_key), indent=2))
    except (AggnetError, ValueError, OSError) as exc:
        print(f"aggnet stats: {exc}", file=sys.stderr)
        return 1
    return 0
