"""The aggnet wire format: the one definition of every message header.

Every aggnet message, on every transport and on the switch path, starts with
this fixed 48-byte header. Header fields are always big-endian (network
order) so that a P4 parser reads them as they are; the payload byte order is
named by the ``LITTLE_ENDIAN`` flag (host paths send native little-endian
payloads and skip a byteswap; the switch path carries big-endian int32).

::

     0                   1                   2                   3
     0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
    +-------------------------------+---------------+---------------+
    |          magic 0xA66E         |    version    |  msg_type     |  0
    +---------------+---------------+---------------+---------------+
    |     flags     |     dtype     |            sender             |  4
    +---------------+---------------+-------------------------------+
    |                            job_id                             |  8
    +---------------------------------------------------------------+
    |                            round                              | 12
    +---------------------------------------------------------------+
    |                 index (chunk, or pool slot)                   | 16
    +---------------------------------------------------------------+
    |                    count (payload elements)                   | 20
    +-------------------------------+-------------------------------+
    |        exponent (int16)       |     next_exponent (int16)     | 24
    +-------------------------------+-------------------------------+
    |        nsum (uint16)          |        world (uint16)         | 28
    +-------------------------------+-------------------------------+
    |                      ref (shared-memory slot)                 | 32
    +---------------------------------------------------------------+
    |                  reserved (must be zero)                      | 36
    +---------------------------------------------------------------+
    |                                                               | 40
    +                  offset (uint64, elements)                    +
    |                                                               | 44
    +---------------------------------------------------------------+
    |  payload: count elements of dtype, byte order per flags ...   | 48

Fields:

* ``magic``/``version``: reject anything that is not aggnet, or a version
  this build does not speak, before looking at the rest.
* ``msg_type``: :class:`MsgType`.
* ``flags``: :class:`Flag` bits (slot version bit, payload byte order,
  shared-memory payload, uplink, retransmission, element-wise max, result
  to one rank).
* ``dtype``: :class:`DType` of the payload.
* ``sender``: the worker's rank in the job (a rack's id on an uplink).
* ``job_id``: which job; aggregators keep jobs apart by this.
* ``round``: which all-reduce of the job (every worker counts the same).
* ``index``: the chunk of the buffer (host paths) or the slot of the pool
  (switch path).
* ``count``: payload elements; the payload length must equal
  ``count * itemsize``.
* ``exponent``: the agreed scale exponent of an int32-quantized payload.
* ``next_exponent``: the sender's exponent proposal for its next block; a
  result carries the MAX over all senders.
* ``nsum``: contributions summed into a result (0 in a push, except with
  ``TO_OWNER``: the rank the result goes to).
* ``world``: the job's worker count (JOIN, results).
* ``ref``: where a shared-memory payload lies (flag ``SHM``).
* ``offset``: the element offset of this chunk in the caller's buffer.
"""

from __future__ import annotations

import enum
import json
import struct
import zlib
from dataclasses import dataclass

MAGIC = 0xA66E
VERSION = 1

#: struct layout of the header; one place, used by pack, unpack and the P4
#: header generator.
HEADER_FORMAT = ">HBBBBHIIIIhhHHIIQ"
HEADER_SIZE = struct.calcsize(HEADER_FORMAT)
assert HEADER_SIZE == 48

#: (name, bits) of each header field in order: the P4 header is generated
#: from this list, and a test checks it against HEADER_FORMAT.
HEADER_FIELDS: tuple[tuple[str, int], ...] = (
    ("magic", 16),
    ("version", 8),
    ("msg_type", 8),
    ("flags", 8),
    ("dtype", 8),
    ("sender", 16),
    ("job_id", 32),
    ("round", 32),
    ("index", 32),
    ("count", 32),
    ("exponent", 16),
    ("next_exponent", 16),
    ("nsum", 16),
    ("world", 16),
    ("ref", 32),
    ("reserved", 32),
    ("offset", 64),
)

_STRUCT = struct.Struct(HEADER_FORMAT)

#: exponent value that marks "this sender saw NaN or Inf"; the MAX carries
#: it to every worker so that all of them stop instead of summing garbage.
EXPONENT_NONFINITE = 32767
#: exponent of a block of zeros: below any float32 (denormals reach 2**-149).
EXPONENT_ZERO = -150


class MsgType(enum.IntEnum):
    JOIN = 1  #: a worker registers with a job (world size in ``world``)
    JOIN_OK = 2  #: the aggregator accepted the JOIN (JSON details in payload)
    PUSH = 3  #: a worker's contribution to one chunk/slot
    RESULT = 4  #: the aggregated chunk/slot
    ERROR = 5  #: UTF-8 text of what went wrong
    LEAVE = 6  #: a worker leaves its job (service shards echo it: the worker may then close)
    HELLO = 7  #: ask a service for its shard map
    HELLO_OK = 8  #: JSON shard map
    STATS = 9  #: ask for counters
    STATS_OK = 10  #: JSON counters
    PROBE = 11  #: switch protocol: ask a slot's state (who is missing)
    PROBE_OK = 12  #: ``nsum`` = count, ``ref`` = seen bitmap, ``world``
    #: switch protocol on aggregator hosts: a worker is alive. The host
    #: echoes a member's with the lapse it allows in ``ref`` (ms), a
    #: non-member's with 0 (docs/protocol.md "A worker that dies")
    HEARTBEAT = 13
    #: a worker's buffer of round ``round`` lies in shared memory of its own
    #: (JSON: control.SHARE): its chunks' PUSHes with flag ``SHM`` are read
    #: there, at their ``offset``, instead of from its input ring slot
    SHARE = 14
    #: a RESULT whose sum the shard wrote into the member's shared buffer
    #: itself (its SHARE asked for it): the RESULT's header, no payload
    RESULT_IN_PLACE = 15
    # sparse tables on aggregator hosts (hosts/sparse.py; row payloads as
    # aggnet/protocol/sparse_layout.py says; docs/protocol.md "Sparse tables")
    TABLE = 20  #: create or open a sparse table (JSON, control.TABLE)
    TABLE_OK = 21  #: JSON: the table's partitions on this shard
    SPARSE_PUSH = 22  #: a worker's gradient rows of one partition for one round
    SPARSE_PULL = 23  #: ask for rows of one partition (``nsum``: state slot)
    SPARSE_ROWS = 24  #: rows back (a pull), a round's sum, or an empty acknowledgement
    SPARSE_LOAD = 25  #: set rows of one partition's state slot (restore)


class Flag(enum.IntFlag):
    NONE = 0
    VERSION = 0x01  #: slot version bit (switch protocol)
    LITTLE_ENDIAN = 0x02  #: payload is little-endian (host paths)
    #: payload lies in a shared-memory slot named by ``ref``, or in the
    #: sender's shared buffer when a SHARE named one for the round
    SHM = 0x04
    UPLINK = 0x08  #: a rack's partial sent to its parent / parent's final
    RETRANSMIT = 0x10  #: a resend after a timeout
    OP_MAX = 0x20  #: element-wise MAX instead of SUM
    #: the result goes to one rank only, named by the push's ``nsum`` (a
    #: reduce-scatter: each rank receives only its own shard of the sum);
    #: the other ranks get a RESULT without payload (``count`` 0) that
    #: frees their window
    TO_OWNER = 0x40
    #: a PUSH that carries a complete result, sent by a member that has it
    #: to an aggregator that restarted and lost it: the aggregator answers
    #: the members still waiting for that result with it, exactly as the
    #: first aggregator summed it, instead of waiting for contributions that
    #: the members who finished can no longer send
    FINAL = 0x80


#: flags the P4 program leaves undeclared: a switch multicasts every result
#: to all members of a job and cannot deliver one rank's share, and keeps
#: no job across a restart of its own, so only aggregator services honour
#: them
NOT_IN_P4 = Flag.TO_OWNER | Flag.FINAL

#: message types only aggregator hosts speak: the P4 program's enum leaves
#: them out (a switch drops them as unknown)
HOST_ONLY_TYPES = frozenset({MsgType.HEARTBEAT, MsgType.SHARE, MsgType.RESULT_IN_PLACE, MsgType.TABLE,
                             MsgType.TABLE_OK, MsgType.SPARSE_PUSH, MsgType.SPARSE_PULL, MsgType.SPARSE_ROWS,
                             MsgType.SPARSE_LOAD})


class DType(enum.IntEnum):
    NONE = 0  #: no elements, or opaque bytes (JSON, text)
    FLOAT32 = 1
    INT32 = 2
    FLOAT16 = 3
    BFLOAT16 = 4
    INT16 = 5


#: bytes per element of each dtype (NONE counts bytes)
ITEMSIZE = {
    DType.NONE: 1,
    DType.FLOAT32: 4,
    DType.INT32: 4,
    DType.FLOAT16: 2,
    DType.BFLOAT16: 2,
    DType.INT16: 2,
}


class WireError(ValueError):
    """A message that is not a valid aggnet message; ``reason`` is a short
    counter key (``short``, ``magic``, ``version``, ``type``, ``dtype``,
    ``length``, ``reserved``) for the aggregator's drop counters."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(slots=True)
class Header:
    msg_type: MsgType
    job_id: int = 0
    round: int = 0
    index: int = 0
    sender: int = 0
    flags: int = 0
    dtype: DType = DType.NONE
    count: int = 0
    exponent: int = 0
    next_exponent: int = 0
    nsum: int = 0
    world: int = 0
    ref: int = 0
    offset: int = 0

    def pack(self) -> bytes:
        return pack_header(self)

    def pack_for(self, payload: bytes) -> bytes:
        """Pack a control message's header, counting its opaque payload."""
        self.count = len(payload)
        return pack_header(self)

    @property
    def payload_bytes(self) -> int:
        return self.count * ITEMSIZE[self.dtype]


def _fields(h: Header) -> tuple:
    return (MAGIC, VERSION, h.msg_type, h.flags, h.dtype, h.sender, h.job_id, h.round, h.index, h.count,
            h.exponent, h.next_exponent, h.nsum, h.world, h.ref, 0, h.offset)


def pack_header(h: Header) -> bytes:
    """The header's bytes; a field outside its width raises ValueError
    naming the header."""
    try:
        return _STRUCT.pack(*_fields(h))
    except struct.error as exc:
        raise ValueError(f"cannot pack aggnet header {h!r}: {exc}") from None


def pack_into(buf, h: Header) -> None:
    """Write the header into the first HEADER_SIZE bytes of ``buf`` (a
    preallocated packet buffer), so hot paths allocate nothing; fails as
    :func:`pack_header` does."""
    try:
        _STRUCT.pack_into(buf, 0, *_fields(h))
    except struct.error as exc:
        raise ValueError(f"cannot pack aggnet header {h!r} into a buffer of {len(buf)} bytes: {exc}") from None


_MSG_TYPES = frozenset(int(t) for t in MsgType)
_DTYPES = frozenset(int(d) for d in DType)


def unpack_header(buf) -> Header:
    """Parse and validate the header at the start of ``buf``.

    Raises :class:`WireError` naming what is wrong; the payload length is
    checked separately by :func:`check_payload` because some transports
    carry it in another frame or in shared memory.
    """
    n = len(buf)
    if n < HEADER_SIZE:
        raise WireError("short", f"message of {n} bytes is shorter than the {HEADER_SIZE}-byte aggnet header")
    (magic, version, msg_type, flags, dtype, sender, job_id, rnd, index,
     count, exponent, next_exponent, nsum, world, ref, reserved,
     offset) = _STRUCT.unpack_from(buf, 0)
    if magic != MAGIC:
        raise WireError("magic", f"bad magic 0x{magic:04X} (aggnet messages start with 0x{MAGIC:04X})")
    if version != VERSION:
        raise WireError("version", f"wire version {version} is not supported (this aggnet speaks version {VERSION})")
    if msg_type not in _MSG_TYPES:
        raise WireError("type", f"unknown message type {msg_type}")
    if dtype not in _DTYPES:
        raise WireError("dtype", f"unknown dtype code {dtype}")
    if reserved != 0:
        raise WireError("reserved", f"reserved header field is {reserved}, must be 0")
    return Header(
        MsgType(msg_type), job_id, rnd, index, sender, flags, DType(dtype),
        count, exponent, next_exponent, nsum, world, ref, offset,
    )


def check_payload(h: Header, payload_len: int) -> None:
    """Raise :class:`WireError` unless the payload length matches the
    header's element count (shared-memory payloads carry none inline)."""
    expected = 0 if h.flags & Flag.SHM else h.payload_bytes
    if payload_len != expected:
        raise WireError(
            "length",
            f"payload of {payload_len} bytes does not match count={h.count} "
            f"of {h.dtype.name} ({expected} bytes)",
        )


def unpack_message(buf) -> tuple[Header, memoryview]:
    """Header and payload of a single-buffer message (datagram paths)."""
    h = unpack_header(buf)
    payload = memoryview(buf)[HEADER_SIZE:]
    check_payload(h, len(payload))
    return h, payload


#: index of the per-shard message that agrees the int32 exponents of a
#: round's chunks (a MAX over workers) before their data is sent
SCALE_INDEX = 0xFFFFFFFF
#: index of the per-round message that agrees the buffer's size (a MAX of
#: its size and of its negation over workers): a worker whose buffer
#: differs fails with JobMismatch on every rank, not with a timeout
PLAN_INDEX = 0xFFFFFFFE
#: set in a chunk's index when it goes a second time with the exponent its
#: first result agreed: that chunk was quantized with an exponent carried
#: from an earlier round (docs/protocol.md, "Exponents carried from the
#: last round") that the workers' values outgrew, or that was too coarse
#: for them. Chunk indices stay below it; SCALE_INDEX and PLAN_INDEX have
#: it set and are told apart by their whole value
REDO_BIT = 0x80000000
#: values in the buffer-size agreement: size (two words), wire dtype, key,
#: their negations, and how many rounds back the sender's oldest
#: unfinished one is (the MAX over workers says which results every
#: worker has, so the results kept for a restarted aggregator can go)
PLAN_VALUES = 9
_ROUNDS = 1 << 32


def round_at_or_before(r: int, mark: int) -> bool:
    """Whether round ``r`` is ``mark`` or earlier, rounds counted modulo 2**32."""
    return (mark - r) % _ROUNDS < _ROUNDS // 2


def settled_through(round_: int, plan) -> int:
    """The last round every worker had finished, read from ``round_``'s
    agreed buffer-size agreement ``plan`` (PLAN_VALUES int32)."""
    return (round_ - int(plan[PLAN_VALUES - 1])) % _ROUNDS



def json_payload(obj) -> bytes:
    """Control messages (JOIN, HELLO_OK, STATS_OK) carry small JSON objects."""
    return json.dumps(obj, separators=(",", ":")).encode()


def parse_json(payload) -> dict:
    try:
        obj = json.loads(bytes(payload) or b"{}")
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, a 5000-digit number, nested too deep
        raise WireError("json", f"control payload is not JSON: {str(exc)[:200]}") from None
    if not isinstance(obj, dict):
        raise WireError("json", "control payload must be a JSON object")
    return obj


class ErrorCode(str, enum.Enum):
    """What an ERROR message is about (its JSON ``code``)."""

    MALFORMED = "malformed"  #: the message could not be parsed
    NOT_JOINED = "not_joined"  #: the sender is not a member of the job
    JOB_MISMATCH = "job_mismatch"  #: world size, name, sizes or dtypes disagree
    STALL = "stall"  #: a slot waited too long for some workers
    REFUSED = "refused"  #: anything else the aggregator will not do


def error_payload(code: ErrorCode, message: str) -> bytes:
    return json_payload({"code": code.value, "message": message})


def parse_error(payload) -> tuple[str, str]:
    """(code, message) of an ERROR payload; unparsable text is kept."""
    try:
        obj = parse_json(payload)
        return str(obj.get("code", ErrorCode.REFUSED.value)), str(obj.get("message", ""))
    except WireError:
        return ErrorCode.REFUSED.value, bytes(payload).decode(errors="replace")


def job_id_of(name: str) -> int:
    """A job's wire id: a stable 32-bit hash of its name (the aggregator
    also keeps the name and rejects a different name with the same id)."""
    return zlib.crc32(name.encode()) & 0xFFFFFFFF
