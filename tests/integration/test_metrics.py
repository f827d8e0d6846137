"""The Prometheus endpoint (aggnet.metrics): scraped over HTTP from a real
service and a real switch-mode aggregator, its numbers checked against
what the jobs did and against the aggregators' own stats."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
import uuid

import numpy as np
import pytest

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from aggnet import Client, ClientStats  # noqa: E402
from aggnet import metrics  # noqa: E402
from aggnet.protocol.wire import job_id_of  # noqa: E402
from aggnet.hosts import service  # noqa: E402
from aggnet.processes import ServiceProcess, free_port  # noqa: E402
from aggnet.transport import connect  # noqa: E402
from aggnet.protocol.wire import DType, Header, MsgType  # noqa: E402

K = 64


def scrape(port: int) -> dict:
    """{(sample name, frozenset of labels): value} of one scrape."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, frozenset(labels.items()))]


def labelled(samples: dict, name: str, label: str) -> dict:
    return {dict(lbl)[label]: v for (n, lbl), v in samples.items() if n == name}


@pytest.fixture
def endpoints():
    """Stops every metrics server a test started."""
    servers = []
    yield servers
    for s in servers:
        s.shutdown()
        s.server_close()


def _serve(endpoints, stats_fn, **kw):
    server, port = metrics.start_metrics_server(0, stats_fn, **kw)
    endpoints.append(server)
    return port


def test_service_metrics_match_what_the_job_did(endpoints):
    svc = service.start(f"inproc://metrics-{uuid.uuid4().hex[:6]}", shards=2)
    clients = []
    try:
        port = _serve(endpoints, svc.stats)
        job = f"m-{uuid.uuid4().hex[:6]}"
        clients = [Client(svc.address, job=job, rank=r, world_size=2, chunk_bytes=4096, timeout=20) for r in range(2)]
        bufs = [np.full(10000, r + 1, np.float32) for r in range(2)]  # 40000 bytes: 10 chunks of 4096
        for f in [c.allreduce(b) for c, b in zip(clients, bufs)]:
            f.result(30)
        assert (bufs[0] == 3).all()

        got = scrape(port)  # the workers are still joined: the job is shown
        totals = svc.collect_stats()["totals"]
        assert value(got, "aggnet_up") == 1
        assert value(got, "aggnet_pushes_total") == totals["pushes"] > 0
        assert value(got, "aggnet_results_total") == totals["results"] >= 10
        assert value(got, "aggnet_messages_total") >= totals["pushes"]
        assert value(got, "aggnet_bytes_total", direction="in") == totals["bytes_in"] >= 2 * 40000
        assert value(got, "aggnet_bytes_total", direction="out") == totals["bytes_out"] >= 2 * 40000
        assert value(got, "aggnet_internal_errors_total") == 0
        assert labelled(got, "aggnet_shard_up", "shard") == {"0": 1, "1": 1}
        # both shards' latency histograms, summed: one observation per result
        assert value(got, "aggnet_chunk_seconds_count") == totals["results"]
        assert value(got, "aggnet_chunk_seconds_bucket", le="+Inf") == totals["results"]
        assert value(got, "aggnet_chunk_seconds_sum") > 0
        # the job's own counters: every result sums one push of each worker
        assert value(got, "aggnet_jobs") == 1
        assert value(got, "aggnet_members", job=job) == 2
        assert value(got, "aggnet_job_pushes_total", job=job) == 2 * value(got, "aggnet_job_results_total", job=job)
        assert value(got, "aggnet_job_results_total", job=job) == totals["results"]
        assert value(got, "aggnet_job_bytes_total", job=job, direction="in") == totals["bytes_in"]
        assert value(got, "aggnet_pool_buffers") >= 1
        assert not labelled(got, "aggnet_dropped_total", "reason")

        # junk to a shard: dropped and counted by reason, the service goes on
        with connect([svc.shards[0].address]) as conn:
            conn.send(0, b"junk")
            conn.send(0, b"\x00" * 48)
            assert conn.recv(5) is not None and conn.recv(5) is not None  # the ERRORs saying why
        drops = labelled(scrape(port), "aggnet_dropped_total", "reason")
        assert drops == {"malformed_short": 1, "malformed_magic": 1}
    finally:
        for c in clients:
            c.close()
        svc.stop()


def test_switch_metrics_match_the_aggregator_counters(endpoints):
    from aggnet.hosts.switch import SwitchService

    svc = SwitchService("udp://127.0.0.1:0", pool=512, elements=K, shards=1)
    stop = threading.Event()
    loop = threading.Thread(target=svc.serve, args=(stop.is_set,), name="switch-under-test", daemon=True)
    loop.start()
    clients = []
    try:
        port = _serve(endpoints, svc.stats)
        job = f"sw-{uuid.uuid4().hex[:6]}"
        clients = [Client(str(svc.address), job=job, rank=r, world_size=2, elements=K, timeout=20)
                   for r in range(2)]
        bufs = [np.full(5000, r + 1, np.int32) for r in range(2)]
        for f in [c.allreduce(b) for c, b in zip(clients, bufs)]:
            f.result(30)
        assert (bufs[1] == 3).all()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(b"short", (svc.address.host, svc.address.port))
        deadline = time.monotonic() + 5
        while svc.collect_stats()["totals"].get("dropped_short", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)

        got = scrape(port)
        stats = svc.collect_stats()
        totals = stats["totals"]
        assert value(got, "aggnet_up") == 1
        assert value(got, "aggnet_messages_total") == totals["received"]
        assert value(got, "aggnet_pushes_total") == totals["summed"] >= 2 * (5000 // K)
        assert value(got, "aggnet_results_total") == totals["completed"] >= 5000 // K
        assert value(got, "aggnet_retransmits_total", what="result") == totals.get("results_resent", 0)
        assert value(got, "aggnet_retransmits_total", what="uplink") == 0
        assert labelled(got, "aggnet_dropped_total", "reason") == {"short": 1}
        assert value(got, "aggnet_pool_slots") == 512
        hists = stats.get("histograms") or {}
        if "slot_seconds" in hists:
            assert value(got, "aggnet_slot_seconds_count") == sum(hists["slot_seconds"]["counts"])
        # the job, with both workers joined
        assert value(got, "aggnet_jobs") == 1, f"the switch's stats show no job: {stats['jobs']}"
        assert value(got, "aggnet_members", job=job) == 2
        assert value(got, "aggnet_pool_used") > 0
        assert value(got, "aggnet_job_pushes_total", job=job) == totals["summed"]
        assert value(got, "aggnet_job_results_total", job=job) == totals["completed"]

        # a worker's own counters, from its process's endpoint
        server, cport = metrics.export_client(clients[0], 0)
        endpoints.append(server)
        mine = scrape(cport)
        st = clients[0].stats
        assert value(mine, "aggnet_client_chunks_sent_total", job=job, rank="0") == st.chunks_sent > 0
        assert value(mine, "aggnet_client_results_total", job=job, rank="0") == st.results > 0
        assert value(mine, "aggnet_client_allreduces_total", job=job, rank="0") == 1
    finally:
        for c in clients:
            c.close()
        stop.set()
        loop.join(10)
        svc.close()


def test_a_failing_or_stuck_stats_call_reads_as_down_not_as_a_failed_scrape(endpoints):
    calls = []

    def broken():
        calls.append(1)
        raise ConnectionError("the aggregator went away")

    port = _serve(endpoints, broken)
    for n in (1, 2):
        got = scrape(port)
        assert value(got, "aggnet_up") == 0
        assert value(got, "aggnet_scrape_errors_total") == n
        assert ("aggnet_pushes_total", frozenset()) not in got
    assert len(calls) == 2

    release = threading.Event()
    started = []

    def stuck():
        started.append(1)
        release.wait(30)
        return {"kind": "service", "totals": {}, "shards": []}

    port = _serve(endpoints, stuck, timeout=0.2)
    try:
        t0 = time.monotonic()
        assert value(scrape(port), "aggnet_up") == 0
        assert value(scrape(port), "aggnet_scrape_errors_total") == 2
        assert time.monotonic() - t0 < 5
        assert len(started) == 1  # the second scrape waited on the first call, it did not start another
    finally:
        release.set()
    deadline = time.monotonic() + 5
    while value(scrape(port), "aggnet_up") != 1:  # the call came back: the next scrape reads a new one
        assert time.monotonic() < deadline


def test_shards_are_summed_and_a_silent_shard_keeps_its_last_counters(endpoints):
    hist = {"bounds": [0.01, 0.1, 1.0], "counts": [1, 2, 0, 1], "sum": 2.5}
    other = {"bounds": [0.1, 1.0], "counts": [3, 1, 0], "sum": 0.7}  # other bounds: merged on their union
    shard0 = {"counters": {"pushes": 4, "results": 2, "dropped_unknown_job": 1}, "pool_buffers": 2,
              "histograms": {"chunk_seconds": hist},
              "jobs": {"a": {"members": [0, 1], "open_slots": 1, "counters": {"pushes": 4, "results": 2}}}}
    shard1 = {"counters": {"pushes": 6, "results": 3, "dropped_unknown_job": 2}, "pool_buffers": 1,
              "histograms": {"chunk_seconds": other, "broken": {"bounds": [1], "counts": [1]}, "Bad-Name": hist},
              "jobs": {"a": {"members": [0, 1], "open_slots": 0, "counters": {"pushes": 6, "results": 3}}}}
    answers = [
        {"totals": {"messages": 20, "pushes": 10, "results": 5, "dropped_unknown_job": 3}, "shards": [shard0, shard1],
         "restarts": 0},
        # shard 1 too busy to answer: its last counters stay in the sums
        {"totals": {"messages": 21, "pushes": 4, "results": 2, "dropped_unknown_job": 1}, "shards": [shard0, None],
         "restarts": 0},
    ]
    # a service's STATS replies, in the shape its stats() gives the exporter
    port = _serve(endpoints, lambda: service.stats_view(answers.pop(0)))
    for up in ({"0": 1, "1": 1}, {"0": 1, "1": 0}):
        got = scrape(port)
        assert labelled(got, "aggnet_shard_up", "shard") == up
        assert value(got, "aggnet_pushes_total") == 10
        assert value(got, "aggnet_results_total") == 5
        assert value(got, "aggnet_dropped_total", reason="unknown_job") == 3
        assert value(got, "aggnet_job_pushes_total", job="a") == 10
        assert value(got, "aggnet_members", job="a") == 2
        assert value(got, "aggnet_open_slots", job="a") == 1
        assert value(got, "aggnet_pool_buffers") == 3
        assert labelled(got, "aggnet_chunk_seconds_bucket", "le") == {"0.01": 1, "0.1": 6, "1.0": 7, "+Inf": 8}
        assert value(got, "aggnet_chunk_seconds_sum") == pytest.approx(3.2)
        assert ("aggnet_broken_count", frozenset()) not in got  # malformed: left out, the rest is served
    assert value(got, "aggnet_messages_total") == 21


def test_client_collector_exports_every_counter(endpoints):
    class Fake:
        job, rank = "train", 3
        stats = ClientStats(allreduces=2, chunks_sent=7, bytes_sent=700, bytes_received=650, results=6,
                            retransmissions=1, seconds=0.25)

    server, port = metrics.export_client(Fake(), 0)
    endpoints.append(server)
    got = scrape(port)
    mine = {n: v for (n, lbl), v in got.items() if n.startswith("aggnet_client_")}
    assert all(dict(lbl) == {"job": "train", "rank": "3"} for (n, lbl) in got if n.startswith("aggnet_client_"))
    assert mine["aggnet_client_chunks_sent_total"] == 7
    assert mine["aggnet_client_retransmissions_total"] == 1
    assert mine["aggnet_client_allreduce_seconds_total"] == 0.25
    assert {f"aggnet_client_{f}_total" for f in ("bytes_sent", "bytes_received", "results", "errors", "rejoins",
                                                  "dropped_replies", "fast_retransmissions")} <= set(mine)


def test_stats_of_an_unknown_kind_read_as_down_and_say_why(endpoints, caplog):
    port = _serve(endpoints, lambda: {"kind": "router", "totals": {"pushes": 1}})
    with caplog.at_level("WARNING", logger="aggnet.metrics"):
        got = scrape(port)
    assert value(got, "aggnet_up") == 0 and value(got, "aggnet_scrape_errors_total") == 1
    assert ("aggnet_pushes_total", frozenset()) not in got
    assert any("'router'" in r.getMessage() and "service, switch" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("mode", ["service", "switch", "tcp-service"])
def test_aggnet_serve_metrics_port(tmp_path, mode):
    port = free_port()
    listen = {"switch": "udp://127.0.0.1:0", "service": f"zmq+ipc://{tmp_path}/agg",
              "tcp-service": "tcp://127.0.0.1:0"}[mode]
    extra = {"switch": ["--mode", "switch", "--elements", str(K), "--pool", "64"],
             "tcp-service": ["--receive-budget", "128MiB"]}.get(mode, [])
    with ServiceProcess(listen, shards=2, args=[*extra, "--metrics-port", str(port)]) as svc:
        # the serving line comes after the endpoint is up
        got = scrape(port)
        assert value(got, "aggnet_up") == 1
        if mode == "switch":
            assert value(got, "aggnet_pool_slots") == 64
        else:
            assert labelled(got, "aggnet_shard_up", "shard") == {"0": 1, "1": 1}
            # each shard's memory, by shard: what an operator alerts on
            resident = labelled(got, "aggnet_shard_resident_bytes", "shard")
            peak = labelled(got, "aggnet_shard_peak_resident_bytes", "shard")
            assert set(resident) == set(peak) == {"0", "1"}
            assert all(10 << 20 < resident[s] <= peak[s] for s in resident), (resident, peak)
        if mode == "tcp-service":  # and what its budgets hold, beside the budgets
            assert labelled(got, "aggnet_shard_receive_budget_bytes", "shard") == {"0": 128 << 20, "1": 128 << 20}
            assert labelled(got, "aggnet_shard_unsent_budget_bytes", "shard") == {"0": 1 << 30, "1": 1 << 30}
            assert labelled(got, "aggnet_shard_receiving_bytes", "shard") == {"0": 0, "1": 0}
            assert labelled(got, "aggnet_shard_unsent_bytes", "shard") == {"0": 0, "1": 0}
        assert svc.alive()


def test_serve_refuses_a_port_it_cannot_bind(endpoints):
    class Args:
        metrics_host = "127.0.0.1"

    server, port = metrics.start_metrics_server(0, dict)
    endpoints.append(server)
    Args.metrics_port = port  # taken
    with pytest.raises(SystemExit, match="cannot serve metrics"):
        metrics.serve_metrics_for(Args, dict)


def test_a_raw_push_for_an_unknown_job_is_a_drop_by_reason(endpoints):
    svc = service.start(f"inproc://metrics-{uuid.uuid4().hex[:6]}", shards=1)
    try:
        port = _serve(endpoints, svc.stats)
        payload = np.zeros(4, np.float32).tobytes()
        h = Header(MsgType.PUSH, job_id=job_id_of("nobody"), dtype=DType.FLOAT32, count=4, world=1)
        with connect([svc.shards[0].address]) as conn:
            conn.send(0, h.pack(), payload)
            assert conn.recv(5) is not None
        assert value(scrape(port), "aggnet_dropped_total", reason="unknown_job") == 1
    finally:
        svc.stop()
