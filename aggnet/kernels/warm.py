"""Importing this module sets numba's code generator up, once, in a
process that will fork.

A process's first call of a compiled kernel costs about 0.7 CPU-seconds
even when the kernel loads from numba's on-disk cache: that is when
numba sets LLVM and its target machine up. Each later kernel loads in
milliseconds. A process that forks workers imports this module first
(a forkserver's preload list names it), and every child starts with the
code generator ready instead of setting it up again.
"""

from __future__ import annotations

import numpy as np


def warm_up() -> None:
    """Load one small kernel (from the cache where it is there); idempotent."""
    from aggnet.kernels import cpu

    cpu.block_exponents(np.zeros(1, np.float32), 1, np.empty(1, np.int16))


warm_up()
