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
``kill`` and return codes (negative for a signal); the forking is
:mod:`aggnet.processes.forked`'s.

Like ``ip netns exec``, the child also gets a mount namespace of its own
with the namespace's ``/sys`` and the files of ``/etc/netns/NS`` over
those of ``/etc`` (the emulation names its hosts there).
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess

from aggnet.processes.forked import ForkedPopen
from aggnet.processes.forked import forkable as _forkable_python
from aggnet.processes import DDP_WORKER_PRELOAD, keeps_fork_server

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
    if os.environ.get("AGGNET_NETNS_EXEC") == "1" or not _forkable_python(cmd, kw):
        return False
    return os.path.exists(os.path.join(NETNS_DIR, ns))


def popen_in(ns: str, cmd: list[str], env: dict | None = None, *, fork: bool = True, **kw) -> subprocess.Popen:
    """``cmd`` in the network namespace ``ns`` with Popen's keywords ``kw``
    and ``env`` over this process's environment: a Python module forked
    from the fork server where it can be (and ``fork``), anything else
    under ``ip netns exec``."""
    env = {**os.environ, **(env or {})}
    if fork and forkable(ns, cmd, kw):  # a Python worker: forked, its imports done once
        return NamespacePopen(ns, cmd, env=env, **kw)
    return subprocess.Popen(["ip", "netns", "exec", ns, *cmd], env=env, **kw)


def service_launcher(ns: str):
    """What :class:`aggnet.processes.ServiceProcess` starts ``aggnet serve``
    in ``ns`` with: forked where this process keeps a fork server, as
    services outside namespaces are, else under ``ip netns exec``."""
    return functools.partial(popen_in, ns, fork=keeps_fork_server())


class NamespacePopen(ForkedPopen):
    """``subprocess.Popen([sys.executable, "-m", MODULE, *args], ...)`` in
    the network namespace ``ns``, forked from the fork server."""

    def __init__(self, ns: str, cmd: list[str], **kw):
        super().__init__(cmd, preload=EMULATION_WORKER_PRELOAD,
                         enter=functools.partial(_enter, os.path.join(NETNS_DIR, ns)), **kw)


def _enter(ns_path: str) -> None:
    """What ``ip netns exec`` does before it runs a command: the network
    namespace, then a mount namespace whose /sys and /etc show it."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    with open(ns_path) as ns:
        check(libc.setns(ns.fileno(), _CLONE_NEWNET), f"setns into {ns_path}")
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
