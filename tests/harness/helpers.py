"""Running N workers against a service: threads for inproc services,
real processes (forked) for socket transports."""

from __future__ import annotations

import collections
import multiprocessing
import os
import queue
import socket
import threading
import time
import tempfile
import traceback
import uuid

import numpy as np

from aggnet import Client
from aggnet.errors import AggregationTimeout
from aggnet.hosts import service as service_mod
from aggnet.processes import (DDP_WORKER_PRELOAD, ServiceProcess, fork_server, free_port,  # noqa: F401
                              free_ports)  # free_port(s): the harness's own names


def free_port_block(n: int) -> int:
    """A port P with P..P+n-1 free now: a service's control endpoint and
    the consecutive ports its shards take."""
    for _ in range(100):
        base = free_port()
        held = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def process_gone(pid: int) -> bool:
    """No such process, or a zombie nobody reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def child_pids(pid: int) -> list[int]:
    """Child processes of ``pid``, made by any of its threads."""
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(p) for p in f.read().split()]
        except FileNotFoundError:
            pass  # a thread that ended meanwhile
    return out


class WorkerFailed(AssertionError):
    pass


def _fresh_process_context():
    """Workers with a fresh process's state (no threads, sockets or torch
    state of the test process), forked from a server that has imported
    torch and aggnet once (the suite starts hundreds of workers). The
    server keeps the environment it started with, so each worker is handed
    the test's environment and directory (see _call); conftest.py names
    these imports before any test can start it with fewer (a benchmark run
    in-process)."""
    return fork_server(DDP_WORKER_PRELOAD)


def _call(fn, rank, args, out, env=None, cwd=None):
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
    try:
        out.put((rank, True, fn(rank, *args)))
    except BaseException as exc:  # report every failure, with its type
        out.put((rank, False, (type(exc).__name__, str(exc), traceback.format_exc())))


def silent_rank_run(rank, address, job, peers_failed, size: int, idle_s: float = 30.0, **client_opts):
    """Three workers of which rank 2 joins but never all-reduces: the
    others return the error they got and how long they waited. Rank 2
    stays joined until both have (each releases ``peers_failed``, a
    semaphore made before the workers start), ``idle_s`` at most."""
    # the aggregator names the silent rank at half the timeout, the worker's
    # own limit comes at the whole: room for a loaded machine between them
    with Client(address, job=job, rank=rank, world_size=3, timeout=3.0, **client_opts) as c:
        if rank == 2:
            deadline = time.monotonic() + idle_s
            for _peer in range(2):
                peers_failed.acquire(timeout=max(0.0, deadline - time.monotonic()))
            return "idle"
        t0 = time.monotonic()
        try:
            c.allreduce(np.ones(size, np.float32)).result(30)
        except AggregationTimeout as exc:
            return str(exc), time.monotonic() - t0
        finally:
            peers_failed.release()
        return "no error", 0


def worker_context(address: str, start_method: str = "fork"):
    """The multiprocessing context :func:`run_workers` starts the workers
    for ``address`` from, to make what they share (a semaphore) in."""
    if address.startswith("ucx://"):
        # UCX does not survive fork once a process has used it
        start_method = "spawn"
    return _fresh_process_context() if start_method == "spawn" else multiprocessing.get_context(start_method)


def run_workers(address: str, world: int, fn, *args, timeout: float = 60.0, expect_errors: bool = False,
                start_method: str = "fork"):
    """Run ``fn(rank, *args)`` for every rank; return results by rank.

    Workers are threads for ``inproc://`` services, else processes
    (``start_method="spawn"`` for workers that use torch or UCX: they start
    from a fresh process's state, see _fresh_process_context). With
    ``expect_errors`` a failing worker's (type name, message) is returned
    in its place instead of failing the test."""
    inproc = address.startswith("inproc://")
    if inproc:
        out = queue.Queue()
        workers = [threading.Thread(target=_call, args=(fn, r, args, out), daemon=True) for r in range(world)]
    else:
        ctx = worker_context(address, start_method)
        fresh = ctx.get_start_method() == "forkserver"
        out = ctx.Queue()
        where = (dict(os.environ), os.getcwd()) if fresh else ()
        workers = [ctx.Process(target=_call, args=(fn, r, args, out, *where), daemon=True) for r in range(world)]
    for w in workers:
        w.start()
    results = {}
    deadline = time.monotonic() + timeout
    while len(results) < world:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            rank, ok, value = out.get(timeout=left)
        except queue.Empty:
            break
        if not ok and not expect_errors:
            for w in workers:
                if not inproc and w.is_alive():
                    w.kill()
            raise WorkerFailed(f"rank {rank} failed: {value[0]}: {value[1]}\n{value[2]}")
        results[rank] = value if ok else value[:2]
    for w in workers:
        w.join(timeout=max(0.1, deadline - time.monotonic()))
        if not inproc and w.is_alive():
            w.kill()
    missing = sorted(set(range(world)) - set(results))
    if missing:
        raise WorkerFailed(f"rank(s) {missing} did not finish within {timeout:g}s")
    return [results[r] for r in range(world)]


class RunningService:
    """A service for a test: in-process threads or a real `aggnet serve`."""

    def __init__(self, kind: str, shards: int = 2):
        self.kind = kind
        if kind == "inproc":
            self._svc = service_mod.start(f"inproc://agg-{uuid.uuid4().hex[:8]}", shards)
            self.address = self._svc.address
        else:
            # Unix socket paths are limited to 107 bytes: keep them short
            args = []
            if kind in ("tcp", "zmq+tcp", "ucx"):
                listen = f"{kind}://127.0.0.1:0"
            elif kind == "udp":  # a host in switch mode
                listen, args = "udp://127.0.0.1:0", ["--mode", "switch"]
            else:
                listen = f"{kind}://{tempfile.mkdtemp(prefix='agg-')}/agg.sock"
            self._svc = ServiceProcess(listen, shards, args=args)
            self.address = self._svc.address

    def stats(self) -> dict:
        from aggnet.protocol import wire
        from aggnet.transport import connect

        if self.kind == "udp":
            from aggnet.client.switch import query_stats

            return query_stats(self.address, timeout=10.0)

        with connect([self.address]) as conn:
            conn.send(0, wire.Header(wire.MsgType.STATS).pack())
            msg = conn.recv(10.0)
        assert msg is not None, f"no STATS answer from {self.address}"
        return wire.parse_json(msg.payload)

    def alive(self) -> bool:
        return self.kind == "inproc" or self._svc.alive()

    def mark_counts(self) -> None:
        """Remember the counters now: a shared service's earlier tests bumped
        them, and a test asserts what it caused (``new_counts``)."""
        self._marked = dict(self.stats()["totals"])

    def new_counts(self) -> collections.Counter:
        """Each counter's increase since ``mark_counts`` (0 for one never bumped)."""
        now = self.stats()["totals"]
        marked = getattr(self, "_marked", {})
        return collections.Counter({k: v - marked.get(k, 0) for k, v in now.items()
                                    if isinstance(v, (int, float)) and not isinstance(v, bool)})

    def stop(self):
        if self.kind == "inproc":
            self._svc.stop()
            return 0
        return self._svc.stop()


def peak_rss(pid: int) -> int:
    """Bytes of process ``pid``'s peak resident memory (VmHWM)."""
    from aggnet import pids

    peak = pids.memory(pid).get("peak_rss_bytes")
    assert peak is not None, f"no VmHWM for process {pid}"
    return peak


def a_job_runs(address: str, job: str, size: int = 300_001) -> None:
    """Two workers of a fresh job all-reduce at ``address`` and get the
    exact sum: the service serves after whatever came before."""
    import numpy as np

    from aggnet import Client

    bufs = [np.full(size, r + 1, np.float32) for r in range(2)]
    clients = [Client(address, job=job, rank=r, world_size=2, timeout=30) for r in range(2)]
    try:
        for f in [c.allreduce(b) for c, b in zip(clients, bufs)]:
            f.result(30)
    finally:
        for c in clients:
            c.close()
    assert all((b == 3).all() for b in bufs), "the all-reduce after returned a wrong sum"

