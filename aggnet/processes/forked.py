"""``python -m MODULE`` as a child forked from the fork server.

A fresh interpreter for ``aggnet serve`` or an emulated worker imports
numpy, numba's kernels, aggnet (and for a worker torch) again before its
first line of work: a second for a service with two shards, five for a
DDP worker. Where this process keeps a fork server
(:func:`aggnet.processes.fork_server`) that imported them once,
:class:`ForkedPopen` runs the module in a child forked from it: the child
optionally enters somewhere first (a network namespace, see
:mod:`aggnet.emulation.nsprocess`), takes the pipes the caller asked for
as its standard streams, the caller's environment and directory, a
session of its own when asked, and runs the module as ``__main__``. To
the caller it is a :class:`subprocess.Popen`: the same pipes, ``poll``,
``wait``, ``communicate``, ``send_signal``, ``kill`` and return codes
(negative for a signal).

``AGGNET_EXEC_CHILDREN=1`` turns it off: every such child is exec'd.
"""

from __future__ import annotations

import atexit
import multiprocessing.connection
import multiprocessing.process
import os
import runpy
import signal
import subprocess
import sys
import threading
import traceback

from aggnet.processes import TORCH_WORKER_PRELOAD, fork_server

#: Popen's keywords a forked child honours
FORKABLE_KEYWORDS = frozenset({"stdin", "stdout", "stderr", "text", "env", "cwd", "bufsize", "start_new_session"})


def forkable(cmd: list[str], kw: dict) -> bool:
    """Whether ``cmd`` (with Popen's keywords ``kw``) can run forked:
    ``python -m MODULE ...`` with this interpreter and nothing of Popen's
    that a fork server's child cannot honour."""
    if os.environ.get("AGGNET_EXEC_CHILDREN") == "1":
        return False
    if len(cmd) < 3 or cmd[0] != sys.executable or cmd[1] != "-m":
        return False
    return not set(kw) - FORKABLE_KEYWORDS


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


class ForkedPopen(subprocess.Popen):
    """``subprocess.Popen([sys.executable, "-m", MODULE, *args], ...)``
    forked from the fork server. ``enter`` (picklable, no arguments) runs
    first in the child; an OSError from it ends the child with status 1
    and the message on its stderr."""

    def __init__(self, cmd: list[str], *, preload=TORCH_WORKER_PRELOAD, enter=None, **kw):
        self._preload = preload
        self._enter = enter
        self._new_session = bool(kw.get("start_new_session"))
        self._process = None
        #: one reader of the child's status at a time (see _read_status)
        self._status_lock = threading.Lock()
        super().__init__(cmd, **kw)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, *rest):
        # -1: the stream is not redirected, the child shares the caller's
        stdio = [_Fd(fd if fd != -1 else i) for i, fd in enumerate((p2cread, c2pwrite, errwrite))]
        ctx = fork_server(self._preload)
        self._process = ctx.Process(target=_run_module, daemon=False,
                                    args=(self._enter, list(args[2:]), dict(os.environ if env is None else env),
                                          cwd or os.getcwd(), stdio, self._new_session))
        self._process.start()
        # the caller owns the child, as it owns a Popen's: multiprocessing
        # would poll it from whichever thread starts its next child (and
        # wait for it at exit), and two readers of its status race
        multiprocessing.process._children.discard(self._process)
        self.pid = self._process.pid
        self._child_created = True
        # the child's ends went to the server with the request
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
        self._closed_child_pipe_fds = True

    def _read_status(self) -> int | None:
        """The child's status once the fork server has sent it, else None;
        never blocks. The server writes it once, and multiprocessing reads
        it without a lock: a second reader at the same moment finds the
        pipe at its end and takes the child for one whose server died
        (status 255), whatever the child returned. So one thread reads it
        here at a time, and the others find it read."""
        with self._status_lock:
            if self.returncode is None:
                self.returncode = self._process.exitcode
            return self.returncode

    def _internal_poll(self, *args, _finalizing=sys.is_finalizing, **kwargs):
        # Popen.__del__ polls too: at the interpreter's exit multiprocessing
        # can no longer import what its poll needs, and the fork server
        # reaps the child anyway
        if _finalizing() or self.returncode is not None or self._process is None:
            return self.returncode
        return self._read_status()

    def _wait(self, timeout):
        if self.returncode is not None:
            return self.returncode
        # readable once the status is there: waited for without taking it
        if not multiprocessing.connection.wait([self._process.sentinel], timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._read_status()


def _run_module(enter, argv: list[str], env: dict, cwd: str, stdio: list[int], new_session: bool) -> None:
    """The child: wherever ``enter`` takes it, onto the caller's streams,
    then the module as a fresh ``python -m`` would run it; never returns."""
    if new_session:
        os.setsid()
    _untie()
    _name(argv)
    if enter is not None:
        try:
            enter()
        except OSError as exc:
            os.write(stdio[2], f"cannot start `-m {' '.join(argv)}`: {exc}\n".encode())
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


def _name(argv: list[str]) -> None:
    """Name the process after what it runs (``aggnet serve``), which ``top``,
    ``ps -e`` and ``pgrep`` show: its command line stays the fork
    server's."""
    import ctypes

    name = " ".join(argv[:2]) if argv[0] == "aggnet" and len(argv) > 1 else argv[0]
    try:
        pr_set_name = 15
        ctypes.CDLL(None).prctl(pr_set_name, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the name is cosmetic


def _untie() -> None:
    """Let go of the fork server's liveness pipe and the resource tracker's
    pipe, which an exec'd child would not have: while a child holds them,
    those processes (and the caller's streams they keep open) live on, and
    a detached service lives for hours after its caller ended."""
    from multiprocessing import forkserver, resource_tracker

    for owner, attr in ((forkserver._forkserver, "_forkserver_alive_fd"), (resource_tracker._resource_tracker, "_fd")):
        fd = getattr(owner, attr, None)
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
            setattr(owner, attr, None)


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
