"""Hostile inputs for aggnet's aggregators, and campaigns that send them.

An aggregator serves whoever reaches its port, so each of its parsers must
take a message or refuse it with a counted reason: never crash, never
stall, and never let a stranger's bytes touch a job's sums. The generators
here make what a broken or hostile peer sends: random bytes, well-formed
headers with one thing wrong, control payloads that break each rule of
their schema, and well-formed packets from the wrong place (a running
job's id and real ranks from a foreign address). Everything is drawn from
one seeded ``random.Random``, so a failing campaign replays from its seed.

:func:`run_campaign` sends them at a running aggregator: datagrams at a
switch-mode one (``udp://``), multipart messages at a service's control
endpoint and shards (``zmq+tcp://``, ``zmq+ipc://``, and ``tcp://``, whose
peers send the same frames in aggnet's own framing). ``aggnet fuzz`` runs
one and then asks the target for its drop counters.
"""

from __future__ import annotations

import collections
import functools
import json
import random
import socket
import struct
import sys
import time

from aggnet.errors import AggnetError
from aggnet.protocol import wire
from aggnet.protocol.wire import HEADER_SIZE, ITEMSIZE, DType, Flag, Header, MsgType, WireError


def _field_offsets() -> dict[str, tuple[int, int]]:
    out, pos = {}, 0
    for (name, _bits), code in zip(wire.HEADER_FIELDS, wire.HEADER_FORMAT[1:]):
        out[name] = (pos, struct.calcsize(">" + code))
        pos += out[name][1]
    assert pos == HEADER_SIZE
    return out


#: (byte offset, bytes) of each header field, from the one definition
FIELDS = _field_offsets()

#: JSON values of every wrong type and size a schema must refuse
HOSTILE_VALUES = (
    "abc", "", "60", "\x00", "\u202e", "x" * 300, -1, 0, 1, 2 ** 31, 2 ** 63, 2 ** 64, 2 ** 70, -(2 ** 70), 10 ** 300,
    1.5, -0.0, 1e-300, 1e308, float("nan"), float("inf"), float("-inf"), True, False, None, [], [1, 2], {},
    {"window": 1}, {"a": {"b": {"c": [None]}}},
)
#: control payloads that are not a JSON object, or barely one
HOSTILE_PAYLOADS = (
    b"", b"{", b"}", b"[]", b"null", b"1", b'"text"', b"NaN", b"\xff\xfe\x00\x01", b"\x00" * 16, b"{}" * 3,
    b'{"name":"\xc3\x28"}', b'{"name":"\\ud800"}', b"[" * 2000, b'{"a":' * 800 + b"1" + b"}" * 800,
    b"1" * 4000, b"-" + b"9" * 4000, b'{"timeout":1e999}', b'{"world":' + b"9" * 600 + b"}",
    b'{"name":"x"}' + b" " * 5000,
)
#: JOIN payloads that broke an aggregator once, or are one type or bound
#: away from it: each must be answered (refused, or taken as harmless)
KNOWN_BAD_JOINS = (
    {"timeout": "abc"}, {"timeout": None, "shm": None}, {"timeout": float("nan")}, {"timeout": -5},
    {"timeout": 1e308}, {"shm": {"window": 2 ** 70, "chunk_bytes": 1}}, {"shm": {"window": 1, "chunk_bytes": 2 ** 70}},
    {"shm": {"window": -1, "chunk_bytes": 4096}}, {"shm": {"window": 1024, "chunk_bytes": 256 << 20}},
    {"shm": "big"}, {"shm": []}, {"slots": -1}, {"slots": 2 ** 70}, {"slots": 1.5}, {"elements": 0},
    {"elements": -1}, {"elements": 2 ** 40}, {"max_elements": 0}, {"max_elements": "all"}, {"name": 7},
    {"name": ""}, {"name": "a\nb"}, {"name": "x" * 5000}, {"world": "two"}, {"auth": "x"},
    {"auth": {"nonce": "zz", "ts": "now", "mac": 1}},
)
_EXTREMES = (0, 1, 2, 0x7F, 0x80, 0xFF, 0x7FFF, 0x8000, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF,
             1 << 63, (1 << 64) - 1)


class Fuzzer:
    """Seeded makers of hostile messages.

    ``job_id``/``ranks``/``elements``/``name`` describe a running job the
    campaign must not disturb: its id and real ranks are used for forged
    packets (well-formed, from a foreign source), so that what refuses them
    is admission, not a length check that comes first.
    """

    def __init__(self, seed: int = 0, job_id: int | None = None, ranks=(0, 1), elements: int = 64,
                 name: str | None = None, world: int | None = None):
        self.rng = random.Random(seed)
        self.job_id = job_id
        self.ranks = tuple(ranks) or (0,)
        self.elements = elements
        self.name = name
        self.world = world or max(self.ranks) + 1

    # -- building blocks ---------------------------------------------------------------

    def random_bytes(self, n: int | None = None) -> bytes:
        r = self.rng
        if n is None:
            n = r.choice((0, 1, 2, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 1, r.randrange(256),
                          r.randrange(9100)))
        return r.randbytes(n)

    def other_job(self) -> int:
        """A job id that is not the running job's."""
        while True:
            j = self.rng.choice((0, 1, 0xFFFFFFFF, self.rng.getrandbits(32)))
            if j != self.job_id:
                return j

    def fresh_job(self) -> int:
        """A job id for a job of the fuzzer's own (the fixed ids of
        :meth:`other_job` would clash with the names other JOINs gave them)."""
        while True:
            j = self.rng.getrandbits(32)
            if j not in (0, 1, 0xFFFFFFFF, self.job_id):
                return j

    def header(self, msg_type=None, **fields) -> Header:
        """A header every field of which is valid on its own."""
        r = self.rng
        h = Header(msg_type if msg_type is not None else r.choice(list(MsgType)),
                   job_id=r.choice((self.job_id, self.other_job())) if self.job_id is not None else self.other_job(),
                   round=r.getrandbits(32), index=r.choice((0, 1, r.randrange(64), r.getrandbits(32))),
                   sender=r.choice(self.ranks + (r.randrange(64), r.getrandbits(16))),
                   flags=r.getrandbits(8) & 0x3F, dtype=r.choice(list(DType)), count=r.choice((0, 1, self.elements)),
                   exponent=r.randrange(-32768, 32768), next_exponent=r.choice((-150, 0, 32767, -32768)),
                   nsum=r.getrandbits(16), world=r.choice((0, 1, 2, 32, 33, 65535)), ref=r.getrandbits(32),
                   offset=r.choice((0, r.getrandbits(64))))
        for k, v in fields.items():
            setattr(h, k, v)
        return h

    def message(self, h: Header | None = None, payload: bytes | None = None) -> bytes:
        """A well-formed message: the payload length matches the count."""
        h = h or self.header()
        if payload is None:
            if h.flags & Flag.SHM:
                payload = b""
            else:
                h.count = min(h.count, 16384 // ITEMSIZE[h.dtype])
                payload = self.rng.randbytes(h.payload_bytes)
        elif h.dtype == DType.NONE:
            h.count = len(payload)
        return h.pack() + payload

    def set_field(self, data: bytes, name: str, value: int | None = None) -> bytes:
        """``data`` with header field ``name`` set to ``value`` (an extreme
        bit pattern when None), as far as ``data`` reaches."""
        off, size = FIELDS[name]
        if value is None:
            value = self.rng.choice(_EXTREMES + (self.rng.getrandbits(8 * size),))
        raw = (value & ((1 << 8 * size) - 1)).to_bytes(size, "big")
        buf = bytearray(data)
        buf[off:off + size] = raw[:max(0, len(buf) - off)]
        return bytes(buf)

    def mutate(self, data: bytes, times: int | None = None) -> bytes:
        """Bit flips, truncations, extensions, spliced bytes and extreme
        field values, 1 to 4 of them."""
        r = self.rng
        buf = bytearray(data)
        for _ in range(times or r.randint(1, 4)):
            op = r.randrange(6)
            if op == 0 and buf:  # bit flips, mostly in the header
                for _ in range(r.randint(1, 8)):
                    i = r.randrange(min(len(buf), HEADER_SIZE) if r.random() < 0.8 else len(buf))
                    buf[i] ^= 1 << r.randrange(8)
            elif op == 1 and buf:
                del buf[r.choice((r.randrange(len(buf)), r.randrange(min(len(buf), HEADER_SIZE + 1)))):]
            elif op == 2:
                buf += r.randbytes(r.choice((1, 3, 4, 64, r.randrange(2048))))
            elif op == 3 and buf:
                i = r.randrange(len(buf))
                buf[i:i + 8] = r.randbytes(min(8, len(buf) - i))
            else:
                buf = bytearray(self.set_field(bytes(buf), r.choice(list(FIELDS))))
        return bytes(buf)

    def hostile_json(self) -> bytes:
        """A control payload that breaks its schema (or JSON itself)."""
        r = self.rng
        pick = r.random()
        if pick < 0.2:
            return r.choice(HOSTILE_PAYLOADS)
        if pick < 0.4:
            obj = dict(r.choice(KNOWN_BAD_JOINS))
        else:
            obj = {"name": f"fuzz-{r.getrandbits(24):06x}", "world": 2, "timeout": 30.0, "elements": self.elements,
                   "max_elements": 2048, "slots": 8}
            if r.random() < 0.3:
                obj["shm"] = {"window": 4, "chunk_bytes": 4096}
            for _ in range(r.randint(1, 3)):
                key = r.choice(("name", "world", "timeout", "elements", "max_elements", "slots", "shm", "auth",
                                "job", "admin", "extra"))
                if key == "shm" and r.random() < 0.5:
                    obj[key] = {"window": r.choice(HOSTILE_VALUES), "chunk_bytes": r.choice(HOSTILE_VALUES)}
                elif r.random() < 0.2:
                    obj.pop(key, None)
                else:
                    obj[key] = r.choice(HOSTILE_VALUES)
        text = json.dumps(obj)  # NaN and Infinity as Python's json writes them
        if r.random() < 0.1:
            text = text[:r.randrange(len(text) + 1)]
        return text.encode()

    def control(self, msg_type: MsgType | None = None, job_id: int | None = None) -> bytes:
        """A control message (JOIN, STATS, HELLO, LEAVE, ...) with a hostile payload."""
        r = self.rng
        t = msg_type or r.choice((MsgType.JOIN, MsgType.JOIN, MsgType.JOIN, MsgType.STATS, MsgType.HELLO,
                                  MsgType.LEAVE, MsgType.JOIN_OK, MsgType.ERROR, MsgType.HELLO_OK, MsgType.STATS_OK))
        h = self.header(t, dtype=DType.NONE, flags=0, job_id=self.other_job() if job_id is None else job_id,
                        world=r.choice((1, 2, 3, 32, 33, 0, 65535)))
        h.sender = r.randrange(h.world) if h.world and r.random() < 0.7 else r.getrandbits(16)
        return self.message(h, self.hostile_json())

    # -- datagrams (switch mode) ---------------------------------------------------------

    def forged_push(self) -> bytes:
        """A well-formed PUSH (or a parent's RESULT) of the running job,
        naming a real rank: from any source but that rank's, it must be
        refused as not admitted."""
        r = self.rng
        t = MsgType.PUSH if r.random() < 0.8 else MsgType.RESULT
        job = self.job_id if self.job_id is not None else self.other_job()
        h = Header(t, job_id=job, round=r.getrandbits(32), index=r.randrange(4), sender=r.choice(self.ranks),
                   flags=r.choice((0, Flag.VERSION, Flag.RETRANSMIT, Flag.UPLINK | Flag.VERSION)),
                   dtype=DType.INT32, count=self.elements, ref=r.randrange(1, 1 << 20),
                   next_exponent=r.choice((-150, 32767)), world=self.world)
        return h.pack() + r.randbytes(4 * self.elements)

    def member_datagram(self, job_id: int, rank: int, elements: int, slots: int) -> bytes:
        """A PUSH, PROBE or RESULT from a member of a job of the fuzzer's
        own, on a few slots with nearby, equal, stale and far tags, odd
        flags, exponents and counts: the slot rules' every branch, on a
        slice no other job uses."""
        r = self.rng
        t = r.choice((MsgType.PUSH,) * 6 + (MsgType.PROBE, MsgType.RESULT))
        tag = r.choice((1, 2, 2, 3, 3, 4, 5, 0, 2 ** 31, 2 ** 32 - 1))
        h = Header(t, job_id=job_id, round=r.getrandbits(8), sender=rank if r.random() < 0.9 else r.randrange(40),
                   index=r.randrange(min(slots, 3)) if r.random() < 0.9 else r.choice((slots, 2 ** 32 - 1)),
                   flags=(tag & 1) | r.choice((0, 0, 0, Flag.RETRANSMIT, Flag.UPLINK, Flag.OP_MAX, Flag.LITTLE_ENDIAN)),
                   dtype=DType.INT32 if r.random() < 0.9 else r.choice(list(DType)),
                   count=elements if r.random() < 0.9 else r.choice((0, 1, elements + 1)),
                   exponent=r.choice((0, 0, 0, 7, -150, 32767)), next_exponent=r.choice((-150, 0, 9, 32767)),
                   world=r.getrandbits(16), ref=tag, offset=r.choice((0, 64, 2 ** 64 - 1)))
        if t == MsgType.PROBE:
            return h.pack() + (b"" if r.random() < 0.9 else b"\0" * 4)
        return h.pack() + r.randbytes(4 * elements + r.choice((0,) * 9 + (-4, 4)))

    def member_join(self, job_id: int, rank: int, world: int, elements: int, slots: int) -> bytes:
        """A well-formed JOIN of a job of the fuzzer's own, asking for its K
        and slots, so that its members know both without reading replies."""
        payload = wire.json_payload({"name": f"fuzz-own-{job_id:08x}", "elements": elements, "slots": slots})
        return Header(MsgType.JOIN, job_id=job_id, sender=rank, world=world).pack_for(payload) + payload

    DATAGRAM_KINDS = ("random", "mutated", "short", "magic", "version", "reserved", "type", "dtype", "length",
                      "unknown_job", "huge", "control", "forged", "probe", "leave_other", "known_bad_join")

    def datagram(self, kind: str) -> bytes:
        r = self.rng
        if kind == "random":
            return self.random_bytes()
        if kind == "mutated":
            return self.mutate(self.message())
        if kind == "short":
            return self.message()[:r.randrange(HEADER_SIZE)]
        if kind in ("magic", "version", "reserved", "type", "dtype"):
            name = {"type": "msg_type"}.get(kind, kind)
            bad = {"magic": r.choice((0, 0x6EA6, wire.MAGIC ^ 1, r.getrandbits(16))),
                   "version": r.choice((0, 2, 255)), "reserved": r.choice((1, 1 << 31, 0xFFFFFFFF)),
                   "msg_type": r.choice((0, 13, 200, 255)), "dtype": r.choice((6, 99, 255))}[name]
            while name == "magic" and bad == wire.MAGIC:
                bad = r.getrandbits(16)
            base = self.forged_push() if r.random() < 0.5 else self.message()
            return self.set_field(base, name, bad)
        if kind == "length":
            data = self.forged_push()
            return data[:-r.randint(1, 4)] if r.random() < 0.5 else data + r.randbytes(r.randint(1, 8))
        if kind == "unknown_job":
            h = Header(MsgType.PUSH, job_id=self.other_job(), index=r.randrange(8), sender=r.randrange(4),
                       dtype=DType.INT32, count=self.elements, ref=1)
            return h.pack() + bytes(4 * self.elements)
        if kind == "huge":
            data = self.forged_push()
            for name in r.sample(("count", "world", "index", "offset", "sender", "nsum", "exponent", "ref"), 2):
                data = self.set_field(data, name)
            return data
        if kind == "control":
            return self.control()
        if kind == "known_bad_join":
            h = Header(MsgType.JOIN, job_id=self.other_job(), sender=0, world=2)
            return self.message(h, json.dumps(r.choice(KNOWN_BAD_JOINS)).encode())
        job = self.job_id if self.job_id is not None else self.other_job()
        if kind == "forged":
            return self.forged_push()
        if kind == "probe":
            h = Header(MsgType.PROBE, job_id=r.choice((job, self.other_job())), index=r.choice((0, 1, 1 << 31)),
                       sender=r.choice(self.ranks), flags=r.getrandbits(1), ref=r.getrandbits(32))
            return h.pack() + (b"" if r.random() < 0.8 else r.randbytes(4))
        if kind == "leave_other":
            return Header(MsgType.LEAVE, job_id=job, sender=r.choice(self.ranks), world=self.world).pack()
        raise ValueError(f"no datagram kind {kind!r}")

    # -- multipart messages (service) -------------------------------------------------------

    MESSAGE_KINDS = ("random_frames", "empty_frame", "header_only", "three_frames", "empty_frames", "long_header",
                     "mutated", "short", "unknown_job", "forged", "length", "control", "leave_other",
                     "known_bad_join", "wrong_endpoint")

    def frames(self, kind: str) -> list[bytes]:
        r = self.rng
        if kind == "random_frames":
            return [self.random_bytes(r.choice((0, 48, r.randrange(200)))) for _ in range(r.randint(1, 5))]
        if kind == "empty_frame":
            return [b""]
        if kind == "header_only":
            h = self.header(r.choice((MsgType.PUSH, MsgType.JOIN, MsgType.STATS)), dtype=DType.INT32,
                            count=r.choice((1, 16)), flags=0)
            return [h.pack()]
        if kind == "three_frames":
            data = self.message(self.header(MsgType.PUSH, flags=0))
            return [data[:HEADER_SIZE], data[HEADER_SIZE:], r.randbytes(r.choice((0, 4, 100)))] + \
                [b""] * r.randrange(3)
        if kind == "empty_frames":
            return [b""] * r.randint(2, 6)
        if kind == "long_header":  # a valid header with bytes after it, in the header frame
            data = self.message(self.header(flags=0))
            return [data[:HEADER_SIZE] + r.randbytes(r.choice((1, 4, 64))), data[HEADER_SIZE:]]
        if kind == "mutated":
            data = self.mutate(self.message())
            return [data[:HEADER_SIZE], data[HEADER_SIZE:]]
        if kind == "short":
            return [self.message()[:r.randrange(HEADER_SIZE)], r.randbytes(r.randrange(8))]
        if kind == "unknown_job":
            h = Header(MsgType.PUSH, job_id=self.other_job(), sender=r.randrange(4), dtype=DType.FLOAT32,
                       count=16, flags=Flag.LITTLE_ENDIAN)
            return [h.pack(), r.randbytes(64)]
        if kind == "forged":
            h = Header(MsgType.PUSH, job_id=self.job_id if self.job_id is not None else self.other_job(),
                       round=r.randrange(1 << 20), index=r.randrange(16), sender=r.choice(self.ranks),
                       dtype=r.choice((DType.INT32, DType.FLOAT32)), count=r.choice((1, 256)), flags=Flag.LITTLE_ENDIAN)
            return [h.pack(), r.randbytes(h.payload_bytes)]
        if kind == "length":
            h = Header(MsgType.PUSH, job_id=r.choice((self.job_id or 0, self.other_job())), sender=0,
                       dtype=DType.FLOAT32, count=r.choice((1, 16, 0xFFFFFFFF)), flags=Flag.LITTLE_ENDIAN)
            return [h.pack(), r.randbytes(max(0, h.payload_bytes % 997 + r.choice((-1, 1, 3))))]
        if kind == "control":
            data = self.control()
            return [data[:HEADER_SIZE], data[HEADER_SIZE:]] if len(data) > HEADER_SIZE else [data]
        if kind == "known_bad_join":
            payload = json.dumps(r.choice(KNOWN_BAD_JOINS)).encode()
            return [Header(MsgType.JOIN, job_id=self.other_job(), sender=0, world=2).pack_for(payload), payload]
        if kind == "leave_other":
            job = self.job_id if self.job_id is not None else self.other_job()
            return [Header(MsgType.LEAVE, job_id=job, sender=r.choice(self.ranks), world=self.world).pack()]
        if kind == "wrong_endpoint":  # what a shard takes; the campaign sends it to the control endpoint
            return self.frames(r.choice(("forged", "control", "unknown_job")))
        raise ValueError(f"no message kind {kind!r}")

    def member_push(self, job_id: int, sender: int, elements: int) -> list[bytes]:
        """A hostile PUSH from a member of a job of the fuzzer's own: any
        dtype, count, flag, offset and exponent; sums of its own job only."""
        r = self.rng
        h = Header(MsgType.PUSH, job_id=job_id, round=r.randrange(4), index=r.choice((0, 1, 2, wire.SCALE_INDEX,
                                                                                       wire.PLAN_INDEX)),
                   sender=sender, flags=r.getrandbits(6), dtype=r.choice(list(DType)),
                   count=r.choice((0, 1, 7, elements, elements, 1 << 20)), exponent=r.choice((0, -150, 32767, -32768)),
                   next_exponent=r.choice((-150, 0, 32767)), ref=r.choice((0, 1, 2 ** 31, 2 ** 32 - 1)),
                   offset=r.choice((0, 64, 2 ** 63)))
        payload = b"" if h.flags & Flag.SHM else r.randbytes(min(h.payload_bytes, 4 * elements))
        if r.random() < 0.1:
            payload = payload[:-1] if payload else b"\0"
        return [h.pack(), payload]


# -- campaigns ------------------------------------------------------------------------------


def _loopback_source(host: str, i: int) -> str:
    """Sources for datagrams: other loopback addresses when the target is
    on loopback (foreign hosts, as far as the aggregator can tell)."""
    return f"127.0.0.{2 + i}" if host.startswith("127.") else "0.0.0.0"


class _Tally:
    def __init__(self):
        self.sent = collections.Counter()
        self.replies = collections.Counter()
        self.bytes_sent = self.bytes_received = 0

    def reply(self, data) -> None:
        self.bytes_received += len(data)
        try:
            self.replies[wire.unpack_header(data).msg_type.name] += 1
        except wire.WireError as exc:
            self.replies[f"malformed_{exc.reason}"] += 1

    def result(self, started: float) -> dict:
        return {"sent": dict(self.sent), "total": sum(self.sent.values()), "replies": dict(self.replies),
                "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "seconds": round(time.monotonic() - started, 3)}


def _budget(seconds, count, default):
    """A predicate that says when a campaign has sent enough, and shows
    how far it is, a tenth at a time."""
    from aggnet.progress import Progress

    if seconds is None and count is None:
        count = default
    start = time.monotonic()
    deadline = None if seconds is None else start + seconds
    progress = Progress("aggnet fuzz", 10)

    def done(n: int) -> bool:
        now = time.monotonic()
        share = max(n / count if count else 0.0, (now - start) / seconds if seconds else 0.0)
        while progress.done < min(int(share * 10), 10):
            progress.step(f"{n:,} messages")
        finished = (count is not None and n >= count) or (deadline is not None and now >= deadline)
        if finished:
            progress.close()
        return finished

    return done


def _pace(rate, n: int, started: float) -> None:
    if rate:
        ahead = n / rate - (time.monotonic() - started)
        if ahead > 0:
            time.sleep(ahead)


def target_job(address: str, job: str | None) -> dict | None:
    """What the target's STATS says about job ``job`` (by name), or about
    its only job; None when it says nothing."""
    from aggnet.client.stats import query

    try:
        stats = query(address, timeout=3.0)
    except Exception:
        return None
    shards = stats.get("shards")  # a service's per-shard tables (a switch says how many it has)
    tables = [stats.get("jobs", {})] + [(s or {}).get("jobs", {}) for s in (shards if isinstance(shards, list) else [])]
    for table in tables:
        for name, info in table.items():
            if job is None or name == job:
                return {"name": name, **info}
    return None


def udp_campaign(address: str, fuzzer: Fuzzer, done, tally: _Tally, rate: float | None = None,
                 sources: int = 8, hijack: bool = False) -> None:
    """Datagrams at a switch-mode aggregator's shards from ``sources``
    sockets: control messages at shard 0's port (the one that takes them),
    the rest at any shard's, and members of jobs of the fuzzer's own."""
    from aggnet.protocol.address import parse

    addr = parse(address)
    dest = (socket.gethostbyname(addr.host), addr.port)
    socks = []
    for i in range(sources):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.bind((_loopback_source(dest[0], i), 0))
        except OSError:
            s.bind(("0.0.0.0", 0))
        s.setblocking(False)
        socks.append(s)
    ports = _switch_ports(socks[0], dest)
    kinds = fuzzer.DATAGRAM_KINDS + ("member",) + (("hijack",) if hijack else ())
    weights = [8 if k in ("mutated", "forged", "random", "member") else 3 if k == "control" else 2 for k in kinds]
    own = []  # (job id, [(socket, rank)]): jobs of the fuzzer's own, K and slots as it asked
    k, slots = fuzzer.elements, 8
    r = fuzzer.rng
    started = time.monotonic()
    n = 0
    try:
        while not done(n):
            kind = r.choices(kinds, weights)[0]
            s, to = r.choice(socks), (dest[0], r.choice(ports))
            if kind == "hijack":
                data, to = _hijack_join(fuzzer), dest
            elif kind == "member":
                if len(own) < 3 or (len(own) < 6 and r.random() < 0.001):
                    job_id, world = fuzzer.fresh_job(), r.choice((1, 2, 2))
                    members = list(zip(r.sample(socks, world), range(world)))
                    for ms, rank in members:
                        ms.sendto(fuzzer.member_join(job_id, rank, world, k, slots), dest)
                        tally.sent["member_join"] += 1
                    own.append((job_id, members))
                job_id, members = r.choice(own)
                s, rank = r.choice(members)
                data = fuzzer.member_datagram(job_id, rank, k, slots)
            else:
                data = fuzzer.datagram(kind)
                if kind in ("control", "known_bad_join", "leave_other"):
                    to = dest
            try:
                s.sendto(data, to)
                tally.sent[kind] += 1
                tally.bytes_sent += len(data)
            except BlockingIOError:
                tally.sent["send_would_block"] += 1
                time.sleep(0.001)
            except OSError:  # EMSGSIZE, or an ICMP error from an earlier datagram
                tally.sent["send_error"] += 1
            n += 1
            if n % 256 == 0:
                _drain_udp(socks, tally)
                _pace(rate, n, started)
        time.sleep(0.2)
        _drain_udp(socks, tally)
    finally:
        for s in socks:
            s.close()


def _switch_ports(sock, dest) -> list[int]:
    """The ports of a switch-mode aggregator's shards, from its HELLO_OK."""
    from aggnet.client.switch import udp_request

    blocking = sock.gettimeout()
    try:
        reply = udp_request(sock, dest, MsgType.HELLO, b"", MsgType.HELLO_OK, 3.0, "HELLO")
        shards = (reply or {}).get("shards", [])
        return [int(str(a).rsplit(":", 1)[1]) for a in shards] or [dest[1]]
    except (AggnetError, WireError, ValueError, IndexError, OSError):
        return [dest[1]]
    finally:
        sock.settimeout(blocking)


def _hijack_join(fuzzer: Fuzzer) -> bytes:
    """A JOIN that claims a real rank of the running job (its name and
    world): an aggregator that takes it hands the rank to a stranger."""
    h = Header(MsgType.JOIN, job_id=fuzzer.job_id, sender=fuzzer.rng.choice(fuzzer.ranks), world=fuzzer.world)
    return fuzzer.message(h, wire.json_payload({"name": fuzzer.name or str(fuzzer.job_id), "slots": 0,
                                                "max_elements": 2048}))


def _drain_udp(socks, tally: _Tally) -> None:
    for s in socks:
        while True:
            try:
                data = s.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # ICMP port unreachable from an earlier send
                tally.replies["icmp_error"] += 1
                continue
            tally.reply(data)


def zmq_campaign(address: str, fuzzer: Fuzzer, done, tally: _Tally, *, rate: float | None = None,
                 peers: int = 4, hijack: bool = False, deaf: bool = False) -> None:
    """Multipart messages at a service's control endpoint and shards, from
    ``peers`` DEALERs per endpoint, a short-lived one now and then (its
    replies have nowhere to go), members of the fuzzer's own jobs, and a
    few raw TCP connections that never speak ZMTP properly. With ``deaf``,
    a peer per endpoint also sends junk and never reads what it earns: a
    service whose replies block on a full queue stalls on it."""
    import zmq

    from aggnet.protocol.address import parse, reached_via
    from aggnet.transport.zmq import zmq_endpoint

    ctx = zmq.Context.instance()
    control = parse(address)
    # a tcp:// service takes the same messages from peers of its own
    # transport (frames after the first travel as one payload)
    plain = control.scheme == "tcp"
    dealer = _TcpPeer if plain else functools.partial(_dealer, ctx)
    first = str(control) if plain else zmq_endpoint(control)
    endpoints = [first] + [str(reached_via(a, control)) if plain else zmq_endpoint(parse(a))
                           for a in _shard_map(dealer, first)]
    socks = []
    for ep in endpoints:
        for _ in range(peers):
            socks.append((ep, dealer(ep)))
    members = []  # (socket, job id, rank): the fuzzer's own jobs on shards
    deaf_socks = [dealer(ep) for ep in endpoints] if deaf else []
    kinds, weights = _zmq_kinds(fuzzer, hijack, deaf)
    started = time.monotonic()
    n = 0
    r = fuzzer.rng
    try:
        while not done(n):
            kind = r.choices(kinds, weights)[0]
            ep, s = r.choice(socks)
            if kind == "churn":
                s = dealer(ep)
                frames = fuzzer.frames(r.choice(fuzzer.MESSAGE_KINDS))
            elif kind == "raw_tcp":
                if control.scheme in ("zmq+tcp", "tcp"):
                    _raw_tcp(ep, fuzzer, plain)
                tally.sent[kind] += 1
                n += 1
                continue
            elif kind == "member":
                if len(members) < 4 or r.random() < 0.02:
                    members += _join_own_job(dealer, endpoints[1 + r.randrange(len(endpoints) - 1)], fuzzer, tally)
                    while len(members) > 16:  # an abandoned member: its job stalls, then lingers
                        members.pop(0)[0].close(linger=0)
                ms, job_id, rank = r.choice(members)
                s, frames = ms, fuzzer.member_push(job_id, rank, 16)
            elif kind == "hijack":
                ep, s = r.choice(socks[peers:])  # a shard's
                frames = _split(_hijack_join(fuzzer))
            elif kind == "wrong_endpoint":
                ep, s = r.choice(socks[:peers])  # the control endpoint's
                frames = fuzzer.frames(kind)
            elif kind == "deaf":
                s, frames = r.choice(deaf_socks), fuzzer.frames(r.choice(("short", "forged", "unknown_job")))
            else:
                frames = fuzzer.frames(kind)
            try:
                s.send_multipart(frames, zmq.NOBLOCK)
                tally.sent[kind] += 1
                tally.bytes_sent += sum(len(f) for f in frames)
            except zmq.Again:
                tally.sent["send_would_block"] += 1
            if kind == "churn":
                s.close(linger=100)
            n += 1
            if n % 64 == 0:
                _drain_zmq([s for _, s in socks] + [m[0] for m in members], tally)
                _pace(rate, n, started)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:  # the last replies, counted
            if not _drain_zmq([s for _, s in socks] + [m[0] for m in members], tally):
                time.sleep(0.05)
    finally:
        for s in [s for _, s in socks] + [m[0] for m in members] + deaf_socks:
            s.close(linger=0)


def _zmq_kinds(fuzzer: Fuzzer, hijack: bool, deaf: bool) -> tuple[tuple, list]:
    """The kinds of message the ZeroMQ campaign sends, and how often."""
    kinds = fuzzer.MESSAGE_KINDS + ("member", "churn", "raw_tcp") + (("hijack",) if hijack else ()) + \
        (("deaf",) if deaf else ())
    weights = [6 if k in ("mutated", "forged", "member", "deaf") else 1 if k in ("churn", "raw_tcp") else 3
               for k in kinds]
    return kinds, weights


def _split(data: bytes) -> list[bytes]:
    return [data[:HEADER_SIZE], data[HEADER_SIZE:]] if len(data) > HEADER_SIZE else [data]


def _dealer(ctx, endpoint: str):
    import zmq

    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    return s


class _TcpPeer:
    """A peer of a tcp:// service with the DEALER calls the campaign makes:
    the frames after the first travel as one payload, as a shard would
    read them over ZeroMQ."""

    def __init__(self, address: str):
        from aggnet.transport import connect

        self._conn = connect([address])
        self._held = None

    def send_multipart(self, frames, flags: int = 0) -> None:
        frames = [bytes(f) for f in frames]
        self._conn.send(0, frames[0] if frames else b"", b"".join(frames[1:]) if len(frames) > 1 else None)

    def poll(self, timeout_ms: int) -> bool:
        if self._held is None:
            self._held = self._conn.recv(timeout_ms / 1000)
        return self._held is not None

    def recv_multipart(self, flags: int = 0) -> list[bytes]:
        import zmq

        m, self._held = self._held or self._conn.recv(0 if flags else 5.0), None
        if m is None:
            raise zmq.Again()
        return [bytes(m.header)] + ([bytes(m.payload)] if len(m.payload) else [])

    def close(self, linger: int = 0) -> None:
        self._conn.close()


def _shard_map(dealer, endpoint: str) -> list[str]:
    """The shards' addresses, from the control endpoint's HELLO_OK."""
    s = dealer(endpoint)
    try:
        s.send_multipart([Header(MsgType.HELLO).pack()])
        if not s.poll(5000):
            raise ConnectionError(f"{endpoint} did not answer HELLO within 5s")
        frames = s.recv_multipart()
        h = wire.unpack_header(frames[0])
        if h.msg_type != MsgType.HELLO_OK:
            raise ConnectionError(f"{endpoint} answered HELLO with {h.msg_type.name}")
        return list(wire.parse_json(frames[1] if len(frames) > 1 else b"").get("shards", []))
    finally:
        s.close(linger=0)


def _join_own_job(dealer, endpoint: str, fuzzer: Fuzzer, tally: _Tally) -> list:
    """DEALERs that joined a fresh job (world 1 or 2, every rank the
    fuzzer's, half of them over tiny shared-memory rings) at a shard, so
    that hostile PUSHes reach the summation code and not only admission."""
    r = fuzzer.rng
    job_id, world = fuzzer.fresh_job(), r.choice((1, 2))
    fields = {"name": f"fuzz-own-{job_id:08x}", "timeout": 1.0}
    if r.random() < 0.5:
        fields["shm"] = {"window": 2, "chunk_bytes": 256}
    payload = wire.json_payload(fields)
    members = []
    for rank in range(world):
        s = dealer(endpoint)
        s.send_multipart([Header(MsgType.JOIN, job_id=job_id, sender=rank, world=world).pack_for(payload), payload])
        tally.sent["member_join"] += 1
        members.append((s, job_id, rank))
    return members


def _raw_tcp(endpoint: str, fuzzer: Fuzzer, plain: bool = False) -> None:
    """A TCP peer that sends bytes that are not ZMTP (not aggnet's framing,
    at a ``plain`` tcp:// service), or a greeting with flipped bits, and
    hangs up."""
    host, port = endpoint[len("tcp://"):].rsplit(":", 1)
    if plain:
        from aggnet.transport.tcp import GREETING, frame_head

        greeting = GREETING + frame_head(Header(MsgType.PUSH).pack(), 64)
    else:
        greeting = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL" + b"\0" * 16 + b"\0" + b"\0" * 31
    data = fuzzer.mutate(greeting) + fuzzer.random_bytes(fuzzer.rng.randrange(256))
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0) as s:
            s.sendall(data if fuzzer.rng.random() < 0.7 else fuzzer.random_bytes())
    except OSError:
        pass


def _drain_zmq(socks, tally: _Tally) -> int:
    import zmq

    got = 0
    for s in socks:
        while True:
            try:
                frames = s.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            got += 1
            tally.reply(frames[0])
            tally.bytes_received += sum(len(f) for f in frames[1:])
    return got


def run_campaign(address: str, seconds: float | None = None, datagrams: int | None = None,
                 messages: int | None = None, seed: int = 0, job_id: int | None = None, *, job: str | None = None,
                 ranks=None, elements: int | None = None, rate: float | None = None, hijack: bool = False,
                 deaf: bool = False) -> dict:
    """Send hostile inputs at the aggregator at ``address`` until
    ``seconds`` pass or ``datagrams`` (udp://) / ``messages`` (ZeroMQ)
    are sent (10,000 when neither is given).

    ``job_id`` (or ``job``, a name) is a running job to forge packets for;
    its world, ranks and elements per packet come from the target's STATS
    where it shows them. ``hijack`` adds JOINs that claim the job's real
    ranks from foreign sources, which an aggregator must refuse (with job
    keys) but an open one takes: they break the job, so they are off
    unless asked for. ``deaf`` adds peers that never read their replies
    (ZeroMQ). Returns what was sent, by kind, and what came back:
    ``{"sent": {kind: n}, "total", "replies": {type: n}, "bytes_sent",
    "bytes_received", "seconds"}``.
    """
    udp = address.startswith("udp://")
    info = target_job(address, job) if (job_id is not None or job is not None) else None
    if job is not None and job_id is None:
        from aggnet.protocol.wire import job_id_of

        job_id = info["id"] if info else job_id_of(job)
    world = info.get("world") if info else None
    if ranks is None:
        ranks = range(world) if world else (0, 1)
    k = elements or (info or {}).get("elements") or 64
    fuzzer = Fuzzer(seed, job_id, tuple(ranks), elements=k, name=job or (info or {}).get("name"), world=world)
    tally = _Tally()
    started = time.monotonic()
    if udp:
        udp_campaign(address, fuzzer, _budget(seconds, datagrams, 10000), tally, rate, hijack=hijack)
    else:
        zmq_campaign(address, fuzzer, _budget(seconds, messages, 10000), tally, rate=rate, hijack=hijack,
                     deaf=deaf)
    return tally.result(started)


# -- aggnet fuzz ------------------------------------------------------------------------------


def add_arguments(p) -> None:
    p.add_argument("--target", required=True, metavar="ADDRESS",
                   help="the aggregator: udp://host:port (switch mode) or its control endpoint (tcp://..., "
                        "zmq+tcp://...)")
    p.add_argument("--seconds", type=float, default=None, help="run this long")
    p.add_argument("--count", type=int, default=None, help="send this many datagrams or messages (default 10000 "
                                                           "when --seconds is not given)")
    p.add_argument("--seed", type=int, default=0, help="seed of every choice (a campaign replays from its seed)")
    p.add_argument("--job", default=None, help="a running job (name) to forge packets for")
    p.add_argument("--rate", type=float, default=None, help="at most this many per second")
    p.add_argument("--hijack", action="store_true",
                   help="also send JOINs claiming the job's real ranks (they take it over on an aggregator "
                        "without job keys)")
    p.add_argument("--deaf", action="store_true",
                   help="ZeroMQ: also peers that never read their replies (a service whose sends block stalls)")
    p.add_argument("--hoard", action="store_true",
                   help="tcp:// service: then peers that try to make each shard hold memory (the largest payloads, "
                        "announced and never finished; members that read none of their results), sending GBs; "
                        "fails where a shard grew past its --receive-budget and --unsent-budget")


def drop_counters(stats: dict) -> dict:
    """The ``dropped_*``, ``refused_*`` and ``internal_error`` counters of
    a STATS answer (either kind of aggregator), summed over shards."""
    totals = stats.get("totals", {})
    return {k: v for k, v in sorted(totals.items())
            if k.startswith(("dropped_", "refused_")) or k == "internal_error"}


def health(before: dict, after: dict) -> list[str]:
    """What is wrong with a target, from its STATS before and after a
    campaign: shards that did not answer or restarted, and messages that
    made it raise."""
    problems = []
    shards = after.get("shards")
    if isinstance(shards, list):
        silent = [i for i, s in enumerate(shards) if s is None]
        if silent:
            problems.append(f"shard(s) {silent} did not answer STATS")
    if after.get("restarts", 0) > before.get("restarts", 0):
        problems.append(f"{after['restarts'] - before.get('restarts', 0)} shard restart(s): a shard process died")
    raised = after.get("totals", {}).get("internal_error", 0) - before.get("totals", {}).get("internal_error", 0)
    if raised > 0:
        problems.append(f"{raised} message(s) made it raise (internal_error; its log says where)")
    return problems


def _hoard(target: str, before: dict) -> list[str]:
    """Run the hoard (aggnet/cli/hoard.py), print what it did, and return
    what is wrong with the target after it."""
    from aggnet.cli import hoard
    from aggnet.client.stats import query

    def progress(phase: str, sent: int, closed: int) -> None:
        print(f"  hoard, {phase}: {sent / 2 ** 30:.2f} GiB sent, {closed} closed by the target", flush=True)

    print("hoard: peers that try to make each shard hold memory")
    try:
        out = hoard.hoard_campaign(target, progress=progress)
    except (OSError, KeyError, ValueError) as exc:
        return [f"the hoard could not run against {target}: {exc}"]
    print(f"hoard: {out['peers']['hoarder']} hoarders and {out['peers']['deaf']} deaf members sent "
          f"{out['bytes_sent'] / 2 ** 30:.2f} GiB; the target closed {out['closed_by_target']['hoarder']} "
          f"hoarders and {out['closed_by_target']['deaf']} deaf members")
    for i, s in enumerate(out["shards"]):
        if s["peak_rss_before"] is not None and s["peak_rss_after"] is not None:
            print(f"  shard {i}: peak resident {s['peak_rss_before'] >> 20} -> {s['peak_rss_after'] >> 20} MiB "
                  f"(budgets: receive {(s['receive_budget'] or 0) >> 20} MiB, unsent "
                  f"{(s['unsent_budget'] or 0) >> 20} MiB)")
    try:
        after = query(target, timeout=5.0)
    except Exception as exc:
        return [f"target {target} is DOWN or silent after the hoard: {exc}"]
    return health(before, after) + hoard.hoard_problems(out)


def main(args) -> int:
    from aggnet.client.stats import query

    if args.hoard and not args.target.startswith("tcp://"):
        print(f"aggnet fuzz: --hoard checks a tcp:// service's memory budgets; {args.target} is not tcp://",
              file=sys.stderr)
        return 2
    if not args.target.startswith(("udp://", "tcp://", "zmq+tcp://", "zmq+ipc://")):
        print(f"aggnet fuzz: cannot fuzz {args.target}: give udp:// (switch mode) or a tcp://, zmq+tcp:// or "
              f"zmq+ipc:// service address", file=sys.stderr)
        return 2
    try:
        before = query(args.target, timeout=3.0)
    except Exception as exc:
        print(f"aggnet fuzz: {args.target} does not answer STATS before the campaign: {exc}", file=sys.stderr)
        return 1
    udp = args.target.startswith("udp://")
    out = run_campaign(args.target, seconds=args.seconds, datagrams=args.count if udp else None,
                       messages=None if udp else args.count, seed=args.seed, job=args.job, rate=args.rate,
                       hijack=args.hijack, deaf=args.deaf)
    print(f"sent {out['total']} {'datagrams' if udp else 'messages'} in {out['seconds']:.1f}s (seed {args.seed}):")
    for kind, n in sorted(out["sent"].items()):
        print(f"  {kind:<18} {n}")
    print(f"replies: {json.dumps(out['replies'], sort_keys=True)} ({out['bytes_received']} bytes for "
          f"{out['bytes_sent']} sent)")
    try:
        after = query(args.target, timeout=5.0)
    except Exception as exc:
        print(f"target {args.target} is DOWN or silent after the campaign: {exc}")
        return 1
    was = drop_counters(before)
    print(f"target {args.target} answers STATS; its drop counters (change during the campaign):")
    for k, v in drop_counters(after).items():
        print(f"  {k:<36} {v:>10}  (+{v - was.get(k, 0)})")
    problems = health(before, after)
    if args.hoard and not problems:
        problems = _hoard(args.target, before)
    for p in problems:
        print(f"PROBLEM: {p}")
    if not problems:
        print(f"target {args.target} is up")
    return 1 if problems else 0
