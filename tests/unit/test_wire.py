"""The wire format: one definition, strict parsing, reasons for rejection."""

import struct

import pytest

from aggnet.protocol import wire
from aggnet.protocol.address import AddressError, advertised_as, parse, reached_via
from aggnet.transport import connect, listen
from aggnet.protocol.wire import DType, Flag, Header, MsgType, WireError


def sample() -> Header:
    return Header(MsgType.PUSH, job_id=0xDEADBEEF, round=7, index=3, sender=31, flags=Flag.VERSION | Flag.LITTLE_ENDIAN,
                  dtype=DType.INT32, count=64, exponent=-20, next_exponent=5, nsum=2, world=32, ref=9,
                  offset=2**40 + 5)


def test_round_trip_keeps_every_field():
    h = sample()
    assert wire.unpack_header(h.pack()) == h
    buf = bytearray(wire.HEADER_SIZE + 256)
    wire.pack_into(buf, h)
    got, payload = wire.unpack_message(buf)
    assert got == h and len(payload) == 256


def test_header_is_big_endian_with_magic_first():
    raw = sample().pack()
    assert raw[:2] == b"\xa6\x6e" and raw[2] == wire.VERSION and raw[3] == MsgType.PUSH
    assert struct.unpack_from(">I", raw, 8)[0] == 0xDEADBEEF


def test_field_table_matches_struct_layout():
    assert sum(bits for _, bits in wire.HEADER_FIELDS) == 8 * wire.HEADER_SIZE
    assert len(wire.HEADER_FIELDS) == len(wire.HEADER_FORMAT) - 1  # minus the '>'
    sizes = {"H": 16, "B": 8, "I": 32, "h": 16, "Q": 64}
    assert [sizes[c] for c in wire.HEADER_FORMAT[1:]] == [b for _, b in wire.HEADER_FIELDS]


@pytest.mark.parametrize(
    "mutate, reason, text",
    [
        (lambda b: b[:47], "short", "shorter than the 48-byte"),
        (lambda b: b"\x00\x00" + b[2:], "magic", "bad magic 0x0000"),
        (lambda b: b[:2] + b"\x09" + b[3:], "version", "wire version 9 is not supported"),
        (lambda b: b[:3] + b"\x63" + b[4:], "type", "unknown message type 99"),
        (lambda b: b[:5] + b"\x42" + b[6:], "dtype", "unknown dtype code 66"),
        (lambda b: b[:36] + b"\x00\x00\x00\x01" + b[40:], "reserved", "reserved header field is 1"),
    ],
)
def test_malformed_headers_are_rejected_with_the_reason(mutate, reason, text):
    with pytest.raises(WireError) as err:
        wire.unpack_header(mutate(sample().pack()))
    assert err.value.reason == reason and text in str(err.value)


def test_both_packers_refuse_a_field_out_of_range_with_the_same_error():
    h = Header(MsgType.PUSH, sender=1 << 16)
    with pytest.raises(ValueError, match="cannot pack aggnet header"):
        h.pack()
    with pytest.raises(ValueError, match="cannot pack aggnet header"):
        wire.pack_into(bytearray(wire.HEADER_SIZE), h)
    with pytest.raises(ValueError, match="buffer of 10 bytes"):
        wire.pack_into(bytearray(10), Header(MsgType.PUSH))


def test_payload_length_must_match_count():
    h = sample()
    with pytest.raises(WireError, match="payload of 255 bytes does not match count=64 of INT32 \\(256 bytes\\)") as err:
        wire.unpack_message(h.pack() + b"\0" * 255)
    assert err.value.reason == "length"
    h.flags |= Flag.SHM  # shared-memory payloads travel out of band
    wire.check_payload(h, 0)


def test_control_payloads_are_counted_json():
    payload = wire.json_payload({"a": 1})
    h = Header(MsgType.HELLO_OK)
    got = wire.unpack_header(h.pack_for(payload))
    wire.check_payload(got, len(payload))
    assert wire.parse_json(payload) == {"a": 1}
    with pytest.raises(WireError, match="not JSON"):
        wire.parse_json(b"{nope")
    assert wire.parse_error(wire.error_payload(wire.ErrorCode.STALL, "slow")) == ("stall", "slow")


def test_addresses_parse_and_unknown_schemes_list_the_known_ones():
    assert str(parse("zmq+tcp://127.0.0.1:5555")) == "zmq+tcp://127.0.0.1:5555"
    assert parse("zmq+ipc:///tmp/x.sock").path == "/tmp/x.sock"
    assert parse("udp://[::1]:9000").host == "::1"
    assert str(parse("tcp://[fd00::1]:5555")) == "tcp://[fd00::1]:5555"
    with pytest.raises(AddressError, match="unknown address scheme 'http'.*known schemes: tcp, zmq\\+tcp, zmq\\+ipc"):
        parse("http://example.com:80")
    with pytest.raises(AddressError, match="needs host and port"):
        parse("zmq+tcp://localhost")
    with pytest.raises(AddressError, match="absolute path"):
        parse("zmq+ipc://relative")
    with pytest.raises(AddressError, match="not a URL"):
        parse("localhost:5555")
    with pytest.raises(AddressError, match="has no message transport"):
        listen("udp://127.0.0.1:0")


@pytest.mark.parametrize("advertised,control,expected", [
    ("zmq+tcp://0.0.0.0:5556", "zmq+tcp://10.1.2.3:5555", "zmq+tcp://10.1.2.3:5556"),
    ("zmq+tcp://[::]:5556", "zmq+tcp://[fd00::1]:5555", "zmq+tcp://[fd00::1]:5556"),
    ("ucx://0.0.0.0:13338", "ucx://agg-host:13337", "ucx://agg-host:13338"),
    ("zmq+tcp://10.9.9.9:5556", "zmq+tcp://10.1.2.3:5555", "zmq+tcp://10.9.9.9:5556"),  # --advertise: as given
    ("zmq+ipc:///run/agg.sock.0", "zmq+ipc:///run/agg.sock", "zmq+ipc:///run/agg.sock.0"),
])
def test_a_wildcard_shard_address_is_reached_where_the_service_was(advertised, control, expected):
    assert str(reached_via(advertised, control)) == expected


def test_a_service_advertises_its_listen_address_or_the_host_it_was_given():
    assert str(advertised_as("zmq+tcp://0.0.0.0:5556", None)) == "zmq+tcp://0.0.0.0:5556"
    assert str(advertised_as("zmq+tcp://0.0.0.0:5556", "agg.example")) == "zmq+tcp://agg.example:5556"
    assert str(advertised_as("zmq+tcp://[::]:5556", "[fd00::7]")) == "zmq+tcp://[fd00::7]:5556"
    assert str(advertised_as("zmq+ipc:///run/a.0", "agg.example")) == "zmq+ipc:///run/a.0"


def test_listen_reports_the_bound_port_and_refuses_a_taken_one():
    with listen("zmq+tcp://127.0.0.1:0") as a:
        assert a.address.port > 0
        with pytest.raises(ConnectionError, match=f"cannot listen on zmq\\+tcp://127.0.0.1:{a.address.port}"):
            listen(str(a.address))
        with connect([str(a.address)]) as c:
            c.send(0, b"hello", b"payload")
            m = a.recv(5)
            assert bytes(m.header) == b"hello" and bytes(m.payload) == b"payload"
            assert a.send(m.peer, b"back")
            r = c.recv(5)
            assert r.peer == 0 and bytes(r.header) == b"back"
            c.wakeup()
            assert c.recv(5) is None  # woken, nothing received
        assert not a.send(b"no-such-peer", b"x")
