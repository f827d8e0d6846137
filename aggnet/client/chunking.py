"""Cutting a buffer into chunks and assigning them to aggregator shards.

Chunks are fixed-size runs of elements (the last one shorter). Chunk ``c``
of a buffer goes to shard ``(c + rotation) % shards``: consecutive chunks
land on different shards, so a client's window keeps every shard busy at
once, and the same chunk of the same buffer always meets the same shard
(PHub's locality: a shard's state for a key never moves). ``rotation``
spreads small buffers, which have fewer chunks than there are shards.

A reduce-scatter's buffer is split among ranks first (:func:`plan_owned`):
each rank's share is chunked on its own, so that no chunk straddles two
shares and each result can go to the one rank that owns it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Chunk:
    index: int
    offset: int  #: first element
    count: int  #: elements
    shard: int
    #: the rank that receives this chunk's result (None: every rank)
    owner: int | None = None


def plan(n_elements: int, chunk_elements: int, shards: int, rotation: int = 0) -> list[Chunk]:
    if chunk_elements < 1:
        raise ValueError(f"chunk must hold at least one element, got {chunk_elements}")
    if shards < 1:
        raise ValueError(f"need at least one shard, got {shards}")
    chunks = []
    for index, offset in enumerate(range(0, n_elements, chunk_elements)):
        count = min(chunk_elements, n_elements - offset)
        chunks.append(Chunk(index, offset, count, (index + rotation) % shards))
    return chunks


def plan_owned(bounds: list[int], chunk_elements: int, shards: int, rotation: int = 0) -> list[Chunk]:
    """Chunks of a buffer whose elements ``bounds[r]:bounds[r + 1]`` belong
    to rank ``r``; chunks are numbered and spread over shards as one buffer's."""
    if any(b > e for b, e in zip(bounds, bounds[1:])) or (bounds and bounds[0] != 0):
        raise ValueError(f"share bounds must start at 0 and never decrease, got {bounds}")
    chunks = []
    for owner, (start, end) in enumerate(zip(bounds, bounds[1:])):
        for c in plan(end - start, chunk_elements, 1):
            index = len(chunks)
            chunks.append(Chunk(index, start + c.offset, c.count, (index + rotation) % shards, owner))
    return chunks
