"""What a member keeps for a restarted aggregator: the last chunks, and
the agreements until a later agreement settles them."""

from aggnet.protocol.replay import KeptResults, final_of
from aggnet.protocol.wire import PLAN_INDEX, SCALE_INDEX, DType, Flag, Header, MsgType


def _result(round_, index, flags=Flag.LITTLE_ENDIAN):
    return Header(MsgType.RESULT, job_id=7, round=round_, index=index, flags=flags, dtype=DType.INT32, count=4,
                  nsum=3, world=3)


def test_the_last_chunks_and_unsettled_agreements_are_kept():
    kept = KeptResults(chunks=3)
    for r in (1, 2):
        kept.keep(_result(r, PLAN_INDEX, Flag.OP_MAX | Flag.LITTLE_ENDIAN), b"p")
        kept.keep(_result(r, SCALE_INDEX, Flag.OP_MAX | Flag.LITTLE_ENDIAN), b"s")
        for c in range(4):
            kept.keep(_result(r, c), b"c")
    assert [(h.round, h.index) for h, _ in kept.results()] == [
        (1, PLAN_INDEX), (1, SCALE_INDEX), (2, PLAN_INDEX), (2, SCALE_INDEX), (2, 1), (2, 2), (2, 3)]
    kept.forget_through(1)
    assert [(h.round, h.index) for h, _ in kept.results()] == [(2, PLAN_INDEX), (2, SCALE_INDEX), (2, 1), (2, 2),
                                                               (2, 3)]
    kept.forget_through(2)
    assert len(kept) == 0


def test_a_final_replays_the_result_as_a_push_of_its_sender():
    f = final_of(_result(9, 5, Flag.OP_MAX | Flag.LITTLE_ENDIAN | Flag.SHM), sender=2, world=4)
    assert (f.msg_type, f.round, f.index, f.sender, f.world, f.nsum, f.count) == (MsgType.PUSH, 9, 5, 2, 4, 3, 4)
    assert f.flags == Flag.OP_MAX | Flag.LITTLE_ENDIAN | Flag.FINAL
