"""Properties of every wire and control message parser, over any input.

An aggregator parses bytes from anyone, so each parser has to be total:
any byte string is either parsed or refused with a reason the drop
counters know, never an exception of another kind. Examples run
derandomized (the same inputs on every run), and the inputs that once
broke a parser are pinned with ``@example``.
"""

from __future__ import annotations

import json
import math

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from aggnet.protocol import control, wire
from aggnet.protocol.control import ControlError
from aggnet.cli.fuzz import HOSTILE_PAYLOADS, HOSTILE_VALUES, KNOWN_BAD_JOINS
from aggnet.protocol.wire import HEADER_SIZE, DType, ErrorCode, Header, MsgType, WireError

PROPERTY = settings(max_examples=300, derandomize=True, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

#: the drop counters' keys a header or message can be refused with
HEADER_REASONS = {"short", "magic", "version", "type", "dtype", "reserved"}
MESSAGE_REASONS = HEADER_REASONS | {"length"}


def _u(bits):
    return st.integers(0, (1 << bits) - 1)


headers = st.builds(
    Header, msg_type=st.sampled_from(MsgType), job_id=_u(32), round=_u(32), index=_u(32), sender=_u(16),
    flags=_u(8), dtype=st.sampled_from(DType), count=_u(32), exponent=st.integers(-32768, 32767),
    next_exponent=st.integers(-32768, 32767), nsum=_u(16), world=_u(16), ref=_u(32), offset=_u(64),
)


@st.composite
def near_headers(draw):
    """A packed header with some bytes overwritten, cut short or extended:
    most inputs of interest are one byte away from valid."""
    buf = bytearray(draw(headers).pack())
    for pos, value in draw(st.lists(st.tuples(st.integers(0, HEADER_SIZE - 1), _u(8)), max_size=3)):
        buf[pos] = value
    cut = draw(st.one_of(st.none(), st.integers(0, HEADER_SIZE)))
    if cut is not None:
        del buf[cut:]
    return bytes(buf) + draw(st.binary(max_size=64))


any_bytes = st.one_of(st.binary(max_size=200), near_headers(), st.sampled_from(HOSTILE_PAYLOADS))

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20),
              st.sampled_from(HOSTILE_VALUES)),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)
_FIELD_NAMES = ("name", "world", "timeout", "shm", "window", "chunk_bytes", "elements", "max_elements", "slots",
                "auth", "nonce", "ts", "mac", "job", "admin")
#: objects that use the schema's field names with values of any type
control_objects = st.one_of(
    st.dictionaries(st.sampled_from(_FIELD_NAMES) | st.text(max_size=8), json_values, max_size=6),
    st.sampled_from(KNOWN_BAD_JOINS),
    st.fixed_dictionaries({"shm": st.fixed_dictionaries({"window": json_values, "chunk_bytes": json_values})}),
)


# -- the header ------------------------------------------------------------------------------------


@PROPERTY
@given(headers, st.binary(max_size=32))
def test_a_header_survives_pack_and_unpack(h, tail):
    packed = h.pack()
    assert len(packed) == HEADER_SIZE
    assert wire.unpack_header(packed + tail) == h
    buf = bytearray(HEADER_SIZE + len(tail))
    wire.pack_into(buf, h)
    assert bytes(buf[:HEADER_SIZE]) == packed


@PROPERTY
@given(any_bytes)
@example(b"")
@example(b"\xa6\x6e" + bytes(46))
def test_any_bytes_are_a_header_or_refused_with_a_known_reason(data):
    try:
        h = wire.unpack_header(data)
    except WireError as exc:
        assert exc.reason in HEADER_REASONS, exc.reason
        return
    # what parses is canonical: packing it again gives the same 48 bytes
    assert h.pack() == bytes(data[:HEADER_SIZE])


@PROPERTY
@given(headers, st.integers(-2, 2))
def test_out_of_range_header_fields_are_refused_when_packing(h, delta):
    h.sender = 65536 + delta if delta >= 0 else delta
    try:
        h.pack()
    except ValueError:
        assert not 0 <= h.sender <= 65535
    else:
        assert 0 <= h.sender <= 65535


# -- whole messages (datagram paths) ----------------------------------------------------------------


@st.composite
def messages(draw):
    """A message whose payload length is right, or off by a little."""
    h = draw(headers)
    h.count = draw(st.integers(0, 64))
    payload = draw(st.binary(min_size=h.payload_bytes, max_size=h.payload_bytes))
    if h.flags & wire.Flag.SHM:
        payload = b""
    data = h.pack() + payload
    return data[:len(data) - draw(st.integers(0, 2))] + draw(st.binary(max_size=2))


@PROPERTY
@given(st.one_of(any_bytes, messages()))
def test_any_bytes_are_a_message_or_refused_with_a_known_reason(data):
    try:
        h, payload = wire.unpack_message(data)
    except WireError as exc:
        assert exc.reason in MESSAGE_REASONS, exc.reason
        return
    expected = 0 if h.flags & wire.Flag.SHM else h.payload_bytes
    assert len(payload) == expected == len(data) - HEADER_SIZE


# -- JSON control payloads and ERROR texts ---------------------------------------------------------


@PROPERTY
@given(st.one_of(any_bytes, json_values.map(lambda v: json.dumps(v).encode())))
@example(b"1" * 4301)  # an integer past Python's 4300-digit conversion limit
@example(b"[" * 1500)  # nesting past the recursion limit
@example('{"a": 1}'.encode("utf-16"))
def test_parse_json_returns_an_object_or_refuses_as_json(data):
    try:
        obj = wire.parse_json(data)
    except WireError as exc:
        assert exc.reason == "json"
        return
    assert isinstance(obj, dict)


@PROPERTY
@given(st.dictionaries(st.text(max_size=10), json_values.filter(lambda v: "NaN" not in json.dumps(v)), max_size=5))
def test_json_payloads_round_trip(obj):
    assert wire.parse_json(wire.json_payload(obj)) == obj


@PROPERTY
@given(any_bytes)
@example(b"1" * 4301)
@example(b"[" * 1500)
def test_parse_error_never_raises(data):
    code, text = wire.parse_error(data)
    assert isinstance(code, str) and isinstance(text, str)


@PROPERTY
@given(st.sampled_from(ErrorCode), st.text())
def test_error_payloads_round_trip(code, text):
    assert wire.parse_error(wire.error_payload(code, text)) == (code.value, text)


# -- control schemas ---------------------------------------------------------------------------------


def _encode(obj) -> bytes:
    return json.dumps(obj).encode()  # NaN and Infinity as a peer's json module may write them


def _parse(schema, payload):
    try:
        return control.parse(schema, payload, "TEST")
    except ControlError as exc:
        assert exc.code in (ErrorCode.MALFORMED, ErrorCode.REFUSED), exc.code
        assert isinstance(exc.reason, str) and exc.reason
        return None


def _within(schema: tuple, info: dict) -> None:
    """Every field the parser returned has its schema's type and bounds."""
    for f in schema:
        if f.name not in info:
            continue
        value = info[f.name]
        if f.kind == "int":
            assert type(value) is int and f.lo <= value <= f.hi, (f.name, value)
        elif f.kind == "number":
            assert type(value) is float and math.isfinite(value) and f.lo <= value <= f.hi, (f.name, value)
        elif f.kind in ("str", "hex"):
            assert isinstance(value, str) and f.lo <= len(value) <= f.hi and value.isprintable(), (f.name, value)
        elif f.kind == "object":
            assert isinstance(value, dict)
            _within(f.schema, value)


@PROPERTY
@given(st.one_of(any_bytes, control_objects.map(_encode)))
@example(b'{"timeout":' + b"[" * 1500 + b"]" * 1500 + b"}")
@example(b"1" * 5000)
def test_a_join_payload_is_parsed_within_its_schema_or_refused(payload):
    info = _parse(control.JOIN, payload)
    if info is None:
        return
    _within(control.JOIN, info)
    assert "timeout" in info and "elements" in info and "slots" in info  # the defaults
    if "shm" in info:
        try:
            control.check_shm(2, info["shm"])
        except ControlError as exc:
            assert exc.reason == "field_shm"


@PROPERTY
@given(st.one_of(any_bytes, control_objects.map(_encode)))
def test_a_stats_payload_is_parsed_within_its_schema_or_refused(payload):
    info = _parse(control.STATS, payload)
    if info is not None:
        _within(control.STATS, info)
