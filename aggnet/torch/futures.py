"""From aggnet's client futures to the torch futures DDP and torch.distributed
wait on: one bridge for the DDP hook, its sparse and rows paths, and the
process-group backend. Not part of aggnet's user API.

aggnet's clients return :class:`concurrent.futures.Future` objects, completed
on the client's own thread. DDP's reducer and the backend's consumers (DDP
without a hook, FSDP2) chain on a :class:`torch.futures.Future` and read its
value in C++. Two things make the bridge less plain than ``set_result`` /
``set_exception``:

* an error must be raised inside a ``then`` callback to reach C++ as an
  error: ``torch.futures.Future.set_exception`` stores the exception as the
  future's *value*, which DDP would take for a gradient;
* the torch future must always complete, whatever goes wrong on the way:
  DDP's backward pass, or a ``Work.wait()``, waits on it without a limit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

__all__ = ["torch_future", "when_all"]


def torch_future(
    future: Future,
    value: Callable[[Future], Any],
    context: Callable[[BaseException], BaseException] | None = None,
    *,
    errors: list[BaseException] | None = None,
    devices: list[torch.device] | None = None,
) -> torch.futures.Future:
    """The torch future DDP (or a backend ``Work``) waits on for ``future``.

    Once ``future`` is done, ``value(future)`` gives what the torch future
    completes with; as in :meth:`torch.futures.Future.then`, it gets the done
    future, whose ``result()`` raises the client's error, so that a caller
    may turn some errors into a value (the DDP hook's
    ``on_nonfinite="propagate"``). Whatever ``value`` raises, the torch
    future still completes, with that error, passed through ``context``
    first when given (to say which bucket or collective it is about; if
    ``context`` itself fails, the error goes on as it was). The error is
    also appended to ``errors``, before the torch future completes: torch
    hands it to Python wrapped in its own RuntimeError, and a caller that
    raises it itself wants it as it is.

    ``devices`` (CUDA devices): the value is device work still queued on
    the current stream of the thread ``value`` runs on; torch's CUDA future
    then makes whoever waits on it wait for that work on the device, as a
    NCCL all-reduce's future does, where a CPU future would leave it to the
    host.
    """
    inner: torch.futures.Future = torch.futures.Future(devices=devices) if devices else torch.futures.Future()
    failure: list[BaseException] = []

    def unwrap(f: torch.futures.Future):
        # DDP reads the future's value in C++: an error must be raised inside
        # a ``then`` callback to reach it as an error rather than as a value
        if failure:
            raise failure[0]
        return f.value()

    out = inner.then(unwrap)

    def done(f: Future) -> None:
        try:
            result = value(f)
        except BaseException as exc:  # the future must always complete
            if context is not None:
                try:
                    exc = context(exc)
                except BaseException:
                    pass
            failure.append(exc)
            if errors is not None:
                errors.append(exc)
            # never seen: unwrap raises the error in its place
            inner.set_result(None)
        else:
            inner.set_result(result)

    future.add_done_callback(done)
    return out


def when_all(futures: Sequence[Future]) -> Future:
    """One future for several: it completes once every one of ``futures``
    is done, with the list of them in the order they finished, and never
    fails itself (each one's ``result()`` gives its value or raises its
    error). Waiting for all, even after one failed, keeps a bucket or
    collective from completing while a client still writes into its
    buffers."""
    all_done: Future = Future()
    finished: list[Future] = []
    lock = threading.Lock()

    def one(f: Future) -> None:
        with lock:
            finished.append(f)
            last = len(finished) == len(futures)
        if last:
            all_done.set_result(list(finished))

    if not futures:
        all_done.set_result([])
    for f in futures:
        f.add_done_callback(one)
    return all_done
