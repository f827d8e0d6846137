"""The aggregator service: a supervisor and K shard processes.

``aggnet serve --listen URL`` binds a control endpoint at URL that answers
HELLO with the shard map and STATS with every shard's counters, and starts K
shard processes (default: one per core), each bound to its own address:

* ``zmq+tcp://host:P`` -> shards at ``host:P+1 .. host:P+K`` (P = 0: any free ports)
* ``zmq+ipc:///path`` -> shards at ``/path.0 .. /path.K-1``
* ``inproc://name`` -> shards ``name.0 ..`` as threads of this process (tests)

SIGTERM or SIGINT to ``aggnet serve`` stops the shards and then the
supervisor; hosts/supervisor.py runs the shard processes. With
``until_idle`` the service stops once its jobs are done and the process
that started it (if given) is gone, or once that process is gone and its
jobs fell silent (the embedded default must not outlive its use, and
serves every job of the process that started it).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import ClassVar

from aggnet.protocol import keys, wire
from aggnet.protocol.control import ControlError
from aggnet.protocol.keys import Keyring
from aggnet.processes import keep_large_buffers
from aggnet.protocol.address import Address, advertised_as, parse
from aggnet.transport import Listener, connect, listen
from aggnet.protocol.wire import ErrorCode, Header, MsgType

from aggnet.hosts.aggregator import STOP_POLL, Aggregator
from aggnet.hosts.shard import JOB_LEASE, Shard, transport_counters
from aggnet.hosts.supervisor import STOP_TIMEOUT, RestartLimit, ShardStartError, ShardSupervisor, alive
from aggnet.hosts.uplink import Uplink, UplinkConfig

log = logging.getLogger("aggnet.hosts.service")

def default_shards() -> int:
    return max(1, len(os.sched_getaffinity(0)))


def shard_addresses(control: Address, shards: int) -> list[Address]:
    if control.scheme in ("tcp", "zmq+tcp", "ucx"):
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


@dataclass(frozen=True)
class _ShardSettings:
    """What every shard process of a service starts with (picklable: a
    restarted shard is spawned with it)."""

    log_level: int
    keyring: Keyring | None
    curve: object
    uplink: UplinkConfig | None
    count: int
    job_lease: float | None
    #: what every shard's listener is opened with besides CURVE (a tcp://
    #: listener's budgets)
    listener_options: dict = field(default_factory=dict)


def _shard_main(index: int, report, should_stop, address: str, settings: _ShardSettings) -> None:
    """A shard process's work, run by the ShardSupervisor."""
    keep_large_buffers()
    logging.basicConfig(level=settings.log_level,
                        format=f"%(asctime)s aggnet shard {index} %(levelname)s %(message)s")
    try:
        _warm_up_kernels()
        listener = listen(address, **_curve_options(settings.curve), **settings.listener_options)
    except Exception as exc:
        report.failed(f"shard {index} cannot start on {address}: {exc}")
        return
    report.ready(str(listener.address))
    uplink = Uplink(settings.uplink, index, settings.count) if settings.uplink is not None else None
    shard = Shard(listener, index, settings.keyring, uplink, job_lease=settings.job_lease)
    try:
        shard.serve(should_stop)
    finally:
        shard.close()
        listener.close()


@dataclass
class _ShardHandle:
    address: str
    thread: threading.Thread | None = None  #: an in-process shard (inproc://)


@dataclass
class Service(Aggregator):
    """A running service: control endpoint plus shards."""

    kind: ClassVar[str] = "service"
    title: ClassVar[str] = "aggnet service"

    control: Listener
    shards: list[_ShardHandle]
    #: the shard processes; None where the shards are threads (inproc://)
    supervisor: ShardSupervisor | None = None
    stop_event: threading.Event = field(default_factory=threading.Event)
    in_process_shards: list[Shard] = field(default_factory=list)
    keyring: Keyring = field(default_factory=Keyring)
    #: restart a shard process that died (``aggnet serve --restart``)
    restart: bool = False
    curve: object = None  #: the service's CURVE key pair (zmq+tcp)
    #: a rack under a root service: where its shards send partial sums
    uplink: UplinkConfig | None = None
    counters: collections.Counter = field(default_factory=collections.Counter)
    #: the host the shard map names (``aggnet serve --advertise``); None:
    #: the listen host, a wildcard one resolved by each worker
    advertise: str | None = None
    #: ``aggnet serve --until-idle``: see _idle
    until_idle: float | None = None
    #: the process that started the service: with until_idle, the service
    #: waits for more jobs while it runs, and its exit ends the service once
    #: the jobs are done or fell silent
    parent_pid: int | None = None
    _closed: bool = field(default=False, init=False, repr=False)
    _closing: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    #: the control endpoint's one connection to every shard, for STATS
    #: (opened at the first; a connection per STATS left a socket in
    #: TIME_WAIT per shard and query), and the lock its users take
    #: (the control loop and the metrics exporter's thread)
    _stats_conn: object = field(default=None, init=False, repr=False)
    _stats_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    @property
    def address(self) -> str:
        return str(self.control.address)

    @property
    def shard_count(self) -> int:
        return len(self.shards)

    def shard_map(self) -> dict:
        return {"service": "aggnet", "version": wire.VERSION,
                "shards": [str(advertised_as(s.address, self.advertise)) for s in self.shards], "pid": os.getpid()}

    def handle_control(self, peer, header_buf, payload) -> None:
        """One control message; none, however malformed, stops the service."""
        self.counters["messages"] += 1
        try:
            self._control(peer, header_buf, payload)
        except Exception:
            self.counters["internal_error"] += 1
            log.exception("control message from %r failed; the service goes on", peer)

    def _control(self, peer, header_buf, payload) -> None:
        try:
            if len(header_buf) > wire.HEADER_SIZE:
                raise wire.WireError("header_length", f"header frame of {len(header_buf)} bytes; aggnet headers "
                                                      f"are {wire.HEADER_SIZE}")
            h = wire.unpack_header(header_buf)
            wire.check_payload(h, len(payload))
        except wire.WireError as exc:
            self.counters[f"dropped_malformed_{exc.reason}"] += 1
            self._send(peer, MsgType.ERROR, wire.error_payload(ErrorCode.MALFORMED, str(exc)))
            return
        if h.msg_type == MsgType.HELLO:
            self._send(peer, MsgType.HELLO_OK, wire.json_payload(self.shard_map()))
        elif h.msg_type == MsgType.STATS:
            try:
                jobs = self.keyring.stats_view(h, payload, peer)
            except ControlError as exc:
                self.counters[f"dropped_{exc.reason}"] += 1
                self._send(peer, MsgType.ERROR, wire.error_payload(exc.code, str(exc)))
                return
            self._send(peer, MsgType.STATS_OK, wire.json_payload(self.collect_stats(jobs=jobs)))
        else:
            self.counters["dropped_unexpected_type"] += 1
            self._send(peer, MsgType.ERROR, wire.error_payload(
                ErrorCode.REFUSED,
                f"the control endpoint {self.address} answers HELLO and STATS; send {h.msg_type.name} to a shard "
                f"(the HELLO reply lists them)"))

    def _send(self, peer, msg_type: MsgType, payload: bytes) -> None:
        self.control.send(peer, Header(msg_type).pack_for(payload), payload)

    def collect_stats(self, timeout: float = 2.0, jobs: set | None = None) -> dict:
        """Every shard's counters, asked over its own socket (a shard that
        does not answer in time shows as null); ``jobs`` limits the job
        tables shown to those names."""
        shards: list = [None] * len(self.shards)
        ask = Header(MsgType.STATS)
        if self.keyring.enforced and self.keyring.admin is not None:
            payload = wire.json_payload({"admin": keys.sign(self.keyring.admin, "STATS", 0, 0, 0, {})})
        else:
            payload = b""
        with self._stats_lock:
            conn = None if self._closed else self._stats_connection()
            while conn is not None and conn.recv(0) is not None:
                pass  # a late answer to an earlier STATS that gave up waiting
            for i in range(len(self.shards) if conn is not None else 0):
                conn.send(i, ask.pack_for(payload), payload or None)
            deadline = time.monotonic() + timeout
            while conn is not None and any(s is None for s in shards) and time.monotonic() < deadline:
                msg = conn.recv(deadline - time.monotonic())
                if msg is None:
                    continue
                try:
                    h = wire.unpack_header(msg.header)
                    if h.msg_type == MsgType.STATS_OK:
                        shards[msg.peer] = wire.parse_json(msg.payload)
                except wire.WireError:
                    continue
        totals: dict = dict(self.counters)
        for k, v in transport_counters(self.control).items():  # what the control listener closed (tcp://)
            totals[k] = totals.get(k, 0) + v
        for s in shards:
            for k, v in (s or {}).get("counters", {}).items():
                totals[k] = totals.get(k, 0) + v
            if s is not None and jobs is not None:
                s["jobs"] = {name: j for name, j in s.get("jobs", {}).items() if name in jobs}
        return {"service": self.shard_map(), "totals": totals, "shards": shards,
                "restarts": self.supervisor.restarts if self.supervisor is not None else 0}

    def _stats_connection(self):
        if self._stats_conn is None:
            client_curve = None
            if self.curve is not None:
                from aggnet.transport.zmq import Curve

                client_curve = Curve(self.curve.public)
            self._stats_conn = connect([s.address for s in self.shards], **_curve_options(client_curve))
        return self._stats_conn

    def stats(self) -> dict:
        return stats_view(self.collect_stats())

    def serve(self, should_stop=lambda: False, started=None) -> None:
        """Answer control requests until ``should_stop()`` or stop(); the
        shards serve already (start() waited for them). With
        ``until_idle``, stop when the last member of the last job has
        left, or when no job came for that long: the embedded default
        serves a job, not the worker that started it."""
        try:
            if started is not None:
                started()
            next_check = 0.0
            began = time.monotonic()
            self._seen_jobs = False
            while not self.stop_event.is_set() and not should_stop():
                msg = self.control.recv(STOP_POLL)
                if msg is not None:
                    self.handle_control(msg.peer, msg.header, msg.payload)
                now = time.monotonic()
                if now >= next_check:
                    next_check = now + 0.5
                    if not self._recover():
                        break
                    if self.until_idle is not None and self._idle(now - began, self.until_idle, self.parent_pid):
                        break
        finally:
            self.stop()

    def _idle(self, age: float, limit: float, parent_pid: int | None) -> bool:
        stats = self.collect_stats(timeout=1.0)
        if any(s is None for s in stats["shards"]):
            return False  # a busy or restarting shard: look again later
        jobs = sum(len(s.get("jobs", {})) for s in stats["shards"])
        now = time.monotonic()
        messages = stats["totals"].get("pushes", 0) + stats["totals"].get("joins", 0)
        if messages != getattr(self, "_messages", None):
            self._messages, self._quiet_since = messages, now
        if jobs or stats["totals"].get("joins", 0):
            self._seen_jobs = True  # a job that came and went between looks counts too
        if jobs:
            # members killed without LEAVE: once the process that started
            # the service is gone too and nothing moves, nobody is left
            if parent_pid is not None and not alive(parent_pid) and now - self._quiet_since >= limit:
                log.info("parent process %d is gone and the job(s) sent nothing for %gs; stopping", parent_pid, limit)
                return True
            return False
        if parent_pid is not None and alive(parent_pid):
            return False  # the process that started it may give it another job (an embedded service)
        if self._seen_jobs:
            log.info("the last member of the last job left; stopping")
            return True
        if age >= limit:
            log.info("no job joined within %gs; stopping", limit)
            return True
        return False

    def _recover(self) -> bool:
        """Restart dead shards at their addresses (with ``restart``); False
        when the service must stop instead. Workers of the jobs the shard
        held see their all-reduce fail naming it, and join it again."""
        if self.supervisor is None:
            return True
        try:
            # a successor imports and binds for seconds; the control endpoint
            # answers STATS and HELLO meanwhile (the shard shows as null)
            for shard in self.supervisor.restarting():
                self.supervisor.finish_restart(shard)
            for shard in self.supervisor.exited():
                if not self.restart:
                    log.error("shard %d (pid %d) died with status %s; stopping the service (run `aggnet serve "
                              "--restart` to restart shards instead)", shard.index, shard.pid, shard.exitcode)
                    return False
                self.supervisor.begin_restart(shard)
        except (RestartLimit, ShardStartError) as exc:
            log.error("%s; stopping the service", exc)
            return False
        return True

    def stop(self) -> None:
        """Stop the shards, then close the control endpoint; twice is harmless."""
        self.stop_event.set()
        with self._closing:
            if self._closed:
                return
            self._closed = True
            if self.supervisor is not None:
                self.supervisor.stop()
            deadline = time.monotonic() + STOP_TIMEOUT
            for s in self.shards:
                if s.thread is not None:
                    s.thread.join(max(0.0, deadline - time.monotonic()))
            with self._stats_lock:
                if self._stats_conn is not None:
                    self._stats_conn.close()
                    self._stats_conn = None
            self.control.close()

    def close(self) -> None:
        self.stop()


def stats_view(reply: dict) -> dict:
    """A service's STATS reply (collect_stats) in the shape every
    aggregator's stats() has (hosts/aggregator.py): one part per shard."""
    shards = []
    for s in reply.get("shards") or []:
        if s is None:
            shards.append(None)
            continue
        pool = s.get("pool") if isinstance(s.get("pool"), dict) else {}
        shards.append({
            "counters": dict(s.get("counters") or {}),
            "jobs": {name: {"members": len(j.get("members") or ()), "open_slots": j.get("open_slots", 0),
                            "counters": dict(j.get("counters") or {})} for name, j in (s.get("jobs") or {}).items()},
            "histograms": dict(s.get("histograms") or {}),
            "pool": {"slots": pool.get("slots"), "used": pool.get("used"), "buffers": s.get("pool_buffers", 0)},
            "memory": dict(s.get("memory") or {}),
        })
    return {"kind": Service.kind, "totals": dict(reply.get("totals") or {}), "jobs": {},
            "histograms": dict(reply.get("histograms") or {}),
            "pool": {"slots": None, "used": None, "buffers": 0}, "shards": shards, "restarts": reply.get("restarts")}


def _curve_options(curve) -> dict:
    """Transport options of a CURVE-protected service (ZeroMQ only)."""
    return {} if curve is None else {"curve": curve}


def start(listen_address: str, shards: int | None = None, *, log_level: int = logging.INFO,
          keyring: Keyring | None = None, restart: bool = False, curve=None,
          uplink: UplinkConfig | None = None, advertise: str | None = None,
          until_idle: float | None = None, parent_pid: int | None = None,
          job_lease: float | None = JOB_LEASE, listener_options: dict | None = None) -> Service:
    """Start shards and bind the control endpoint; returns when every shard
    is ready. ``inproc://`` services run their shards as threads. With
    ``uplink`` the service is a rack under a root service (hosts/uplink.py);
    with ``advertise`` its shard map names that host (a service behind NAT,
    or one whose workers reach it by a name of its own); ``until_idle`` and
    ``parent_pid``: see Service; ``job_lease``: see Shard;
    ``listener_options``: what each shard's listener is opened with (a
    tcp:// listener's budgets: transport.tcp.TcpListener)."""
    keyring = keyring or Keyring()
    if keyring.enforced and keyring.admin is None:
        # the supervisor reads every shard's full table (STATS, metrics,
        # --until-idle) with an admin key nobody else knows
        keyring.admin = bytes.fromhex(keys.new_key())
    control_addr = parse(listen_address)
    n = shards or default_shards()
    if n < 1:
        raise ValueError(f"shards must be >= 1, got {n}")
    addrs = shard_addresses(control_addr, n)
    if curve is not None and control_addr.scheme != "zmq+tcp":
        raise ValueError(f"CURVE protects zmq+tcp services; {control_addr.scheme} addresses are protected by "
                         f"file permissions (the socket's directory)")
    listener_options = dict(listener_options or {})
    if listener_options and control_addr.scheme != "tcp":
        raise ValueError(f"listener options {sorted(listener_options)} are a tcp:// listener's; this service "
                         f"listens at {control_addr}")
    if control_addr.scheme == "inproc":
        return _start_threads(control_addr, addrs, keyring, uplink, job_lease)
    _refuse_a_second_service(control_addr)
    handles = [_ShardHandle(str(a)) for a in addrs]
    # a restarted shard binds the address its first process reported (the
    # port a ":0" address was given), with the same settings
    settings = _ShardSettings(log_level, keyring, curve, uplink, n, job_lease, listener_options)
    supervisor = ShardSupervisor(_shard_main, n, lambda i: (handles[i].address, settings))
    # fork before any socket exists in this process: children start fast and
    # inherit nothing they should not; the kernels loaded once here, not in
    # every shard (a restarted shard is spawned and loads its own)
    _warm_up_kernels()
    try:
        started = supervisor.start()
    except ShardStartError as exc:
        raise ShardStartError(f"{exc}{_ports_hint(control_addr, n, str(exc))}") from None
    for handle, address in zip(handles, started):
        handle.address = address
    try:
        control = listen(control_addr, **_curve_options(curve))
    except BaseException as exc:
        supervisor.stop()
        if "in use" in str(exc):
            raise ShardStartError(f"the control endpoint cannot listen: {exc}{_ports_hint(control_addr, n, str(exc))}"
                                  ) from None
        raise
    svc = Service(control, handles, supervisor=supervisor, keyring=keyring, restart=restart, curve=curve,
                  uplink=uplink, advertise=advertise, until_idle=until_idle, parent_pid=parent_pid)
    log.info("aggnet service at %s with %d shard(s): %s%s", svc.address, n, ", ".join(svc.shard_map()["shards"]),
             f"; rack {uplink.rack_id} of {uplink.racks} under {uplink.parent}" if uplink else "")
    return svc


def _refuse_a_second_service(control: Address) -> None:
    """An aggnet service that answers at ``control`` already: say so, not
    that some shard port is in use."""
    if control.scheme not in ("tcp", "zmq+tcp") or not control.port:
        return
    import socket

    with socket.socket(socket.AF_INET6 if ":" in control.host else socket.AF_INET) as s:
        try:
            s.bind((control.host, control.port))
            return  # the port is free
        except OSError:
            pass
    try:
        with connect([str(control)]) as conn:
            conn.send(0, Header(MsgType.HELLO).pack())
            msg = conn.recv(1.0)
        answer = wire.parse_json(msg.payload) if msg is not None else None
    except Exception:
        answer = None
    if isinstance(answer, dict) and answer.get("service") == "aggnet":
        raise ShardStartError(f"an aggnet service already runs at {control} (its shards at "
                              f"{', '.join(map(str, answer.get('shards', [])))}); stop it, or give this one another "
                              f"--listen port")


def _ports_hint(control: Address, n: int, text: str) -> str:
    if "in use" not in text or control.scheme not in ("tcp", "zmq+tcp", "ucx") or not control.port:
        return ""
    return (f"; a service takes its control port and the {n} after it ({control.port}..{control.port + n}, one per "
            f"shard): pick a --listen port with {n} free ports after it, fewer --shards, or port 0 for any free ports")


def _start_threads(control_addr: Address, addrs: list[Address], keyring: Keyring,
                   uplink: UplinkConfig | None = None, job_lease: float | None = JOB_LEASE) -> Service:
    handles = []
    svc = Service(listen(control_addr), handles, keyring=keyring, uplink=uplink)
    for i, a in enumerate(addrs):
        shard = Shard(listen(a), i, keyring, Uplink(uplink, i, len(addrs)) if uplink is not None else None,
                      job_lease=job_lease)
        t = threading.Thread(target=_serve_thread, args=(shard, svc.stop_event), name=f"aggnet-shard-{i}", daemon=True)
        handles.append(_ShardHandle(str(shard.listener.address), thread=t))
        svc.in_process_shards.append(shard)
        t.start()
    ctl = threading.Thread(target=svc.serve, name="aggnet-control", daemon=True)
    ctl.start()
    return svc


def _serve_thread(shard: Shard, stop: threading.Event) -> None:
    try:
        shard.serve(stop.is_set)
    finally:
        shard.close()
        shard.listener.close()
