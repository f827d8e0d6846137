"""The chunk a worker cuts: the transport's default, a user's setting, and
under a root whose uplinks the topology gives, one that crosses such an
uplink in UPLINK_CHUNK_SECONDS (a rack forwards whole chunks, so a slow
uplink fills and drains by them)."""

from __future__ import annotations

import pytest

from aggnet.client.config import (DEFAULT_CHUNK_BYTES, MIN_UPLINK_CHUNK_BYTES, SHM_CHUNK_BYTES, UPLINK_CHUNK_SECONDS,
                                  ClientConfig)

KIB = 1 << 10


@pytest.mark.parametrize("mbit, want", [(None, DEFAULT_CHUNK_BYTES), (10_000, DEFAULT_CHUNK_BYTES),
                                        (400, 1024 * KIB), (200, 512 * KIB), (100, 256 * KIB), (10, 256 * KIB)])
def test_a_slow_uplink_halves_the_chunk_until_one_crosses_it_in_time(mbit, want):
    got = ClientConfig().chunk_bytes_for("zmq+tcp", mbit)
    assert got == want
    if mbit is not None and MIN_UPLINK_CHUNK_BYTES < got < DEFAULT_CHUNK_BYTES:
        assert got <= mbit * 1e6 / 8 * UPLINK_CHUNK_SECONDS < 2 * got  # the largest that crosses in time


def test_shared_memory_starts_from_its_own_size():
    assert ClientConfig().chunk_bytes_for("shm") == SHM_CHUNK_BYTES
    assert ClientConfig().chunk_bytes_for("shm", 1000) == SHM_CHUNK_BYTES
    assert ClientConfig().chunk_bytes_for("shm", 100) == 256 * KIB


def test_a_chunk_size_the_user_set_wins_over_the_uplinks(monkeypatch):
    assert ClientConfig(chunk_bytes=64 * KIB).chunk_bytes_for("zmq+tcp", 100) == 64 * KIB
    assert ClientConfig(chunk_bytes=4 << 20).chunk_bytes_for("zmq+tcp", 100) == 4 << 20
    monkeypatch.setenv("AGGNET_CHUNK_BYTES", "2MiB")
    assert ClientConfig.from_env().chunk_bytes_for("zmq+tcp", 100) == 2 << 20
