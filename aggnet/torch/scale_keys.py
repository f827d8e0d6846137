"""Keys for the backend's int32 all-reduces and reduce-scatters, so that
they carry their exponents from an earlier round as the DDP hook's
buckets do.

torch.distributed names no buffer: an ``all_reduce`` is a tensor and an
op. A round without a key agrees every chunk's exponent before any value
is quantized (a MAX over the workers: one more round trip, about a sixth
of a 64 KiB or 1 MiB all-reduce on one host, docs/benchmarks.md); a
round under a key carries them from its key's last round instead. The
backend names its rounds by what every rank sees alike, the sizes of its
calls in their order (the collectives of one group run in the same order
on every rank, or they mismatch):

* a round takes, of the keys of its size whose last round is at least
  ``LAG`` calls older, the one used longest ago, or a new key when there
  is none;
* so a loop that all-reduces the same tensors every step carries each one
  from itself in its last step (from ``ceil(LAG / calls)`` steps back when
  a step makes fewer than ``LAG`` calls; a step's tensors of one size, up
  to ``LAG`` of them, each keep a key of their own, more share them), and
  tensors of one size issued together (FSDP2's equal layers, a coalesced
  list) take different keys: a round waits for its key's last round (the
  client's rule) only when that one is ``LAG`` calls back, never for the
  call just before it.

Two tensors of one size may share a key. A chunk whose values outgrew (or
fell far below) what it carried goes again with the agreed exponent
(``chunks_sent_again``): sharing costs at most that, never a wrong sum.
"""

from __future__ import annotations

import collections
import threading

__all__ = ["LAG", "ScaleKeys"]

#: how many calls back a round's key was last used, at least: a round
#: issued beside the one before it does not wait for it
LAG = 2
#: sizes whose keys are remembered (the least recently used is forgotten:
#: its next round takes a new key and agrees)
MAX_SIZES = 4096


class ScaleKeys:
    """The key of each round, from the sizes of the calls so far."""

    def __init__(self, lag: int = LAG, max_sizes: int = MAX_SIZES):
        if lag < 1:
            raise ValueError(f"lag must be at least 1, got {lag}")
        self._lag, self._max_sizes = lag, max_sizes
        self._calls = 0
        self._new = 0  #: the next key never given
        #: size -> [last call, key] per key of that size, least recently used size first
        self._uses: collections.OrderedDict[object, list[list[int]]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def key(self, size) -> int:
        """The key of the next round, of ``size`` (anything hashable that
        two calls share when their exponents may carry: an element count)."""
        with self._lock:
            call = self._calls
            self._calls += 1
            uses = self._uses.pop(size, [])
            self._uses[size] = uses
            if len(self._uses) > self._max_sizes:
                self._uses.popitem(last=False)
            ready = [u for u in uses if u[0] <= call - self._lag]
            if ready:
                use = min(ready, key=lambda u: u[0])  # in a periodic loop: the same tensor's
            else:
                # at most `lag` keys a size: the ones used within the last lag - 1 calls, and one older
                use = [call, self._new]
                self._new = (self._new + 1) & 0x7FFFFFFF
                uses.append(use)
            use[0] = call
            return use[1]
