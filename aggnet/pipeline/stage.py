"""One pipeline stage's passes: which weights each pass runs at, the
gradients it produces and the update after every backward.

A stage never talks to the network: the one-process emulator
(:mod:`aggnet.pipeline.emulator`) and the distributed runner
(:mod:`aggnet.pipeline.runner`) both drive the same :class:`Stage` in the
same per-stage order, so they compute the same weights bit for bit.

Which weights a pass sees, by mode:

* ``sync`` and ``vanilla``: the stage's current weights in both passes
  (in ``sync`` nothing changes in between; in ``vanilla`` other batches'
  updates may have, and the backward runs at the new weights);
* ``stash`` (PipeDream): the backward reuses the forward's weights;
* ``spectrain``: the forward runs at the weights predicted ``s_f``
  updates ahead, the backward at those ``s_b`` ahead
  (:mod:`aggnet.pipeline.schedule`); gradients go to the real weights.

Autograd keeps the tensors a forward ran with, and the stage updates its
weights in place, so every forward runs through
:func:`torch.func.functional_call` on tensors of its own: a copy, or the
prediction. Where the backward's weights differ from the forward's, the
stage recomputes the forward from the input it kept (``backward=
"recompute"``, the paper's semantics); ``backward="reuse"`` runs the
backward through the forward's graph instead (one forward fewer; the
gradient is then taken at the forward's prediction).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
from torch.func import functional_call

from aggnet.pipeline.predict import WeightPredictor
from aggnet.pipeline.schedule import check_mode, paper_versions

BACKWARDS = ("recompute", "reuse")


class Stage:
    """Stage ``index`` of ``stages``: ``module`` (its layers), updated by
    ``optimizer`` after every backward. The last stage takes ``loss_fn(out,
    target)``. ``versions``: (forward s, backward s) for ``spectrain``
    (default: the paper's formulas for this stage)."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, *, index: int, stages: int,
                 mode: str = "spectrain", loss_fn: Callable | None = None, backward: str = "recompute",
                 versions: tuple[int, int] | None = None):
        check_mode(mode)
        if backward not in BACKWARDS:
            raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}")
        if not 0 <= index < stages:
            raise ValueError(f"index must be in [0, {stages}), got {index}")
        self.last = index == stages - 1
        if self.last and loss_fn is None:
            raise ValueError("the last stage needs loss_fn(output, target)")
        self.module, self.optimizer = module, optimizer
        self.index, self.stages, self.mode, self.backward_mode = index, stages, mode, backward
        self.names = [n for n, _ in module.named_parameters()]
        self.params = [p for _, p in module.named_parameters()]
        self.loss_fn = loss_fn
        self.versions = versions if versions is not None else paper_versions(index, stages)
        if mode != "spectrain":
            self.versions = (0, 0)
        self.predictor = WeightPredictor(self.params, optimizer)
        self.updates = 0  #: weight updates so far
        #: batch -> what its backward needs: (input, output or loss, weights, updates at forward)
        self._kept: dict = {}

    # -- passes ---------------------------------------------------------------

    def _weights(self, s: int) -> list[torch.Tensor]:
        """Leaves the pass differentiates against: the prediction ``s``
        ahead, or a copy of the current weights (never the parameters
        themselves: they change in place before the backward)."""
        return [w.requires_grad_() for w in self.predictor.predicted(s)]

    def _run(self, x: torch.Tensor, weights: list[torch.Tensor], target):
        out = functional_call(self.module, dict(zip(self.names, weights)), (x,))
        return self.loss_fn(out, target) if self.last else out

    def forward(self, batch: int, x: torch.Tensor, target=None) -> torch.Tensor:
        """The forward of ``batch``: what goes to the next stage (detached),
        or the loss at the last stage."""
        if batch in self._kept:
            raise RuntimeError(f"stage {self.index}: batch {batch} ran its forward twice")
        if self.index > 0:
            x = x.detach().requires_grad_()
        weights = self._weights(self.versions[0])
        out = self._run(x, weights, target)
        self._kept[batch] = (x, out, weights, self.updates, target)
        return out.detach()

    def backward(self, batch: int, grad_output: torch.Tensor | None = None) -> torch.Tensor | None:
        """The backward of ``batch``: leaves the parameters' gradients in
        ``.grad`` (for :meth:`update`, after any data-parallel reduction)
        and returns the gradient for the previous stage (None at stage 0)."""
        try:
            x, out, weights, updates_then, target = self._kept.pop(batch)
        except KeyError:
            raise RuntimeError(f"stage {self.index}: backward of batch {batch} before its forward") from None
        if self.mode in ("vanilla", "spectrain") and not (self.mode == "spectrain" and self.backward_mode == "reuse"):
            s_b = self.versions[1]
            if self.updates != updates_then or s_b != self.versions[0]:
                weights = self._weights(s_b)
                out = self._run(x, weights, target)
        inputs = ([x] if self.index > 0 else []) + weights
        grads = torch.autograd.grad(out, inputs, grad_outputs=None if self.last else grad_output)
        for p, g in zip(self.params, grads[len(inputs) - len(weights):]):
            p.grad = g
        return grads[0] if self.index > 0 else None

    @property
    def device(self) -> torch.device:
        """Where the stage's weights are, and so where its passes run."""
        return self.params[0].device if self.params else torch.device("cpu")

    def flat_gradients(self) -> torch.Tensor:
        """The gradients as one contiguous float32 buffer (for an all-reduce)."""
        return torch.cat([p.grad.reshape(-1) for p in self.params])

    def set_flat_gradients(self, flat: torch.Tensor) -> None:
        at = 0
        for p in self.params:
            n = p.numel()
            p.grad = flat[at:at + n].view_as(p).to(p.device, copy=True)
            at += n

    def update(self) -> None:
        """The optimizer step after a backward."""
        self.predictor.before_step()
        self.optimizer.step()
        self.predictor.after_step()
        self.optimizer.zero_grad(set_to_none=True)
        self.updates += 1

    @property
    def in_flight(self) -> int:
        """Batches whose forward ran here and whose backward has not."""
        return len(self._kept)
