"""The host buffers a client takes, seen as NumPy arrays without a copy.

Results are written in place, so a buffer from another array library (a
torch CPU tensor, anything else that speaks DLPack) is all-reduced through
a NumPy view of its own memory, never a copy that the caller would not
see. NumPy has no bfloat16: a torch bfloat16 tensor is viewed as its
16-bit patterns, with the wire type said beside them (as the DDP hook
sends its bfloat16 buckets).
"""

from __future__ import annotations

import sys

import numpy as np

from aggnet.protocol.wire import DType

__all__ = ["host_view", "tensor_view"]

_TAKES = "a NumPy array, a torch tensor, or another array with __dlpack__ (CUDA ones with __cuda_array_interface__)"


def host_view(buf, call: str, name: str = "buf") -> tuple[np.ndarray, DType | None]:
    """(NumPy array sharing ``buf``'s memory, wire type hint or None)."""
    if isinstance(buf, np.ndarray):
        return buf, None
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(buf, torch.Tensor):
        return _torch_view(torch, buf, call, name)
    if hasattr(buf, "__dlpack__"):
        try:
            return np.from_dlpack(buf), None
        except (BufferError, TypeError, RuntimeError) as exc:
            raise TypeError(f"{call} cannot see {name} ({type(buf).__name__}) as host memory: {exc}") from None
    raise TypeError(f"{call} takes {_TAKES}; got {type(buf).__name__} for {name}")


def tensor_view(t) -> tuple[np.ndarray, DType | None]:
    """(NumPy view sharing host tensor ``t``'s memory, wire type hint): the
    one place a torch tensor becomes a client's buffer (the DDP hook's
    buckets, the backend's tensors, the stager's pinned memory, a caller's
    tensor)."""
    torch = sys.modules["torch"]  # a tensor exists, so torch is loaded
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16), DType.BFLOAT16
    return t.numpy(), None


def _torch_view(torch, t, call: str, name: str) -> tuple[np.ndarray, DType | None]:
    if t.layout != torch.strided:
        raise TypeError(f"{call} takes dense tensors; {name} is {t.layout} (sparse rows go to "
                        f"aggnet.torch's sparse path, docs/sparse.md)")
    if t.device.type != "cpu":
        raise TypeError(f"{call} takes CPU and CUDA tensors; {name} is on {t.device}: copy it to one of them first")
    try:
        # all-reduced in place as torch.distributed does, outside autograd
        return tensor_view(t.detach())
    except TypeError as exc:  # a dtype NumPy lacks
        raise TypeError(f"{call} cannot take a {t.dtype} tensor: {exc}") from None
