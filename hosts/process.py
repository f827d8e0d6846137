"""Run ``aggnet serve`` as a child process and wait until it serves.

Used by the embedded default, the benchmarks and the tests: the service
prints one line on stdout once every shard is ready (``aggnet serving
ADDRESS shards=K pid=P``); this reads that line, with a deadline.
"""

from __future__ import annotations

import atexit
import os
import select
import signal
import subprocess
import sys
import time

from aggnet.errors import AggregatorUnreachable


class ServiceProcess:
    def __init__(self, listen: str, shards: int | None = None, *, parent_pid: int | None = None,
                 start_timeout: float = 60.0, log_level: str = "WARNING", env: dict | None = None,
                 args: list[str] = (), prefix: list[str] = ()):
        """``args`` go to ``aggnet serve`` (e.g. ``--mode switch``); ``prefix``
        runs it under another command (``ip netns exec NAME``)."""
        cmd = [*prefix, sys.executable, "-m", "aggnet", "serve", "--listen", listen, "--log-level", log_level, *args]
        if shards:
            cmd += ["--shards", str(shards)]
        if parent_pid is not None:
            cmd += ["--parent-pid", str(parent_pid)]
        self.command = cmd
        # its own process group: a stop that has to kill takes the shards too
        self.process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                        env=None if env is None else {**os.environ, **env}, start_new_session=True)
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
