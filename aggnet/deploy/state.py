"""What ``aggnet up`` started, kept so that ``up`` again and ``down`` act
on exactly those processes and switch jobs and nothing else.

One JSON file per topology file (named after its job and a hash of its
absolute path, so two copies of one example do not share it) in a
directory only its user can read, beside a lock file that keeps two
``up``/``down`` of one topology from interleaving. A process counts as
ours only while its command line is still the one recorded: a pid the
kernel has since given to another program is never signalled.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import signal
import stat
import tempfile
import time

VERSION = 1


class StateError(RuntimeError):
    """The state directory or file cannot be used; the message says why
    and what to do."""


def default_dir() -> str:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "aggnet")
    # the embedded aggregator's directory too (aggnet.client.embedded.runtime_dir)
    return os.path.join(tempfile.gettempdir(), f"aggnet-{os.getuid()}")


def ensure_dir(path: str) -> str:
    """``path``, created 0700 if absent; one another user owns, or can
    write to, is refused (others could plant pids for ``down`` to kill)."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.stat(path)
    except OSError as exc:
        raise StateError(f"cannot create the state directory {path}: {exc.strerror}; give another with "
                         f"--state-dir DIR") from None
    if not stat.S_ISDIR(st.st_mode):
        raise StateError(f"{path} is not a directory; give a state directory with --state-dir DIR")
    if st.st_uid != os.getuid():
        raise StateError(f"the state directory {path} belongs to uid {st.st_uid}, not to you; give your own with "
                         f"--state-dir DIR")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "x"


def path_hash(topology_path: str) -> str:
    return hashlib.sha256(os.path.abspath(topology_path).encode()).hexdigest()[:12]


def state_path(state_dir: str, job: str, topology_path: str) -> str:
    return os.path.join(state_dir, f"{_slug(job)}-{path_hash(topology_path)}.json")


def find_state(state_dir: str, topology_path: str) -> str | None:
    """The state file of ``topology_path`` whatever its job is now (the
    file may have been edited or removed since ``up``)."""
    suffix = f"-{path_hash(topology_path)}.json"
    try:
        names = sorted(n for n in os.listdir(state_dir) if n.endswith(suffix))
    except OSError:
        return None
    return os.path.join(state_dir, names[0]) if names else None


def log_path(state_file: str, role: str) -> str:
    return f"{state_file[:-len('.json')]}-{_slug(role)}.log"


@contextlib.contextmanager
def locked(state_file: str, timeout: float = 60.0):
    """Hold the topology's lock; another ``up``/``down`` of it waits (bounded)."""
    path = state_file[:-len(".json")] + ".lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise StateError(f"another aggnet up or down of this topology holds {path} for more than "
                                     f"{timeout:g}s; wait for it to finish, or remove {path} if none runs") from None
                time.sleep(0.1)
        yield
    finally:
        os.close(fd)


def load(state_file: str) -> dict:
    """The recorded state, or an empty one."""
    empty = {"version": VERSION, "aggregators": {}, "switch_jobs": {}}
    try:
        with open(state_file, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return empty
    except (OSError, ValueError) as exc:
        raise StateError(f"the state file {state_file} is unreadable ({exc}); stop the aggregators it named by "
                         f"hand and remove it") from None
    if not isinstance(data, dict) or data.get("version") != VERSION:
        raise StateError(f"the state file {state_file} is not one this aggnet writes; stop the aggregators it "
                         f"named by hand and remove it")
    data.setdefault("aggregators", {})
    data.setdefault("switch_jobs", {})
    return data


def save(state_file: str, data: dict) -> None:
    """Write atomically: an interrupted ``up`` leaves the old or the new
    state, never half of one."""
    tmp = f"{state_file}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, state_file)


def remove(state_file: str) -> None:
    # the lock file stays: one waiting on it must not lose it to a newcomer
    with contextlib.suppress(FileNotFoundError):
        os.unlink(state_file)


# -- processes ---------------------------------------------------------------------------


def command_line(pid: int) -> list[str] | None:
    """The running command of ``pid``; None when gone (zombies included)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return None
    if not raw:
        return None  # a zombie, or a kernel thread
    return [part.decode(errors="replace") for part in raw.rstrip(b"\0").split(b"\0")]


def running(pid: int, argv: list[str]) -> bool:
    """``pid`` is alive and still runs ``argv``."""
    if not os.path.isdir("/proc/self"):
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True
    return command_line(pid) == list(argv)


def _reap(pid: int) -> None:
    # ours when this process started it (tests, a failed up): collect it
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def _group_alive(pgid: int) -> bool:
    """Some process of group ``pgid`` still runs (zombies, which hold no
    port and wait only for their parent to collect them, do not count)."""
    if not os.path.isdir("/proc/self"):
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def stop_all(procs: list[tuple[int, list[str]]], timeout: float = 10.0) -> list[str]:
    """Stop processes ``up`` started, all at once: SIGTERM, then SIGKILL
    to each one's whole session group (its forked shards) after
    ``timeout``. Returns what happened to each, in words."""
    out = ["stopped"] * len(procs)
    waiting = []
    for i, (pid, argv) in enumerate(procs):
        if not running(pid, argv):
            _reap(pid)
            out[i] = "not running"
            continue
        try:
            os.kill(pid, signal.SIGTERM)
            waiting.append(i)
        except ProcessLookupError:
            out[i] = "not running"
    deadline = time.monotonic() + timeout
    while waiting and time.monotonic() < deadline:
        for i in list(waiting):
            _reap(procs[i][0])
            if not running(*procs[i]):
                waiting.remove(i)
        time.sleep(0.05)
    for i in waiting:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(procs[i][0], signal.SIGKILL)
        out[i] = f"killed (it did not stop within {timeout:g}s of SIGTERM)"
    # shards leave with their leader; any that linger go with the group,
    # started as a session of its own whose id is the leader's pid
    stopped = [pid for (pid, _), word in zip(procs, out) if word != "not running"]
    end = time.monotonic() + 5
    while time.monotonic() < end and any(_group_alive(pid) for pid in stopped):
        for pid in stopped:
            _reap(pid)
        time.sleep(0.05)
    for pid in stopped:
        if _group_alive(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
    return out


def stop(pid: int, argv: list[str], timeout: float = 10.0) -> str:
    return stop_all([(pid, argv)], timeout)[0]
