"""``aggnet soak``: many all-reduces in a row, watching every process for leaks.

A leak that costs a few hundred bytes or one file descriptor per all-reduce
is invisible in a test of ten and takes a training job down after a day.
This runs N all-reduces (default 10,000) through each kind of aggregator
and samples the resident memory (VmRSS), open file descriptors and threads
of every worker and every aggregator process (shard children included) at
the end of warm-up, at points in between and at the end, while the workers
are paused between two all-reduces, so the samples compare like with like.

* ``switch``: a switch-mode aggregator (one shard: the relay forwards to
  one port) behind :class:`~aggnet.emulation.lossy_relay.LossyRelay`,
  which drops each datagram with probability ``--loss`` in both
  directions, so retransmission runs all the time, as on a real lossy
  fabric (no root needed, unlike iptables on lo).
* ``service``: the sharded service over zmq+tcp (``--scheme tcp``: plain
  TCP); TCP recovers its own losses below aggnet, so no loss is applied
  there.
* ``racks``: two racks of services under a root service, workers placed
  by a topology file, as a cluster runs them.

``--kill-every SECONDS`` makes it a chaos run: every aggregator runs with
``--restart``, and a shard picked at random (of the service, or of the
root or a rack) is killed with SIGKILL that often. Every all-reduce must
still come back right (with resume, a restart costs a rejoin, not a
result), and the memory and descriptors of each aggregator (its
supervisor and its shard processes together, since killed shards are
replaced) must stay flat.

Workers start from a fork server (:func:`aggnet.processes.fork_server`):
nothing of this process (the relay's sockets and thread) is inherited
into the counts. Every worker knows every
rank's inputs and checks every result: int32 exactly, float32 within the
quantization bound (switch) or float32 rounding (service); a running CRC of
the results also shows every worker held the same bytes. The exit status
is 1 when a result was wrong, a process failed, or memory grew more than
``--max-rss-growth-mb``.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
import uuid
import zlib

import numpy as np

from aggnet.bench.cpu import descendants
from aggnet.processes import NUMPY_WORKER_PRELOAD, fork_server

#: all-reduces before the first sample: allocator pools, JIT-compiled
#: kernels and socket buffers reach their working size first
WARMUP = 100
#: samples after warm-up (the last one at the end)
SAMPLES = 8


def add_arguments(p) -> None:
    p.add_argument("--allreduces", type=int, default=10000, help="all-reduces per worker (default %(default)s)")
    p.add_argument("--loss", type=float, default=0.01,
                   help="switch kind: drop probability of each datagram, both directions (default %(default)s)")
    p.add_argument("--kind", choices=["switch", "service", "racks", "both"], default="both",
                   help="aggregator: switch mode over UDP, the service over TCP (--scheme), two racks of services "
                        "under a root, or both switch and service (default both)")
    p.add_argument("--scheme", choices=["zmq+tcp", "tcp"], default="zmq+tcp",
                   help="service and racks: the services' transport, ZeroMQ or plain TCP (default %(default)s)")
    p.add_argument("--kill-every", type=float, default=None, metavar="SECONDS",
                   help="service and racks: SIGKILL a random aggregator shard this often (they run with --restart)")
    p.add_argument("--seed", type=int, default=1, help="which shards --kill-every kills (default %(default)s)")
    p.add_argument("--elements", type=int, default=65536,
                   help="values per all-reduce buffer, alternately int32 and float32 (default %(default)s)")
    p.add_argument("--workers", type=int, default=2, help="worker processes (default %(default)s)")
    p.add_argument("--max-rss-growth-mb", type=float, default=None,
                   help="exit 1 when a process's RSS grew more than this from warm-up to the end")
    p.add_argument("--json", default=None, help="write the full record (every sample) here")


# -- /proc ----------------------------------------------------------------------


def proc_sample(pid: int) -> dict | None:
    """RSS (kB), open fds and threads of ``pid``; None once it is gone.

    A process killed but not yet reaped (a zombie) has no memory lines in its
    status: it is gone too, though its pid is still listed."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError):
        return None
    if "VmRSS" not in fields:
        return None
    return {"rss_kb": int(fields["VmRSS"].split()[0]), "fds": fds, "threads": int(fields["Threads"])}


# -- the workers ----------------------------------------------------------------


def _inputs(rank: int, elements: int):
    """Rank ``rank``'s base int32 and float32 inputs (every rank can make
    every other's: results are checked without talking)."""
    rng = np.random.default_rng(rank + 1)
    return (rng.integers(-(2**20), 2**20, elements, dtype=np.int32),
            rng.standard_normal(elements).astype(np.float32))


def _float_tolerance(floats: list, exact: np.ndarray, world: int, block: int | None) -> np.ndarray:
    """Per-element bound on the float32 error. Switch protocol (``block``
    values per packet): each block is quantized to int32 with the exponent
    of its largest value over all workers, half a step per worker, plus
    float32 rounding of the sum. Service: float32 summation, at most
    world - 1 roundings of partial sums."""
    if block is None:
        return max(world - 1, 1) * sum(np.abs(f.astype(np.float64)) for f in floats) * 2.0**-23
    from aggnet.kernels import quant_shift

    tol = np.empty(exact.size)
    for b in range(0, exact.size, block):
        s = slice(b, b + block)
        e = max(int(np.frexp(np.max(np.abs(f[s])))[1]) for f in floats)
        tol[s] = world * 2.0 ** -quant_shift(e, world) / 2
    return tol + np.abs(exact) * 2.0**-23


def _worker(rank: int, world: int, address: str, job: str, elements: int, points: list, conn,
            topology: str | None = None) -> None:
    """N all-reduces, alternately int32 (even) and float32 (odd), each
    checked; at each point in ``points`` it reports and waits for the
    driver to sample and say go."""
    from aggnet import Client

    try:
        bases = [_inputs(r, elements) for r in range(world)]
        want_int = sum(b[0].astype(np.int64) for b in bases).astype(np.int32)  # |sum| < 2**31: no wrap
        exact = sum(b[1].astype(np.float64) for b in bases)
        ibuf, fbuf = np.empty(elements, np.int32), np.empty(elements, np.float32)
        iwant, err = np.empty(elements, np.int32), np.empty(elements)
        where = {"topology": topology} if topology else {"address": address}
        with Client(job=job, rank=rank, world_size=world, timeout=30, **where) as c:
            block = c.elements if address.startswith("udp://") else None
            tol = _float_tolerance([b[1] for b in bases], exact, world, block)
            failures = {"int32": 0, "float32": 0}
            first_failure = None
            crc, busy, done = 0, 0.0, 0
            for point in points:
                t0 = time.perf_counter()
                for i in range(done, point):
                    if i % 2 == 0:
                        np.add(bases[rank][0], i, out=ibuf)
                        c.allreduce(ibuf).result(120)
                        np.add(want_int, world * i, out=iwant)
                        ok, buf, kind = bool(np.array_equal(ibuf, iwant)), ibuf, "int32"
                    else:
                        # a power-of-two scale moves the exponents (and the
                        # quantization steps) about without rounding
                        scale = 2.0 ** (i % 9 - 4)
                        np.multiply(bases[rank][1], np.float32(scale), out=fbuf)
                        c.allreduce(fbuf).result(120)
                        np.multiply(exact, scale, out=err)
                        np.subtract(fbuf, err, out=err)
                        np.abs(err, out=err)
                        err *= 1 / scale
                        ok, buf, kind = bool(np.all(err <= tol)), fbuf, "float32"
                    if not ok:
                        failures[kind] += 1
                        if first_failure is None:
                            first_failure = f"all-reduce {i} ({kind}) gave a wrong result"
                    crc = zlib.crc32(buf, crc)
                busy += time.perf_counter() - t0
                done = point
                s = c.stats
                conn.send({"at": point, "busy_s": busy, "failures": dict(failures), "first_failure": first_failure,
                           "crc": crc, "retransmissions": s.retransmissions,
                           "fast_retransmissions": s.fast_retransmissions, "errors": s.errors, "rejoins": s.rejoins,
                           "chunks_sent": s.chunks_sent, "results": s.results})
                if conn.recv() != "go":
                    return
    except BaseException as exc:  # the driver reports it and stops the run
        conn.send({"error": f"rank {rank}: {type(exc).__name__}: {exc}"})


# -- the driver -----------------------------------------------------------------


class SoakFailed(RuntimeError):
    pass


def checkpoints(n: int) -> list[int]:
    warm = max(1, min(WARMUP, n // 3))
    return sorted({warm, *(warm + (n - warm) * k // SAMPLES for k in range(1, SAMPLES + 1))})


def _gather(conns: list, procs: list, services: list, timeout: float) -> list[dict]:
    """One report from every worker; raises as soon as a worker or an
    aggregator fails."""
    got: dict[int, dict] = {}
    deadline = time.monotonic() + timeout
    while len(got) < len(conns):
        if time.monotonic() > deadline:
            raise SoakFailed(f"workers {sorted(set(range(len(conns))) - set(got))} did not report in {timeout:g}s")
        for service in services:
            if not service.alive():
                raise SoakFailed(f"the aggregator (pid {service.pid}) exited with status {service.process.poll()}")
        for r, conn in enumerate(conns):
            if r in got or not conn.poll(0.05):
                continue
            try:
                msg = conn.recv()
            except EOFError:
                raise SoakFailed(f"worker {r} exited with status {procs[r].exitcode}") from None
            if "error" in msg:
                raise SoakFailed(msg["error"])
            got[r] = msg
    return [got[r] for r in range(len(conns))]


def _sample(roles: dict, services: dict) -> dict:
    """A sample of every known process; shard processes are looked up
    afresh each time, so one that died or was replaced shows."""
    for name, service in services.items():
        for pid in descendants(service.pid):
            roles.setdefault(pid, f"{name} child {pid}")
    return {pid: proc_sample(pid) for pid in roles}


def _sample_groups(services: dict) -> dict:
    """Per aggregator: its supervisor and its shard processes of now,
    summed (a chaos run replaces the shards it kills)."""
    out = {}
    for name, service in services.items():
        live = [x for x in (proc_sample(pid) for pid in [service.pid, *descendants(service.pid)]) if x]
        out[name] = {k: sum(x[k] for x in live) for k in ("rss_kb", "fds", "threads")}
    return out


def kill_shard(address: str, shard: int, timeout: float = 60.0, stop=None) -> int:
    """SIGKILL shard ``shard`` of the `aggnet serve --restart` service at
    ``address`` and return its pid once a successor serves (the restart
    count went up, the shard has a new pid); ``stop()`` true ends the wait."""
    from aggnet.client.stats import query
    from aggnet.errors import AggnetError

    stats = query(address)
    pid, restarts = stats["shards"][shard]["pid"], stats["restarts"]
    os.kill(pid, 9)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not (stop and stop()):
        try:
            s = query(address)
        except AggnetError:
            continue  # a loaded machine: the deadline bounds the asking
        if s["restarts"] > restarts and s["shards"][shard] is not None and s["shards"][shard]["pid"] != pid:
            return pid
        time.sleep(0.05)
    raise SoakFailed(f"{address}: shard {shard} (pid {pid}) was killed and not restarted within {timeout:g}s")


class Killer:
    """Kills a random shard of a random aggregator every ``every``
    seconds, each time once the last one's successor serves."""

    def __init__(self, services: dict, every: float, seed: int):
        import random
        import threading

        self.services, self.every = services, every
        self.rng = random.Random(seed)
        self.kills: list[dict] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="aggnet-soak-killer", daemon=True)

    def start(self) -> "Killer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)

    def _run(self) -> None:
        from aggnet.client.stats import query

        t0 = time.monotonic()
        while not self._stop.wait(self.every):
            name = self.rng.choice(sorted(self.services))
            address = self.services[name].address
            try:
                shard = self.rng.randrange(len(query(address)["shards"]))
                pid = kill_shard(address, shard, stop=self._stop.is_set)
            except Exception as exc:  # reported by the driver
                self.error = f"killing a shard of {name}: {exc}"
                return
            self.kills.append({"t": round(time.monotonic() - t0, 2), "aggregator": name, "shard": shard,
                               "pid": pid})
            print(f"  killed {name} shard {shard} (pid {pid}); its successor serves", flush=True)


def _racks(workers: int, restart: list, tmp: str, scheme: str = "zmq+tcp"):
    """A root and two racks of services, and a topology file placing
    ``workers`` (even) on them."""
    from aggnet.processes import ServiceProcess

    services = {"root": ServiceProcess(f"{scheme}://127.0.0.1:0", shards=2, args=restart)}
    try:
        for i in range(2):
            services[f"rack{i}"] = ServiceProcess(f"{scheme}://127.0.0.1:0", shards=2, args=[
                "--parent", services["root"].address, "--rack-id", str(i), "--racks", "2", *restart])
    except BaseException:
        for s in services.values():
            s.stop()
        raise
    per = workers // 2
    lines = ['job = "soak"', "[root]", 'kind = "service"', f'address = "{services["root"].address}"', "shards = 2"]
    for i in range(2):
        lines += ["[[racks]]", f'name = "rack{i}"', f'ranks = "{i * per}-{(i + 1) * per - 1}"',
                  f'aggregator = {{ kind = "service", address = "{services[f"rack{i}"].address}", shards = 2 }}']
    path = os.path.join(tmp, "topology.toml")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return services, path


def _aggregators(kind: str, workers: int, restart: list, tmp: str,
                 scheme: str = "zmq+tcp") -> tuple[dict, str | None]:
    """The soak's aggregators by name, and the racks' topology file."""
    from aggnet.processes import ServiceProcess

    if kind == "switch":
        return {"aggregator": ServiceProcess("udp://127.0.0.1:0", shards=1, args=["--mode", "switch"])}, None
    if kind == "service":
        return {"aggregator": ServiceProcess(f"{scheme}://127.0.0.1:0", shards=2, args=restart)}, None
    return _racks(workers, restart, tmp, scheme)


def _start_workers(addresses: list, elements: int, points: list, topology: str | None) -> tuple[list, list]:
    """One process per rank, and the driver's end of each one's pipe."""
    ctx = fork_server(NUMPY_WORKER_PRELOAD)
    workers = len(addresses)
    job = f"soak-{uuid.uuid4().hex[:8]}"
    procs, conns = [], []
    for r in range(workers):
        mine, theirs = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(r, workers, addresses[r], job, elements, points, theirs, topology),
                        daemon=True)
        p.start()
        theirs.close()
        procs.append(p)
        conns.append(mine)
    return procs, conns


def _stop_workers(conns: list, procs: list, failed: bool) -> None:
    for conn in conns:
        try:
            conn.send("stop")  # to a worker still waiting at a sample point (after a failure)
        except OSError:
            pass
    for p in procs:
        p.join(1 if failed else 15)
        if p.is_alive():
            p.kill()
            p.join(5)


def _roles(services: dict, procs: list, relay, kill_every: float | None) -> dict:
    """What each sampled process is, by pid."""
    roles = {}
    for name, svc in services.items():
        roles[svc.pid] = name
        if not kill_every:  # a chaos run replaces the shards it kills: they are summed per aggregator
            roles.update({pid: f"{name} child {pid}" for pid in descendants(svc.pid)})
    roles.update({p.pid: f"worker {r}" for r, p in enumerate(procs)})
    if relay is not None:
        roles[os.getpid()] = "relay (driver)"
    return roles


def run_soak(kind: str, allreduces: int, loss: float, elements: int, workers: int, kill_every: float | None = None,
             seed: int = 1, scheme: str = "zmq+tcp") -> dict:
    """One soak of ``kind`` ("switch", "service" or "racks"); returns its record."""
    import tempfile

    from aggnet.emulation.lossy_relay import LossyRelay

    points = checkpoints(allreduces)
    tmp = tempfile.TemporaryDirectory(prefix="aggnet-soak-")
    services, topology = _aggregators(kind, workers, ["--restart"] if kill_every else [], tmp.name, scheme)
    service = next(iter(services.values()))
    relay = killer = None
    record = {"kind": kind, "allreduces": allreduces, "workers": workers, "elements": elements,
              "loss": loss if kind == "switch" else None, "warmup": points[0], "points": points,
              "kill_every": kill_every, "scheme": None if kind == "switch" else scheme}
    procs, conns = [], []
    try:
        addresses = [service.address] * workers
        if kind == "switch":
            host, port = service.address[len("udp://"):].rsplit(":", 1)
            relay = LossyRelay((host, int(port)), workers, drop=loss, seed=1).start()
            addresses = relay.addresses
        procs, conns = _start_workers(addresses, elements, points, topology)
        roles = _roles(services, procs, relay, kill_every)
        samples, reports = [], []
        if kill_every:
            from aggnet.client.stats import query

            for svc in services.values():
                query(svc.address)  # the control endpoint's connections to its shards open on the first STATS
        t0 = time.monotonic()
        for prev, point in zip([0] + points, points):
            # generous: even at 10% loss a segment runs at tens of all-reduces/s
            reps = _gather(conns, procs, list(services.values()), timeout=120 + 0.5 * (point - prev))
            if killer is not None and killer.error:
                raise SoakFailed(killer.error)
            sample = {"at": point, "t": time.monotonic() - t0,
                      "procs": {str(pid): s for pid, s in _sample(roles, services if not kill_every else {}).items()}}
            if kill_every:
                sample["aggregators"] = _sample_groups(services)
            samples.append(sample)
            reports.append(reps)
            if kill_every and killer is None:
                killer = Killer(services, kill_every, seed).start()  # after warm-up
            print(f"  {point}/{allreduces} all-reduces", flush=True)
            for conn in conns:
                conn.send("go")
        record["wall_s"] = time.monotonic() - t0
        record["aggregator_alive"] = all(s.alive() for s in services.values())
    except SoakFailed as exc:
        record["error"] = str(exc)
        record["aggregator_alive"] = all(s.alive() for s in services.values())
        return record
    finally:
        if killer is not None:
            killer.stop()
            record["kills"] = killer.kills
        _stop_workers(conns, procs, "error" in record)
        if relay is not None:
            relay.stop()
            record["relay"] = dict(relay.counters)
        for svc in services.values():
            svc.stop()
        tmp.cleanup()
    _summarize_run(record, reports, samples, roles, services)
    return record


def _summarize_run(record: dict, reports: list, samples: list, roles: dict, services: dict) -> None:
    """The run's rate, failures, agreement and resources, into ``record``."""
    final = reports[-1]
    # a segment takes as long as its slowest worker; the pauses to sample are left out
    busy = [max(rep[r]["busy_s"] for r in range(record["workers"])) for rep in reports]
    timed = busy[-1] - busy[0]
    record.update({
        "allreduces_per_s": (record["allreduces"] - record["warmup"]) / timed if timed > 0 else None,
        "failures": {k: sum(f["failures"][k] for f in final) for k in ("int32", "float32")},
        "first_failure": next((f["first_failure"] for f in final if f["first_failure"]), None),
        "results_agree": len({f["crc"] for f in final}) == 1,
        "client_stats": [{k: v for k, v in f.items() if k not in ("at", "busy_s", "failures", "first_failure", "crc")}
                         for f in final],
        "samples": samples,
        "processes": _summarize(roles, samples),
    })
    if record["kill_every"]:
        record["aggregators"] = {
            name: {k: {"start": samples[0]["aggregators"][name][k], "end": samples[-1]["aggregators"][name][k],
                       "max": max(x["aggregators"][name][k] for x in samples)} for k in ("rss_kb", "fds", "threads")}
            for name in services}


def _summarize(roles: dict, samples: list) -> list[dict]:
    """Per process: start (warm-up), end and max of RSS, fds and threads."""
    rows = []
    for pid, role in roles.items():
        seen = [s["procs"].get(str(pid)) for s in samples]
        live = [s for s in seen if s]
        row = {"process": role, "pid": pid, "present_start": bool(seen[0]), "present_end": bool(seen[-1])}
        for key in ("rss_kb", "fds", "threads"):
            row[key] = {"start": seen[0][key] if seen[0] else None, "end": seen[-1][key] if seen[-1] else None,
                        "max": max(s[key] for s in live) if live else None}
        rows.append(row)
    return rows


def problems(record: dict, max_rss_growth_mb: float | None = None) -> list[str]:
    """What makes this soak a failure."""
    out = []
    if "error" in record:
        return [f"{record['kind']}: {record['error']}"]
    if any(record["failures"].values()):
        out.append(f"{record['kind']}: wrong results {record['failures']} (first: {record['first_failure']})")
    if not record["results_agree"]:
        out.append(f"{record['kind']}: the workers' results differ")
    if not record["aggregator_alive"]:
        out.append(f"{record['kind']}: the aggregator exited during the soak")
    for row in record["processes"]:
        if not (row["present_start"] and row["present_end"]):
            out.append(f"{record['kind']}: {row['process']} was not there from warm-up to the end")
        elif max_rss_growth_mb is not None:
            growth = (row["rss_kb"]["end"] - row["rss_kb"]["start"]) / 1024
            if growth > max_rss_growth_mb:
                out.append(f"{record['kind']}: {row['process']} RSS grew {growth:.1f} MB (> {max_rss_growth_mb:g})")
    for name, row in record.get("aggregators", {}).items():
        growth = (row["rss_kb"]["end"] - row["rss_kb"]["start"]) / 1024
        if max_rss_growth_mb is not None and growth > max_rss_growth_mb:
            out.append(f"{record['kind']}: {name} (supervisor and shards) RSS grew {growth:.1f} MB "
                       f"(> {max_rss_growth_mb:g})")
        if row["fds"]["end"] > row["fds"]["start"] + 8:
            out.append(f"{record['kind']}: {name} (supervisor and shards) holds {row['fds']['end']} descriptors, "
                       f"{row['fds']['start']} after warm-up")
    if record.get("kill_every") and not record.get("kills"):
        out.append(f"{record['kind']}: no shard was killed; run longer than --kill-every")
    return out


def _print_record(r: dict) -> None:
    loss = f"{r['loss']:g} loss through the relay" if r["kind"] == "switch" else \
        f"{r.get('scheme') or 'zmq+tcp'}: no loss applied (TCP retransmits below aggnet)"
    print(f"\n{r['kind']}: {r['allreduces']} all-reduces x {r['workers']} workers of {r['elements']} values, {loss}")
    if "error" in r:
        print(f"  FAILED: {r['error']}")
        return
    print(f"{'process':>24} {'pid':>7} {'RSS MB start':>12} {'end':>7} {'max':>7} {'growth':>7} "
          f"{'fds start':>9} {'end':>4} {'max':>4} {'thr start':>9} {'end':>4}")
    mb = lambda kb: f"{kb / 1024:.1f}" if kb is not None else "-"  # noqa: E731
    num = lambda v: str(v) if v is not None else "-"  # noqa: E731
    for p in r["processes"]:
        rss, fds, thr = p["rss_kb"], p["fds"], p["threads"]
        growth = mb(rss["end"] - rss["start"]) if rss["start"] is not None and rss["end"] is not None else "-"
        print(f"{p['process']:>24} {p['pid']:>7} {mb(rss['start']):>12} {mb(rss['end']):>7} {mb(rss['max']):>7} "
              f"{growth:>7} {num(fds['start']):>9} {num(fds['end']):>4} {num(fds['max']):>4} "
              f"{num(thr['start']):>9} {num(thr['end']):>4}")
    retrans = sum(s["retransmissions"] for s in r["client_stats"])
    rate = f"{r['allreduces_per_s']:.1f}" if r["allreduces_per_s"] else "-"
    relay = r.get("relay")
    seen = f", relay dropped {relay.get('dropped', 0)} of {relay.get('seen', 0)} datagrams" if relay else ""
    for name, a in r.get("aggregators", {}).items():
        rss, fds = a["rss_kb"], a["fds"]
        print(f"{name + ' (all shards)':>24} {'':>7} {mb(rss['start']):>12} {mb(rss['end']):>7} {mb(rss['max']):>7} "
              f"{mb(rss['end'] - rss['start']):>7} {fds['start']:>9} {fds['end']:>4} {fds['max']:>4}")
    kills = f"; {len(r['kills'])} shard(s) killed and restarted" if r.get("kill_every") else ""
    rejoins = sum(s["rejoins"] for s in r["client_stats"])
    print(f"  {rate} all-reduces/s after warm-up ({r['wall_s']:.1f} s in all); retransmissions {retrans}{seen}; "
          f"wrong results {r['failures']}; workers agree: {r['results_agree']}; "
          f"aggregator alive: {r['aggregator_alive']}{kills}; worker rejoins {rejoins}")


def main(args) -> int:
    kinds = ["switch", "service"] if args.kind == "both" else [args.kind]
    if args.allreduces < 3 or args.workers < 1 or args.elements < 1 or not 0 <= args.loss < 1:
        print("aggnet soak: needs --allreduces >= 3, --workers >= 1, --elements >= 1 and 0 <= --loss < 1",
              file=sys.stderr)
        return 2
    if args.kind == "racks" and args.workers % 2:
        print("aggnet soak: --kind racks places --workers on two racks: give an even number", file=sys.stderr)
        return 2
    if args.kill_every is not None and (args.kill_every <= 0 or "switch" in kinds):
        print("aggnet soak: --kill-every takes seconds > 0, with --kind service or racks (a switch-mode aggregator "
              "does not resume after a restart)", file=sys.stderr)
        return 2
    records = [run_soak(k, args.allreduces, args.loss, args.elements, args.workers, args.kill_every, args.seed,
                        args.scheme) for k in kinds]
    found = []
    for r in records:
        _print_record(r)
        found += problems(r, args.max_rss_growth_mb)
    summary = [{k: v for k, v in r.items() if k not in ("samples", "points")} for r in records]
    print("\n" + json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"system_info": {"host": platform.node(), "python": platform.python_version(),
                                       "cpus": os.cpu_count(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")},
                       "runs": records, "problems": found}, f, indent=1)
        print(f"wrote {args.json}")
    for line in found:
        print(f"PROBLEM: {line}")
    return 1 if found else 0
