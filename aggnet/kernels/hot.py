"""Calling a numba kernel tens of thousands of times a second with named
tuples of arrays.

numba's dispatcher finds the type of every argument on every call to pick
the compiled version. For an array that is a fast path in C; for a tuple
of arrays it walks each field in Python: microseconds a call, which is as
much as the switch path's kernels spend on a batch of small packets. Those
kernels are called once per received batch with the same preallocated
arrays (same dtypes, dimensions and layouts every time), so :func:`hot`
binds a kernel to the compiled version its first call picks and calls
that version's entry point from then on (its arguments are still unboxed
and checked by compiled code, only the Python-level typing is skipped).
"""

from __future__ import annotations

import numba


class HotKernel:
    """A jitted kernel whose calls after the first skip type dispatch. Its
    callers pass arguments of one type signature (the first call's); the
    dispatcher stays reachable as ``dispatcher`` (other signatures, and
    jitted callers, use it)."""

    def __init__(self, dispatcher):
        self.dispatcher = dispatcher
        self.__doc__ = dispatcher.__doc__
        self.__name__ = getattr(dispatcher, "__name__", "kernel")
        self._entry = None

    def __call__(self, *args):
        if self._entry is not None:
            return self._entry(*args)
        result = self.dispatcher(*args)  # compiles, or loads from the cache
        signature = tuple(numba.typeof(a) for a in args)
        compiled = self.dispatcher.overloads.get(signature)
        if compiled is not None:
            self._entry = compiled.entry_point
        return result

    def __getattr__(self, name):
        return getattr(self.dispatcher, name)


def hot(dispatcher) -> HotKernel:
    return HotKernel(dispatcher)
