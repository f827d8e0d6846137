"""``aggnet fuzz --hoard``: peers that try to make a tcp:// service hold
memory, and a check that each shard held no more than its budgets allow.

Malformed messages cost a shard a drop each; what can take it down is
memory that well-formed streams make it hold. Two kinds of peer, per shard:

* hoarders announce the largest payload a listener takes, send all of it
  but the last MiB and hold the stream open: a listener that gave every
  announced payload a buffer would hold them all (the receive budget makes
  the rest wait, unread, in the kernel's buffers);
* deaf members join a job of their own (world 1, so that every chunk they
  push comes straight back), push the largest chunks and read nothing: a
  listener that queued every reply would hold them all (the unsent budget
  closes the peer holding the most).

Deaf members go first, hoarders second. The shards' peak resident memory
(STATS, ``memory.peak_rss_bytes``) is read before and after; a shard that
grew past its budgets and a few messages of working room is a problem.
"""

from __future__ import annotations

import itertools
import random
import select
import socket
import time

from aggnet.protocol import wire
from aggnet.protocol.limits import MAX_MESSAGE_BYTES
from aggnet.protocol.wire import DType, Flag, Header, MsgType
from aggnet.transport.tcp import GREETING, frame_head

#: room a shard may grow by beyond its two budgets under the hoard: the
#: payloads it is summing and the buffers its pools keep
WORKING_ROOM = 4 * MAX_MESSAGE_BYTES
#: hoarders per shard beyond those its receive budget holds at once
EXTRA_HOARDERS = 8
#: deaf members per shard (one alone meets the per-peer bound first)
DEAF_MEMBERS = 3
#: seconds without a byte taken by the target after which the hoard holds
#: what it has: the shards took all they will
QUIET = 2.0
class _Peer:
    """One raw stream and the views it has yet to send (sent as the socket
    takes them: a shard that stops reading leaves them unsent)."""

    def __init__(self, host: str, port: int, parts: list):
        self.sock = socket.create_connection((host, port), timeout=5)
        self.sock.setblocking(False)
        self.parts = [memoryview(GREETING), *parts]
        self.sent = 0
        self.closed_by_target = False

    def pump(self) -> bool:
        """Send what the socket takes; True while something is left."""
        while self.parts:
            try:
                n = self.sock.send(self.parts[0])
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:  # the target closed it
                self.closed_by_target = True
                self.parts = []
                return False
            self.sent += n
            self.parts[0] = self.parts[0][n:]
            if not self.parts[0].nbytes:
                self.parts.pop(0)
        return False

    def close(self) -> None:
        self.sock.close()


def _hoarder(host: str, port: int, zeros: memoryview) -> _Peer:
    h = Header(MsgType.PUSH).pack()
    return _Peer(host, port, [memoryview(frame_head(h, MAX_MESSAGE_BYTES)), zeros[:MAX_MESSAGE_BYTES - (1 << 20)]])


def _deaf_member(host: str, port: int, zeros: memoryview, job_id: int, pushes: int) -> _Peer:
    join = wire.json_payload({"name": f"fuzz-hoard-{job_id:08x}", "timeout": 30.0})
    jh = Header(MsgType.JOIN, job_id=job_id, sender=0, world=1).pack_for(join)
    parts = [memoryview(frame_head(jh, len(join))), memoryview(join)]
    count = MAX_MESSAGE_BYTES // 4
    for i in range(pushes):
        ph = Header(MsgType.PUSH, job_id=job_id, round=0, index=i, sender=0, flags=Flag.LITTLE_ENDIAN,
                    dtype=DType.FLOAT32, count=count, world=1, offset=i * count).pack()
        parts += [memoryview(frame_head(ph, MAX_MESSAGE_BYTES)), zeros]
    return _Peer(host, port, parts)


def _shard_memory(address: str) -> list[dict]:
    from aggnet.client.stats import query

    return [(s or {}).get("memory") or {} for s in query(address, timeout=5.0).get("shards", [])]


def _run(phase: str, peers: list, seconds: float, progress) -> None:
    """Move the peers' bytes until each sent all it had or was closed, the
    target took nothing for QUIET seconds, or ``seconds`` passed."""
    deadline = time.monotonic() + seconds
    next_report = time.monotonic() + 1.0
    moved, last_move = 0, time.monotonic()
    while (now := time.monotonic()) < deadline:
        busy = [p for _, p in peers if p.pump()]
        sent = sum(p.sent for _, p in peers)
        if sent != moved:
            moved, last_move = sent, now
        if not busy or now - last_move > QUIET:
            break
        if progress is not None and now >= next_report:
            next_report += 1.0
            progress(phase, sent, sum(p.closed_by_target for _, p in peers))
        select.select([], [p.sock for p in busy], [], 0.05)
    for _, p in peers:  # a stream the target closed shows once its end is written to
        p.pump()


def hoard_campaign(address: str, seconds: float = 30.0, progress=None) -> dict:
    """Run the hoard at the tcp:// service at ``address``: deaf members
    first, then hoarders (a hoarder holding the receive budget would keep
    the deaf members' chunks waiting), each phase for at most ``seconds``;
    then close every peer. Returns, per shard, its budgets and peak resident
    memory before and after, and what the peers sent and how many the
    service closed."""
    from aggnet.client.stats import query
    from aggnet.protocol.address import parse, reached_via

    control = parse(address)
    if control.scheme != "tcp":
        raise ValueError(f"the hoard is for tcp:// services (their budgets); {address} is {control.scheme}://")
    shards = [reached_via(a, control) for a in query(address, timeout=5.0)["service"]["shards"]]
    before = _shard_memory(address)
    zeros = memoryview(bytes(MAX_MESSAGE_BYTES))
    job_ids = itertools.count(0x40000000 + random.getrandbits(29))  # apart from another hoard's jobs
    deaf: list[tuple[str, _Peer]] = []
    hoarders: list[tuple[str, _Peer]] = []
    try:
        for shard, memory in zip(shards, before):
            unsent = memory.get("unsent_budget") or 1 << 30
            for _ in range(DEAF_MEMBERS):
                deaf.append(("deaf", _deaf_member(shard.host, shard.port, zeros, next(job_ids),
                                                  unsent // MAX_MESSAGE_BYTES + 4)))
        _run("deaf members", deaf, seconds, progress)
        for shard, memory in zip(shards, before):
            receive = memory.get("receive_budget") or 4 * MAX_MESSAGE_BYTES
            for _ in range(receive // MAX_MESSAGE_BYTES + EXTRA_HOARDERS):
                hoarders.append(("hoarder", _hoarder(shard.host, shard.port, zeros)))
        _run("hoarders", hoarders, seconds, progress)
        after = _shard_memory(address)
    finally:
        for _, p in deaf + hoarders:
            p.close()
    peers = deaf + hoarders
    return {
        "peers": {kind: sum(k == kind for k, _ in peers) for kind in ("hoarder", "deaf")},
        "closed_by_target": {kind: sum(k == kind and p.closed_by_target for k, p in peers)
                             for kind in ("hoarder", "deaf")},
        "bytes_sent": sum(p.sent for _, p in peers),
        "shards": [{"receive_budget": b.get("receive_budget"), "unsent_budget": b.get("unsent_budget"),
                    "peak_rss_before": b.get("peak_rss_bytes"), "peak_rss_after": a.get("peak_rss_bytes")}
                   for b, a in zip(before, after)],
    }


def hoard_problems(result: dict) -> list[str]:
    """Shards that grew past their budgets and working room under the hoard."""
    problems = []
    for i, s in enumerate(result["shards"]):
        if s["peak_rss_before"] is None or s["peak_rss_after"] is None or s["receive_budget"] is None:
            problems.append(f"shard {i} does not report its memory and budgets (STATS memory): cannot check it")
            continue
        grew = s["peak_rss_after"] - s["peak_rss_before"]
        bound = s["receive_budget"] + s["unsent_budget"] + WORKING_ROOM
        if grew > bound:
            problems.append(f"shard {i} grew {grew >> 20} MiB under the hoard, past its budgets and working room "
                            f"({bound >> 20} MiB)")
    return problems
