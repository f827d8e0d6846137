"""Progress of a long command (a benchmark, an emulation, a fuzzing run),
on standard error so that the tables and JSON on standard output stay
clean: a bar where standard error is a terminal (rich's), a line per step
where it is a log or a pipe (CI, ``| tee``), and nothing with
``AGGNET_PROGRESS=0``."""

from __future__ import annotations

import os
import sys
import time


def _enabled() -> bool:
    return os.environ.get("AGGNET_PROGRESS", "1") != "0"


class Progress:
    """``total`` steps of ``what``; ``step(note)`` after each. A context
    manager: the bar goes away at the end, errors pass through. ``bar=False``
    prints lines on a terminal too (a worker process under a command that
    draws its own bar)."""

    def __init__(self, what: str, total: int, bar: bool = True):
        self.what, self.total, self.done = what, max(int(total), 1), 0
        self._t0 = time.monotonic()
        self._bar = self._task = None
        if bar and _enabled() and sys.stderr.isatty():
            try:
                from rich.progress import BarColumn, Progress as Bar, TextColumn, TimeElapsedColumn
            except ImportError:  # a line per step instead
                return
            self._bar = Bar(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                            TimeElapsedColumn(), TextColumn("{task.fields[note]}"), transient=True)
            self._bar.start()
            self._task = self._bar.add_task(what, total=self.total, note="")

    def step(self, note: str = "") -> None:
        self.done += 1
        if not _enabled():
            return
        if self._bar is not None:
            self._bar.update(self._task, advance=1, note=note)
        else:
            print(f"  {self.what}: {self.done}/{self.total}{' ' + note if note else ''} "
                  f"({time.monotonic() - self._t0:.0f}s)", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
