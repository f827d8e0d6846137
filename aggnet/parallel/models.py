"""Two layer chains that sit at the two ends of the placement question,
for ``aggnet plan``, ``aggnet emulate bench-hybrid`` and the docs.

* :func:`narrow_cut`: wide fully-connected layers around a 32-wide
  bottleneck. Its weights are megabytes, what crosses the bottleneck is
  128 bytes a sample: cut there, a stage per rack sends almost nothing
  over the uplinks, where data parallelism sends the model.
* :func:`wide_activation`: small convolutions on 32x32 feature maps, a
  dense prediction at the end. Kilobytes of weights, 64 KiB of activation
  a sample at every cut: data parallelism moves far less.

Each returns ``(model, sample)``: the ``nn.Sequential`` and a batch of
inputs of the right shape (what ``aggnet plan --model`` expects of a
factory).
"""

from __future__ import annotations

import torch
import torch.nn as nn


def narrow_cut(batch: int = 16, width: int = 1024, bottleneck: int = 32, inputs: int = 512, classes: int = 10):
    model = nn.Sequential(
        nn.Linear(inputs, width), nn.ReLU(),
        nn.Linear(width, width), nn.ReLU(),
        nn.Linear(width, bottleneck), nn.ReLU(),
        nn.Linear(bottleneck, width), nn.ReLU(),
        nn.Linear(width, width), nn.ReLU(),
        nn.Linear(width, classes),
    )
    return model, torch.randn(batch, inputs)


def wide_activation(batch: int = 16, channels: int = 16, size: int = 32, depth: int = 6):
    """A fully convolutional net (a dense prediction: the loss is on the
    output map), so no cut is narrow: every one moves a 16x32x32 map."""
    layers: list[nn.Module] = [nn.Conv2d(3, channels, 3, padding=1), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU()]
    layers.append(nn.Conv2d(channels, 3, 3, padding=1))
    return nn.Sequential(*layers), torch.randn(batch, 3, size, size)


def chain(batch: int = 8, layers: int = 100, width: int = 64):
    """A long chain of small layers (the planner's speed test)."""
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]), torch.randn(batch, width)
