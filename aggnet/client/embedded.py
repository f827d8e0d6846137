"""The embedded default: an aggregator on this machine that nobody starts
by hand.

When no address is configured, rank 0 of a job starts ``aggnet serve`` as a
child process on a per-job Unix socket in a directory only this user can
enter; the other ranks of the job find it at the same path. Rank 0 also
makes the job's key and leaves it beside the socket (mode 0600), the way it
leaves the address, so every JOIN is signed without any set-up.

The service serves the job, not rank 0: it lives until the job's last
member has left (rank 0 may finish first), and removes its socket, lock
and key files as it stops. If every worker dies without leaving, it stops
once rank 0 is gone and the job has been silent for a while.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import tempfile
import time

from aggnet.protocol import keys
from aggnet.client.config import ClientConfig
from aggnet.errors import AggregatorUnreachable
from aggnet.processes import ServiceProcess

log = logging.getLogger("aggnet.embedded")

#: seconds the embedded service waits for a first job, and for a silent
#: job after rank 0 is gone
IDLE_SECONDS = 120.0


def runtime_dir() -> str:
    path = os.path.join(tempfile.gettempdir(), f"aggnet-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise AggregatorUnreachable(f"{path} must belong to this user with mode 0700 (it holds job keys); "
                                    f"remove it or chmod 700 {path}")
    return path


def _base(job: str) -> str:
    tag = hashlib.sha1(job.encode()).hexdigest()[:12]
    return os.path.join(runtime_dir(), f"job-{tag}")


def embedded_address(job: str) -> str:
    # workers on this host: payloads through shared memory, control over a Unix socket
    return f"shm://{_base(job)}.sock"


def key_path(job: str) -> str:
    return _base(job) + ".keys"


def read_job_key(job: str, timeout: float) -> bytes:
    """The key rank 0 left for the job (waiting for it to appear)."""
    path = key_path(job)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(path) as f:
                return keys.parse_key(json.load(f)["jobs"][job], f"key of job {job!r} in {path}")
        except (OSError, ValueError, KeyError):
            if time.monotonic() >= deadline:
                raise AggregatorUnreachable(
                    f"no embedded aggregator for job {job!r} on this machine within {timeout:g}s (rank 0 starts "
                    f"it and leaves the job's key at {path}): is rank 0 running with the same job name? For "
                    f"several machines start `aggnet serve` and set AGGNET_ADDRESS") from None
            time.sleep(0.05)


class EmbeddedService:
    """A local ``aggnet serve`` child process, one per job name per machine
    (it holds a lock file next to the socket while it serves)."""

    def __init__(self, job: str, address: str, shards: int | None, start_timeout: float):
        self.address = address
        lock_path = address.split("://", 1)[1] + ".lock"
        if _locked(lock_path):
            raise AggregatorUnreachable(
                f"another process already runs the embedded aggregator at {address} for this job name; "
                f"give this job another name, or set AGGNET_ADDRESS to share a running service")
        self.key = keys.new_key()
        keys.write_job_key(key_path(job), job, self.key)
        try:
            self.service = ServiceProcess(address, shards, parent_pid=os.getpid(), start_timeout=start_timeout,
                                          args=["--keys", key_path(job), "--lock-file", lock_path,
                                                "--until-idle", str(IDLE_SECONDS)])
        except BaseException:
            for path in (key_path(job), lock_path):
                try:
                    os.unlink(path)
                except OSError:
                    pass
            raise
        log.info("embedded aggregator serving %s (pid %d)", address, self.service.pid)

    def stop(self) -> None:
        """Rank 0 is done: the service goes on for the other ranks and stops
        after the last one leaves."""
        self.service.detach()


def _locked(path: str) -> bool:
    try:
        with open(path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


def local_aggregator(job: str, rank: int, config: ClientConfig):
    """(service handle or None, address) of the job's embedded aggregator:
    rank 0 starts it, the other ranks only learn where it is."""
    address = embedded_address(job)
    if rank != 0:
        return None, address
    return EmbeddedService(job, address, config.embedded_shards, config.connect_timeout), address
