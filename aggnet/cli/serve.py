"""``aggnet serve``: run an aggregator of either kind.

It listens on this machine only (127.0.0.1) unless given an address: an
aggregator is a shared service that anyone who reaches it can talk to, so
serving other hosts is a choice, and serving them without job keys is said
out loud at start.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import sys
import threading

log = logging.getLogger("aggnet.serve")

DEFAULT_SERVICE_LISTEN = "zmq+tcp://127.0.0.1:5555"


def add_arguments(s) -> None:
    s.add_argument("--listen", default=None,
                   help="control address (tcp://host:port: plain TCP, zmq+tcp://host:port, zmq+ipc:///path, "
                        "shm:///path, ucx://host:port; "
                        f"udp://host:port with --mode switch); default {DEFAULT_SERVICE_LISTEN}, or "
                        "udp://127.0.0.1:42606 in switch mode. Give 0.0.0.0 to serve other hosts (with --keys)")
    s.add_argument("--advertise", default=None, metavar="HOST",
                   help="the host name or IP the shard map gives workers (default: the --listen host; on 0.0.0.0 "
                        "or [::] each worker uses the host it reached the service at). Set it when workers reach "
                        "this machine by another address than the one they were given (NAT, a proxy)")
    s.add_argument("--mode", choices=["service", "switch"], default="service",
                   help="service: sharded aggregator (chunks over messages); switch: the switch protocol "
                        "over UDP, standing in for a ToR switch or serving as a parent (docs/protocol.md)")
    s.add_argument("--keys", default=None, metavar="FILE",
                   help="job keys (aggnet job create NAME --keys FILE): every JOIN must be signed with its job's "
                        "key, and STATS shows a job only to its key or the admin key (docs/security.md)")
    s.add_argument("--curve-secret-file", default=None, metavar="FILE",
                   help="service mode over zmq+tcp: encrypt and authenticate with ZeroMQ CURVE using this "
                        "secret key file (aggnet job curve-keys makes one); clients set server_key")
    s.add_argument("--restart", action="store_true",
                   help="service mode: restart a shard process that dies (its jobs' workers join it again) "
                        "instead of stopping the service")
    s.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics at http://127.0.0.1:PORT/metrics (docs/observability.md)")
    s.add_argument("--metrics-host", default="127.0.0.1", help="address of the metrics endpoint")
    s.add_argument("--pool", type=int, default=4096, help="switch mode: slots in the pool (default %(default)s)")
    s.add_argument("--elements", type=int, default=None,
                   help="switch mode: int32 elements per packet for jobs that do not ask (default 2048: 8240-byte "
                        "datagrams, for jumbo frames; a worker whose path MTU is smaller gets what fits it)")
    s.add_argument("--max-elements", type=int, default=None,
                   help="switch mode: the most elements per packet a job may ask for (default: 2048 or --elements)")
    s.add_argument("--io", choices=["gso", "mmsg", "plain"], default=None,
                   help="switch mode: batching of UDP I/O (default: the best the kernel offers; AGGNET_UDP_IO)")
    s.add_argument("--parent", default=None,
                   help="this aggregator serves a rack under a root that reduces across racks: udp://host:port in "
                        "switch mode, the root service's tcp:// or zmq+tcp://host:port in service mode (same --shards)")
    s.add_argument("--rack-id", type=int, default=0, help="this rack's id at its parent (0..racks-1)")
    s.add_argument("--racks", type=int, default=1, help="racks under the parent")
    s.add_argument("--reclaim-idle", type=float, default=300.0, metavar="SECONDS",
                   help="switch mode: when the pool is full, a new job takes the slices of jobs that sent "
                        "nothing for this long (workers killed without LEAVE); default %(default)g")
    s.add_argument("--heartbeat-lapse", type=float, default=None, metavar="SECONDS",
                   help="switch mode: a worker whose heartbeats stop for this long is gone, and the others' "
                        "all-reduces fail at once naming it; 0: off (they wait for their timeout); default 3")
    s.add_argument("--job-lease", type=float, default=None, metavar="SECONDS",
                   help="service mode: reclaim a job none of whose members was heard from for this long "
                        "(workers killed without LEAVE, junk JOINs); a member that comes back later fails one "
                        "all-reduce and joins again on its next; default: never")
    s.add_argument("--receive-budget", default=None, metavar="SIZE",
                   help="tcp:// service: bytes of payloads a shard reads at once, over all its streams; past it a "
                        "stream waits, unread (at least 64MiB; default 256MiB)")
    s.add_argument("--unsent-budget", default=None, metavar="SIZE",
                   help="tcp:// service: bytes of replies a shard holds unsent, over all its streams; past it the "
                        "stream holding the most is closed (at least 64MiB; default 1GiB)")
    s.add_argument("--shards", type=int, default=None, help="shard processes (default: one per core)")
    s.add_argument("--parent-pid", type=int, default=None, help="stop when this process is gone")
    s.add_argument("--until-idle", type=float, default=None, metavar="SECONDS",
                   help="service mode: stop once the last job's last member has left, or when no job came for "
                        "this long; with --parent-pid, only after that process is gone (the embedded default's "
                        "lifetime)")
    s.add_argument("--lock-file", default=None, metavar="PATH",
                   help="hold an exclusive lock on PATH while serving, and remove it (and --keys) at exit")
    s.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="what the aggregator logs on standard error (default %(default)s)")


def _serves_others(host: str) -> bool:
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host != "localhost"


def _in_a_namespace_of_its_own() -> bool:
    """Whether this process runs in a named network namespace (`ip netns
    add`, as `aggnet emulate` makes them): its hosts are namespaces that
    only this machine reaches."""
    try:
        me = os.stat("/proc/self/ns/net").st_ino
        return any(os.stat(os.path.join("/run/netns", n)).st_ino == me for n in os.listdir("/run/netns"))
    except OSError:
        return False


def _warn_if_open(address, keyring, curve: bool) -> None:
    if address.scheme in ("tcp", "zmq+tcp", "udp", "ucx") and _serves_others(address.host) and not keyring.enforced \
            and not _in_a_namespace_of_its_own():
        log.warning("serving other hosts at %s WITHOUT job keys: anyone who reaches this port can join any job, "
                    "replace its workers and read its counters. Start with --keys FILE (aggnet job create) "
                    "to require signed JOINs%s", address,
                    "" if curve or address.scheme == "udp" else
                    ", and zmq+tcp:// with --curve-secret-file to encrypt" if address.scheme == "tcp" else
                    ", and --curve-secret-file to encrypt")


def main(args) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level), stream=sys.stderr,
                        format="%(asctime)s aggnet %(levelname)s %(message)s")
    from aggnet.protocol.address import parse
    from aggnet.protocol.keys import Keyring

    try:
        keyring = Keyring.load(args.keys) if args.keys else Keyring()
        if args.listen is None:
            from aggnet.protocol.limits import SWITCH_PORT

            args.listen = f"udp://127.0.0.1:{SWITCH_PORT}" if args.mode == "switch" else DEFAULT_SERVICE_LISTEN
        address = parse(args.listen)
    except ValueError as exc:
        print(f"aggnet serve: {exc}", file=sys.stderr)
        return 2
    if args.mode == "switch" and address.scheme != "udp":
        print(f"aggnet serve: switch mode listens on udp://host:port, not {args.listen}", file=sys.stderr)
        return 2
    if args.mode == "service" and address.scheme == "udp":
        print("aggnet serve: udp:// addresses speak the switch protocol: add --mode switch", file=sys.stderr)
        return 2
    lock = None
    if args.lock_file:
        lock = _take_lock(args.lock_file)
        if lock is None:
            print(f"aggnet serve: another aggregator holds {args.lock_file}", file=sys.stderr)
            return 1
    try:
        _warn_if_open(address, keyring, bool(args.curve_secret_file))
        return _serve(args, keyring)
    finally:
        if lock is not None:
            _remove_embedded_files(args)
            lock.close()


def _remove_embedded_files(args) -> None:
    """An embedded service (one with a lock file) leaves nothing behind:
    its lock, its keys file and the job files that name it."""
    if args.keys:
        from aggnet.client.embedded import remove_pointers

        remove_pointers(args.keys, os.getpid())
    for path in (args.lock_file, args.keys):
        try:
            os.unlink(path)
        except (OSError, TypeError):
            pass


def _take_lock(path: str):
    import fcntl

    f = open(path, "a")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    return f


class _BadSetting(Exception):
    """A flag the aggregator cannot start with (exit status 2)."""


def _service(args, keyring):
    from aggnet.hosts import service

    curve = None
    if args.curve_secret_file:
        from aggnet.transport.zmq import load_curve_secret

        try:
            curve = load_curve_secret(args.curve_secret_file)
        except ValueError as exc:
            raise _BadSetting(exc) from None
    if args.job_lease is not None and not args.job_lease > 0:
        raise _BadSetting(f"--job-lease must be a positive number of seconds, got {args.job_lease:g}")
    budgets = _stream_budgets(args)
    uplink = None
    if args.parent is not None:
        from aggnet.hosts.uplink import UplinkConfig

        try:
            uplink = UplinkConfig(args.parent, args.rack_id, args.racks)
        except ValueError as exc:
            raise _BadSetting(exc) from None
    return service.start(args.listen, args.shards, log_level=getattr(logging, args.log_level), keyring=keyring,
                         restart=args.restart, curve=curve, uplink=uplink, advertise=args.advertise,
                         until_idle=args.until_idle, parent_pid=args.parent_pid, listener_options=budgets,
                         **({"job_lease": args.job_lease} if args.job_lease is not None else {}))


def _stream_budgets(args) -> dict:
    """A tcp:// shard listener's budgets from --receive-budget and
    --unsent-budget (transport/tcp.py), refused in one line where they are
    no size, too small, or given to a service of another scheme."""
    from aggnet.client.config import format_size, parse_size
    from aggnet.protocol.address import AddressError, parse
    from aggnet.protocol.limits import MAX_MESSAGE_BYTES

    budgets = {}
    for flag, option, given in (("--receive-budget", "receive_budget", args.receive_budget),
                                ("--unsent-budget", "unsent_budget", args.unsent_budget)):
        if given is None:
            continue
        try:
            size = parse_size(given)
        except ValueError as exc:
            raise _BadSetting(f"{flag}: {exc}") from None
        if size < MAX_MESSAGE_BYTES:
            raise _BadSetting(f"{flag} must hold the largest message, {format_size(MAX_MESSAGE_BYTES)}; got {given}")
        budgets[option] = size
    try:
        scheme = parse(args.listen).scheme if budgets else "tcp"
    except AddressError:
        scheme = "tcp"  # the address is refused, saying why, where the service starts
    if scheme != "tcp":
        raise _BadSetting(f"--receive-budget and --unsent-budget bound a tcp:// service's streams; this one listens "
                          f"at {args.listen} ({scheme}), which has no such budgets")
    return budgets


def _switch(args, keyring):
    from aggnet.hosts.service import default_shards
    from aggnet.hosts.switch import SwitchService
    from aggnet.protocol.limits import DEFAULT_HOST_ELEMENTS

    if args.heartbeat_lapse is not None and not 0 <= args.heartbeat_lapse <= 60:
        raise _BadSetting(f"--heartbeat-lapse must be 0 (off) to 60 seconds, got {args.heartbeat_lapse:g}")
    svc = SwitchService(args.listen, pool=args.pool, elements=args.elements or DEFAULT_HOST_ELEMENTS,
                        max_elements=args.max_elements, parent=args.parent, rack_id=args.rack_id,
                        racks=args.racks, reclaim_idle=args.reclaim_idle, shards=args.shards or default_shards(),
                        io=args.io, keyring=keyring, advertise=args.advertise,
                        **({"heartbeat_lapse": args.heartbeat_lapse} if args.heartbeat_lapse is not None else {}))
    log.info("aggnet switch-mode aggregator at %s: %d shard(s) on ports %d..%d, pool %d slots, %d elements per "
             "packet by default (at most %d), UDP I/O %s%s", svc.address, svc.shards, svc.address.port,
             svc.address.port + svc.shards - 1, args.pool, svc.default_elements, svc.regs.max_elements, svc.io,
             f", rack {args.rack_id} of {args.racks} under {args.parent}" if args.parent else "")
    return svc


#: ``--mode`` -> the aggregator its flags make (hosts/aggregator.py)
_MODES = {"service": _service, "switch": _switch}


def _serve(args, keyring) -> int:
    from aggnet.hosts.supervisor import alive

    try:
        aggregator = _MODES[args.mode](args, keyring)
    except _BadSetting as exc:
        print(f"aggnet serve: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        print(f"aggnet serve: {exc}", file=sys.stderr)
        return 1
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    # one that stops when idle serves jobs, which may outlive the parent
    parent_pid = args.parent_pid if aggregator.until_idle is None else None

    def should_stop() -> bool:
        if parent_pid is not None and not alive(parent_pid):
            log.info("parent process %d is gone; stopping", parent_pid)
            return True
        return stop.is_set()

    def started() -> None:
        # once every shard serves: the metrics thread must not be copied
        # into shards made by fork
        if args.metrics_port is not None:
            from aggnet import metrics

            metrics.serve_metrics_for(args, aggregator.stats)
        # one line on stdout says where it serves: launchers wait for it
        print(f"aggnet serving {aggregator.address} shards={aggregator.shard_count} pid={os.getpid()}", flush=True)

    try:
        aggregator.serve(should_stop, started=started)
    finally:
        aggregator.close()
    log.info("%s stopped", aggregator.title)
    logging.shutdown()
    sys.stdout.flush()
    if args.lock_file:
        _remove_embedded_files(args)
    # nothing is left to do: skip interpreter teardown, where transport
    # libraries' finalizers (UCX's) can block
    os._exit(0)
