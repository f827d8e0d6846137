"""STATS of a running aggregator of either kind: the request (signed for
a job's table or for every job's) and the query (``aggnet stats``,
``aggnet up`` checking what it started, the fuzzer reading drop counters).
"""

from __future__ import annotations

import time

from aggnet.client import session
from aggnet.errors import AggnetError, AggregatorUnreachable
from aggnet.protocol import keys, wire
from aggnet.transport import TransportError, connect


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
        from aggnet.client.switch import query_stats

        return query_stats(address, timeout, payload)
    options = {}
    if server_key:
        from aggnet.transport.zmq import Curve

        options["curve"] = Curve(server_key.encode())

    def unreachable(_missing) -> AggnetError:
        return AggregatorUnreachable(f"no answer from {address} within {timeout:g}s: is `aggnet serve --listen "
                                     f"{address}` running?")

    try:
        with connect([address], **options) as conn:
            return session.request_reply(conn, [0], wire.Header(wire.MsgType.STATS), payload or None,
                                         wire.MsgType.STATS_OK, time.monotonic() + timeout,
                                         where=lambda _: f"{address} refused STATS", unreachable=unreachable)[0]
    except (TransportError, ValueError) as exc:
        raise AggregatorUnreachable(f"cannot reach {address}: {exc}") from None
