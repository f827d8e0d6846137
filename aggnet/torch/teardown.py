"""Ending a process group after DDP without a deadlock.

A gloo collective launched during ``backward()`` keeps a Python object
(the autograd engine's saved ``contextvars`` context) in the work's
thread-local state, and gloo's worker thread drops that work, which takes
the GIL, after it has completed the collective. A DDP model's C++
reducer holds the process group; when the model is the group's last
holder (``destroy_process_group()`` ran while the model was still alive,
and the model goes when its function returns), the group is destroyed in
the reducer's deallocation, with the GIL held, and that destructor joins
gloo's worker threads: a worker still waiting for the GIL never ends, and
neither does the process. On two busy cores a three-rank run hung so in
about one teardown in five.

:func:`ends_process_group` orders it the other way: the function's
models are gone before the group is destroyed, so the group dies from
``destroy_process_group()``, whose binding lets the GIL go.
"""

from __future__ import annotations

import functools
import gc
import traceback


def ends_process_group(fn):
    """Decorate a worker function that starts a default process group and
    trains with it: when it returns or raises, the models its frame held
    (and, for an error, its traceback's frames) are released, then the
    group is destroyed. The function does not destroy the group itself."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        import torch.distributed as dist

        try:
            return fn(*args, **kwargs)
        except BaseException as exc:
            # the traceback keeps every frame's locals, the models among them;
            # its text (file, line, code) stays
            for err in _chain(exc):
                traceback.clear_frames(err.__traceback__)
            raise
        finally:
            gc.collect()  # models in reference cycles
            if dist.is_initialized():
                dist.destroy_process_group()

    return run


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__
