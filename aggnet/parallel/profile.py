"""A layer chain's profile: what the partitioner and the cost model weigh.

Each layer of an ``nn.Sequential`` is timed on this device (forward and
backward, median of a few runs, on the output of the layer before it),
and its output size is measured: that is what crosses a cut after it, per
sample. Parameter bytes say what its gradient all-reduce moves; memory
adds its gradients and optimizer state to its parameters and keeps its
output for the backward pass.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LayerProfile:
    name: str
    #: forward + backward seconds per sample (measured at ``batch`` and divided)
    seconds_per_sample: float
    #: bytes of this layer's output per sample (what a cut after it moves each way)
    out_bytes_per_sample: int
    param_bytes: int
    #: parameters with their gradients and optimizer state, plus the saved
    #: output of one micro-batch of ``batch`` samples
    memory_bytes: int


@dataclass(frozen=True)
class Profile:
    layers: tuple
    batch: int  #: the batch the layers were timed at
    device: str

    @property
    def param_bytes(self) -> int:
        return sum(layer.param_bytes for layer in self.layers)

    def compute(self, samples: float) -> np.ndarray:
        """Each layer's forward + backward seconds for ``samples`` samples."""
        return np.array([layer.seconds_per_sample for layer in self.layers]) * samples

    def out_bytes(self, samples: float) -> np.ndarray:
        return np.array([layer.out_bytes_per_sample for layer in self.layers], dtype=np.float64) * samples

    def params(self) -> np.ndarray:
        return np.array([layer.param_bytes for layer in self.layers], dtype=np.float64)

    def memory(self) -> np.ndarray:
        return np.array([layer.memory_bytes for layer in self.layers], dtype=np.float64)

    def stage_params(self, bounds) -> list[int]:
        p = self.params()
        return [int(p[a:b].sum()) for a, b in bounds]


def layers_of(model):
    """The chain to cut: an ``nn.Sequential``'s children, in order."""
    import torch.nn as nn

    if not isinstance(model, nn.Sequential):
        raise TypeError(f"the model must be an nn.Sequential (a chain of layers to cut), got "
                        f"{type(model).__name__}; wrap its layers in nn.Sequential")
    return list(model.named_children())


def profile(model, sample, *, reps: int = 3, optimizer_states: int = 1) -> Profile:
    """Time and measure every layer of ``model`` on ``sample`` (a batch of
    inputs; its first dimension is the batch)."""
    import torch

    named = layers_of(model)
    batch = int(sample.shape[0])
    x = sample.detach()
    # on the CPU, this process's CPU time: what a layer costs a core, which
    # other processes on a busy machine (another job, a test beside it) do
    # not add to; elsewhere the wall clock
    on_cpu = sample.device.type == "cpu"
    clock = time.process_time if on_cpu else time.perf_counter
    threads = torch.get_num_threads()
    if on_cpu:
        # one intra-op thread, so that the CPU time is one core's work: torch's
        # pool would add every idle thread's spinning to it (12 CPU-s against
        # 2.8 for the same hundred layers on a many-core machine)
        torch.set_num_threads(1)
    try:
        return _profile(named, x, batch, clock, reps, optimizer_states, sample.device)
    finally:
        if on_cpu:
            torch.set_num_threads(threads)


def _settle(device) -> None:
    """Wait until ``device`` has run what was queued on it: a GPU's kernels
    run after the calls that queue them return, so a clock read without
    this times the queueing."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _profile(named, x, batch, clock, reps, optimizer_states, device) -> Profile:
    import torch

    layers = []
    for name, layer in named:
        x_in = x.detach().requires_grad_(x.is_floating_point())
        times = []
        for _ in range(max(1, reps) + 1):  # the first run warms caches and is not counted
            layer.zero_grad(set_to_none=True)
            x_use = x_in.detach().requires_grad_(x_in.is_floating_point())
            _settle(device)
            t0 = clock()
            out = layer(x_use)
            if out.requires_grad:
                out.backward(torch.ones_like(out))
            _settle(device)
            times.append(clock() - t0)
        layer.zero_grad(set_to_none=True)
        params = sum(p.numel() * p.element_size() for p in layer.parameters())
        out_bytes = out.numel() * out.element_size()
        memory = params * (2 + optimizer_states) + out_bytes
        layers.append(LayerProfile(name, statistics.median(times[1:]) / batch, out_bytes // batch, params, memory))
        x = out.detach()
    return Profile(tuple(layers), batch, str(device))
