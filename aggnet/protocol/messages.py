"""Typed views of the switch-path messages whose header fields carry other
meanings than their names say.

A switch answers a JOIN or a PROBE by rewriting the packet it got and
sending it back, so the answer's values travel in the fields a PUSH uses
for something else: a JOIN_OK's slice size in ``index``, a PROBE_OK's
seen bitmap in ``ref``. Each such reuse is written down once here, as a
dataclass whose ``FIELDS`` maps each value to its header field. The
aggregator host and the worker read and write through
:meth:`~_View.from_header` / :meth:`~_View.to_header`, the numba data path
takes its byte offsets from ``FIELDS`` (:mod:`aggnet.kernels.datagrams`),
and the P4 program's actions that write these answers are generated from
it (:mod:`aggnet.p4.generate`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from aggnet.protocol.wire import HEADER_FIELDS, Header, MsgType

_FIELD_BITS = dict(HEADER_FIELDS)


class _View:
    """A message type and the header field of each of its values."""

    MSG_TYPE: ClassVar[MsgType]
    #: value name -> header field, in the order the values are declared
    FIELDS: ClassVar[dict[str, str]]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        unknown = set(cls.FIELDS.values()) - set(_FIELD_BITS)
        if unknown or len(set(cls.FIELDS.values())) != len(cls.FIELDS):
            raise TypeError(f"{cls.__name__}: each value needs a header field of its own, got {cls.FIELDS}")

    @classmethod
    def from_header(cls, h: Header):
        return cls(**{name: getattr(h, f) for name, f in cls.FIELDS.items()})

    def to_header(self, h: Header) -> Header:
        """Turn ``h`` into this message: its type and these values; the
        other fields stay as they are (an answer keeps the request's job,
        sender and round)."""
        h.msg_type = self.MSG_TYPE
        for name, f in self.FIELDS.items():
            setattr(h, f, getattr(self, name))
        return h

    @classmethod
    def field_bits(cls, name: str) -> int:
        """Bits of the header field that carries value ``name``."""
        return _FIELD_BITS[cls.FIELDS[name]]


@dataclass(frozen=True)
class JoinOk(_View):
    """An aggregator's answer to a JOIN, in the JOIN's own header."""

    MSG_TYPE: ClassVar[MsgType] = MsgType.JOIN_OK
    FIELDS: ClassVar[dict[str, str]] = {"slots": "index", "elements": "nsum", "base": "offset", "world": "world",
                                        "shard_slots": "ref"}

    slots: int  #: the job's slice of the pool
    elements: int  #: K, int32 values per packet
    base: int  #: the slice's first slot in the pool (which shard port serves a slot)
    world: int  #: members of the job at this aggregator
    #: pool slots per shard port of a sharded host; 0 for one port
    shard_slots: int = 0


@dataclass(frozen=True)
class JoinShards(_View):
    """What a sharded aggregator joining its parent as a rack says of its
    own shards (a worker's JOIN leaves both 0): the parent sends a slot's
    final sum to the rack shard that serves it."""

    MSG_TYPE: ClassVar[MsgType] = MsgType.JOIN
    FIELDS: ClassVar[dict[str, str]] = {"base": "offset", "shard_slots": "ref"}

    base: int  #: the job's first slot in the rack's pool
    shard_slots: int  #: the rack's pool slots per shard port; 0 for one port


@dataclass(frozen=True)
class ProbeOk(_View):
    """A slot's state, the answer to a PROBE, in the PROBE's own header."""

    MSG_TYPE: ClassVar[MsgType] = MsgType.PROBE_OK
    FIELDS: ClassVar[dict[str, str]] = {"count": "nsum", "seen": "ref", "tag": "offset", "world": "world"}

    count: int  #: contributions the slot's use holds (0 once complete)
    seen: int  #: bitmap of the members whose contribution it holds
    tag: int  #: the use the slot's registers hold
    world: int  #: members of the job


@dataclass(frozen=True)
class JoinHeartbeats(_View):
    """What an aggregator host in switch mode adds to its JOIN_OK when the
    JOIN asked for heartbeats (``heartbeats`` in its JSON): the silence it
    allows a member before the member is gone. A P4 switch leaves the field
    as the JOIN had it, 0: its workers send none (docs/protocol.md "A
    worker that dies")."""

    MSG_TYPE: ClassVar[MsgType] = MsgType.JOIN_OK
    FIELDS: ClassVar[dict[str, str]] = {"lapse_ms": "round"}

    lapse_ms: int = 0


@dataclass(frozen=True)
class Heartbeat(_View):
    """A worker's heartbeat to an aggregator host in switch mode (``ref``
    0), and the host's answer to one from a worker that is not a member of
    the job (any more): ``ref`` 0 too, so it knows its job went on without
    it. A member's heartbeat is not answered."""

    MSG_TYPE: ClassVar[MsgType] = MsgType.HEARTBEAT
    FIELDS: ClassVar[dict[str, str]] = {"lapse_ms": "ref"}

    lapse_ms: int = 0


#: the views the P4 program writes: its actions are generated from these
P4_ANSWERS = (JoinOk, ProbeOk)

__all__ = ["JoinOk", "JoinShards", "ProbeOk", "JoinHeartbeats", "Heartbeat", "P4_ANSWERS"]



def padding_asked(h: Header) -> int:
    """An aggregator's answer to an unsigned UDP request (HELLO, STATS)
    whose reply would be larger than the request: the reply's type with no
    payload and, in ``index``, the size in bytes the request must be padded
    to (zeros after its payload) to draw the reply. An aggregator never
    answers a spoofed source with more bytes than it sent. 0: a reply."""
    return h.index if h.count == 0 and h.msg_type in (MsgType.HELLO_OK, MsgType.STATS_OK) else 0


def ask_padding(reply_type: MsgType, needed: int) -> Header:
    """The header-only answer that says ``needed`` (see padding_asked)."""
    return Header(reply_type, index=needed, count=0)
