"""Properties of the control-message schema and of job-key signatures:
any bytes are parsed or refused with a reason, never anything else; what a
worker signs, an aggregator verifies, and nothing else."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from aggnet.protocol import control, keys
from aggnet.protocol.control import ControlError

settings.register_profile("aggnet-control", max_examples=300, derandomize=True, deadline=None)
settings.load_profile("aggnet-control")

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 80, 2 ** 80) | st.floats(allow_nan=True) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12)
join_keys = st.sampled_from(["name", "world", "timeout", "shm", "elements", "max_elements", "slots", "auth", "x"])


@given(st.binary(max_size=300))
def test_any_bytes_are_parsed_or_refused_with_a_reason(data):
    for schema, what in ((control.JOIN, "JOIN"), (control.STATS, "STATS")):
        try:
            msg = control.parse(schema, data, what)
        except ControlError as exc:
            assert exc.reason and str(exc) and exc.code
        else:
            assert isinstance(msg, dict) and isinstance(msg.raw, dict)


@given(st.dictionaries(join_keys, json_values, max_size=8))
def test_any_json_object_is_parsed_into_bounded_fields_or_refused_naming_one(obj):
    payload = json.dumps(obj).encode()
    try:
        msg = control.parse(control.JOIN, payload, "JOIN")
    except ControlError as exc:
        assert exc.reason.startswith(("field_", "malformed_json", "control_too_large"))
        if exc.reason.startswith("field_"):
            assert repr(exc.reason[len("field_"):]) in str(exc) or exc.reason[len("field_"):] in str(exc)
        return
    assert 0.5 <= msg["timeout"] <= 86400
    assert 0 <= msg["slots"] <= 1 << 20 and 0 <= msg["elements"]
    if "shm" in msg:
        assert 1 <= msg["shm"]["window"] <= control.MAX_SHM_WINDOW


@given(st.text(min_size=1, max_size=40).filter(str.isprintable), st.integers(0, 31), st.integers(1, 32),
       st.floats(0.5, 1000), st.binary(min_size=16, max_size=32))
def test_what_a_worker_signs_verifies_and_a_changed_field_does_not(name, rank, world, timeout, key):
    rank = rank % world
    fields = {"name": name, "timeout": timeout}
    payload = json.dumps({**fields, "auth": keys.sign(key, "JOIN", 7, rank, world, fields)}).encode()
    ring = keys.Keyring({name: key})
    msg = control.parse(control.JOIN, payload, "JOIN")
    assert ring.verify("JOIN", 7, rank, world, name, msg, peer="a")
    assert ring.verify("JOIN", 7, rank, world, name, msg, peer="a")  # a resend from the same peer
    for bad in (lambda: ring.verify("JOIN", 7, rank, world, name, msg, peer="b"),  # a replay
                lambda: ring.verify("JOIN", 8, rank, world, name, msg, peer="a"),  # another job
                lambda: ring.verify("JOIN", 7, (rank + 1) % 33, world, name, msg, peer="a")):  # another rank
        try:
            bad()
        except ControlError as exc:
            assert exc.reason in ("auth_replay", "auth_bad_mac")
        else:
            raise AssertionError("accepted")
