"""The aggnet header as a scapy layer, so that packet captures of the
switch protocol (an emulated rack, a real one) can be read as aggnet
messages rather than opaque UDP payloads: in scapy, in scripts, and with
``aggnet pcap FILE``.

The layer's fields are generated from :data:`aggnet.protocol.wire.HEADER_FIELDS` and
:data:`aggnet.protocol.wire.HEADER_FORMAT`, so it cannot drift from the format the
workers and aggregators speak. Datagrams are recognized by the header's
magic on any UDP port: a capture taken at the sender of a GSO batch holds
several messages in one datagram, and each is decoded.

scapy is an optional dependency (``pip install aggnet[pcap]``); it is
imported on first use.
"""

from __future__ import annotations

import functools
import itertools
import struct

import numpy as np

from aggnet.protocol import wire
from aggnet.protocol.limits import SWITCH_PORT
from aggnet.protocol.wire import HEADER_SIZE, ITEMSIZE, DType, Flag, MsgType

#: ports an aggregator listens on: a sharded host uses one per shard
DEFAULT_PORTS = range(SWITCH_PORT, SWITCH_PORT + 64)

_MAGIC = struct.pack(">H", wire.MAGIC)
#: byte offset of ``count``, filled in when a built message leaves it unset
_COUNT_AT = sum(bits for _, bits in itertools.takewhile(lambda f: f[0] != "count", wire.HEADER_FIELDS)) // 8
#: numpy element type of each payload dtype (bfloat16 is widened by hand)
_NUMPY = {DType.FLOAT32: "f4", DType.INT32: "i4", DType.FLOAT16: "f2", DType.INT16: "i2", DType.BFLOAT16: "u2"}


def _scapy():
    try:
        import scapy.fields as fields
        import scapy.layers.inet as inet
        import scapy.layers.inet6  # noqa: F401  (IPv6 under Ether in captures)
        import scapy.packet as packet
        import scapy.utils as utils
    except ImportError as exc:
        raise ImportError(f"decoding aggnet captures needs scapy: pip install aggnet[pcap] ({exc})") from None
    return fields, inet, packet, utils


def _payload_bytes(pkt) -> int:
    if pkt.flags is not None and int(pkt.flags) & Flag.SHM:
        return 0  # the payload lies in shared memory
    try:
        return (pkt.count or 0) * ITEMSIZE[DType(pkt.dtype)]
    except ValueError:
        return 0  # an unknown dtype: its size is unknown too


def _enum(cls, value):
    try:
        return cls(value)
    except ValueError:
        return value


@functools.cache
def layer():
    """The :class:`Aggnet` scapy layer (imports scapy)."""
    fields, _, packet, _ = _scapy()
    flag_names = {int(f): f.name for f in Flag if f}
    by_code = {"B": fields.ByteField, "H": fields.ShortField, "h": fields.SignedShortField,
               "I": fields.IntField, "Q": fields.LongField}
    special = {
        "magic": fields.XShortField("magic", wire.MAGIC),
        "version": fields.ByteField("version", wire.VERSION),
        "msg_type": fields.ByteEnumField("msg_type", MsgType.PUSH, {int(t): t.name for t in MsgType}),
        "flags": fields.FlagsField("flags", 0, 8, [flag_names.get(1 << i, f"bit{i}") for i in range(8)]),
        "dtype": fields.ByteEnumField("dtype", DType.NONE, {int(d): d.name for d in DType}),
        "job_id": fields.XIntField("job_id", 0),
        "count": fields.IntField("count", None),
    }
    codes = wire.HEADER_FORMAT.lstrip("<>!=@")
    assert len(codes) == len(wire.HEADER_FIELDS)
    desc = [special.get(name) or by_code[code](name, 0) for (name, _), code in zip(wire.HEADER_FIELDS, codes)]
    desc.append(fields.StrLenField("data", b"", length_from=_payload_bytes))

    class Aggnet(packet.Packet):
        """An aggnet message: the header, then ``data``, its payload."""

        name = "aggnet"
        fields_desc = desc

        def post_build(self, p, pay):
            if self.count is None:  # count the payload's elements
                n = len(self.data) // ITEMSIZE.get(_enum(DType, self.dtype), 1)
                p = p[:_COUNT_AT] + struct.pack(">I", n) + p[_COUNT_AT + 4:]
            return p + pay

        def guess_payload_class(self, payload):
            # what follows a message in the same datagram is the next
            # message of a GSO batch, or is not aggnet
            if payload[:2] == _MAGIC and len(payload) >= HEADER_SIZE:
                return Aggnet
            return packet.Raw

        def mysummary(self):
            return self.sprintf("aggnet %msg_type% job=%job_id% round=%round% index=%index% count=%count%")

        def values(self):
            """The payload: a numpy array of its elements (native byte
            order, bfloat16 widened to float32), or the text of a control
            message (dtype NONE: JSON, or an error's text)."""
            raw = bytes(self.data)
            dtype = _enum(DType, self.dtype)
            if dtype not in _NUMPY:
                return raw.decode("utf-8", "replace")
            order = "<" if int(self.flags) & Flag.LITTLE_ENDIAN else ">"
            code = _NUMPY[dtype]
            out = np.frombuffer(raw, order + code, len(raw) // int(code[1])).astype(code)
            if dtype == DType.BFLOAT16:
                out = (out.astype(np.uint32) << 16).view(np.float32)
            return out

    return Aggnet


def __getattr__(name):
    if name == "Aggnet":
        return layer()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def bind_ports(ports=DEFAULT_PORTS) -> None:
    """Dissect UDP datagrams to or from ``ports`` as aggnet in scapy
    (``UDP(...)/Aggnet(...)``, ``pkt[Aggnet]``); :func:`decode_pcap` finds
    aggnet on any port without this."""
    _, inet, packet, _ = _scapy()
    agg = layer()
    for port in ports:
        packet.bind_layers(inet.UDP, agg, dport=port)
        packet.bind_layers(inet.UDP, agg, sport=port)


def messages(udp_payload: bytes) -> list:
    """The aggnet messages of one UDP payload (several for a GSO batch),
    or none when it does not start with the aggnet magic."""
    if udp_payload[:2] != _MAGIC or len(udp_payload) < HEADER_SIZE:
        return []
    agg = layer()
    out, msg = [], agg(udp_payload)
    while isinstance(msg, agg):
        out.append(msg)
        msg = msg.payload
    return out


def decode_pcap(path) -> list[dict]:
    """Every aggnet message in a pcap or pcapng file, in capture order.

    Each is a dict: ``time`` (seconds since the epoch), ``src``/``dst``
    (IP addresses), ``sport``/``dport``, every header field by its name in
    :data:`aggnet.protocol.wire.HEADER_FIELDS` (``msg_type``, ``dtype`` and ``flags``
    as the wire enums where known) and ``values`` (``Aggnet.values()``).
    """
    _, inet, _, utils = _scapy()
    from scapy.error import Scapy_Exception

    out = []
    try:
        reader = utils.PcapReader(str(path))
    except Scapy_Exception as exc:  # not a capture file
        raise ValueError(f"{path}: {exc}") from None
    with reader:
        for pkt in reader:
            udp = pkt.getlayer(inet.UDP)
            if udp is None:
                continue
            ip = udp.underlayer
            for msg in messages(bytes(udp.payload)):
                rec = {"time": float(pkt.time), "src": getattr(ip, "src", None), "dst": getattr(ip, "dst", None),
                       "sport": udp.sport, "dport": udp.dport}
                for name, _ in wire.HEADER_FIELDS:
                    rec[name] = getattr(msg, name)
                rec["msg_type"] = _enum(MsgType, rec["msg_type"])
                rec["dtype"] = _enum(DType, rec["dtype"])
                rec["flags"] = Flag(int(rec["flags"]))
                rec["values"] = msg.values()
                out.append(rec)
    return out
