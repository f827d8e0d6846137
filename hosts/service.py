"""The aggregator service: a supervisor and K shard processes.

``aggnet serve --listen URL`` binds a control endpoint at URL that answers
HELLO with the shard map and STATS with every shard's counters, and starts K
shard processes (default: one per core), each bound to its own address:

* ``zmq+tcp://host:P`` -> shards at ``host:P+1 .. host:P+K`` (P = 0: any free ports)
* ``zmq+ipc:///path`` -> shards at ``/path.0 .. /path.K-1``
* ``inproc://name`` -> shards ``name.0 ..`` as threads of this process (tests)

SIGTERM or SIGINT stops the shards and then the supervisor; with
``parent_pid`` the service also stops when that process is gone (the
embedded default must never outlive the worker that started it).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from dataclasses import dataclass, field

from aggnet import wire
from aggnet.processes import die_with_parent
from aggnet.address import Address, parse
from aggnet.transport import Listener, connect, listen
from aggnet.wire import ErrorCode, Header, MsgType

from .shard import Shard

log = logging.getLogger("aggnet.hosts.service")

#: seconds a shard process may take to start (imports, kernel warm-up)
SHARD_START_TIMEOUT = 60.0
#: seconds shards get to stop before they are killed
SHARD_STOP_TIMEOUT = 5.0


def default_shards() -> int:
    return max(1, len(os.sched_getaffinity(0)))


def shard_addresses(control: Address, shards: int) -> list[Address]:
    if control.scheme in ("zmq+tcp", "ucx"):
        return [control.with_port(0 if control.port == 0 else control.port + 1 + i) for i in range(shards)]
    if control.scheme in ("zmq+ipc", "shm", "inproc"):
        return [control.with_path(f"{control.path}.{i}") for i in range(shards)]
    raise ValueError(f"the aggregator service cannot listen on {control.scheme} addresses")


def _warm_up_kernels() -> None:
    """Compile (or load from cache) every kernel a shard uses, before it
    reports ready, so the first chunk of a job is not delayed by the JIT."""
    import numpy as np

    from aggnet import kernels

    k = kernels.load("cpu")
    for dt in (np.float32, np.int32):
        a = np.zeros(8, dt)
        k.accumulate(a, a)
    a32 = np.zeros(8, np.int32)
    k.accumulate(a32, a32, True)
    k.byteswap32(a32, a32)
    f = np.zeros(8, np.float32)
    h = np.zeros(8, np.uint16)
    for fmt in ("f16", "bf16"):
        k.from_half(h, f, fmt)
        k.accumulate_half(f, h, fmt)
        k.to_half(f, h, fmt)


def _shard_main(index: int, address: str, report, log_level: int) -> None:
    """Entry point of a shard process."""
    die_with_parent()
    logging.basicConfig(level=log_level, format=f"%(asctime)s aggnet shard {index} %(levelname)s %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides
    try:
        _warm_up_kernels()
        listener = listen(address)
    except Exception as exc:
        report.send(("error", f"shard {index} cannot start on {address}: {exc}"))
        return
    report.send(("ready", str(listener.address)))
    report.close()
    shard = Shard(listener, index)
    try:
        shard.serve(stop.is_set)
    finally:
        shard.close()
        listener.close()
        logging.shutdown()
        # skip interpreter teardown: transport libraries' finalizers (UCX's)
        # can block an exit that has nothing left to do
        os._exit(0)


@dataclass
class _ShardHandle:
    address: str
    process: multiprocessing.Process | None = None
    thread: threading.Thread | None = None


@dataclass
class Service:
    """A running service: control endpoint plus shards."""

    control: Listener
    shards: list[_ShardHandle]
    stop_event: threading.Event = field(default_factory=threading.Event)
    in_process_shards: list[Shard] = field(default_factory=list)

    @property
    def address(self) -> str:
        return str(self.control.address)

    def shard_map(self) -> dict:
        return {"service": "aggnet", "version": wire.VERSION, "shards": [s.address for s in self.shards],
                "pid": os.getpid()}

    def handle_control(self, peer, header_buf, payload) -> None:
        try:
            h = wire.unpack_header(header_buf)
        except wire.WireError as exc:
            self._send(peer, MsgType.ERROR, wire.error_payload(ErrorCode.MALFORMED, str(exc)))
            return
        if h.msg_type == MsgType.HELLO:
            self._send(peer, MsgType.HELLO_OK, wire.json_payload(self.shard_map()))
        elif h.msg_type == MsgType.STATS:
            self._send(peer, MsgType.STATS_OK, wire.json_payload(self.collect_stats()))
        else:
            self._send(peer, MsgType.ERROR, wire.error_payload(
                ErrorCode.REFUSED,
                f"the control endpoint {self.address} answers HELLO and STATS; send {h.msg_type.name} to a shard "
                f"(the HELLO reply lists them)"))

    def _send(self, peer, msg_type: MsgType, payload: bytes) -> None:
        self.control.send(peer, Header(msg_type).pack_for(payload), payload)

    def collect_stats(self, timeout: float = 2.0) -> dict:
        """Every shard's counters, asked over its own socket."""
        shards: list = [None] * len(self.shards)
        with connect([s.address for s in self.shards]) as conn:
            for i in range(len(self.shards)):
                conn.send(i, Header(MsgType.STATS).pack())
            deadline = time.monotonic() + timeout
            while any(s is None for s in shards) and time.monotonic() < deadline:
                msg = conn.recv(deadline - time.monotonic())
                if msg is None:
                    continue
                h = wire.unpack_header(msg.header)
                if h.msg_type == MsgType.STATS_OK:
                    shards[msg.peer] = wire.parse_json(msg.payload)
        totals: dict = {}
        for s in shards:
            for k, v in (s or {}).get("counters", {}).items():
                totals[k] = totals.get(k, 0) + v
        return {"service": self.shard_map(), "totals": totals, "shards": shards}

    def run(self, parent_pid: int | None = None) -> None:
        """Answer control requests until stopped (or the parent is gone)."""
        next_check = 0.0
        while not self.stop_event.is_set():
            msg = self.control.recv(0.2)
            if msg is not None:
                self.handle_control(msg.peer, msg.header, msg.payload)
            now = time.monotonic()
            if now >= next_check:
                next_check = now + 0.5
                if parent_pid is not None and not _alive(parent_pid):
                    log.info("parent process %d is gone; stopping", parent_pid)
                    break
                dead = [i for i, s in enumerate(self.shards) if s.process is not None and not s.process.is_alive()]
                if dead:
                    log.error("shard process(es) %s died; stopping the service", dead)
                    break
        self.stop()

    def stop(self) -> None:
        self.stop_event.set()
        for s in self.shards:
            if s.process is not None and s.process.is_alive():
                s.process.terminate()
        deadline = time.monotonic() + SHARD_STOP_TIMEOUT
        for s in self.shards:
            if s.process is not None:
                s.process.join(max(0.0, deadline - time.monotonic()))
                if s.process.is_alive():
                    log.warning("shard process %d did not stop in time; killing it", s.process.pid)
                    s.process.kill()
                    s.process.join(1.0)
            if s.thread is not None:
                s.thread.join(max(0.0, deadline - time.monotonic()))
        self.control.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def start(listen_address: str, shards: int | None = None, log_level: int = logging.INFO) -> Service:
    """Start shards and bind the control endpoint; returns when every shard
    is ready. ``inproc://`` services run their shards as threads."""
    control_addr = parse(listen_address)
    n = shards or default_shards()
    if n < 1:
        raise ValueError(f"shards must be >= 1, got {n}")
    addrs = shard_addresses(control_addr, n)
    if control_addr.scheme == "inproc":
        return _start_threads(control_addr, addrs)
    handles = []
    # fork before any socket exists in this process: children start fast and
    # inherit nothing they should not
    ctx = multiprocessing.get_context("fork")
    pipes = []
    for i, a in enumerate(addrs):
        ours, theirs = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_shard_main, args=(i, str(a), theirs, log_level), name=f"aggnet-shard-{i}", daemon=True)
        p.start()
        theirs.close()
        pipes.append(ours)
        handles.append(_ShardHandle(str(a), process=p))
    try:
        for i, (h, pipe) in enumerate(zip(handles, pipes)):
            if not pipe.poll(SHARD_START_TIMEOUT):
                raise RuntimeError(f"shard {i} did not start within {SHARD_START_TIMEOUT:g}s")
            try:
                kind, value = pipe.recv()
            except EOFError:
                raise RuntimeError(f"shard {i} exited while starting (see its log above)") from None
            if kind != "ready":
                raise RuntimeError(value)
            h.address = value
        control = listen(control_addr)
    except BaseException:
        for h in handles:
            h.process.kill()
        raise
    svc = Service(control, handles)
    log.info("aggnet service at %s with %d shard(s): %s", svc.address, n, ", ".join(h.address for h in handles))
    return svc


def _start_threads(control_addr: Address, addrs: list[Address]) -> Service:
    handles = []
    svc = Service(listen(control_addr), handles)
    for i, a in enumerate(addrs):
        shard = Shard(listen(a), i)
        t = threading.Thread(target=_serve_thread, args=(shard, svc.stop_event), name=f"aggnet-shard-{i}", daemon=True)
        handles.append(_ShardHandle(str(shard.listener.address), thread=t))
        svc.in_process_shards.append(shard)
        t.start()
    ctl = threading.Thread(target=svc.run, name="aggnet-control", daemon=True)
    ctl.start()
    return svc


def _serve_thread(shard: Shard, stop: threading.Event) -> None:
    try:
        shard.serve(stop.is_set)
    finally:
        shard.close()
        shard.listener.close()
