"""The int32 codec without an exponent agreement per round: a buffer
all-reduced under the same key carries its exponents from its last round
(one octave above the MAX each chunk's result brought), and a chunk whose
values outgrew them, or that they would quantize too coarsely, goes again
with the agreed one. Worker processes against real services (TCP and
shared memory) and real racks under a root: the chunks sent again sum to
the very bits agreeing first gives, the others within the carried
exponent's quantization step, and every worker decides alike."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from aggnet import Client, kernels
from harness.helpers import RunningService, run_workers
from harness.racks import Racks

BLOCK = 1024  # elements per chunk: chunk_bytes=4096
CHUNKS = 8
GROWN, SHRUNK, ZEROED = 1, 2, 3  # chunks changed from the third round on


def values(rank: int, rnd: int, nan_in: int | None = None) -> np.ndarray:
    """Rank ``rank``'s buffer in round ``rnd``: the same values every round
    but from the third on, chunk GROWN 16x larger (four octaves: more than
    the carried headroom), chunk SHRUNK 2**-10 as large (more than the
    slack) and chunk ZEROED all zeros. A chunk's largest magnitude on
    rank 0 is not its largest on rank 1, so the MAX matters."""
    rng = np.random.default_rng(7 + rank)
    x = (rng.standard_normal(CHUNKS * BLOCK - 5) * np.exp2(rng.integers(-8, 8, CHUNKS * BLOCK - 5))).astype(np.float32)
    if rnd >= 2:
        x[GROWN * BLOCK:(GROWN + 1) * BLOCK] *= 16
        x[SHRUNK * BLOCK:(SHRUNK + 1) * BLOCK] *= 2.0 ** -10
        x[ZEROED * BLOCK:(ZEROED + 1) * BLOCK] = 0
    if nan_in is not None and rnd == nan_in and rank == 1:
        x[5 * BLOCK + 3] = np.nan
    return x


def _rounds(rank: int, where: dict, job: str, rounds: int, key, predict: bool, nan_in=None, world: int = 2):
    out = []
    with Client(**where, job=job, rank=rank, world_size=world, chunk_bytes=4 * BLOCK, timeout=60,
                predict_scale=predict if isinstance(predict, bool) else predict[rank]) as client:
        for rnd in range(rounds):
            buf = values(rank % 2, rnd, nan_in)
            before = (client.stats.scales_carried, client.stats.chunks_sent_again)
            try:
                client.allreduce(buf, codec="int32", key=key).result(60)
                got = buf.view(np.uint32).copy()
            except Exception as exc:  # noqa: BLE001 - what each rank was told is the point
                got = (type(exc).__name__, str(exc))
            out.append({"bits": got, "carried": client.stats.scales_carried - before[0],
                        "again": client.stats.chunks_sent_again - before[1]})
    return out


def run(address_or_topology: dict, rounds: int, key=7, predict=True, nan_in=None, world: int = 2):
    return run_workers("spawn://" if "topology" in address_or_topology else address_or_topology["address"], world,
                       _rounds, address_or_topology, f"carry-{uuid.uuid4().hex[:8]}", rounds, key, predict, nan_in,
                       world, timeout=120)


def exact_sum(rnd: int, world: int = 2) -> np.ndarray:
    return np.sum([values(r % 2, rnd).astype(np.float64) for r in range(world)], axis=0)


def assert_within_step(got_bits, rnd: int, exponents: np.ndarray, world: int = 2):
    """Each chunk within the quantization error of its exponent: half a
    step per worker, and the float32 rounding of the result."""
    got = got_bits.view(np.float32).astype(np.float64)
    want = exact_sum(rnd, world)
    for i, e in enumerate(exponents):
        part = slice(i * BLOCK, (i + 1) * BLOCK)
        step = 2.0 ** -kernels.quant_shift(int(e), world)
        bound = world * step / 2 + np.abs(want[part]) * 2.0 ** -24
        assert (np.abs(got[part] - want[part]) <= bound).all(), f"chunk {i} off by more than its step"


def chunk_exponents(rnd: int, world: int = 2) -> np.ndarray:
    """The agreed exponent of each chunk: the MAX over workers of each one's own."""
    exps = np.full(CHUNKS, -150)
    for r in range(world):
        x = values(r % 2, rnd)
        for i in range(CHUNKS):
            bits, nonfinite = kernels.load("cpu").block_stats(x[i * BLOCK:(i + 1) * BLOCK])
            exps[i] = max(exps[i], kernels.exponent_of(bits, nonfinite))
    return exps


@pytest.fixture(scope="module", params=["zmq+tcp", "shm"])
def service(request):
    svc = RunningService(request.param, shards=2)
    yield svc
    svc.stop()


def test_a_keyed_buffer_carries_its_exponents_and_sends_again_only_what_outgrew_them(service):
    where = {"address": service.address}
    carried = run(where, 4)
    agreed = run(where, 4, predict=False)
    for rank in range(2):
        np.testing.assert_array_equal(carried[rank][0]["bits"], agreed[0][0]["bits"])
        np.testing.assert_array_equal(carried[rank][2]["bits"], carried[0][2]["bits"])  # every worker alike
        # the first round agrees; every later one carries
        assert [r["carried"] for r in carried[rank]] == [0, 1, 1, 1]
        assert [r["carried"] for r in agreed[rank]] == [0, 0, 0, 0]
        # round 2 sends again the chunk that grew and the one that shrank
        # (not the one of zeros: zeros sum to zero at any scale); round 3
        # carries round 2's exponents and needs nothing again
        assert [r["again"] for r in carried[rank]] == [0, 0, 2, 0]
    # carried from round 0, one octave up: within that step of the exact sum
    assert_within_step(carried[0][1]["bits"], 1, chunk_exponents(0) + 1)
    # round 2: the chunks sent again sum to the very bits agreeing gives
    got, want = carried[0][2]["bits"], agreed[0][2]["bits"]
    for i in (GROWN, SHRUNK, ZEROED):
        part = slice(i * BLOCK, (i + 1) * BLOCK)
        np.testing.assert_array_equal(got[part], want[part])
    carried_from = chunk_exponents(1) + 1
    carried_from[[GROWN, SHRUNK]] = chunk_exponents(2)[[GROWN, SHRUNK]]
    assert_within_step(got, 2, carried_from)
    assert_within_step(carried[0][3]["bits"], 3, chunk_exponents(2) + 1)


def test_an_unkeyed_buffer_agrees_every_round(service):
    got = run({"address": service.address}, 2, key=None)
    assert [r["carried"] for r in got[0]] == [0, 0]


def test_workers_that_carry_and_workers_that_agree_are_told_to_set_predict_scale_alike(service):
    """At once, by the buffer-size agreement: without it the one waits for
    the other's exponents and the other for the one's chunks, until the
    stall timeout."""
    got = run({"address": service.address}, 2, predict=[True, False])
    for rank in got:
        assert not isinstance(rank[0]["bits"], tuple)  # the first round agrees on both
        kind, text = rank[1]["bits"]
        assert kind == "JobMismatch" and "some workers carry the int32 exponents of key 7 from its last round and " \
            "some agree them: set predict_scale (AGGNET_PREDICT_SCALE) alike on every worker" in text


def _two_sizes_under_one_key(rank: int, address: str, job: str, rounds: int):
    """Buffers of two sizes under one key (large, large, small, over and
    over), all submitted before any is waited for: the rounds of a key
    may end in any order here."""
    sizes = (CHUNKS * BLOCK - 5, CHUNKS * BLOCK - 5, 3 * BLOCK)
    with Client(address, job=job, rank=rank, world_size=2, chunk_bytes=4 * BLOCK, timeout=60) as client:
        bufs = [values(rank, 0)[:sizes[i % 3]].copy() for i in range(rounds)]
        futures = [client.allreduce(b, codec="int32", key=1) for b in bufs]
        for f in futures:
            f.result(60)
        return {"bits": [b.view(np.uint32).copy() for b in bufs], "carried": client.stats.scales_carried}


def test_buffers_of_two_sizes_under_one_key_in_flight_together_carry_alike_on_every_worker(service):
    got = run_workers(service.address, 2, _two_sizes_under_one_key, service.address, f"two-{uuid.uuid4().hex[:8]}",
                      12, timeout=120)
    # a large round after a large one carries (waiting for it if it is
    # open); after a small one it agrees, whatever has ended by then
    assert got[0]["carried"] == got[1]["carried"] == 4
    want = exact_sum(0)
    for a, b in zip(got[0]["bits"], got[1]["bits"]):
        np.testing.assert_array_equal(a, b)
        result = a.view(np.float32).astype(np.float64)
        assert np.allclose(result, want[:result.size], rtol=1e-6, atol=1e-3)


def test_nan_in_a_carried_round_is_named_by_its_rank_and_the_next_round_agrees_again(service):
    got = run({"address": service.address}, 3, nan_in=1)
    assert got[1][1]["bits"][0] == "NonFiniteError"
    assert "rank 1" in got[1][1]["bits"][1] and "1 NaN/Inf value(s) (chunk 5" in got[1][1]["bits"][1]
    assert got[0][1]["bits"][0] == "NonFiniteError" and "another worker reported NaN/Inf" in got[0][1]["bits"][1]
    for rank in got:
        assert [r["carried"] for r in rank] == [0, 1, 0]  # nothing to carry from a failed round
        assert not isinstance(rank[2]["bits"], tuple)
    np.testing.assert_array_equal(got[0][2]["bits"], got[1][2]["bits"])


#: two shares of whole chunks: a reduce-scatter's chunks are then the all-reduce's
SHARES = [0, 4 * BLOCK, CHUNKS * BLOCK - 5]


def _scatter_rounds(rank: int, address: str, job: str, rounds: int, predict: bool):
    out = []
    with Client(address, job=job, rank=rank, world_size=2, chunk_bytes=4 * BLOCK, timeout=60,
                predict_scale=predict) as client:
        s = client.stats
        for rnd in range(rounds):
            share = np.empty(SHARES[rank + 1] - SHARES[rank], np.float32)
            before = (s.scales_carried, s.chunks_sent_again)
            client.reduce_scatter(values(rank, rnd), share, SHARES, codec="int32", key=5).result(60)
            out.append({"bits": share.view(np.uint32).copy(), "carried": s.scales_carried - before[0],
                        "again": s.chunks_sent_again - before[1]})
    return out


def test_a_keyed_reduce_scatter_carries_its_exponents_from_what_every_chunk_acknowledged(service):
    """A reduce-scatter's rank receives only its share's sums; the other
    chunks come back as acknowledgements that bring their MAX exponent,
    so every worker carries every chunk's, and sends again alike what
    outgrew them: each share is the keyed all-reduce's bits."""
    job = f"rs-{uuid.uuid4().hex[:8]}"
    got = run_workers(service.address, 2, _scatter_rounds, service.address, job, 4, True, timeout=120)
    agreed = run_workers(service.address, 2, _scatter_rounds, service.address, job + "-a", 4, False, timeout=120)
    whole = run({"address": service.address}, 4)
    for rank in range(2):
        assert [r["carried"] for r in got[rank]] == [0, 1, 1, 1]
        assert [r["again"] for r in got[rank]] == [0, 0, 2, 0]  # from every worker, its own share's or not
        assert [r["carried"] for r in agreed[rank]] == [0, 0, 0, 0]
        mine = slice(SHARES[rank], SHARES[rank + 1])
        for rnd in range(4):
            np.testing.assert_array_equal(got[rank][rnd]["bits"], whole[0][rnd]["bits"][mine])
        np.testing.assert_array_equal(got[rank][0]["bits"], agreed[rank][0]["bits"])


def _spike(rank: int, address: str, job: str, rounds: int, spike: int, predict: bool):
    """Round ``spike``'s values 2**10 times the others' (a loss spike)."""
    out = []
    with Client(address, job=job, rank=rank, world_size=2, chunk_bytes=4 * BLOCK, timeout=60,
                predict_scale=predict) as client:
        s = client.stats
        for rnd in range(rounds):
            buf = values(rank, 0) * np.float32(2.0 ** 10 if rnd == spike else 1.0)
            before = (s.scales_carried, s.chunks_sent_again, s.scales_unsteady)
            client.allreduce(buf, codec="int32", key=3).result(60)
            out.append({"bits": buf.view(np.uint32).copy(), "carried": s.scales_carried - before[0],
                        "again": s.chunks_sent_again - before[1], "unsteady": s.scales_unsteady - before[2]})
    return out


def test_after_a_round_that_carrying_would_send_again_mostly_the_key_agrees_until_it_is_steady(service):
    """A spike: its round sends every chunk again; the next one, carrying
    the spike's exponents, would too (now far too coarse), so it agrees;
    so does the one after it (carried from the spike, the round before
    would still have gone again), and the key carries once steady again."""
    job = f"spike-{uuid.uuid4().hex[:8]}"
    got = run_workers(service.address, 2, _spike, service.address, job, 6, 2, True, timeout=120)
    agreed = run_workers(service.address, 2, _spike, service.address, job + "-a", 6, 2, False, timeout=120)
    for rank in got:
        assert [r["carried"] for r in rank] == [0, 1, 1, 0, 0, 1]
        assert [r["again"] for r in rank] == [0, 0, CHUNKS, 0, 0, 0]
        assert [r["unsteady"] for r in rank] == [0, 0, 0, 1, 1, 0]
        # the rounds that went again or agreed are the very bits agreeing gives
        for rnd in (0, 2, 3, 4):
            np.testing.assert_array_equal(rank[rnd]["bits"], agreed[0][rnd]["bits"])
    np.testing.assert_array_equal(got[0][5]["bits"], got[1][5]["bits"])
    assert_within_step(got[0][5]["bits"], 0, chunk_exponents(0) + 1)


def test_racks_under_a_root_carry_the_jobs_maxima():
    """A rack's partial brings its workers' MAX to the root, whose final
    brings the job's to every rack: all four workers send the same chunks
    again, and the sums equal one aggregator's."""
    racks = Racks("service", per_rack=2)
    try:
        got = run({"topology": racks.topology}, 3, world=4)
    finally:
        racks.stop()
    for rank in got:
        assert [r["carried"] for r in rank] == [0, 1, 1]
        assert [r["again"] for r in rank] == [0, 0, 2]
        np.testing.assert_array_equal(rank[2]["bits"], got[0][2]["bits"])
    assert_within_step(got[0][1]["bits"], 1, chunk_exponents(0, 4) + 1, world=4)
