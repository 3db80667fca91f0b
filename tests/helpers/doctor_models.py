"""Models with a planted fault (a layer that scales its input) and the loss over a fixed
data set, as the doctor's tests hand them to ``doctor``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Scale", "mlp_factory", "batches"]


class Scale(nn.Module):
    """Multiplies its input by ``k`` (1e5 overflows fp16 downstream)."""

    def __init__(self, k: float) -> None:
        super().__init__()
        self.k = k

    def forward(self, x):
        return x * self.k


def mlp_factory(middle: nn.Module | None = None, d: int = 64):
    """A maker of ``Linear(16, d), GELU, [middle], Linear(d, 4)`` (seed 0 each time)."""
    def make():
        torch.manual_seed(0)
        layers = [nn.Linear(16, d), nn.GELU()]
        if middle is not None:
            layers.append(middle)
        layers.append(nn.Linear(d, 4))
        return nn.Sequential(*layers)
    return make


def batches(scale: float = 1.0):
    """``fn(model, step)``: the cross-entropy of 20 fixed batches of 32, in turn, times
    ``scale``."""
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g))
            for _ in range(20)]

    def fn(model, step):
        x, y = data[step % len(data)]
        return F.cross_entropy(model(x), y) * scale
    return fn
