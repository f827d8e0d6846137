"""``aggnet stats ADDRESS``: a running aggregator's counters.

With job keys, an aggregator shows a job's table only to a STATS signed
with that job's key (``--job NAME``, key from AGGNET_JOB_KEY) and every
job's to the admin key (``--admin-keys FILE``); anyone sees the totals.
"""

from __future__ import annotations

import json
import os
import sys

from . import keys, wire
from .errors import AggnetError, AggregatorUnreachable


def add_arguments(p) -> None:
    p.add_argument("address", help="the aggregator's address (its control endpoint; udp:// for switch mode)")
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--job", default=None, help="show this job (signed with AGGNET_JOB_KEY)")
    p.add_argument("--admin-keys", default=None, metavar="FILE", help="keys file holding the admin key: all jobs")
    p.add_argument("--server-key", default=os.environ.get("AGGNET_SERVER_KEY"),
                   help="the service's CURVE public key (zmq+tcp with CURVE)")


def stats_request(job: str | None = None, job_key: bytes | None = None, admin_key: bytes | None = None) -> bytes:
    """The payload of a STATS that asks for a job's (or every job's) table."""
    if admin_key is not None:
        return wire.json_payload({"admin": keys.sign(admin_key, "STATS", 0, 0, 0, {})})
    if job is not None and job_key is not None:
        return wire.json_payload({"job": job, "auth": keys.sign(job_key, "STATS", 0, 0, 0, {"job": job})})
    return b""


def query(address: str, timeout: float = 5.0, payload: bytes = b"", server_key: str | None = None) -> dict:
    """STATS of an aggregator of either kind; raises AggnetError naming why not."""
    if address.startswith("udp://"):
        from .switch_client import query_stats

        return query_stats(address, timeout, payload)
    from .transport import TransportError, connect

    options = {}
    if server_key:
        from .transport.zmq import Curve

        options["curve"] = Curve(server_key.encode())
    try:
        with connect([address], **options) as conn:
            conn.send(0, wire.Header(wire.MsgType.STATS).pack_for(payload), payload or None)
            msg = conn.recv(timeout)
    except (TransportError, ValueError) as exc:
        raise AggregatorUnreachable(f"cannot reach {address}: {exc}") from None
    if msg is None:
        raise AggregatorUnreachable(f"no answer from {address} within {timeout:g}s: is `aggnet serve --listen "
                                    f"{address}` running?")
    try:
        h = wire.unpack_header(msg.header)
        if h.msg_type == wire.MsgType.ERROR:
            raise AggnetError(f"{address} refused STATS: {wire.parse_error(msg.payload)[1]}")
        return wire.parse_json(msg.payload)
    except wire.WireError as exc:
        raise AggnetError(f"{address} answered STATS with a malformed message: {exc}") from None


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
