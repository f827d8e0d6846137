"""The switch path's answers whose header fields carry other meanings: the
typed views put each value where the wire says, and back."""

from __future__ import annotations

import dataclasses

import pytest

from aggnet.protocol import wire
from aggnet.protocol.messages import JoinOk, JoinShards, ProbeOk, _View
from aggnet.protocol.wire import Header, MsgType


def test_a_join_ok_travels_in_the_join_header_fields_workers_read():
    join = Header(MsgType.JOIN, job_id=77, sender=3, world=4, round=9)
    packed = JoinOk(slots=128, elements=2048, base=4096, world=4, shard_slots=512).to_header(join).pack()
    # the bytes a worker of an older build reads: slots in index, K in
    # nsum, base in offset, pool slots per shard in ref
    assert packed == Header(MsgType.JOIN_OK, job_id=77, sender=3, world=4, round=9, index=128, nsum=2048,
                            offset=4096, ref=512).pack()
    assert JoinOk.from_header(wire.unpack_header(packed)) == JoinOk(128, 2048, 4096, 4, 512)


def test_a_probe_ok_carries_count_seen_bitmap_and_tag():
    h = ProbeOk(count=2, seen=0b101, tag=0xFFFFFFFF, world=3).to_header(Header(MsgType.PROBE, index=5))
    back = wire.unpack_header(h.pack())
    assert (back.msg_type, back.nsum, back.ref, back.offset, back.world, back.index) == \
        (MsgType.PROBE_OK, 2, 0b101, 0xFFFFFFFF, 3, 5)
    assert ProbeOk.from_header(back) == ProbeOk(2, 0b101, 0xFFFFFFFF, 3)


def test_a_racks_join_says_its_shards_and_a_workers_says_none():
    h = JoinShards(base=64, shard_slots=256).to_header(Header(MsgType.JOIN, sender=1, world=2))
    assert (h.msg_type, h.offset, h.ref) == (MsgType.JOIN, 64, 256)
    assert JoinShards.from_header(Header(MsgType.JOIN, sender=0, world=2)) == JoinShards(0, 0)


def test_every_value_of_a_view_has_a_header_field_of_its_own():
    for view in (JoinOk, JoinShards, ProbeOk):
        assert list(view.FIELDS) == [f.name for f in dataclasses.fields(view)]
    with pytest.raises(TypeError, match="field of its own"):
        class _Clash(_View):
            MSG_TYPE = MsgType.JOIN_OK
            FIELDS = {"a": "index", "b": "index"}
    with pytest.raises(TypeError, match="field of its own"):
        class _Unknown(_View):
            MSG_TYPE = MsgType.JOIN_OK
            FIELDS = {"a": "no_such_field"}
