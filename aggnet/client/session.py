"""A worker's conversation with an aggregator, written once for every
client kind.

Every kind asks and waits the same way: a request goes to some endpoints
(HELLO to a service's control endpoint, JOIN to each shard, STATS to
either kind), unanswered ones are sent again now and then (a transport may
lose the first while a service starts, and datagrams are lost anyway), and
each endpoint's first answer of the wanted type is taken. An ERROR ends
the wait as the one exception its code maps to, the same exception
whichever kind of aggregator sent it. LEAVE is said the same way, its echo
awaited briefly, since a connection closed right behind its last message
may lose it.
"""

from __future__ import annotations

import time
from typing import Callable

from aggnet.errors import AggnetError, AggregationError, AggregationTimeout, AggregatorUnreachable, JobMismatch
from aggnet.protocol import wire
from aggnet.protocol.wire import ErrorCode, Header, MsgType
from aggnet.transport import TransportError

#: seconds between sends of a request that has not been answered
RESEND_INTERVAL = 0.5

#: an aggregator's ERROR code -> what the worker raises; anything else is
#: an AggregationError
ERROR_TYPES: dict[str, type[AggnetError]] = {
    ErrorCode.STALL.value: AggregationTimeout,
    ErrorCode.JOB_MISMATCH.value: JobMismatch,
}


def error_type(code: str) -> type[AggnetError]:
    return ERROR_TYPES.get(code, AggregationError)


def wire_error(payload, where: str) -> AggnetError:
    """The exception an ERROR payload stands for, its text behind ``where``
    (which job, which aggregator, which request)."""
    code, text = wire.parse_error(payload)
    return error_type(code)(f"{where}: {text}")


def next_message(conn, timeout: float):
    """The next message and its header, or None (nothing within ``timeout``,
    or a malformed header, which a caller waiting for replies ignores)."""
    msg = conn.recv(timeout)
    if msg is None:
        return None
    try:
        return msg, wire.unpack_header(msg.header)
    except wire.WireError:
        return None


def request_reply(conn, endpoints: list[int], header: Header, payload, want: MsgType, deadline: float, *,
                  where: Callable[[int], str], unreachable: Callable[[list[int]], Exception],
                  dropped: Callable[[], None] = lambda: None) -> dict[int, dict]:
    """Send ``header`` (and ``payload``) to each of ``endpoints`` of
    ``conn`` until each has answered with ``want``; returns each answer's
    JSON by endpoint. An ERROR raises (``where(endpoint)`` says who
    refused); no answer by ``deadline`` raises ``unreachable(missing)``.
    An ERROR about a numbered round is a late answer to a round that
    already failed, not to this request, and is ``dropped()`` like a
    malformed answer."""
    replies: dict[int, dict] = {}
    packed = header.pack() if payload is None else header.pack_for(payload)
    next_send = 0.0
    while len(replies) < len(endpoints):
        now = time.monotonic()
        if now >= deadline:
            raise unreachable([e for e in endpoints if e not in replies])
        if now >= next_send:
            for e in endpoints:
                if e not in replies:
                    try:
                        conn.send(e, packed, payload)
                    except TransportError:
                        pass  # no connection yet (or a refused handshake): the deadline decides
            next_send = time.monotonic() + RESEND_INTERVAL
        got = next_message(conn, min(RESEND_INTERVAL, deadline - now))
        refused = {e: why for e, why in conn.refused().items() if e in endpoints and e not in replies}
        if refused:
            # no wait makes a missing or wrong key work: say so now
            e, why = next(iter(refused.items()))
            raise AggregatorUnreachable(f"{where(e)}: {why}")
        if got is None:
            continue
        msg, h = got
        if h.msg_type == MsgType.ERROR and h.round:
            dropped()
            continue
        if h.msg_type == MsgType.ERROR:
            raise wire_error(msg.payload, where(msg.peer))
        if h.msg_type == want and msg.peer in endpoints:
            try:
                replies[msg.peer] = wire.parse_json(msg.payload)
            except wire.WireError:
                dropped()
    return replies


def leave(conn, header: Header, timeout: float, echo_awaited: bool = True) -> None:
    """Say LEAVE to every endpoint of ``conn`` and, unless another thread
    reads the connection (``echo_awaited=False``), wait up to ``timeout``
    for each endpoint's echo."""
    packed = header.pack()
    waiting = set()
    for i in range(len(conn.addresses)):
        try:
            conn.send(i, packed)
            waiting.add(i)
        except TransportError:
            pass
    if not echo_awaited:
        return
    deadline = time.monotonic() + timeout
    while waiting and time.monotonic() < deadline:
        got = next_message(conn, deadline - time.monotonic())
        if got is not None and got[1].msg_type == MsgType.LEAVE and got[1].job_id == header.job_id:
            waiting.discard(got[0].peer)
