"""Hostile traffic at live aggregators while a real job runs on them.

A switch-mode aggregator takes 100,000 random and mutated datagrams, and a
ZeroMQ service 10,000 malformed messages (aggnet.cli.fuzz), while two workers
all-reduce int32 and float32 buffers whose sums they check exactly. Both
aggregators must stay up and answer STATS, count what they dropped by
reason, never fail on a message (``internal_error``), and keep the job's
members and sums untouched. The last tests pin inputs that once broke an
aggregator, a peer that never reads its replies, and JOINs that claim a
keyed job's real ranks.
"""

from __future__ import annotations

import json
import multiprocessing
import queue
import re
import socket
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
import zmq

from aggnet import Client
from aggnet.protocol import keys, wire
from aggnet.protocol.address import parse
from aggnet.protocol.wire import job_id_of
from aggnet.cli.fuzz import KNOWN_BAD_JOINS, drop_counters, run_campaign
from aggnet.processes import ServiceProcess
from harness.helpers import a_job_runs
from aggnet.client.stats import query
from aggnet.transport.zmq import zmq_endpoint
from aggnet.protocol.wire import Header, MsgType


K = 64
SIZE = 3001  # not a multiple of K: every all-reduce has a padded tail block


def _ints(rank: int, it: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * it + rank)
    return rng.integers(-(2 ** 31), 2 ** 31, SIZE, dtype=np.int64).astype(np.int32)


def _floats(rank: int, it: int) -> np.ndarray:
    """Integer values below 2**10: the switch protocol's int32 quantization
    of a 2-worker sum carries them exactly, so float sums are exact too."""
    rng = np.random.default_rng(1000 * it + rank + 500)
    return rng.integers(-1000, 1000, SIZE).astype(np.float32)


def _job_worker(rank, address, job, rounds, last, out, opts):
    """All-reduce in a loop, counting finished rounds in ``rounds``, until
    round ``last`` (0: not yet known; every rank stops at the same round,
    so none leaves while another waits for it); report (rank, rounds,
    errors)."""
    errors, it = [], 0
    try:
        with Client(address, job=job, rank=rank, world_size=2, **opts) as c:
            while last.value == 0 or it < last.value:
                x, y = _ints(rank, it), _floats(rank, it)
                c.allreduce(x).result(60)
                c.allreduce(y).result(60)
                want_x = ((_ints(0, it).astype(np.int64) + _ints(1, it) + 2 ** 31) % 2 ** 32 - 2 ** 31).astype(np.int32)
                want_y = _floats(0, it) + _floats(1, it)
                for what, got, want in (("int32", x, want_x), ("float32", y, want_y)):
                    if not np.array_equal(got, want):
                        errors.append(f"round {it}: {what} sum differs at {np.flatnonzero(got != want)[:5]}")
                it += 1
                rounds.value = it
    except BaseException as exc:  # the test reports it with the rank
        errors.append(f"{type(exc).__name__}: {exc}")
    out.put((rank, it, errors))


class Job:
    """Two worker processes all-reducing through ``address`` until stopped."""

    def __init__(self, address: str, name: str, **opts):
        ctx = multiprocessing.get_context("fork")
        self.last, self.out = ctx.Value("l", 0, lock=False), ctx.Queue()
        self.rounds = [ctx.Value("l", 0, lock=False) for _ in range(2)]
        self.procs = [ctx.Process(target=_job_worker, args=(r, address, name, self.rounds[r], self.last, self.out,
                                                             opts), daemon=True) for r in range(2)]
        for p in self.procs:
            p.start()

    def done(self) -> list[int]:
        return [v.value for v in self.rounds]

    def wait_running(self, timeout: float = 60.0) -> list[int]:
        """Rounds done once every rank has finished one."""
        deadline = time.monotonic() + timeout
        while min(self.done()) < 1:
            assert time.monotonic() < deadline, "the job did not complete a first round"
            assert all(p.is_alive() for p in self.procs), "a worker died before its first round"
            time.sleep(0.05)
        return self.done()

    def progressed_since(self, before: list[int], rounds: int = 2) -> None:
        """Each rank finished ``rounds`` more rounds (waiting a little for
        the last ones): the job went on while the campaign ran."""
        deadline = time.monotonic() + 30
        while any(a - b < rounds for a, b in zip(self.done(), before)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(a - b >= rounds for a, b in zip(self.done(), before)), \
            f"the job stalled: rounds {before} before the campaign, {self.done()} after"

    def stop(self) -> None:
        """Let the ranks finish a little after the furthest of them (ranks
        are never more than one round apart)."""
        if self.last.value == 0:
            self.last.value = max(self.done()) + 3

    def kill(self) -> None:
        """End workers that are still running (a test that failed early)."""
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)

    def finish(self, timeout: float = 90.0) -> dict:
        self.stop()
        results, deadline = {}, time.monotonic() + timeout
        try:
            while len(results) < 2:
                rank, rounds, errors = self.out.get(timeout=max(0.1, deadline - time.monotonic()))
                results[rank] = (rounds, errors)
        except queue.Empty:
            pass
        for p in self.procs:
            p.join(timeout=5)
        self.kill()
        assert len(results) == 2, f"rank(s) {sorted({0, 1} - set(results))} did not finish"
        return results


def _check_job(results: dict, min_rounds: int) -> None:
    for rank, (rounds, errors) in sorted(results.items()):
        assert not errors, f"rank {rank}: {errors[:5]}"
        assert rounds >= min_rounds, f"rank {rank} completed only {rounds} rounds"


def _reasons(stats: dict) -> set:
    return {k[len("dropped_"):] for k, v in drop_counters(stats).items() if k.startswith("dropped_") and v}


# -- the live campaigns -------------------------------------------------------------------------


def test_switch_mode_aggregator_survives_100k_hostile_datagrams():
    svc = ServiceProcess("udp://127.0.0.1:0", shards=1, args=["--mode", "switch", "--elements", str(K),
                                                              "--pool", "1024"])
    name = f"fuzzed-{uuid.uuid4().hex[:6]}"
    job = Job(svc.address, name, elements=K, slots=16, timeout=30)
    try:
        before = job.wait_running()
        sent = run_campaign(svc.address, datagrams=100_000, seed=11, job=name)
        print(f"campaign: {sent['total']} datagrams in {sent['seconds']}s; rounds {before} -> {job.done()}")
        assert sent["total"] >= 100_000
        assert sent["sent"]["forged"] > 5000 and sent["sent"]["mutated"] > 5000
        assert svc.alive(), "the aggregator process died"
        stats = query(svc.address, timeout=5.0)
        assert stats["jobs"][name]["members"] == [0, 1]  # nobody took a rank over
        job.progressed_since(before)
        _check_job(job.finish(), min_rounds=3)

        totals = stats["totals"]
        assert totals.get("internal_error", 0) == 0, "a datagram made the aggregator raise (see its log)"
        reasons = _reasons(stats)
        # the data path's reasons, each of which the campaign provokes many times
        for reason in ("short", "magic", "version", "reserved", "length", "unknown_job", "not_admitted"):
            assert reason in reasons, f"no datagram was dropped as {reason!r}: {sorted(reasons)}"
        # control messages: malformed headers and payloads outside the schema
        assert any(r.startswith("malformed_") for r in reasons), sorted(reasons)
        assert any(r.startswith("field_") for r in reasons), sorted(reasons)
        assert totals["received"] > sent["total"] // 2, "most datagrams never reached the aggregator"
    finally:
        job.kill()
        assert svc.stop() == 0, "the aggregator did not stop cleanly"


@pytest.mark.parametrize("scheme", ["zmq+tcp", "tcp"])
def test_a_service_survives_10k_malformed_messages(scheme):
    svc = ServiceProcess(f"{scheme}://127.0.0.1:0", shards=2)
    name = f"fuzzed-{uuid.uuid4().hex[:6]}"
    job = Job(svc.address, name, timeout=30, chunk_bytes=4096)
    try:
        before = job.wait_running()
        sent = run_campaign(svc.address, messages=10_000, seed=12, job=name)
        print(f"campaign: {sent['total']} messages in {sent['seconds']}s; rounds {before} -> {job.done()}")
        assert sent["total"] >= 10_000
        assert svc.alive(), "the service process died"
        stats = query(svc.address, timeout=5.0)
        assert all(s is not None for s in stats["shards"]), "a shard did not answer STATS"
        for shard in stats["shards"]:
            if name in shard["jobs"]:
                assert shard["jobs"][name]["members"] == [0, 1]  # nobody took a rank over
        job.progressed_since(before)
        _check_job(job.finish(), min_rounds=3)

        assert stats["restarts"] == 0
        assert stats["totals"].get("internal_error", 0) == 0, "a message made a shard raise (see its log)"
        reasons = _reasons(stats)
        for reason in ("malformed_short", "malformed_length", "malformed_magic", "malformed_header_length",
                       "unknown_job", "not_member", "unexpected_type"):
            assert reason in reasons, f"no message was dropped as {reason!r}: {sorted(reasons)}"
        assert any(r.startswith("field_") for r in reasons), sorted(reasons)
    finally:
        job.kill()
        assert svc.stop() == 0, "the service did not stop cleanly"


# -- inputs that once broke an aggregator ------------------------------------------------------


@pytest.fixture(scope="module")
def aggregators():
    switch = ServiceProcess("udp://127.0.0.1:0", shards=1, args=["--mode", "switch", "--elements", str(K),
                                                                 "--pool", "1024"])
    service = ServiceProcess("zmq+tcp://127.0.0.1:0", shards=1)
    plain = ServiceProcess("tcp://127.0.0.1:0", shards=1)
    yield {"switch": switch, "service": service, "tcp-service": plain}
    switch.stop()
    service.stop()
    plain.stop()


def _ask_udp(address: str, data: bytes, timeout: float = 2.0) -> bytes | None:
    host, port = address[len("udp://"):].rsplit(":", 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(timeout)
        s.sendto(data, (host, int(port)))
        try:
            return s.recv(1 << 16)
        except socket.timeout:
            return None


def _shard_endpoint(service: ServiceProcess, i: int = 0) -> str:
    return zmq_endpoint(parse(query(service.address)["service"]["shards"][i]))


def _ask_zmq(endpoint: str, frames: list, timeout: float = 2.0) -> list | None:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    try:
        s.send_multipart(frames)
        return s.recv_multipart() if s.poll(int(timeout * 1000)) else None
    finally:
        s.close()


@pytest.mark.parametrize("fields", KNOWN_BAD_JOINS, ids=lambda f: re.sub(r"[^\w.=-]+", "_", json.dumps(f))[:40])
@pytest.mark.parametrize("kind", ["switch", "service"])
def test_a_hostile_join_is_answered_and_the_aggregator_goes_on(aggregators, kind, fields):
    svc = aggregators[kind]
    payload = json.dumps({"name": f"bad-{uuid.uuid4().hex[:6]}", **fields}).encode()
    h = Header(MsgType.JOIN, job_id=int(uuid.uuid4().int & 0xFFFFFFFF), sender=0, world=2)
    if kind == "switch":
        reply = _ask_udp(svc.address, h.pack_for(payload) + payload)
        header, body = (reply[:wire.HEADER_SIZE], reply[wire.HEADER_SIZE:]) if reply else (None, None)
    else:
        frames = _ask_zmq(_shard_endpoint(svc), [h.pack_for(payload), payload])
        header, body = (frames[0], frames[1] if len(frames) > 1 else b"") if frames else (None, None)
    assert header is not None, f"no answer to JOIN {payload[:80]!r}"
    answer = wire.unpack_header(header)
    assert answer.msg_type in (MsgType.JOIN_OK, MsgType.ERROR)
    if answer.msg_type == MsgType.ERROR:
        assert wire.parse_error(body)[0] in ("malformed", "refused", "job_mismatch")
    assert svc.alive()
    assert query(svc.address)["totals"].get("internal_error", 0) == 0


@pytest.mark.parametrize("kind", ["switch", "service", "tcp-service"])
def test_aggnet_fuzz_runs_a_campaign_and_reports_the_target_up(aggregators, kind):
    out = subprocess.run([sys.executable, "-m", "aggnet", "fuzz", "--target", aggregators[kind].address,
                          "--count", "3000", "--seed", "1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "is up" in out.stdout and "dropped_" in out.stdout and "mutated" in out.stdout, out.stdout


@pytest.mark.parametrize("where", ["control", "shard"])
def test_a_peer_that_never_reads_its_replies_does_not_stall_the_service(where):
    """Tens of thousands of junk messages from one DEALER that reads none of
    the ERRORs they earn: the service must go on reading (and drop what it
    cannot deliver), not block on that peer while every other client waits."""
    svc = ServiceProcess("zmq+tcp://127.0.0.1:0", shards=1)
    deaf = zmq.Context.instance().socket(zmq.DEALER)
    deaf.setsockopt(zmq.LINGER, 0)
    try:
        target = zmq_endpoint(parse(svc.address)) if where == "control" else _shard_endpoint(svc)
        deaf.connect(target)
        n = 50_000
        for _ in range(n):
            deaf.send_multipart([b"junk"])
        deadline, read = time.monotonic() + 12, 0
        while read < n:
            reply = _ask_zmq(target, [Header(MsgType.STATS).pack()], timeout=2.0)
            assert reply is not None, f"the {where} endpoint stopped answering after reading {read} of {n} " \
                                      f"messages from a peer that reads nothing"
            stats = json.loads(reply[1])
            read = (stats["counters"] if where == "shard" else stats["totals"]).get("messages", 0)
            assert time.monotonic() < deadline, f"the {where} endpoint read only {read} of {n} messages in 12s"
            time.sleep(0.2)
    finally:
        deaf.close()
        svc.stop(timeout=5)


# -- JOINs that claim a keyed job's real ranks ------------------------------------------------------


@pytest.mark.parametrize("kind", ["switch", "service"])
def test_a_hijacking_join_cannot_replace_a_member_of_a_keyed_job(kind, tmp_path):
    name = f"keyed-{uuid.uuid4().hex[:6]}"
    keyfile = str(tmp_path / "keys.json")
    key = keys.write_job_key(keyfile, name)
    if kind == "switch":
        svc = ServiceProcess("udp://127.0.0.1:0", shards=1, args=["--mode", "switch", "--elements", str(K),
                                                                  "--keys", keyfile])
        opts = {"elements": K, "slots": 16}
    else:
        svc = ServiceProcess("zmq+tcp://127.0.0.1:0", shards=1, args=["--keys", keyfile])
        opts = {"chunk_bytes": 4096}
    job = Job(svc.address, name, timeout=10, job_key=key, **opts)
    try:
        job.wait_running()
        forged = keys.sign(bytes.fromhex("11" * 32), "JOIN", job_id_of(name), 1, 2, {"name": name})
        for rank in (0, 1):
            for auth in (None, forged):
                fields = {"name": name} if auth is None else {"name": name, "auth": auth}
                payload = json.dumps(fields).encode()
                h = Header(MsgType.JOIN, job_id=job_id_of(name), sender=rank, world=2)
                if kind == "switch":
                    reply = _ask_udp(svc.address, h.pack_for(payload) + payload)
                    answer = wire.unpack_header(reply).msg_type if reply else None
                else:
                    frames = _ask_zmq(_shard_endpoint(svc), [h.pack_for(payload), payload])
                    answer = wire.unpack_header(frames[0]).msg_type if frames else None
                how = "with a forged key" if auth else "unsigned"
                assert answer == MsgType.ERROR, f"a JOIN claiming rank {rank} ({how}) was answered {answer}"
        sent = run_campaign(svc.address, datagrams=5000, messages=2000, seed=13, job=name, hijack=True)
        assert sent["sent"].get("hijack", 0) > 0
        _check_job(job.finish(), min_rounds=3)
    finally:
        job.kill()
        svc.stop()


# -- memory a tcp:// service can be made to hold ----------------------------------------------------


def test_the_hoard_leaves_a_tcp_service_within_its_budgets_and_serving():
    """Payloads announced and never finished, and members that read none
    of their results: `aggnet fuzz --hoard` reads each shard's peak memory
    before and after and fails where it grew past its budgets. Without the
    budgets the same hoard grew the shard by 1724 MiB."""
    args = ["--receive-budget", "64MiB", "--unsent-budget", "128MiB"]
    with ServiceProcess("tcp://127.0.0.1:0", shards=1, args=args) as svc:
        out = subprocess.run([sys.executable, "-m", "aggnet", "fuzz", "--target", svc.address, "--count", "500",
                              "--hoard"], capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "hoard: 9 hoarders and 3 deaf members sent" in out.stdout, out.stdout
        assert re.search(r"shard 0: peak resident \d+ -> \d+ MiB \(budgets: receive 64 MiB, unsent 128 MiB\)",
                         out.stdout), out.stdout
        shard = query(svc.address)["shards"][0]
        assert shard["counters"]["dropped_unread_stream"] >= 1 and shard["counters"]["receive_waits"] >= 8
        # every peer is gone: nothing is held for them any more
        deadline = time.monotonic() + 10
        while (shard["memory"]["receiving_bytes"], shard["memory"]["unsent_bytes"]) != (0, 0):
            assert time.monotonic() < deadline, shard["memory"]
            time.sleep(0.1)
            shard = query(svc.address)["shards"][0]
        a_job_runs(svc.address, f"after-hoard-{uuid.uuid4().hex[:6]}")


def test_the_hoard_is_refused_in_one_line_where_there_are_no_budgets():
    out = subprocess.run([sys.executable, "-m", "aggnet", "fuzz", "--target", "zmq+tcp://127.0.0.1:9", "--hoard"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--hoard checks a tcp:// service's memory budgets" in out.stderr
    assert "Traceback" not in out.stderr
