"""A service rack's link to its root: partial sums up, finals down.

A rack served by the sharded service reduces its own workers first; each
complete chunk's partial sum then goes to the root, which sums one partial
per rack, and the final comes back and is handed to the rack's workers as
if the rack had summed it alone. So every rack's uplink carries one partial
per chunk up and one final down: R·S bytes each way across racks for R
racks and an S-byte buffer, whatever the number of workers per rack.

Rack shard ``s`` talks to root shard ``s`` only: workers place chunk ``c``
on shard ``(c + rotation) % shards`` in every rack, so with equal shard
counts a chunk meets the same shard number everywhere, and a shard is one
member (its rack's id) of the root's job. The root is a plain service: it
cannot tell a rack shard from a worker.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from aggnet.protocol import wire
from aggnet.protocol.address import parse, reached_via
from aggnet.hosts.parent import RETRY_INTERVAL, Joins
from aggnet.protocol.limits import MAX_WORKERS
from aggnet.transport import TransportError, connect
from aggnet.protocol.wire import Header, MsgType

log = logging.getLogger("aggnet.hosts.uplink")

#: schemes a root service is reached at from its racks' shards
ROOT_SCHEMES = ("tcp", "zmq+tcp", "zmq+ipc")


@dataclass(frozen=True)
class UplinkConfig:
    """Where a service rack sends its partial sums: its parent's control
    address, its id among the parent's racks and how many there are."""

    parent: str
    rack_id: int
    racks: int

    def __post_init__(self):
        scheme = parse(self.parent).scheme
        if scheme not in ROOT_SCHEMES:
            raise ValueError(f"the parent of a service rack is a service at tcp:// or zmq+tcp://host:port (or "
                             f"zmq+ipc:// on one host), not {self.parent}")
        if not 0 <= self.rack_id < self.racks <= MAX_WORKERS:
            raise ValueError(f"rack id {self.rack_id} of {self.racks} racks: a parent takes 1..{MAX_WORKERS} racks, "
                             f"ids 0..racks-1")


class Uplink:
    """Rack shard ``index`` of ``count``: finds root shard ``index`` (HELLO
    at the root's control endpoint), joins each job there as rack
    ``rack_id`` and carries partials and finals."""

    def __init__(self, config: UplinkConfig, index: int, count: int):
        self.config = config
        self.index = index
        self.count = count
        self.control = connect([config.parent])
        self.data = None  #: connection to root shard ``index`` once known
        self.root_shard: str | None = None
        #: why the root cannot be used (shard counts differ, a bad answer)
        self.error: str | None = None
        self._next_hello = 0.0
        #: job id -> its JOIN (header, payload), sent until the root answers
        self._join_messages: dict[int, tuple] = {}
        self._joins = Joins(self._send_join)
        self.counters = {"partials_up": 0, "finals_down": 0, "bytes_up": 0, "bytes_down": 0}

    @property
    def connections(self) -> list:
        return [self.control] + ([self.data] if self.data is not None else [])

    # -- joining ------------------------------------------------------------------------

    def join(self, job_id: int, name: str, timeout: float) -> None:
        """Ask the root to take ``job_id`` from this rack (answered through
        :meth:`receive` as a JOIN_OK or an ERROR)."""
        h = Header(MsgType.JOIN, job_id=job_id, sender=self.config.rack_id, world=self.config.racks)
        payload = wire.json_payload({"name": name, "timeout": timeout, "rack": 1})
        self._join_messages[job_id] = (h.pack_for(payload), payload)
        self._joins.want(job_id, time.monotonic())

    def _send_join(self, job_id: int) -> None:
        if self.data is not None and self.error is None:
            self._send(*self._join_messages[job_id])

    def leave(self, job_id: int) -> None:
        self.joined(job_id)
        if self.data is not None:
            h = Header(MsgType.LEAVE, job_id=job_id, sender=self.config.rack_id, world=self.config.racks)
            self._send(h.pack())

    def tick(self, now: float) -> None:
        """Resend what the root has not answered yet."""
        if self.error is not None:
            return
        if self.data is None:
            if now >= self._next_hello:
                self._next_hello = now + RETRY_INTERVAL
                try:
                    self.control.send(0, Header(MsgType.HELLO).pack())
                except TransportError:
                    pass
            return
        self._joins.tick(now)

    def joined(self, job_id: int) -> None:
        self._joins.answered(job_id)
        self._join_messages.pop(job_id, None)

    # -- data ---------------------------------------------------------------------------

    def send_partial(self, header: bytes, payload) -> bool:
        if self.data is None:
            return False
        self.counters["partials_up"] += 1
        self.counters["bytes_up"] += memoryview(payload).nbytes
        return self._send(header, payload)

    def send_final(self, header: bytes, payload) -> bool:
        """A final the root sent before it restarted, replayed to it."""
        if self.data is None:
            return False
        self.counters["finals_replayed"] = self.counters.get("finals_replayed", 0) + 1
        return self._send(header, payload)

    def lost(self) -> bool:
        """Whether the connection to the root shard closed since the last
        call (the root shard died; its successor may be starting)."""
        return self.data is not None and bool(self.data.gone())

    def _send(self, header: bytes, payload=None) -> bool:
        try:
            self.data.send(0, header, payload)
            return True
        except TransportError as exc:
            log.warning("rack shard %d: cannot reach root shard %s: %s", self.index, self.root_shard, exc)
            return False

    def receive(self):
        """The root's messages for jobs, as (header, payload); answers to
        the shard discovery are handled here."""
        for conn in self.connections:
            while True:
                msg = conn.recv(0)
                if msg is None:
                    break
                try:
                    h = wire.unpack_header(msg.header)
                    wire.check_payload(h, len(msg.payload))
                except wire.WireError:
                    self.counters["dropped_malformed"] = self.counters.get("dropped_malformed", 0) + 1
                    continue
                if conn is self.control:
                    if h.msg_type == MsgType.HELLO_OK and self.data is None:
                        self._found_root(msg.payload)
                    continue
                if h.msg_type == MsgType.RESULT:
                    self.counters["finals_down"] += 1
                    self.counters["bytes_down"] += memoryview(msg.payload).nbytes
                yield h, msg.payload

    def _found_root(self, payload) -> None:
        try:
            shards = wire.parse_json(payload).get("shards")
        except (wire.WireError, AttributeError):
            shards = None
        if not isinstance(shards, list) or not all(isinstance(a, str) for a in shards):
            self.error = f"the root at {self.config.parent} answered HELLO without a shard list"
        elif len(shards) != self.count:
            self.error = (f"the root at {self.config.parent} has {len(shards)} shard(s), this rack {self.count}; "
                          f"run the root and every service rack with the same --shards")
        else:
            try:
                self.root_shard = str(reached_via(shards[self.index], self.config.parent))
                self.data = connect([self.root_shard])
            except (TransportError, ValueError) as exc:
                self.error = f"cannot connect to root shard {shards[self.index]}: {exc}"
        if self.error is not None:
            log.error("rack shard %d: %s", self.index, self.error)
        else:
            log.info("rack shard %d: partials go to root shard %s as rack %d of %d", self.index, self.root_shard,
                     self.config.rack_id, self.config.racks)
            self._joins.tick(time.monotonic(), every=True)

    def close(self) -> None:
        for conn in self.connections:
            conn.close()
        self.data = None
