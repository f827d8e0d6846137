"""The embedded default: an aggregator on this machine that nobody starts
by hand.

When no address is configured, rank 0 of a job makes sure its process runs
an embedded aggregator (``aggnet serve`` as a child process, on a Unix
socket in a directory only this user can enter) and registers the job
with it: the job's key goes into the service's keys file, which the
service reads again when a JOIN names a job it does not know, and a small
file named after the job says where the service is and holds the key
(mode 0600), so the other ranks find it and every JOIN is signed without
any set-up.

One service per process, not per job: every process group of a training
run (torch builds several) and every Client this process is rank 0 of
share it, and only the first pays for starting it. It lives as long as the
process that started it, and after that until the last member of its last
job has left (rank 0 may finish first); it removes its socket, lock and
keys files as it stops. If every worker dies without leaving, it stops
once that process is gone and its jobs have been silent for a while.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
import time

from aggnet import pids
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


def key_path(job: str) -> str:
    """Where rank 0 leaves the job's key and its service's address."""
    return _base(job) + ".keys"


def _read_pointer(job: str) -> dict | None:
    """The job's file, if a live service's: {"jobs": {job: key}, "address",
    "pid" (the service), "owner" (rank 0's process)}; None if absent, half
    written or left by a service that is gone."""
    try:
        with open(key_path(job)) as f:
            data = json.load(f)
        data["jobs"][job], data["address"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return data if pids.alive(data.get("pid")) else None


def read_job_key(job: str, timeout: float) -> tuple[bytes, str]:
    """The key rank 0 left for the job and its service's address (waiting
    for them to appear)."""
    path = key_path(job)
    deadline = time.monotonic() + timeout
    while True:
        data = _read_pointer(job)
        if data is not None:
            return keys.parse_key(data["jobs"][job], f"key of job {job!r} in {path}"), data["address"]
        if time.monotonic() >= deadline:
            raise AggregatorUnreachable(
                f"no embedded aggregator for job {job!r} on this machine within {timeout:g}s (rank 0 starts "
                f"it and leaves the job's key at {path}): is rank 0 running with the same job name? For "
                f"several machines start `aggnet serve` and set AGGNET_ADDRESS")
        time.sleep(0.05)


class EmbeddedService:
    """This process's ``aggnet serve`` child, shared by every job it is
    rank 0 of (it holds a lock file next to its socket while it serves)."""

    def __init__(self, shards: int | None, start_timeout: float):
        base = os.path.join(runtime_dir(), f"proc-{os.getpid()}-{os.urandom(3).hex()}")
        self.address = f"shm://{base}.sock"
        self.keys_path = base + ".keys"
        lock_path = base + ".sock.lock"
        self.jobs: set[str] = set()
        self._write_keys({"jobs": {}, "pointers": []})
        try:
            self.service = ServiceProcess(self.address, shards, parent_pid=os.getpid(), start_timeout=start_timeout,
                                          args=["--keys", self.keys_path, "--lock-file", lock_path,
                                                "--until-idle", str(IDLE_SECONDS)])
        except BaseException:
            for path in (self.keys_path, lock_path):
                try:
                    os.unlink(path)
                except OSError:
                    pass
            raise
        # when this process ends, the service goes on for the jobs' other
        # ranks and stops after they leave
        self.service.detach()
        log.info("embedded aggregator serving %s (pid %d)", self.address, self.service.pid)

    def alive(self) -> bool:
        return self.service.alive()

    def register(self, job: str) -> bytes:
        """Give ``job`` a key the service knows, and leave the key and the
        service's address where the job's other ranks look."""
        theirs = _read_pointer(job)
        if theirs is not None and theirs.get("owner") != os.getpid() and pids.alive(theirs.get("owner")):
            raise AggregatorUnreachable(
                f"another process (pid {theirs['owner']}) already runs the embedded aggregator of job {job!r}; "
                f"give this job another name, or set AGGNET_ADDRESS to share a running service")
        if job in self.jobs and theirs is not None:
            raise AggregatorUnreachable(
                f"a client of this process is already rank 0 of job {job!r} on the embedded aggregator; "
                f"close it first or give this job another name")
        path = key_path(job)
        with open(self.keys_path) as f:
            known = json.load(f)
        # a job this service served before keeps its key: the shards hold
        # it, and they read the file again only for jobs they do not know
        key = known["jobs"].get(job) or keys.new_key()
        known["jobs"][job] = key
        # the service removes these files as it stops: late ranks find them
        # until then, even after this process ended
        known["pointers"] = sorted(set(known.get("pointers", [])) | {path})
        self._write_keys(known)
        _write_private(path, {"jobs": {job: key}, "address": self.address, "pid": self.service.pid,
                              "owner": os.getpid()})
        self.jobs.add(job)
        return keys.parse_key(key)

    def _write_keys(self, data: dict) -> None:
        _write_private(self.keys_path, data)

    def release(self, job: str) -> None:
        """Rank 0's client of ``job`` closed; the service goes on (for the
        job's other ranks, and for this process's later jobs)."""
        self.jobs.discard(job)


def _write_private(path: str, data: dict) -> None:
    """Replace ``path`` with ``data`` at once, readable by this user only."""
    fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def remove_pointers(keys_file: str, service_pid: int) -> None:
    """At an embedded service's stop: the job files naming it."""
    try:
        with open(keys_file) as f:
            pointers = json.load(f).get("pointers", [])
    except (OSError, ValueError, AttributeError):
        return
    for path in pointers:
        try:
            with open(path) as f:
                if json.load(f).get("pid") != service_pid:
                    continue  # the job runs on another service now
            os.unlink(path)
        except (OSError, ValueError, AttributeError):
            pass


#: this process's embedded service (None until a job needs one)
_shared: EmbeddedService | None = None
_shared_lock = threading.Lock()


def local_aggregator(job: str, rank: int, config: ClientConfig) -> tuple[EmbeddedService | None, str, bytes]:
    """(this process's service or None, address, key) of the job's embedded
    aggregator: rank 0 registers the job with its process's service,
    starting it first if there is none; the other ranks read where it is."""
    global _shared
    if rank != 0:
        key, address = read_job_key(job, config.connect_timeout)
        return None, address, key
    with _shared_lock:
        if _shared is None or not _shared.alive():
            _shared = EmbeddedService(config.embedded_shards, config.connect_timeout)
        key = _shared.register(job)
        return _shared, _shared.address, key
