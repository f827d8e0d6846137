"""Weights ``s`` updates ahead, from the optimizer's own smoothed gradient.

SpecTrain's prediction Ŵ_{t+s} = W_t - s·η·v_{t-1}: the next ``s`` steps
are assumed to move as far as the last one. For momentum SGD the last
step *is* η·v (torch's SGD keeps v in ``momentum_buffer``; with
``dampening`` equal to ``momentum`` it is the paper's smoothed gradient),
so nothing extra is stored. For any other optimizer (Adam, SGD with
Nesterov or without momentum) the last step is recorded as it happens and
extrapolated the same way, at the cost of one copy of the weights.

Used by pipeline stages (:mod:`aggnet.pipeline.stage`) and by the
stale-gradient data-parallel mode (:mod:`aggnet.torch.stale`): in both a
gradient is applied ``s`` updates after the weights it was computed at.
"""

from __future__ import annotations

import torch


class WeightPredictor:
    """Predictions for ``params`` (a list of parameters) updated by
    ``optimizer``; call :meth:`before_step` and :meth:`after_step` around
    every optimizer step."""

    def __init__(self, params, optimizer: torch.optim.Optimizer):
        self.params = list(params)
        self.optimizer = optimizer
        self._lr_of = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                self._lr_of[p] = group
        missing = [i for i, p in enumerate(self.params) if p not in self._lr_of]
        if missing:
            raise ValueError(f"parameters {missing} are not updated by the optimizer: their weights cannot be predicted")
        self.from_momentum = self._momentum_sgd(optimizer)
        self._last_step: list[torch.Tensor] | None = None
        self._before: list[torch.Tensor] | None = None

    @staticmethod
    def _momentum_sgd(optimizer) -> bool:
        if type(optimizer) is not torch.optim.SGD:
            return False
        return all(g.get("momentum", 0) > 0 and not g.get("nesterov", False) and not g.get("maximize", False)
                   for g in optimizer.param_groups)

    def step_of(self, i: int) -> torch.Tensor | None:
        """What the last update did to parameter ``i`` (negated: W_t =
        W_{t-1} - step), None before the first."""
        if self.from_momentum:
            p = self.params[i]
            buf = self.optimizer.state.get(p, {}).get("momentum_buffer")
            return None if buf is None else buf * self._lr_of[p]["lr"]
        return None if self._last_step is None else self._last_step[i]

    def predicted(self, s: int) -> list[torch.Tensor]:
        """Ŵ = W - s·step per parameter: new tensors (detached), never stored
        here; copies of the weights where ``s`` is 0 or no step was taken
        yet."""
        out = []
        for i, p in enumerate(self.params):
            step = self.step_of(i) if s else None
            out.append(p.detach().clone() if step is None else torch.sub(p.detach(), step, alpha=s))
        return out

    def before_step(self) -> None:
        if not self.from_momentum:
            self._before = [p.detach().clone() for p in self.params]

    def after_step(self) -> None:
        if not self.from_momentum and self._before is not None:
            self._last_step = [b.sub_(p.detach()) for b, p in zip(self._before, self.params)]
            self._before = None
