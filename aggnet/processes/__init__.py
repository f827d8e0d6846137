"""Process lifetimes: children that must not outlive their parent, and
``aggnet serve`` as a child (ServiceProcess) for the embedded default, the
benchmarks and the tests: the service prints one line on stdout once every
shard is ready (``aggnet serving ADDRESS shards=K pid=P``), which
ServiceProcess reads with a deadline."""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.context
import os
import random
import select
import signal
import socket
import subprocess
import sys
import time

from aggnet.errors import AggregatorUnreachable

log = logging.getLogger("aggnet")


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies,
    whatever way it dies (PR_SET_PDEATHSIG): a shard or a benchmark helper
    must never outlive the process that started it."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, int(sig), 0, 0, 0)
    except Exception as exc:  # not Linux: the parent's own shutdown covers it
        log.debug("no parent-death signal: %s", exc)


#: what a worker that all-reduces numpy arrays imports anyway; a fork
#: server imports it once (and sets numba's code generator up)
NUMPY_WORKER_PRELOAD = ("numpy", "aggnet", "aggnet.kernels.warm")
#: the same for a worker that uses torch.distributed
TORCH_WORKER_PRELOAD = ("numpy", "torch", "torch.distributed", "torch.nn.parallel", "aggnet", "aggnet.torch",
                        "aggnet.kernels.warm")
#: and for one that trains with DDP, whose constructor imports
#: torch._dynamo (about 2 CPU-seconds a worker; it also makes torch's
#: compile cache folder in the temporary directory). Such a worker ends its
#: process group after its models are gone (aggnet.torch.teardown says why)
DDP_WORKER_PRELOAD = (*TORCH_WORKER_PRELOAD, "torch._dynamo")


def interrupted(exc: BaseException) -> bool:
    """Whether ``exc`` is Ctrl-C as a worker meets it: a KeyboardInterrupt,
    or one that landed in a comm hook's callback, which torch hands to
    ``backward()`` as a RuntimeError naming it ("Got the following error
    when running the callback: KeyboardInterrupt")."""
    seen, chain = exc, set()
    while seen is not None and id(seen) not in chain:
        if isinstance(seen, KeyboardInterrupt) or (
                isinstance(seen, RuntimeError) and "running the callback: KeyboardInterrupt" in str(seen)):
            return True
        chain.add(id(seen))
        seen = seen.__cause__ or seen.__context__
    return False


class _WorkerProcess(multiprocessing.context.ForkServerProcess):
    """A worker from the fork server that Ctrl-C stops quietly: a
    terminal's SIGINT reaches every process of the foreground group, the
    command itself says "interrupted" once, and a traceback from each
    worker would bury that line. Any other error is reported as before."""

    def run(self) -> None:
        try:
            super().run()
        except SystemExit:
            raise  # an exit the worker chose (after a Ctrl-C too) keeps its status
        except BaseException as exc:
            if interrupted(exc):
                for stream in (sys.stdout, sys.stderr):
                    try:
                        stream.flush()  # what it printed before still reaches its reader
                    except (OSError, ValueError, AttributeError):
                        pass
                os._exit(130)
            raise


class _ForkServerContext(multiprocessing.context.ForkServerContext):
    Process = _WorkerProcess


_FORK_SERVER_CONTEXT = _ForkServerContext()


def fork_server(preload=TORCH_WORKER_PRELOAD):
    """A multiprocessing context for workers that must start with a fresh
    process's state (none of the caller's threads, sockets, torch, CUDA or
    UCX state), as "spawn" gives, but forked from a server that imported
    ``preload`` once: spawned, every worker imported torch again (about 3
    CPU-seconds) and set numba's code generator up (about 0.7).

    A process has one fork server. It starts with the first worker and
    imports what every call so far asked for; it keeps that, and that
    moment's environment and directory: a process that will need more asks
    for it before its first worker, and sets what workers read from the
    environment before too."""
    global _SERVER_OWNER
    _PRELOAD.extend(m for m in preload if m not in _PRELOAD)
    _SERVER_OWNER = os.getpid()
    ctx = _FORK_SERVER_CONTEXT
    ctx.set_forkserver_preload(list(_PRELOAD))
    return ctx


#: every module a call of :func:`fork_server` asked for in this process
_PRELOAD: list[str] = []
#: the process that asked for it (a child made by fork inherits the list)
_SERVER_OWNER: int | None = None


def keeps_fork_server() -> bool:
    """Whether this process asked for a fork server (it runs, or starts with
    the next worker) and may start children from it: not a child made by
    fork, which shares its parent's, nor a daemonic process, which may
    start none."""
    return _SERVER_OWNER == os.getpid() and not multiprocessing.current_process().daemon


#: glibc's mallopt parameters
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def keep_large_buffers(mmap_below: int = 64 << 20, trim_above: int = 256 << 20) -> None:
    """Let glibc reuse a shard's large buffers instead of mapping each one
    afresh: a sparse round allocates tens of MB for its rows and frees them
    again, and a fresh mapping costs a page fault per 4 KiB, which at
    α = 5% of a large table took more time than the arithmetic. Blocks
    under ``mmap_below`` come from the heap; up to ``trim_above`` freed
    bytes stay with the process for the next round. Elsewhere than glibc,
    nothing changes."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        if not hasattr(libc, "mallopt"):
            return
        libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_below))
        libc.mallopt(_M_TRIM_THRESHOLD, int(trim_above))
    except Exception as exc:  # not glibc
        log.debug("malloc left as it is: %s", exc)


#: where the kernel draws ports for outgoing connections and bind(0)
_EPHEMERAL = "/proc/sys/net/ipv4/ip_local_port_range"
#: the lowest port :func:`free_ports` draws from
_LOWEST_PORT = 10000
#: its own source of randomness: a test that seeds ``random`` (hypothesis
#: does, per example) must not make two pytest workers draw the same ports
_RNG = random.SystemRandom()


def _ephemeral_start() -> int:
    try:
        with open(_EPHEMERAL) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int = 1, kind: int = socket.SOCK_STREAM) -> list[int]:
    """``n`` distinct ports on 127.0.0.1 nobody holds now, for a child to
    bind seconds later (a torch.distributed rendezvous, a service's
    port). Drawn at random below the kernel's ephemeral range: a port
    from bind(0) lies inside it, where any outgoing connection made
    meanwhile (a spawned worker takes seconds to start) may take it as its
    own, and the child then fails with EADDRINUSE."""
    top = _ephemeral_start()
    pool = range(_LOWEST_PORT, top) if top - _LOWEST_PORT >= 1000 else None
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            for _attempt in range(64 if pool else 0):
                s = socket.socket(socket.AF_INET, kind)
                try:
                    s.bind(("127.0.0.1", _RNG.choice(pool)))
                except OSError:
                    s.close()
                    continue
                socks.append(s)
                break
            else:
                s = socket.socket(socket.AF_INET, kind)
                s.bind(("127.0.0.1", 0))
                socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    """One port as :func:`free_ports` draws them."""
    return free_ports(1)[0]


#: what an aggregator started from here runs with, unless this process's
#: environment says otherwise: it multiplies no matrices, and numpy's
#: OpenBLAS threads spin for about 0.2 CPU-seconds at every start (a
#: two-shard service's start and stop: 0.88-0.90 CPU-s with one thread,
#: 1.04-1.13 with the default, on 2 cores)
AGGREGATOR_ENV = {"OPENBLAS_NUM_THREADS": "1"}


def aggregator_env() -> dict:
    """This process's environment with AGGREGATOR_ENV under it."""
    return {**AGGREGATOR_ENV, **os.environ}


def _service_popen(cmd: list[str], kw: dict) -> subprocess.Popen:
    """``aggnet serve`` forked from this process's fork server where it
    keeps one (it started workers from it, or will), else a fresh
    interpreter: a forked one starts with numpy, numba's kernels and aggnet
    imported (a start with two shards costs about 0.4 CPU-seconds instead
    of 1.1 here), while a process with no fork server would have to start
    one (torch's imports) first."""
    from aggnet.processes.forked import ForkedPopen, forkable

    if keeps_fork_server() and forkable(cmd, kw):
        return ForkedPopen(cmd, preload=(), **kw)
    return subprocess.Popen(cmd, **kw)


class ServiceProcess:
    def __init__(self, listen: str, shards: int | None = None, *, parent_pid: int | None = None,
                 start_timeout: float = 60.0, log_level: str = "WARNING", env: dict | None = None,
                 args: list[str] = (), launch=None):
        """``args`` go to ``aggnet serve`` (e.g. ``--mode switch``);
        ``launch(cmd, **popen_keywords)`` starts it elsewhere than here (in
        a network namespace: aggnet.emulation.nsprocess.popen_in)."""
        cmd = [sys.executable, "-m", "aggnet", "serve", "--listen", listen, "--log-level", log_level, *args]
        if shards:
            cmd += ["--shards", str(shards)]
        if parent_pid is not None:
            cmd += ["--parent-pid", str(parent_pid)]
        self.command = cmd
        # its own process group: a stop that has to kill takes the shards too
        kw = dict(stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env={**aggregator_env(), **(env or {})},
                  start_new_session=True)
        self.process = launch(cmd, **kw) if launch is not None else _service_popen(cmd, kw)
        atexit.register(self.stop)
        deadline = time.monotonic() + start_timeout
        # "aggnet serving ADDRESS shards=K pid=P"; libraries (UCX) may print
        # lines of their own first
        while True:
            line = self._read_line(max(0.0, deadline - time.monotonic()))
            parts = line.split()
            if len(parts) >= 4 and parts[:2] == ["aggnet", "serving"]:
                break
        self.address = parts[2]
        self.shards = int(parts[3].split("=", 1)[1])
        self.pid = self.process.pid

    def _read_line(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        if timeout <= 0:
            self.stop()
            raise AggregatorUnreachable(f"`{' '.join(self.command)}` did not say where it serves in time")
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.process.stdout], [], [], max(0.0, left))
            if not ready:
                self.stop()
                raise AggregatorUnreachable(f"`{' '.join(self.command)}` did not start within {timeout:g}s")
            byte = os.read(self.process.stdout.fileno(), 1)
            if not byte:
                code = self.process.wait()
                self.stop()
                raise AggregatorUnreachable(
                    f"`{' '.join(self.command)}` exited with status {code} while starting; its log is above")
            line += byte
        return line.decode().strip()

    def detach(self) -> None:
        """Let the service run on by itself (it stops on its own terms);
        this process no longer stops it at exit."""
        atexit.unregister(self.stop)
        if self.process.stdout and not self.process.stdout.closed:
            self.process.stdout.close()

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit status."""
        proc = self.process
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        if proc.stdout and not proc.stdout.closed:
            proc.stdout.close()
        atexit.unregister(self.stop)
        return proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
