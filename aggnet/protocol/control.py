"""The schema of every control message's JSON payload, and its one parser.

Control messages (JOIN, STATS) come from anyone who can reach an
aggregator's port, so each field is typed and bounded here, once, for both
aggregator kinds: a message outside the schema is refused with an ERROR
naming the field, and counted by that field, before any handler looks at
it. Handlers then work with values they can trust (a ``timeout`` that is a
finite number of seconds, a shared-memory window that fits in memory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from aggnet.protocol import wire
from aggnet.protocol.limits import MAX_ELEMENTS
from aggnet.protocol.wire import ErrorCode

#: the largest control payload an aggregator reads (a JOIN is ~200 bytes)
MAX_CONTROL_BYTES = 4096
#: a job name: printable, at most this many characters
MAX_NAME = 200
#: shared-memory rings: window slots and bytes per slot a JOIN may ask for
MAX_SHM_WINDOW = 1024
MAX_SHM_CHUNK_BYTES = 256 << 20
#: and in all, per job and shard (world x window x chunk_bytes x 2)
MAX_SHM_BYTES = 8 << 30
#: shared-memory ring slots start on page boundaries
SHM_PAGE = 4096


def slot_size(chunk_bytes: int) -> int:
    """Bytes of one shared-memory ring slot for ``chunk_bytes`` (worker and
    shard map the same layout from the JOIN's numbers)."""
    return (chunk_bytes + SHM_PAGE - 1) // SHM_PAGE * SHM_PAGE


class ControlError(Exception):
    """A control message the aggregator refuses. ``code`` goes in the
    ERROR; ``reason`` is the drop counter's key (``field_timeout``...)."""

    def __init__(self, code: ErrorCode, message: str, reason: str = "refused"):
        super().__init__(message)
        self.code = code
        self.reason = reason


@dataclass(frozen=True)
class Field:
    name: str
    kind: str  #: int, number, str, hex or object
    lo: float = 0
    hi: float = 0
    required: bool = False
    default: object = None
    schema: tuple = ()  #: an object's fields

    def check(self, value, where: str):
        bad = None
        if self.kind == "int":
            if isinstance(value, bool) or not isinstance(value, int) or not self.lo <= value <= self.hi:
                bad = f"an integer in [{self.lo}, {self.hi}]"
        elif self.kind == "number":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not self.lo <= value <= self.hi:
                bad = f"a number in [{self.lo:g}, {self.hi:g}]"
            else:
                value = float(value)
        elif self.kind == "str":
            if not isinstance(value, str) or not self.lo <= len(value) <= self.hi or not value.isprintable():
                bad = f"a printable string of {self.lo}..{self.hi} characters"
        elif self.kind == "hex":
            if not isinstance(value, str) or not self.lo <= len(value) <= self.hi or not _is_hex(value):
                bad = f"a hex string of {self.lo}..{self.hi} digits"
        elif self.kind == "object":
            if not isinstance(value, dict):
                bad = "an object"
            else:
                value = _parse_fields(self.schema, value, f"{where}{self.name}.")
        if bad is not None:
            shown = repr(value)
            if len(shown) > 60:
                shown = shown[:57] + "..."
            raise ControlError(ErrorCode.MALFORMED, f"field {where}{self.name!r} must be {bad}, got {shown}",
                               f"field_{self.name}")
        return value


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


AUTH = Field("auth", "object", schema=(
    Field("nonce", "hex", 16, 64, required=True),
    Field("ts", "number", 0, 1e11, required=True),
    Field("mac", "hex", 64, 64, required=True),
))

#: JOIN: what a worker tells its aggregator about the job
JOIN = (
    Field("name", "str", 1, MAX_NAME),
    Field("world", "int", 1, 1 << 16),
    Field("timeout", "number", 0.5, 86400.0, default=60.0),
    Field("shm", "object", schema=(
        Field("window", "int", 1, MAX_SHM_WINDOW, required=True),
        Field("chunk_bytes", "int", 64, MAX_SHM_CHUNK_BYTES, required=True),
    )),
    Field("elements", "int", 0, MAX_ELEMENTS, default=0),
    Field("max_elements", "int", 1, 1 << 30),
    Field("slots", "int", 0, 1 << 20, default=0),
    #: 1: the member is a rack's aggregator shard, which a supervisor
    #: restarts: when its connection closes, its open chunks wait for it
    #: to join again (a worker's closed connection fails them at once)
    Field("rack", "int", 0, 1, default=0),
    #: 1: the worker sends heartbeats if the aggregator wants them (an
    #: aggregator host in switch mode says so in its JOIN_OK)
    Field("heartbeats", "int", 0, 1, default=0),
    #: IPv4:port the member's datagrams come from and its results go to,
    #: when another machine joins on its behalf: a P4 switch sends no JOIN
    #: of its own, so its control plane joins the root for it
    #: (aggnet/p4/parent.py); a switch-mode aggregator only
    Field("data", "str", 9, 21),
    AUTH,
)

#: SHARE: where a worker's buffer of one round lies (transport/shm.py),
#: and how many of its chunks the shard is to read there
SHARE = (
    Field("name", "str", 1, 64, required=True),
    Field("bytes", "int", 1, 1 << 50, required=True),
    Field("at", "int", 0, 1 << 50, required=True),
    Field("chunks", "int", 1, 1 << 31, required=True),
    #: results to write into the buffer too (times ``multiplier``, an
    #: average's 1/N), answered RESULT_IN_PLACE: every result of the
    #: round's chunks on this shard, or of those in the member's share (a
    #: reduce-scatter); 0: none
    Field("results", "int", 0, 1 << 31, default=0),
    Field("multiplier", "number", 0.0, 1.0, default=1.0),
)

#: STATS: whose counters (a job's, with its key; everything, with the admin key)
STATS = (
    Field("job", "str", 1, MAX_NAME),
    AUTH,
    Field("admin", "object", schema=AUTH.schema),
)


#: TABLE: create or open a sparse table (hosts/sparse.py); names of modes,
#: optimizers and initializers are checked there against what it serves
TABLE = (
    Field("job", "str", 1, MAX_NAME, required=True),
    Field("table", "str", 1, MAX_NAME, required=True),
    Field("rows", "int", 1, 1 << 40, required=True),
    Field("width", "int", 1, 1 << 16, required=True),
    Field("partitions", "int", 1, 4096, required=True),
    Field("shards", "int", 1, 1024, required=True),
    Field("mode", "str", 1, 16, default="ps"),
    Field("op", "str", 1, 8, default="sum"),
    Field("optimizer", "object", required=True, schema=(
        Field("name", "str", 1, 16, required=True),
        Field("lr", "number", 0.0, 1e6, default=0.01),
        Field("momentum", "number", 0.0, 1.0, default=0.0),
        Field("lr_decay", "number", 0.0, 1e6, default=0.0),
        Field("initial_accumulator_value", "number", 0.0, 1e6, default=0.0),
        Field("beta1", "number", 0.0, 1.0, default=0.9),
        Field("beta2", "number", 0.0, 1.0, default=0.999),
        Field("eps", "number", 0.0, 1.0),  # by optimizer: torch's 1e-10 (Adagrad), 1e-8 (Adam)
    )),
    Field("init", "object", schema=(
        Field("kind", "str", 1, 16, required=True),
        Field("scale", "number", 0.0, 1e6, default=1.0),
        Field("seed", "int", 0, (1 << 63) - 1, default=0),
    )),
    Field("close", "int", 0, 1, default=0),
    # workers of one host combine their rows before the network: then only
    # ``pushers`` ranks push each round, and ``pusher`` says whether this
    # rank is one of them (aggnet/client/host_group.py)
    Field("pushers", "int", 1, 1 << 20),
    Field("pusher", "int", 0, 1, default=1),
    AUTH,
)


def _parse_fields(schema: tuple, obj: dict, where: str = "") -> dict:
    out = {}
    for f in schema:
        if f.name in obj and obj[f.name] is not None:
            out[f.name] = f.check(obj[f.name], where)
        elif f.required:
            raise ControlError(ErrorCode.MALFORMED, f"field {where}{f.name!r} is missing", f"field_{f.name}")
        elif f.default is not None:
            out[f.name] = f.default
    return out


class Message(dict):
    """A control payload's checked fields; ``raw`` is the object as sent,
    which a signature covers."""

    raw: dict


def parse(schema: tuple, payload, what: str) -> Message:
    """The fields of a control payload under ``schema`` (fields it does not
    name are ignored: a newer worker may send more); raises ControlError."""
    if len(payload) > MAX_CONTROL_BYTES:
        raise ControlError(ErrorCode.MALFORMED, f"{what} payload of {len(payload)} bytes; at most "
                                                f"{MAX_CONTROL_BYTES}", "control_too_large")
    try:
        obj = wire.parse_json(payload)
    except wire.WireError as exc:
        raise ControlError(ErrorCode.MALFORMED, f"{what}: {exc}", "malformed_json") from None
    except RecursionError:
        raise ControlError(ErrorCode.MALFORMED, f"{what}: JSON nested too deeply", "malformed_json") from None
    msg = Message(_parse_fields(schema, obj))
    msg.raw = obj
    return msg


def shm_bytes(world: int, shm: dict) -> int:
    """Bytes of a job's shared-memory rings on one shard (input slots per
    worker plus result slots), to refuse what no host can map."""
    return (world + 2) * shm["window"] * slot_size(shm["chunk_bytes"])


def check_shm(world: int, shm: dict) -> None:
    total = shm_bytes(world, shm)
    if total > MAX_SHM_BYTES:
        raise ControlError(ErrorCode.REFUSED,
                           f"shared-memory rings of {total} bytes ({world} workers x window {shm['window']} x "
                           f"{shm['chunk_bytes']}-byte chunks) exceed {MAX_SHM_BYTES >> 30} GiB per shard; use a "
                           f"smaller window or chunk_bytes", "field_shm")
