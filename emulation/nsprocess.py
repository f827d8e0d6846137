"""Python workers in a network namespace, forked from aggnet's fork server.

``ip netns exec NS python -m aggnet.demo`` starts an interpreter that
imports torch, torch._dynamo, scikit-learn and aggnet again, about 5
CPU-seconds before the first line of work, for each worker of every run.
:class:`NamespacePopen` runs the same module in a process forked from a
server that imported those once (:func:`aggnet.processes.fork_server`):
the child enters the namespace with ``setns(2)``, takes the pipes the
caller asked for as its standard streams, the caller's environment and
directory, and runs the module as ``__main__``. To the caller it is a
:class:`subprocess.Popen`: the same pipes, ``wait``, ``communicate``,
``kill`` and return codes (negative for a signal).

Like ``ip netns exec``, the child also gets a mount namespace of its own
with the namespace's ``/sys`` and the files of ``/etc/netns/NS`` over
those of ``/etc`` (the emulation names its hosts there).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import runpy
import signal
import subprocess
import sys
import threading
import traceback

from aggnet.processes import DDP_WORKER_PRELOAD, fork_server

#: what the emulation's Python workers import anyway: DDP, the demo's data
EMULATION_WORKER_PRELOAD = (*DDP_WORKER_PRELOAD, "sklearn.datasets")

NETNS_DIR = "/var/run/netns"
#: ``ip netns exec NS`` mounts the files of /etc/netns/NS over /etc's
NETNS_ETC = "/etc/netns"
_CLONE_NEWNET = 0x40000000
_CLONE_NEWNS = 0x00020000
_MS_BIND = 4096
_MS_REC = 16384
_MS_SLAVE = 1 << 19
_MNT_DETACH = 2


def forkable(ns: str, cmd: list[str], kw: dict) -> bool:
    """Whether ``cmd`` (with Popen's keywords ``kw``) can run forked into
    ``ns``: ``python -m MODULE ...`` with this interpreter, a namespace
    made by ``ip netns add``, and nothing of Popen's that a fork server's
    child cannot honour. ``AGGNET_NETNS_EXEC=1`` sends every command
    through ``ip netns exec``."""
    if os.environ.get("AGGNET_NETNS_EXEC") == "1":
        return False
    if len(cmd) < 3 or cmd[0] != sys.executable or cmd[1] != "-m":
        return False
    if set(kw) - {"stdin", "stdout", "stderr", "text", "env", "cwd", "bufsize"}:
        return False
    return os.path.exists(os.path.join(NETNS_DIR, ns))


class _Fd:
    """An open descriptor handed to the fork server's child (over the
    server's socket, as multiprocessing hands its own)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return _received, (reduction.DupFd(self.fd),)


def _received(dup) -> int:
    return dup.detach()


class NamespacePopen(subprocess.Popen):
    """``subprocess.Popen([sys.executable, "-m", MODULE, *args], ...)`` in
    the network namespace ``ns``, forked from the fork server."""

    def __init__(self, ns: str, cmd: list[str], **kw):
        self._ns = ns
        self._process = None
        super().__init__(cmd, **kw)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, *rest):
        # -1: the stream is not redirected, the child shares the caller's
        stdio = [_Fd(fd if fd != -1 else i) for i, fd in enumerate((p2cread, c2pwrite, errwrite))]
        ctx = fork_server(EMULATION_WORKER_PRELOAD)
        self._process = ctx.Process(target=_run_module_in, daemon=False,
                                    args=(os.path.join(NETNS_DIR, self._ns), list(args[2:]),
                                          dict(os.environ if env is None else env), cwd or os.getcwd(), stdio))
        self._process.start()
        self.pid = self._process.pid
        self._child_created = True
        # the child's ends went to the server with the request
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
        self._closed_child_pipe_fds = True

    def _internal_poll(self, *args, **kwargs):
        if self.returncode is None and self._process is not None and self._process.exitcode is not None:
            self.returncode = self._process.exitcode
        return self.returncode

    def _wait(self, timeout):
        if self.returncode is not None:
            return self.returncode
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        self.returncode = self._process.exitcode
        return self.returncode


def _run_module_in(ns_path: str, argv: list[str], env: dict, cwd: str, stdio: list[int]) -> None:
    """The child: into the namespace, onto the caller's streams, then the
    module as a fresh ``python -m`` would run it; never returns."""
    try:
        _enter(ns_path)
    except OSError as exc:
        os.write(stdio[2], f"cannot run in {ns_path}: {exc}\n".encode())
        os._exit(1)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    for target, fd in enumerate(stdio):
        os.dup2(fd, target)
    for fd in set(stdio) - {0, 1, 2}:
        os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the process's own stream)
    sys.stdout = open(1, "w", buffering=1 if unbuffered else -1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)  # noqa: SIM115
    if "OMP_NUM_THREADS" in env and "torch" in sys.modules:
        # OpenMP read the server's environment when torch loaded
        sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))
    module, args = argv[0], argv[1:]
    sys.argv = ["-m", *args]
    # run fresh as __main__ (its imports are what the server saved); a
    # package stays, its __main__ runs
    if not hasattr(sys.modules.get(module), "__path__"):
        sys.modules.pop(module, None)
    sys.modules.pop(f"{module}.__main__", None)
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:
        traceback.print_exc()
        code = 1
    os._exit(_finish(code))


def _enter(ns_path: str) -> None:
    """What ``ip netns exec`` does before it runs a command: the network
    namespace, then a mount namespace whose /sys and /etc show it."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    with open(ns_path) as ns:
        check(libc.setns(ns.fileno(), _CLONE_NEWNET), "setns")
    check(libc.unshare(_CLONE_NEWNS), "unshare")
    # mounts made here stay here
    check(libc.mount(b"none", b"/", None, _MS_SLAVE | _MS_REC, None), "mount --make-rslave /")
    name = os.path.basename(ns_path).encode()
    if libc.umount2(b"/sys", _MNT_DETACH) == 0:
        check(libc.mount(name, b"/sys", b"sysfs", 0, None), "mount /sys")
    etc = os.path.join(NETNS_ETC, os.path.basename(ns_path))
    if os.path.isdir(etc):
        for entry in sorted(os.listdir(etc)):
            src, dst = os.path.join(etc, entry), os.path.join("/etc", entry)
            if os.path.exists(dst):
                check(libc.mount(src.encode(), dst.encode(), b"none", _MS_BIND, None), f"bind {src}")


def _exit_code(value) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def _finish(code: int) -> int:
    """What an interpreter does at exit: wait for its threads, run its
    exit handlers, flush its streams; an interrupt ends it by the signal."""
    try:
        threading._shutdown()
    except BaseException:  # noqa: BLE001 (exiting anyway)
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code
