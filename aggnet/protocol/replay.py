"""Results kept for an aggregator that restarts, and how they are replayed.

A member of a job (a worker at its shard, a rack at its root) keeps the
results it received that another member may still wait for, and sends
them to the restarted aggregator as PUSHes flagged FINAL. Another member
can lack at most the chunks it has open, which a window bounds, so the
last few chunk results are enough; the agreements of a round (exponents,
buffer size) are kept until a later round's buffer-size agreement shows
that every worker has finished it (wire.settled_through).
"""

from __future__ import annotations

import collections

from aggnet.protocol.wire import PLAN_INDEX, SCALE_INDEX, Flag, Header, MsgType, round_at_or_before


class KeptResults:
    """One member's results from one aggregator (shard or root shard):
    the last ``chunks`` chunk results and the agreements not yet settled,
    each as (RESULT header, payload). Payloads are kept by reference: a
    ZeroMQ frame or a pooled UCX buffer is not reused while held."""

    def __init__(self, chunks: int):
        self.chunks = chunks
        self._agreements: collections.OrderedDict = collections.OrderedDict()
        self._chunks: collections.OrderedDict = collections.OrderedDict()

    def keep(self, h: Header, payload) -> None:
        key = (h.round, h.index, bool(h.flags & Flag.OP_MAX))
        if h.index in (SCALE_INDEX, PLAN_INDEX):
            self._agreements[key] = (h, payload)
            return
        self._chunks[key] = (h, payload)
        if len(self._chunks) > self.chunks:
            self._chunks.popitem(last=False)

    def forget_through(self, mark: int) -> None:
        """Every worker has the results of rounds up to ``mark``."""
        for kept in (self._agreements, self._chunks):
            while kept and round_at_or_before(next(iter(kept))[0], mark):
                kept.popitem(last=False)

    def results(self) -> list[tuple[Header, object]]:
        return [*self._agreements.values(), *self._chunks.values()]

    def __len__(self) -> int:
        return len(self._agreements) + len(self._chunks)


def final_of(h: Header, sender: int, world: int) -> Header:
    """The FINAL PUSH that replays RESULT ``h`` from member ``sender`` of
    ``world`` (its payload is the result's, in the message)."""
    return Header(MsgType.PUSH, job_id=h.job_id, round=h.round, index=h.index, sender=sender, world=world,
                  flags=(h.flags & (Flag.LITTLE_ENDIAN | Flag.OP_MAX)) | Flag.FINAL, dtype=h.dtype, count=h.count,
                  exponent=h.exponent, next_exponent=h.next_exponent, nsum=h.nsum, ref=h.ref, offset=h.offset)
