"""Element-wise kernels behind one fixed API, with three implementations:

* :mod:`aggnet.kernels.reference` (NumPy): the definition, used by tests;
* :mod:`aggnet.kernels.cpu` (numba): what the client and aggregators run;
* :mod:`aggnet.kernels.gpu` (CuPy): the same operations on device arrays,
  imported only when a CuPy array is handed in.

Each backend must export exactly ``KERNEL_API`` (a test checks it), so a
caller never needs to know which one it holds.
"""

from __future__ import annotations

import math
from types import ModuleType

from aggnet.protocol.wire import EXPONENT_NONFINITE, EXPONENT_ZERO

KERNEL_API = (
    "block_stats",
    "quantize",
    "dequantize",
    "accumulate",
    "byteswap32",
    "to_half",
    "from_half",
    "accumulate_half",
    "block_exponents",
)

#: headroom bits kept free in an int32 sum: values are scaled so that
#: |x| < 2**30 / world, and the sum of ``world`` of them stays below 2**30.
QUANT_BITS = 30


def load(name: str) -> ModuleType:
    """The kernel module called ``name`` (``reference``, ``cpu``, ``gpu``)."""
    if name == "reference":
        from aggnet.kernels import reference as mod
    elif name == "cpu":
        from aggnet.kernels import cpu as mod
    elif name == "gpu":
        from aggnet.kernels import gpu as mod
    else:
        raise ValueError(f"unknown kernel backend {name!r}; known: reference, cpu, gpu")
    missing = [f for f in KERNEL_API if not callable(getattr(mod, f, None))]
    if missing:
        raise ImportError(f"kernel backend {name!r} lacks {missing}")
    return mod


def for_array(arr) -> ModuleType:
    """The backend for ``arr``: CuPy arrays get the GPU kernels."""
    if type(arr).__module__.startswith("cupy"):
        return load("gpu")
    return load("cpu")


def exponent_of(max_abs_bits: int, nonfinite: int) -> int:
    """The block exponent E (every |x| < 2**E) from :func:`block_stats`."""
    if nonfinite:
        return EXPONENT_NONFINITE
    if max_abs_bits == 0:
        return EXPONENT_ZERO
    import struct

    value = struct.unpack("<f", struct.pack("<I", max_abs_bits))[0]
    return math.frexp(value)[1]


def quant_shift(exponent: int, world: int) -> int:
    """The power-of-two scale for int32 quantization agreed as ``exponent``
    by ``world`` workers: q = rint(x * 2**shift) keeps every partial sum of
    up to ``world`` values within int32."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    return QUANT_BITS - exponent - (world - 1).bit_length()
