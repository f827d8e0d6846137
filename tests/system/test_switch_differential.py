"""Differential tests of the switch program: the same packet sequences
through the P4 program on BMv2 and through the aggregator host's switch
mode give the same packets out, to the same endpoints, and the same drop
counts. One behaviour per case. The host half runs everywhere and checks
each case's expected output; the BMv2 half runs where simple_switch_grpc
is installed and must equal the host's output byte for byte."""

from __future__ import annotations

import numpy as np
import pytest

from aggnet.protocol.wire import job_id_of
from aggnet.emulation.bmv2 import can_run_bmv2
from aggnet.emulation.netns import can_emulate
from aggnet.protocol.wire import HEADER_SIZE, DType, Flag, Header, MsgType, unpack_header
from harness.switch import FOREIGN, K, MOVED, PARENT, Bmv2Aggregator, HostAggregator, job_name

BMV2_OK, BMV2_WHY = can_run_bmv2()
if BMV2_OK:
    BMV2_OK, BMV2_WHY = can_emulate()


def payload(*values) -> bytes:
    v = np.zeros(K, np.int64)
    v[: len(values)] = values
    return v.astype(">i4").tobytes()


def push(job, rank, slot, tag, data=b"", *, exponent=0, next_exp=0, flags=0, count=K) -> bytes:
    h = Header(MsgType.PUSH, job_id=job_id_of(job), round=7, index=slot, sender=rank, dtype=DType.INT32,
               count=count, exponent=exponent, next_exponent=next_exp, world=0, ref=tag, offset=1000 + slot,
               flags=flags | (Flag.VERSION if tag & 1 else 0))
    return h.pack() + (data or payload(rank + 1))


def final(job, slot, tag, data, next_exp=0) -> bytes:
    h = Header(MsgType.RESULT, job_id=job_id_of(job), round=7, index=slot, sender=0, dtype=DType.INT32, count=K,
               next_exponent=next_exp, nsum=2, world=2, ref=tag, offset=1000 + slot,
               flags=Flag.UPLINK | (Flag.VERSION if tag & 1 else 0))
    return h.pack() + data


def probe(job, rank, slot, tag) -> bytes:
    return Header(MsgType.PROBE, job_id=job_id_of(job), index=slot, ref=tag, sender=rank,
                  flags=Flag.VERSION if tag & 1 else 0).pack()


def join(job, rank, world) -> bytes:
    body = b'{"name":"%s"}' % job.encode()
    return Header(MsgType.JOIN, job_id=job_id_of(job), sender=rank, world=world).pack_for(body) + body


# name -> (world, uplink, steps(job) -> [(endpoint, packet bytes)])
SCENARIOS = {
    "first_contribution_then_completion": (2, False, lambda j: [
        (0, push(j, 0, 3, 1, payload(5, -7, 2**31 - 1), next_exp=4)),
        (1, push(j, 1, 3, 1, payload(1, 2, 1), next_exp=9)),
    ]),
    "duplicate_for_incomplete_slot": (3, False, lambda j: [
        (0, push(j, 0, 0, 1)),
        (0, push(j, 0, 0, 1, flags=Flag.RETRANSMIT)),
        (1, push(j, 1, 0, 1)),
    ]),
    "duplicate_for_complete_slot": (2, False, lambda j: [
        (0, push(j, 0, 1, 1)),
        (1, push(j, 1, 1, 1)),
        (0, push(j, 0, 1, 1, flags=Flag.RETRANSMIT)),
    ]),
    "other_version_keeps_the_shadow": (2, False, lambda j: [
        (0, push(j, 0, 2, 1, payload(10))),
        (1, push(j, 1, 2, 1, payload(20))),
        (0, push(j, 0, 2, 2, payload(100))),
        (1, push(j, 1, 2, 1, payload(20), flags=Flag.RETRANSMIT)),
        (1, push(j, 1, 2, 2, payload(200))),
    ]),
    "stale_tag": (2, False, lambda j: [
        (0, push(j, 0, 4, 5)),
        (1, push(j, 1, 4, 5)),
        (0, push(j, 0, 4, 3)),
    ]),
    "early_block": (2, False, lambda j: [
        (0, push(j, 0, 4, 1)),
        (0, push(j, 0, 4, 3)),
    ]),
    "exponent_mismatch": (2, False, lambda j: [
        (0, push(j, 0, 5, 1, exponent=3)),
        (1, push(j, 1, 5, 1, exponent=4)),
        (1, push(j, 1, 5, 1, exponent=3)),
    ]),
    "foreign_sender": (2, False, lambda j: [
        (FOREIGN, push(j, 0, 0, 1)),
        (0, push(j, 1, 0, 1)),
        (0, push(j, 5, 0, 1)),
    ]),
    "wrong_job": (2, False, lambda j: [
        (0, push("no-such-job", 0, 0, 1)),
    ]),
    "truncated_header": (2, False, lambda j: [
        (0, push(j, 0, 0, 1)[:30]),
    ]),
    "truncated_payload": (2, False, lambda j: [
        (0, push(j, 0, 0, 1)[:-4]),
        (0, push(j, 0, 0, 1, count=K - 1)[:-4]),
    ]),
    "bad_version": (2, False, lambda j: [
        (0, (lambda b: b[:2] + b"\x09" + b[3:])(push(j, 0, 0, 1))),
    ]),
    "bad_magic": (2, False, lambda j: [
        (0, b"\x00\x01" + push(j, 0, 0, 1)[2:]),
    ]),
    "index_outside_the_slice": (2, False, lambda j: [
        (0, push(j, 0, 16, 1)),
    ]),
    "probe_names_the_missing": (3, False, lambda j: [
        (0, push(j, 0, 6, 1)),
        (2, push(j, 2, 6, 1)),
        (1, probe(j, 1, 6, 1)),
    ]),
    "probe_answered_to_members_only": (2, False, lambda j: [
        (0, push(j, 0, 6, 1)),
        (FOREIGN, probe(j, 0, 6, 1)),
        (0, probe(j, 1, 6, 1)),
        (MOVED, probe(j, 0, 6, 1)),
    ]),
    "member_address_at_another_port": (2, False, lambda j: [
        (MOVED, push(j, 0, 2, 1)),
        (0, push(j, 0, 2, 1)),
    ]),
    "join_answers_in_the_header": (2, False, lambda j: [
        (1, join(j, 1, 2)),
    ]),
    "single_worker_completes_at_once": (1, False, lambda j: [
        (0, push(j, 0, 0, 1, payload(3, 4), next_exp=-150)),
    ]),
    "uplink_partial_and_final": (2, True, lambda j: [
        (0, push(j, 0, 3, 1, payload(1, 2), next_exp=2)),
        (1, push(j, 1, 3, 1, payload(10, 20), next_exp=5)),
        (0, push(j, 0, 3, 1, payload(1, 2), next_exp=2, flags=Flag.RETRANSMIT)),
        (1, push(j, 1, 3, 1, payload(10, 20), next_exp=5, flags=Flag.RETRANSMIT)),
        (PARENT, final(j, 3, 1, payload(111, 222), next_exp=7)),
        (PARENT, final(j, 3, 1, payload(111, 222), next_exp=7)),
        (1, push(j, 1, 3, 1, payload(10, 20), next_exp=5, flags=Flag.RETRANSMIT)),
    ]),
}
SLOTS = 16


def run(agg, name: str, job: str, like=None):
    """(what each endpoint received after each step, drop counts by reason).
    ``like``: another aggregator's outputs, to stop waiting at a step once
    as many packets came (and a moment more for any beyond them)."""
    world, uplink, steps = SCENARIOS[name]
    agg.install(job, world, SLOTS, uplink)
    before = agg.drops()
    outputs = []
    try:
        sequence = list(steps(job))
        for i, (ep, packet) in enumerate(sequence):
            agg.send(ep, packet)
            # the last step waits it out: nothing comes after it to show a late extra
            expected = {e: len(v) for e, v in like[i].items()} if like and i < len(sequence) - 1 else None
            outputs.append({e: v for e, v in agg.collect(0.25, expected).items() if v})
    finally:
        agg.remove()
    after = agg.drops()
    drops = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}
    return outputs, {k: v for k, v in drops.items() if v}


@pytest.fixture(scope="module")
def host():
    agg = HostAggregator()
    yield agg
    agg.close()


@pytest.fixture(scope="module")
def bmv2():
    if not BMV2_OK:
        pytest.skip(f"no BMv2 here: {BMV2_WHY}")
    agg = Bmv2Aggregator()
    yield agg
    agg.close()


def values(raw: bytes) -> list[int]:
    return np.frombuffer(raw[HEADER_SIZE:], ">i4").astype(np.int64).tolist()


def result(raw: bytes):
    return unpack_header(raw), values(raw)


# what the host must do, case by case (the reference's own checks)
def expect(name, outputs, drops):
    if name == "first_contribution_then_completion":
        assert outputs[0] == {}
        assert set(outputs[1]) == {0, 1}
        for ep in (0, 1):
            (raw,) = outputs[1][ep]
            h, v = result(raw)
            assert h.msg_type == MsgType.RESULT and h.sender == 0 and h.nsum == 2 and h.world == 2
            assert h.next_exponent == 9 and h.ref == 1 and h.index == 3 and h.offset == 1003
            assert v[:3] == [6, -5, -(2**31)]  # int32 wraps
        assert outputs[1][0] == outputs[1][1]
    elif name == "duplicate_for_incomplete_slot":
        assert outputs == [{}, {}, {}] and drops == {"duplicate": 1}
    elif name == "duplicate_for_complete_slot":
        assert set(outputs[1]) == {0, 1}
        assert set(outputs[2]) == {0} and outputs[2][0] == outputs[1][0]  # unicast, same result
    elif name == "other_version_keeps_the_shadow":
        assert values(outputs[1][0][0])[0] == 30
        assert outputs[2] == {}
        assert set(outputs[3]) == {1} and values(outputs[3][1][0])[0] == 30  # the shadow of version 1
        assert set(outputs[4]) == {0, 1} and values(outputs[4][0][0])[0] == 300
    elif name == "stale_tag":
        assert outputs[2] == {} and drops == {"stale": 1}
    elif name == "early_block":
        assert outputs == [{}, {}] and drops == {"early": 1}
    elif name == "exponent_mismatch":
        assert outputs[1] == {} and drops == {"exponent": 1}
        assert set(outputs[2]) == {0, 1}
    elif name == "foreign_sender":
        assert outputs == [{}, {}, {}] and drops == {"not_admitted": 3}
    elif name == "wrong_job":
        assert outputs == [{}] and drops == {"unknown_job": 1}
    elif name == "truncated_header":
        assert outputs == [{}] and drops == {"short": 1}
    elif name == "truncated_payload":
        assert outputs == [{}, {}] and drops == {"length": 2}
    elif name == "bad_version":
        assert outputs == [{}] and drops == {"version": 1}
    elif name == "bad_magic":
        assert outputs == [{}] and drops == {"magic": 1}
    elif name == "index_outside_the_slice":
        assert outputs == [{}] and drops == {"index": 1}
    elif name == "probe_names_the_missing":
        (raw,) = outputs[2][1]
        h = unpack_header(raw)
        assert h.msg_type == MsgType.PROBE_OK and h.nsum == 2 and h.ref == 0b101 and h.world == 3 and h.offset == 1
    elif name == "probe_answered_to_members_only":
        assert outputs == [{}, {}, {}, {}] and drops == {"not_admitted": 3}
    elif name == "member_address_at_another_port":
        # the process that joined is the one admitted: its own push counts
        assert outputs == [{}, {}] and drops == {"not_admitted": 1}
    elif name == "join_answers_in_the_header":
        (raw,) = outputs[0][1]
        h = unpack_header(raw)
        assert h.msg_type == MsgType.JOIN_OK and h.index == SLOTS and h.nsum == K and h.world == 2
        assert raw[HEADER_SIZE:].startswith(b'{"name":"diff-')
    elif name == "single_worker_completes_at_once":
        h, v = result(outputs[0][0][0])
        assert h.msg_type == MsgType.RESULT and v[:2] == [3, 4] and h.next_exponent == -150
    elif name == "uplink_partial_and_final":
        assert outputs[0] == {}
        (partial,) = outputs[1][PARENT]
        h, v = result(partial)
        assert h.msg_type == MsgType.PUSH and h.flags & Flag.UPLINK and h.sender == 1 and v[:2] == [11, 22]
        assert h.next_exponent == 5 and h.nsum == 2
        assert outputs[2] == {PARENT: [partial]}  # member 0's retransmission resends the partial
        assert outputs[3] == {}  # another member's is a duplicate: one resend per round of retransmissions
        assert set(outputs[4]) == {0, 1}
        h, v = result(outputs[4][0][0])
        assert h.msg_type == MsgType.RESULT and not h.flags & Flag.UPLINK and v[:2] == [111, 222]
        assert h.next_exponent == 7
        assert outputs[5] == {} and drops == {"final": 1, "duplicate": 1}  # a duplicated final
        assert set(outputs[6]) == {1} and outputs[6][1] == outputs[4][1]
    else:
        raise AssertionError(f"no expectation for {name}")


#: each scenario's job (the same id on both aggregators) and the host's run of it
JOBS = {name: job_name() for name in SCENARIOS}
_host_runs: dict = {}


def host_run(host, name: str):
    if name not in _host_runs:
        _host_runs[name] = run(host, name, JOBS[name])
    return _host_runs[name]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_host_switch_mode(host, name):
    outputs, drops = host_run(host, name)
    expect(name, outputs, drops)


@pytest.mark.requires_bmv2
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_p4_program_on_bmv2_matches_the_host(host, bmv2, name):
    want = host_run(host, name)
    got = run(bmv2, name, JOBS[name], like=want[0])
    assert got[0] == want[0], f"packets differ:\nbmv2 {got[0]}\nhost {want[0]}"
    assert got[1] == want[1], f"drop counters differ: bmv2 {got[1]}, host {want[1]}"
