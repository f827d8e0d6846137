"""The switch-mode data path's kernels, called on packets in memory (no
sockets): verdicts, rewritten packets and counters kept by the protocol's
names. The end-to-end cases (and the P4 program's equality with this
data path) are test_switch_protocol.py and test_switch_differential.py."""

from __future__ import annotations

import numpy as np
import pytest

from aggnet.hosts.switch_datapath import (
    A_DROP, A_MULTICAST, A_UNICAST, COUNTERS, SendPlan, SwitchRegisters, plan_sends, process_batch, verdicts_for,
)
from aggnet.kernels.datagrams import Batch
from aggnet.protocol.limits import Drop, Event, drop_counter, event_counter
from aggnet.protocol.messages import ProbeOk
from aggnet.protocol.wire import HEADER_SIZE, DType, Flag, Header, MsgType, unpack_header
from aggnet.transport.udp import addr_key

K = 8
JOB = 0xA66E0001
WORKERS = [addr_key(("10.9.0.1", 4000)), addr_key(("10.9.0.2", 4001))]


@pytest.fixture
def regs():
    r = SwitchRegisters(pool=32, max_elements=K)
    r.install(3, JOB, base=8, slots=4, world=2, k=K)
    for rank, key in enumerate(WORKERS):
        r.set_member(3, rank, key)
    return r


def push(rank, slot, tag, values, job=JOB) -> bytes:
    h = Header(MsgType.PUSH, job_id=job, index=slot, sender=rank, dtype=DType.INT32, count=K, ref=tag,
               flags=Flag.VERSION if tag & 1 else 0)
    return h.pack() + np.asarray(values + [0] * (K - len(values)), ">i4").tobytes()


def run(regs, *datagrams):
    """Each (source key, bytes) through the data path as one batch: the
    verdicts and the packets as rewritten."""
    data = [d for _, d in datagrams]
    arena = np.frombuffer(b"".join(data), np.uint8).copy()
    lengths = np.array([len(d) for d in data], np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    sources = np.array([s for s, _ in datagrams], np.int64)
    batch = Batch(arena, offsets, lengths, sources, len(data))
    out = verdicts_for(len(data))
    process_batch(batch, regs.slots, regs.jobs, regs.shard_range(0), regs.shard_counters(0), out)
    packets = [bytes(arena[o:o + n]) for o, n in zip(offsets, lengths)]
    return batch, out, packets


def totals(regs) -> dict:
    return {name: int(v) for name, v in zip(COUNTERS, regs.counters[0]) if v}


def test_the_last_contribution_becomes_the_result_for_every_member(regs):
    batch, out, packets = run(regs, (WORKERS[0], push(0, 1, 1, [5, -7, 2**31 - 1])),
                              (WORKERS[1], push(1, 1, 1, [1, 2, 1])))
    assert list(out.action) == [A_DROP, A_MULTICAST] and list(out.job) == [3, 3]
    h = unpack_header(packets[1])
    assert (h.msg_type, h.nsum, h.world, h.sender) == (MsgType.RESULT, 2, 2, 0)
    assert np.frombuffer(packets[1][HEADER_SIZE:], ">i4")[:3].tolist() == [6, -5, -2**31]
    assert totals(regs) == {"received": 2, "summed": 2, "completed": 1}
    job = dict(zip(COUNTERS, regs.job_counter_totals(3)))
    assert job[event_counter(Event.SUMMED)] == 2 and job[event_counter(Event.RECEIVED)] == 0
    plan = SendPlan(batch.count)
    runs = plan_sends(batch, out, regs.jobs, plan.arrays)
    assert sorted(plan.arrays.run_dest[:runs]) == sorted(WORKERS)
    assert set(plan.arrays.run_start[:runs]) == {batch.offsets[1]}


def test_drops_are_counted_by_reason(regs):
    run(regs, (WORKERS[0], push(0, 0, 1, [1])[:20]),
        (WORKERS[0], push(0, 0, 1, [1], job=JOB + 1)),
        (WORKERS[0], push(0, 4, 1, [1])),
        (WORKERS[1], push(0, 0, 1, [1])),
        (WORKERS[0], push(0, 0, 1, [1])),
        (WORKERS[0], push(0, 0, 1, [1])),
        (WORKERS[0], push(0, 0, 3, [1])))
    expected = {drop_counter(Drop.SHORT): 1, drop_counter(Drop.UNKNOWN_JOB): 1, drop_counter(Drop.INDEX): 1,
                drop_counter(Drop.NOT_ADMITTED): 1, drop_counter(Drop.DUPLICATE): 1, drop_counter(Drop.EARLY): 1,
                "received": 7, "summed": 1}
    assert totals(regs) == expected
    job = {name: int(v) for name, v in zip(COUNTERS, regs.job_counter_totals(3)) if v}
    # drops before the job is known count in the shard's totals only
    assert job == {"dropped_index": 1, "dropped_not_admitted": 1, "dropped_duplicate": 1, "dropped_early": 1,
                   "summed": 1}


def test_a_probe_is_answered_with_the_slots_state(regs):
    run(regs, (WORKERS[1], push(1, 2, 7, [1])))
    probe = Header(MsgType.PROBE, job_id=JOB, index=2, ref=7, flags=Flag.VERSION).pack()
    _, out, packets = run(regs, (WORKERS[0], probe))
    assert out.action[0] == A_UNICAST
    h = unpack_header(packets[0])
    assert h.msg_type == MsgType.PROBE_OK
    assert ProbeOk.from_header(h) == ProbeOk(count=1, seen=0b10, tag=7, world=2)


def test_a_probe_from_anyone_but_the_member_it_names_is_dropped_unanswered(regs):
    run(regs, (WORKERS[1], push(1, 2, 7, [1])))
    stranger = addr_key(("10.9.0.66", 4000))
    probes = [(stranger, Header(MsgType.PROBE, job_id=JOB, index=2, ref=7, sender=0).pack()),
              (WORKERS[0], Header(MsgType.PROBE, job_id=JOB, index=2, ref=7, sender=1).pack()),  # rank 1's name
              (addr_key(("10.9.0.1", 4999)), Header(MsgType.PROBE, job_id=JOB, index=2, ref=7).pack()),  # other port
              (WORKERS[0], Header(MsgType.PROBE, job_id=JOB, index=2, ref=7, sender=9).pack())]
    _, out, packets = run(regs, *probes)
    assert list(out.action) == [A_DROP] * 4
    assert all(unpack_header(p).msg_type == MsgType.PROBE for p in packets)  # nothing was written into them
    assert totals(regs)[drop_counter(Drop.NOT_ADMITTED)] == 4
    assert event_counter(Event.PROBES) not in totals(regs)


def test_a_slot_another_shard_serves_is_dropped_and_counted():
    regs = SwitchRegisters(pool=32, max_elements=K, shards=2)
    regs.install(0, JOB, base=14, slots=4, world=1, k=K)
    regs.set_member(0, 0, WORKERS[0])
    batch_of_two = [(WORKERS[0], push(0, 1, 1, [1])), (WORKERS[0], push(0, 2, 1, [1]))]  # slots 15 and 16
    _, out, _ = run(regs, *batch_of_two)
    assert list(out.action) == [A_MULTICAST, A_DROP]
    assert regs.counters[0, Drop.OTHER_SHARD] == 1
