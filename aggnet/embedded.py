"""The embedded default: an aggregator on this machine that nobody starts
by hand.

When no address is configured, rank 0 of a job starts ``aggnet serve`` as a
child process on a per-job Unix socket and stops it when it exits; the
other ranks of the job find it at the same path. The child also watches its
parent, so it never outlives the worker that started it, even after a crash.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import tempfile

from .config import ClientConfig
from .errors import AggregatorUnreachable
from .hosts.process import ServiceProcess

log = logging.getLogger("aggnet.embedded")


def runtime_dir() -> str:
    path = os.path.join(tempfile.gettempdir(), f"aggnet-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def embedded_address(job: str) -> str:
    tag = hashlib.sha1(job.encode()).hexdigest()[:12]
    # workers on this host: payloads through shared memory, control over a Unix socket
    return f"shm://{runtime_dir()}/job-{tag}.sock"


class EmbeddedService:
    """A local ``aggnet serve`` child process, one per job name per machine
    (a lock file next to the socket keeps a second one from stealing it)."""

    def __init__(self, address: str, shards: int | None, start_timeout: float):
        self.address = address
        self._lock_file = open(address.split("://", 1)[1] + ".lock", "w")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise AggregatorUnreachable(
                f"another process already runs the embedded aggregator at {address} for this job name; "
                f"give this job another name, or set AGGNET_ADDRESS to share a running service"
            ) from None
        try:
            self.service = ServiceProcess(address, shards, parent_pid=os.getpid(), start_timeout=start_timeout)
        except BaseException:
            self._lock_file.close()
            raise
        log.info("embedded aggregator serving %s (pid %d)", address, self.service.pid)

    def stop(self) -> None:
        self.service.stop()
        if not self._lock_file.closed:
            self._lock_file.close()


def local_aggregator(job: str, rank: int, config: ClientConfig):
    """(service handle or None, address) of the job's embedded aggregator:
    rank 0 starts it, the other ranks only learn where it is."""
    address = embedded_address(job)
    if rank != 0:
        return None, address
    return EmbeddedService(address, config.embedded_shards, config.connect_timeout), address
