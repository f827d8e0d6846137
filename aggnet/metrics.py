"""Prometheus metrics of an aggregator and of a client (docs/observability.md).

The aggregators already keep counters for STATS; this module only turns a
stats dict into Prometheus families at scrape time, so the data path gains
no work and a scrape sees exactly what ``aggnet stats`` would. Each endpoint
has its own registry: nothing registered globally by the embedding process
(or by another aggregator in it) leaks into an aggregator's metrics.

prometheus_client is imported only when metrics are asked for.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import ipaddress
import itertools
import logging
import re
import threading
from concurrent.futures import Future

log = logging.getLogger("aggnet.metrics")

#: what a histogram of the stats may be called to become aggnet_<name>
_NAME = re.compile(r"[a-z_][a-z0-9_]*")

#: (stats counter, metric suffix, help, labels) of the counters exported
#: aggregator-wide (no label) and per job (aggnet_job_*, label job)
_COUNTERS = (
    ("messages", "messages", "Messages received (datagrams in switch mode), malformed ones included", {}),
    ("pushes", "pushes", "Contributions summed into a slot", {}),
    ("results", "results", "Slots (chunks) completed and their result sent", {}),
    ("bytes_in", "bytes", "Payload bytes summed in (in) and sent in results (out)", {"direction": "in"}),
    ("bytes_out", "bytes", "Payload bytes summed in (in) and sent in results (out)", {"direction": "out"}),
    ("results_resent", "retransmits",
     "Packets sent again for a worker's retransmission: a lost result (what=result) or a partial sum lost "
     "on the way to the parent (what=uplink)", {"what": "result"}),
    ("uplink_resent", "retransmits",
     "Packets sent again for a worker's retransmission: a lost result (what=result) or a partial sum lost "
     "on the way to the parent (what=uplink)", {"what": "uplink"}),
    ("stalls", "stalls", "Slots given up because a worker did not contribute in time", {}),
    ("receive_waits", "receive_waits", "Times a tcp:// stream waited, unread, for room in its shard's budget "
     "for payloads being received", {}),
    ("internal_error", "internal_errors", "Messages the aggregator failed on (its log says why)", {}),
)


@dataclasses.dataclass(frozen=True)
class _CounterNames:
    """How one kind of aggregator names its counters."""

    #: its names -> the service's names for the same events, so that one
    #: set of metrics describes every kind
    renamed: dict
    #: counters it always reports, at 0 before they happen (stats leave
    #: zero counters out): alerts see 0, not a missing series
    always: tuple


#: by the "kind" of an aggregator's stats (hosts/aggregator.py)
_KINDS = {
    "service": _CounterNames({}, ("messages", "pushes", "results", "bytes_in", "bytes_out", "stalls",
                                  "internal_error")),
    "switch": _CounterNames({"received": "messages", "summed": "pushes", "completed": "results", "finals": "results"},
                            ("messages", "pushes", "results", "results_resent", "uplink_resent", "internal_error")),
}
KINDS = tuple(_KINDS)

#: (pool figure, metric, help) in the order they are exported
_POOL_GAUGES = (
    ("buffers", "pool_buffers", "Accumulator buffers the shards' pools allocated"),
    ("slots", "pool_slots", "Slots in the aggregator's pool"),
    ("used", "pool_used", "Pool slots held by jobs"),
)

_HISTOGRAM_HELP = {
    "chunk_seconds": "Seconds from a chunk's first contribution to its result (service mode)",
    "slot_seconds": "Seconds from a slot's first contribution to its result (switch mode)",
}

_CLIENT_HELP = {
    "allreduces": "All-reduces completed",
    "chunks_sent": "Chunks (switch mode: packets) sent, retransmissions included",
    "bytes_sent": "Payload bytes sent",
    "bytes_received": "Payload bytes of results received",
    "results": "Results received",
    "retransmissions": "Packets sent again (switch mode)",
    "fast_retransmissions": "Retransmissions sent early, on later results (switch mode)",
    "dropped_replies": "Replies dropped: malformed, from a stranger, or for nothing pending",
    "errors": "All-reduces failed by an aggregator's ERROR or a timeout",
    "rejoins": "Times the client joined its aggregator again",
    "scales_carried": "int32 all-reduces quantized with exponents carried from their key's last round",
    "scales_awaited": "int32 all-reduces that waited for their key's last round to end before quantizing",
    "scales_unsteady": "int32 all-reduces under a key that agreed their exponents because carried ones would have "
                       "sent more than a quarter of the key's last round again",
    "chunks_sent_again": "int32 chunks sent again with the agreed exponent (values outgrew the carried one)",
    "chunks_shared": "Chunks a shard read where they lie in the worker's shared memory (no copy into a ring slot)",
    "results_in_place": "Results a shard wrote into the worker's shared memory itself (no copy out of a ring slot)",
    "seconds": "Seconds from submission to completion, summed over all-reduces",
}


def _prometheus():
    try:
        import prometheus_client
        import prometheus_client.core  # noqa: F401
        import prometheus_client.utils  # noqa: F401
    except ImportError:
        raise ImportError("aggnet metrics need prometheus_client: pip install prometheus_client") from None
    return prometheus_client


class StatsCollector:
    """A prometheus_client collector over an aggregator's stats.

    ``stats_fn()`` is called at each scrape: an aggregator's ``stats``
    (hosts/aggregator.py: one shape for every kind; its "kind" says how the
    counters are named). A call that fails, answers with a kind not in
    KINDS or takes longer than ``timeout`` seconds yields ``aggnet_up 0``
    and counts a scrape error; a scrape never fails because of it. A call
    still running when the next scrape comes is waited on, not repeated, so
    a stuck aggregator does not pile up threads.
    """

    def __init__(self, stats_fn, timeout: float = 5.0):
        self.stats_fn = stats_fn
        self.timeout = timeout
        self.scrape_errors = 0
        self._pending: Future | None = None
        self._lock = threading.Lock()
        #: each shard's last answer: a shard too busy to answer in time
        #: keeps its counters in the sums, which would otherwise drop and
        #: read as a counter reset
        self._last_shard: dict[int, dict] = {}

    def collect(self):
        core = _prometheus().core
        try:
            families = list(self._families(core, self._call()))
            up = 1
        except Exception as exc:
            self.scrape_errors += 1
            log.warning("metrics: reading the aggregator's stats failed: %s", exc or type(exc).__name__)
            families, up = [], 0
        yield core.GaugeMetricFamily("aggnet_up", "1 when the aggregator's stats were read at this scrape", up)
        yield core.CounterMetricFamily("aggnet_scrape_errors", "Scrapes that could not read the aggregator's stats",
                                       self.scrape_errors)
        yield from families

    def _call(self) -> dict:
        with self._lock:
            if self._pending is None or self._pending.done():
                self._pending = Future()
                threading.Thread(target=_resolve, args=(self._pending, self.stats_fn), name="aggnet-metrics-stats",
                                 daemon=True).start()
            pending = self._pending
        stats = pending.result(self.timeout)
        if not isinstance(stats, dict):
            raise TypeError(f"stats are a {type(stats).__name__}, not a dict")
        return stats

    # -- stats dict -> families ---------------------------------------------------

    def _families(self, core, stats: dict):
        names = _KINDS.get(stats.get("kind"))
        if names is None:
            raise ValueError(f"stats of kind {stats.get('kind')!r}; this exporter knows {', '.join(KINDS)}")
        totals, jobs, hists, pool, shard_up = self._merge(stats)
        totals = _renamed(totals, names.renamed)
        for metric, (help_text, labels, samples) in _counter_families(totals, names.always, None).items():
            yield _family(core.CounterMetricFamily, f"aggnet_{metric}", help_text, labels, samples)
        per_job = collections.defaultdict(list)
        for name, job in jobs.items():
            counters = _renamed(job["counters"], names.renamed)
            for metric, (help_text, labels, samples) in _counter_families(counters, (), name).items():
                per_job[metric].append((help_text, labels, samples))
        for metric, parts in per_job.items():
            yield _family(core.CounterMetricFamily, f"aggnet_job_{metric}", parts[0][0] + " (per job)",
                          parts[0][1], [s for p in parts for s in p[2]])
        yield core.GaugeMetricFamily("aggnet_jobs", "Jobs the aggregator holds", len(jobs))
        yield _family(core.GaugeMetricFamily, "aggnet_members", "Workers joined to the job", ["job"],
                      [([name], j["members"]) for name, j in jobs.items()])
        open_slots = [([name], j["open_slots"]) for name, j in jobs.items() if j.get("open_slots") is not None]
        if open_slots:
            yield _family(core.GaugeMetricFamily, "aggnet_open_slots", "Slots being summed now", ["job"], open_slots)
        for key, metric, help_text in _POOL_GAUGES:
            if pool[key] is not None:
                yield core.GaugeMetricFamily(f"aggnet_{metric}", help_text, pool[key])
        if shard_up:
            yield _family(core.GaugeMetricFamily, "aggnet_shard_up",
                          "1 when the shard answered this scrape (0: its last answer is used)", ["shard"],
                          [([str(i)], v) for i, v in sorted(shard_up.items())])
        yield from _shard_memory_families(core, stats, shard_up)
        if stats.get("restarts") is not None:
            yield core.CounterMetricFamily("aggnet_shard_restarts", "Shard processes restarted (their counters "
                                           "start again from 0)", stats["restarts"])
        for name, parts in sorted(hists.items()):
            merged = _merge_histograms(parts) if _NAME.fullmatch(name) else None
            if merged is not None:
                yield core.HistogramMetricFamily(f"aggnet_{name}", _HISTOGRAM_HELP.get(name, f"{name} (histogram)"),
                                                 buckets=merged[0], sum_value=merged[1])

    def _merge(self, stats: dict):
        """The aggregator-wide part and every shard's, summed (a silent
        shard's last part stands in for it)."""
        totals = collections.Counter(stats.get("totals") or {})
        parts, shard_up = [stats], {}
        for i, part in enumerate(stats.get("shards") or []):
            if part is not None:
                self._last_shard[i] = part
                shard_up[i] = 1
            else:
                shard_up[i] = 0
                part = self._last_shard.get(i)
                if part is not None:
                    totals.update(part.get("counters") or {})
            if part is not None:
                parts.append(part)
        jobs: dict = {}
        hists = collections.defaultdict(list)
        pool = dict.fromkeys(key for key, _, _ in _POOL_GAUGES)
        for part in parts:
            for name, h in (part.get("histograms") or {}).items():
                hists[name].append(h)
            for key, v in (part.get("pool") or {}).items():
                if key in pool and v is not None:
                    pool[key] = (pool[key] or 0) + v
            # a job has a table on every shard it joined: one job, summed
            for name, j in (part.get("jobs") or {}).items():
                job = jobs.setdefault(name, {"members": 0, "open_slots": None, "counters": collections.Counter()})
                job["members"] = max(job["members"], j.get("members") or 0)
                if j.get("open_slots") is not None:
                    job["open_slots"] = (job["open_slots"] or 0) + j["open_slots"]
                job["counters"].update(j.get("counters") or {})
        return totals, jobs, hists, pool, shard_up


#: (key of a shard's "memory" in STATS, metric, help) exported per shard
_SHARD_MEMORY = (
    ("rss_bytes", "shard_resident_bytes", "Resident memory of the shard process"),
    ("peak_rss_bytes", "shard_peak_resident_bytes", "Peak resident memory of the shard process"),
    ("receiving_bytes", "shard_receiving_bytes",
     "tcp://: bytes of payloads the shard is reading now (at most its --receive-budget)"),
    ("unsent_bytes", "shard_unsent_bytes", "tcp://: bytes of replies the shard holds unsent (at most its "
                                           "--unsent-budget)"),
    ("streams", "shard_streams", "tcp://: connections the shard holds"),
    ("receive_budget", "shard_receive_budget_bytes", "tcp://: the shard's --receive-budget"),
    ("unsent_budget", "shard_unsent_budget_bytes", "tcp://: the shard's --unsent-budget"),
)


def _shard_memory_families(core, stats: dict, shard_up: dict):
    """Each answering shard's memory, labelled by shard: a silent shard's
    last answer would show memory it may no longer hold, so it is left out."""
    answered = [(i, part.get("memory") or {}) for i, part in enumerate(stats.get("shards") or [])
                if part is not None and shard_up.get(i)]
    for key, metric, help_text in _SHARD_MEMORY:
        samples = [([str(i)], memory[key]) for i, memory in answered if memory.get(key) is not None]
        if samples:
            yield _family(core.GaugeMetricFamily, f"aggnet_{metric}", help_text, ["shard"], samples)


def _resolve(future: Future, fn) -> None:
    try:
        future.set_result(fn())
    except BaseException as exc:
        future.set_exception(exc)


def _renamed(counters: dict, renamed: dict) -> collections.Counter:
    out = collections.Counter()
    for name, v in counters.items():
        out[renamed.get(name, name)] += v
    return out


def _counter_families(counters: dict, always, job: str | None) -> dict:
    """metric -> (help, label names, [(label values, value)]) for the
    counters of the table present (or in ``always``), and for every
    ``dropped_<reason>`` counter."""
    out: dict = {}
    prefix = [] if job is None else [job]
    names = [] if job is None else ["job"]
    for counter, metric, help_text, labels in _COUNTERS:
        if counter in counters or counter in always:
            entry = out.setdefault(metric, (help_text, names + list(labels), []))
            entry[2].append((prefix + list(labels.values()), counters.get(counter, 0)))
    for counter, v in sorted(counters.items()):
        if counter.startswith("dropped_"):
            entry = out.setdefault("dropped", ("Messages dropped, by reason", names + ["reason"], []))
            entry[2].append((prefix + [counter[len("dropped_"):]], v))
    return out


def _family(cls, name: str, help_text: str, labels: list, samples: list):
    family = cls(name, help_text, labels=labels)
    for values, v in samples:
        family.add_metric(values, v)
    return family


def _merge_histograms(parts: list):
    """Per-bucket (not cumulative) counts of several shards -> Prometheus's
    cumulative buckets and sum. Shards with other bounds are merged on the
    union of bounds (each count at its own bucket's upper bound); a
    malformed histogram is left out. None when none is usable."""
    good = []
    for h in parts:
        try:
            bounds = [float(b) for b in h["bounds"]]
            counts = [int(c) for c in h["counts"]]
            total = float(h.get("sum", 0.0))
        except (KeyError, TypeError, ValueError):
            continue
        if len(counts) == len(bounds) + 1 and bounds == sorted(bounds):
            good.append((bounds, counts, total))
    if not good:
        return None
    union = sorted({b for bounds, _, _ in good for b in bounds})
    cumulative = [0] * len(union)
    count = 0
    for bounds, counts, _ in good:
        running = list(itertools.accumulate(counts[:-1]))
        for i, u in enumerate(union):
            j = bisect.bisect_right(bounds, u) - 1
            if j >= 0:
                cumulative[i] += running[j]
        count += sum(counts)
    go = _prometheus().utils.floatToGoString
    return [(go(u), c) for u, c in zip(union, cumulative)] + [("+Inf", count)], sum(t for _, _, t in good)


class ClientCollector:
    """A client's counters (:class:`aggnet.ClientStats`) as
    ``aggnet_client_*_total{job, rank}``: what one worker sent, got back
    and retransmitted, next to the aggregator's view."""

    def __init__(self, client):
        self.client = client

    def collect(self):
        core = _prometheus().core
        labels = [self.client.job, str(self.client.rank)]
        for name, value in dataclasses.asdict(self.client.stats).items():
            metric = "allreduce_seconds" if name == "seconds" else name
            family = core.CounterMetricFamily(f"aggnet_client_{metric}", _CLIENT_HELP.get(name, name),
                                              labels=["job", "rank"])
            family.add_metric(labels, value)
            yield family


def _serve(collector, port: int, host: str):
    prom = _prometheus()
    registry = prom.CollectorRegistry()
    registry.register(collector)
    # (server, thread) since prometheus_client 0.20: the server tells the
    # port it bound, and shuts down
    server, _thread = prom.start_http_server(port, addr=host, registry=registry)
    return server, server.server_address[1]


def start_metrics_server(port: int, stats_fn, host: str = "127.0.0.1", timeout: float = 5.0):
    """Serve an aggregator's metrics at ``http://host:port/metrics`` from a
    daemon thread; ``stats_fn`` is its ``stats`` (StatsCollector); port 0
    takes any free port. Returns (server, bound port);
    ``server.shutdown()`` then ``server.server_close()`` stops it."""
    return _serve(StatsCollector(stats_fn, timeout), port, host)


def export_client(client, port: int = 0, host: str = "127.0.0.1"):
    """Serve ``client``'s counters at ``http://host:port/metrics`` (a
    training process's own endpoint); returns (server, bound port)."""
    return _serve(ClientCollector(client), port, host)


def url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}/metrics" if ":" in host else f"http://{host}:{port}/metrics"


def serve_metrics_for(args, stats_fn):
    """``aggnet serve --metrics-port PORT [--metrics-host HOST]``: start
    the endpoint and log where it is; a port that cannot be served stops
    the command, since the operator asked for metrics."""
    host = getattr(args, "metrics_host", None) or "127.0.0.1"
    try:
        server, port = start_metrics_server(args.metrics_port, stats_fn, host)
    except (OSError, ImportError) as exc:
        raise SystemExit(f"aggnet serve: cannot serve metrics at {host}:{args.metrics_port}: {exc}") from None
    try:
        local = ipaddress.ip_address(host).is_loopback
    except ValueError:
        local = host == "localhost"
    if not local:
        # STATS hides a job's table from those without its key; this
        # endpoint has no keys, so job names and counters are public here
        log.warning("metrics at %s are readable by anyone who reaches the port, job names included", url(host, port))
    log.info("Prometheus metrics at %s", url(host, port))
    return server, port
