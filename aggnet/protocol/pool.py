"""Where a job goes on an aggregator: a row of its job tables and a
contiguous run of its slot pool, first fit.

Both kinds of switch aggregator place jobs alike, so a job lands at the
same base on a P4 switch and on a host in switch mode. The host keeps one
:class:`SlotPool` for its lifetime; the P4 control plane builds one from
the jobs it reads back from the switch (:meth:`SlotPool.holding`), since
the switch's tables, not a controller's memory, say what is installed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple


class Placement(NamedTuple):
    row: int  #: the job's row in the aggregator's job tables
    base: int  #: the first slot of its run


class SlotPool:
    """Free runs of a pool of ``size`` slots and free rows of ``rows``
    job-table rows; runs are merged again when a job leaves, so a freed
    pool holds one run."""

    def __init__(self, size: int, rows: int):
        if size < 1 or rows < 1:
            raise ValueError(f"a pool holds at least one slot and one job row, got {size} slots and {rows} rows")
        self.size = size
        self.rows = rows
        self._free: list[tuple[int, int]] = [(0, size)]  # (base, slots), by base
        self._rows_used: set[int] = set()

    @classmethod
    def holding(cls, size: int, rows: int, jobs: Iterable[tuple[int, int, int]]) -> "SlotPool":
        """A pool with ``jobs`` ((row, base, slots) each) in place already."""
        pool = cls(size, rows)
        for row, base, slots in jobs:
            pool.take(row, base, slots)
        return pool

    @property
    def largest_free(self) -> int:
        """Slots in the largest free run: the most a new job may get."""
        return max((slots for _, slots in self._free), default=0)

    @property
    def jobs(self) -> int:
        return len(self._rows_used)

    def free_row(self) -> int | None:
        """The first job row not in use, or None."""
        return next((r for r in range(self.rows) if r not in self._rows_used), None)

    def place(self, slots: int) -> Placement | None:
        """The first free row and the first free run of ``slots`` slots,
        both taken; None (nothing taken) when either is lacking."""
        row = self.free_row()
        if row is None:
            return None
        for i, (base, size) in enumerate(self._free):
            if size >= slots:
                self._cut(i, base, slots)
                self._rows_used.add(row)
                return Placement(row, base)
        return None

    def take(self, row: int, base: int, slots: int) -> None:
        """Take ``row`` and the run ``[base, base + slots)``, chosen by the
        caller; ValueError when either is in use or outside the pool."""
        if not 0 <= row < self.rows or row in self._rows_used:
            raise ValueError(f"job row {row} is in use or not one of the {self.rows} rows")
        for i, (b, size) in enumerate(self._free):
            if b <= base and base + slots <= b + size and slots >= 1:
                self._cut(i, base, slots)
                self._rows_used.add(row)
                return
        raise ValueError(f"slots {base}..{base + slots - 1} are not free in the pool of {self.size} "
                         f"(free runs: {self._free})")

    def release(self, row: int, base: int, slots: int) -> None:
        """Give a job's row and run back."""
        self._rows_used.discard(row)
        merged: list[tuple[int, int]] = []
        for b, s in sorted(self._free + [(base, slots)]):
            if merged and merged[-1][0] + merged[-1][1] == b:
                merged[-1] = (merged[-1][0], merged[-1][1] + s)
            else:
                merged.append((b, s))
        self._free = merged

    def _cut(self, i: int, base: int, slots: int) -> None:
        """Take ``[base, base + slots)`` out of free run ``i``, which holds it."""
        b, size = self._free[i]
        rest = [(b, base - b), (base + slots, b + size - base - slots)]
        self._free[i:i + 1] = [(rb, rs) for rb, rs in rest if rs > 0]
