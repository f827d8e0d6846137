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

import collections
import logging
import multiprocessing
import os
import signal
import threading
import time
from dataclasses import dataclass, field

from aggnet import keys, wire
from aggnet.control import ControlError
from aggnet.keys import Keyring
from aggnet.processes import die_with_parent, keep_large_buffers
from aggnet.address import Address, advertised_as, parse
from aggnet.transport import Listener, connect, listen
from aggnet.wire import ErrorCode, Header, MsgType

from .shard import Shard
from .uplink import Uplink, UplinkConfig

log = logging.getLogger("aggnet.hosts.service")

#: seconds a shard process may take to start (imports, kernel warm-up)
SHARD_START_TIMEOUT = 60.0
#: seconds shards get to stop before they are killed
SHARD_STOP_TIMEOUT = 5.0
#: a shard restarted more often than this within the window stops the service
MAX_RESTARTS = 5
RESTART_WINDOW = 60.0


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


def _shard_main(index: int, address: str, report, log_level: int, keyring: Keyring | None = None,
                curve=None, uplink: UplinkConfig | None = None, count: int = 1) -> None:
    """Entry point of a shard process."""
    die_with_parent()
    keep_large_buffers()
    logging.basicConfig(level=log_level, format=f"%(asctime)s aggnet shard {index} %(levelname)s %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides
    try:
        _warm_up_kernels()
        listener = listen(address, **_curve_options(curve))
    except Exception as exc:
        report.send(("error", f"shard {index} cannot start on {address}: {exc}"))
        return
    report.send(("ready", str(listener.address)))
    report.close()
    shard = Shard(listener, index, keyring, Uplink(uplink, index, count) if uplink is not None else None)
    code = 1
    try:
        shard.serve(stop.is_set)
        code = 0
    except BaseException:
        log.exception("shard %d failed", index)
    finally:
        shard.close()
        listener.close()
        logging.shutdown()
        # skip interpreter teardown: transport libraries' finalizers (UCX's)
        # can block an exit that has nothing left to do; the status tells
        # the supervisor whether the shard stopped or failed
        os._exit(code)


@dataclass
class _ShardHandle:
    address: str
    process: multiprocessing.Process | None = None
    thread: threading.Thread | None = None
    restarts: list = field(default_factory=list)  #: when it was restarted


@dataclass
class Service:
    """A running service: control endpoint plus shards."""

    control: Listener
    shards: list[_ShardHandle]
    stop_event: threading.Event = field(default_factory=threading.Event)
    in_process_shards: list[Shard] = field(default_factory=list)
    keyring: Keyring = field(default_factory=Keyring)
    #: restart a shard process that died (``aggnet serve --restart``)
    restart: bool = False
    log_level: int = logging.INFO
    curve: object = None  #: the service's CURVE key pair (zmq+tcp)
    #: a rack under a root service: where its shards send partial sums
    uplink: UplinkConfig | None = None
    counters: collections.Counter = field(default_factory=collections.Counter)
    #: the host the shard map names (``aggnet serve --advertise``); None:
    #: the listen host, a wildcard one resolved by each worker
    advertise: str | None = None

    @property
    def address(self) -> str:
        return str(self.control.address)

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
        client_curve = None
        if self.curve is not None:
            from aggnet.transport.zmq import Curve

            client_curve = Curve(self.curve.public)
        with connect([s.address for s in self.shards], **_curve_options(client_curve)) as conn:
            for i in range(len(self.shards)):
                conn.send(i, ask.pack_for(payload), payload or None)
            deadline = time.monotonic() + timeout
            while any(s is None for s in shards) and time.monotonic() < deadline:
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
        for s in shards:
            for k, v in (s or {}).get("counters", {}).items():
                totals[k] = totals.get(k, 0) + v
            if s is not None and jobs is not None:
                s["jobs"] = {name: j for name, j in s.get("jobs", {}).items() if name in jobs}
        return {"service": self.shard_map(), "totals": totals, "shards": shards,
                "restarts": sum(len(s.restarts) for s in self.shards)}

    def run(self, parent_pid: int | None = None, until_idle: float | None = None) -> None:
        """Answer control requests until stopped (or the parent is gone).
        With ``until_idle``, stop when the last member of the last job has
        left, or when no job came for that long: the embedded default
        serves a job, not the worker that started it."""
        next_check = 0.0
        started = time.monotonic()
        self._seen_jobs = False
        while not self.stop_event.is_set():
            msg = self.control.recv(0.2)
            if msg is not None:
                self.handle_control(msg.peer, msg.header, msg.payload)
            now = time.monotonic()
            if now >= next_check:
                next_check = now + 0.5
                if parent_pid is not None and until_idle is None and not _alive(parent_pid):
                    log.info("parent process %d is gone; stopping", parent_pid)
                    break
                dead = [i for i, s in enumerate(self.shards) if s.process is not None and not s.process.is_alive()]
                if dead and not self._recover(dead):
                    break
                if until_idle is not None and self._idle(now - started, until_idle, parent_pid):
                    break
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
            if parent_pid is not None and not _alive(parent_pid) and now - self._quiet_since >= limit:
                log.info("parent process %d is gone and the job(s) sent nothing for %gs; stopping", parent_pid, limit)
                return True
            return False
        if self._seen_jobs:
            log.info("the last member of the last job left; stopping")
            return True
        if age >= limit:
            log.info("no job joined within %gs; stopping", limit)
            return True
        return False

    def _recover(self, dead: list[int]) -> bool:
        """Restart dead shards at their addresses (with ``restart``); False
        when the service must stop instead. Workers of the jobs the shard
        held see their all-reduce fail naming it, and join it again."""
        for i in dead:
            handle = self.shards[i]
            code = handle.process.exitcode
            if not self.restart:
                log.error("shard %d (pid %d) died with status %s; stopping the service (run `aggnet serve "
                          "--restart` to restart shards instead)", i, handle.process.pid, code)
                return False
            now = time.monotonic()
            handle.restarts = [t for t in handle.restarts if now - t < RESTART_WINDOW] + [now]
            if len(handle.restarts) > MAX_RESTARTS:
                log.error("shard %d died %d times within %gs; stopping the service", i, len(handle.restarts),
                          RESTART_WINDOW)
                return False
            log.warning("shard %d (pid %d) died with status %s; restarting it at %s", i, handle.process.pid, code,
                        handle.address)
            try:
                handle.process = _spawn_shard(i, handle.address, self.log_level, self.keyring, self.curve,
                                              multiprocessing.get_context("spawn"), self.uplink, len(self.shards))
            except RuntimeError as exc:
                log.error("%s; stopping the service", exc)
                return False
        return True

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


def _curve_options(curve) -> dict:
    """Transport options of a CURVE-protected service (ZeroMQ only)."""
    return {} if curve is None else {"curve": curve}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _spawn_shard(index: int, address: str, log_level: int, keyring: Keyring, curve, ctx,
                 uplink: UplinkConfig | None = None, count: int = 1) -> multiprocessing.Process:
    """Start one shard process and wait until it serves at ``address``."""
    ours, theirs = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_shard_main, args=(index, address, theirs, log_level, keyring, curve, uplink, count),
                    name=f"aggnet-shard-{index}", daemon=True)
    p.start()
    theirs.close()
    try:
        if not ours.poll(SHARD_START_TIMEOUT):
            raise RuntimeError(f"shard {index} did not start within {SHARD_START_TIMEOUT:g}s")
        kind, value = ours.recv()
    except EOFError:
        p.kill()
        raise RuntimeError(f"shard {index} exited while starting (see its log above)") from None
    except BaseException:
        p.kill()
        raise
    finally:
        ours.close()
    if kind != "ready":
        p.kill()
        raise RuntimeError(value)
    return p


def start(listen_address: str, shards: int | None = None, log_level: int = logging.INFO,
          keyring: Keyring | None = None, restart: bool = False, curve=None,
          uplink: UplinkConfig | None = None, advertise: str | None = None) -> Service:
    """Start shards and bind the control endpoint; returns when every shard
    is ready. ``inproc://`` services run their shards as threads. With
    ``uplink`` the service is a rack under a root service (hosts/uplink.py);
    with ``advertise`` its shard map names that host (a service behind NAT,
    or one whose workers reach it by a name of its own)."""
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
    if control_addr.scheme == "inproc":
        return _start_threads(control_addr, addrs, keyring, uplink)
    handles = []
    # fork before any socket exists in this process: children start fast and
    # inherit nothing they should not
    ctx = multiprocessing.get_context("fork")
    pipes = []
    for i, a in enumerate(addrs):
        ours, theirs = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_shard_main, args=(i, str(a), theirs, log_level, keyring, curve, uplink, n),
                        name=f"aggnet-shard-{i}", daemon=True)
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
        control = listen(control_addr, **_curve_options(curve))
    except BaseException:
        for h in handles:
            h.process.kill()
        raise
    svc = Service(control, handles, keyring=keyring, restart=restart, log_level=log_level, curve=curve,
                  uplink=uplink, advertise=advertise)
    log.info("aggnet service at %s with %d shard(s): %s%s", svc.address, n, ", ".join(svc.shard_map()["shards"]),
             f"; rack {uplink.rack_id} of {uplink.racks} under {uplink.parent}" if uplink else "")
    return svc


def _start_threads(control_addr: Address, addrs: list[Address], keyring: Keyring,
                   uplink: UplinkConfig | None = None) -> Service:
    handles = []
    svc = Service(listen(control_addr), handles, keyring=keyring, uplink=uplink)
    for i, a in enumerate(addrs):
        shard = Shard(listen(a), i, keyring, Uplink(uplink, i, len(addrs)) if uplink is not None else None)
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
