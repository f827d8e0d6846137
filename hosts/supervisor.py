"""Shard processes of an aggregator: started, watched, restarted, stopped.

Both aggregator kinds run their shards as child processes with the same
lifetime rules, which live here only:

* a shard reports ready (or why it cannot start) over a pipe, and its
  aggregator serves nobody before every shard has;
* a shard ignores SIGINT (Ctrl-C reaches the whole process group, and the
  aggregator decides how its shards stop), stops at SIGTERM, and dies with
  its parent whatever way the parent dies;
* a stop sends SIGTERM, waits until a deadline, then sends SIGKILL;
* a restart is refused once a shard died too often within a window, so a
  shard that cannot run does not restart forever.

The first shards are forked: a switch-mode shard inherits its bound socket
and the shared registers, a service shard starts without importing
anything again. A restart happens later, in a process that has threads
and transport contexts by then, which a forked child would copy half-way;
so a restart may use another start method ("spawn", the service's).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from aggnet.pids import alive
from aggnet.processes import die_with_parent

log = logging.getLogger("aggnet.hosts.supervisor")

#: seconds a shard process may take to report ready (imports, kernel warm-up)
START_TIMEOUT = 60.0
#: seconds shards get to stop after SIGTERM before they are killed
STOP_TIMEOUT = 5.0
#: a shard restarted more often than this within the window is not restarted again
MAX_RESTARTS = 5
RESTART_WINDOW = 60.0


class ShardStartError(RuntimeError):
    """A shard did not come up; the message names it and says why."""


class RestartLimit(RuntimeError):
    """A shard died more often than the restart limits allow."""


class ShardReport:
    """A shard's end of its start-up pipe: the shard says once that it
    serves (with a detail such as the address it bound) or why it cannot."""

    def __init__(self, conn):
        self._conn = conn

    def ready(self, detail: str = "") -> None:
        self._say("ready", detail)

    def failed(self, message: str) -> None:
        self._say("error", message)

    def _say(self, kind: str, text: str) -> None:
        if self._conn is None:
            return  # said already: the pipe is closed
        try:
            self._conn.send((kind, text))
        finally:
            self._conn.close()
            self._conn = None


def _shard_process(target, index: int, report: ShardReport, args: tuple, label: str) -> None:
    """A shard process from its first instruction to its exit status."""
    die_with_parent()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides
    code = 1
    try:
        target(index, report, stop.is_set, *args)
        code = 0
    except BaseException:
        log.exception("%s %d failed", label, index)
    finally:
        logging.shutdown()
        # skip interpreter teardown: transport libraries' finalizers (UCX's)
        # can block an exit that has nothing left to do; the status tells
        # the supervisor whether the shard stopped or failed
        os._exit(code)


@dataclass
class ShardProcess:
    """One shard's current process and its history."""

    index: int
    process: multiprocessing.process.BaseProcess | None = None
    #: what the shard said when it last reported ready
    detail: str = ""
    #: when it was restarted within the last window (the limit's count)
    recent_restarts: list = field(default_factory=list)
    #: restarts since the supervisor started it
    restarts: int = 0
    #: while a successor starts: its start-up pipe and the deadline to report ready
    starting: tuple | None = None

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def exitcode(self) -> int | None:
        """The exit status once the process ended (negative: the signal that ended it)."""
        return None if self.process is None else self.process.exitcode

    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()


class ShardSupervisor:
    """Runs ``count`` shard processes of ``target``.

    Shards are numbered from ``first`` (the switch's shard 0 is the
    aggregator's own process). In each process
    ``target(index, report, should_stop, *args(index))`` runs:
    it calls ``report.ready(detail)`` once it serves (or
    ``report.failed(message)``), then serves until ``should_stop()`` and
    returns; an exception ends the process with status 1. ``args(index)``
    is asked at every start, so a restarted shard starts with what its
    owner knows of it now (the port it bound the first time, say); with
    ``restart_method`` "spawn", target and arguments must pickle.
    """

    def __init__(self, target: Callable, count: int, args: Callable[[int], Sequence] = lambda i: (), *,
                 first: int = 0, label: str = "shard", start_method: str = "fork", restart_method: str = "spawn",
                 start_timeout: float = START_TIMEOUT, stop_timeout: float = STOP_TIMEOUT,
                 max_restarts: int = MAX_RESTARTS, restart_window: float = RESTART_WINDOW):
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        if not start_timeout > 0 or not stop_timeout > 0:
            raise ValueError(f"timeouts must be positive seconds, got start {start_timeout!r}, stop {stop_timeout!r}")
        self.target = target
        self.args = args
        self.label = label
        self.start_method = start_method
        self.restart_method = restart_method
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.max_restarts = max_restarts
        self.restart_window = restart_window
        self.shards = [ShardProcess(first + i) for i in range(count)]

    def __len__(self) -> int:
        return len(self.shards)

    def __iter__(self):
        return iter(self.shards)

    def __getitem__(self, position: int) -> ShardProcess:
        return self.shards[position]

    @property
    def restarts(self) -> int:
        return sum(s.restarts for s in self.shards)

    # -- start ---------------------------------------------------------------------

    def start(self) -> list[str]:
        """Start every shard and wait until each is ready; returns what each
        reported. If one cannot start, all are killed and ShardStartError
        names it."""
        ctx = multiprocessing.get_context(self.start_method)
        pipes = []
        try:
            # every shard starts before any is waited on: their start-up overlaps
            for shard in self.shards:
                pipes.append(self._launch(shard, ctx))
            for shard, pipe in zip(self.shards, pipes):
                shard.detail = self._await_ready(shard, pipe)
        except BaseException:
            self._kill_all()
            raise
        finally:
            for pipe in pipes:
                pipe.close()
        return [s.detail for s in self.shards]

    def _launch(self, shard: ShardProcess, ctx):
        ours, theirs = ctx.Pipe(duplex=False)
        shard.process = ctx.Process(
            target=_shard_process, args=(self.target, shard.index, ShardReport(theirs),
                                         tuple(self.args(shard.index)), self.label),
            name=f"aggnet-{self.label.replace(' ', '-')}-{shard.index}", daemon=True)
        try:
            shard.process.start()
        finally:
            theirs.close()
        return ours

    def _await_ready(self, shard: ShardProcess, pipe, timeout: float | None = None) -> str:
        i = shard.index
        try:
            if not pipe.poll(self.start_timeout if timeout is None else timeout):
                raise ShardStartError(f"{self.label} {i} did not start within {self.start_timeout:g}s")
            kind, value = pipe.recv()
        except EOFError:
            shard.process.join(1.0)
            status = shard.process.exitcode
            said = "" if status is None else f" with status {status}"
            raise ShardStartError(f"{self.label} {i} exited{said} while starting (see its log above)") from None
        if kind != "ready":
            raise ShardStartError(value)
        return value

    def _kill_all(self) -> None:
        for s in self.shards:
            if s.alive():
                s.process.kill()
        for s in self.shards:
            if s.process is not None:
                s.process.join(1.0)

    # -- watch and restart -----------------------------------------------------------

    def exited(self) -> list[ShardProcess]:
        """Shards whose process has ended (status in ``exitcode``)."""
        return [s for s in self.shards if s.process is not None and s.starting is None and not s.process.is_alive()]

    def restart(self, shard: ShardProcess) -> str:
        """Start a new process for ``shard`` (whose process ended) and wait
        until it is ready; returns what it reported. RestartLimit when it
        died too often within the window, ShardStartError when the new
        process does not come up."""
        self.begin_restart(shard)
        return self.finish_restart(shard, wait=self.start_timeout)

    def begin_restart(self, shard: ShardProcess) -> None:
        """Start a new process for ``shard`` without waiting for it: an
        aggregator goes on answering (STATS shows the shard as null) while
        the successor imports and binds; ``finish_restart`` collects it."""
        now = time.monotonic()
        shard.recent_restarts = [t for t in shard.recent_restarts if now - t < self.restart_window] + [now]
        if len(shard.recent_restarts) > self.max_restarts:
            raise RestartLimit(f"{self.label} {shard.index} died {len(shard.recent_restarts)} times within "
                               f"{self.restart_window:g}s")
        log.warning("%s %d (pid %s) died with status %s; restarting it%s", self.label, shard.index, shard.pid,
                    shard.exitcode, f" at {shard.detail}" if shard.detail else "")
        if shard.process is not None:
            shard.process.join(0)  # reaped already by exited(); drops the handle's resources
        shard.restarts += 1
        shard.starting = (self._launch(shard, multiprocessing.get_context(self.restart_method)),
                          now + self.start_timeout)

    def finish_restart(self, shard: ShardProcess, wait: float = 0.0) -> str | None:
        """What a restarting shard reported once it is ready; None while it
        is still starting (up to ``wait`` seconds are waited);
        ShardStartError when it failed or took past the start timeout."""
        pipe, deadline = shard.starting
        if not pipe.poll(max(0.0, min(wait, deadline - time.monotonic()))):
            if time.monotonic() < deadline:
                return None
        shard.starting = None
        try:
            shard.detail = self._await_ready(shard, pipe, timeout=0.0)
        except BaseException:
            if shard.alive():
                shard.process.kill()
                shard.process.join(1.0)
            raise
        finally:
            pipe.close()
        return shard.detail

    def restarting(self) -> list[ShardProcess]:
        """Shards whose successor was started and has not reported yet."""
        return [s for s in self.shards if s.starting is not None]

    # -- stop ----------------------------------------------------------------------

    def stop(self) -> None:
        """SIGTERM to every shard, SIGKILL to those still running at the
        deadline; returns once all have ended (or were killed)."""
        for s in self.shards:
            if s.starting is not None:
                s.starting[0].close()
                s.starting = None
            if s.alive():
                s.process.terminate()
        deadline = time.monotonic() + self.stop_timeout
        for s in self.shards:
            if s.process is None:
                continue
            s.process.join(max(0.0, deadline - time.monotonic()))
            if s.process.is_alive():
                log.warning("%s process %d did not stop in time; killing it", self.label, s.process.pid)
                s.process.kill()
                s.process.join(1.0)


__all__ = ["ShardSupervisor", "ShardProcess", "ShardReport", "ShardStartError", "RestartLimit", "alive",
           "START_TIMEOUT", "STOP_TIMEOUT", "MAX_RESTARTS", "RESTART_WINDOW"]
