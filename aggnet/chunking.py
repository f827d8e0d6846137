"""Cutting a buffer into chunks and assigning them to aggregator shards.

Chunks are fixed-size runs of elements (the last one shorter). Chunk ``c``
of a buffer goes to shard ``(c + rotation) % shards``: consecutive chunks
land on different shards, so a client's window keeps every shard busy at
once, and the same chunk of the same buffer always meets the same shard
(PHub's locality: a shard's state for a key never moves). ``rotation``
spreads small buffers, which have fewer chunks than there are shards.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Chunk:
    index: int
    offset: int  #: first element
    count: int  #: elements
    shard: int


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
