"""NumericsMonitor: per-layer statistics of activations, activation gradients and
parameter gradients, sampled every N steps.

    mon = NumericsMonitor(model, every=10)
    for step ...:
        with mon.sample(step):            # hooks record only on sampled steps
            loss = model(x); engine.backward(loss)
    mon.summary()                         # per layer: amax, zeros, underflow per format

Statistics are device tensors gathered by hooks. Nothing is copied to the host until
``summary()``. The hooks exist only inside a sampled step's ``with`` block (put the
backward inside it too), so unsampled steps run exactly as without the monitor.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import defaultdict
from collections.abc import Iterator

import torch
from torch import nn

from mixprec.diagnostics.stats import tensor_stats

__all__ = ["NumericsMonitor"]

# torch notes when a full backward hook sees no input requiring grad (the first layer of
# any model): expected here, and noise for the user
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients")


def _leaves(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if n and not list(m.children())]


class NumericsMonitor:
    """Forward-output, output-gradient and parameter-gradient statistics per leaf module."""

    def __init__(self, model: nn.Module, every: int = 1) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.model = model
        self.every = every
        self.active = False
        self.records: dict[str, list[dict]] = defaultdict(list)  # "kind:layer" -> stats
        self._handles = []

    def _attach(self) -> None:
        for name, m in _leaves(self.model):
            self._handles.append(m.register_forward_hook(self._fwd(name)))
            self._handles.append(m.register_full_backward_hook(self._bwd(name)))
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                self._handles.append(p.register_hook(self._pgrad(name)))

    def _fwd(self, name):
        def hook(mod, inp, out):
            if self.active and isinstance(out, torch.Tensor) and out.is_floating_point():
                self.records[f"activation:{name}"].append(tensor_stats(out))
        return hook

    def _bwd(self, name):
        def hook(mod, gin, gout):
            g = gout[0] if gout else None
            if self.active and isinstance(g, torch.Tensor):
                self.records[f"act_grad:{name}"].append(tensor_stats(g))
        return hook

    def _pgrad(self, name):
        def hook(g):
            if self.active:
                self.records[f"param_grad:{name}"].append(tensor_stats(g))
            return g
        return hook

    @contextlib.contextmanager
    def sample(self, step: int) -> Iterator[bool]:
        """Record inside this block if ``step`` is a sampled step."""
        self.active = step % self.every == 0
        if self.active:
            self._attach()
        try:
            yield self.active
        finally:
            self.active = False
            self.remove()

    def summary(self) -> dict[str, dict[str, float]]:
        """Per "kind:layer": each statistic averaged over samples (amax: max)."""
        out = {}
        for key, recs in self.records.items():
            agg = {}
            for stat in recs[0]:
                if stat == "hist":
                    agg[stat] = torch.stack([r[stat] for r in recs]).sum(0).tolist()
                    continue
                vals = torch.stack([r[stat].float().reshape(()) for r in recs])
                agg[stat] = (vals.max() if stat == "amax" else vals.mean()).item()
            out[key] = agg
        return out

    def histogram(self, kind: str = "act_grad") -> list[float]:
        """Summed log2-magnitude histogram over every layer of ``kind``."""
        hs = [r["hist"] for k, recs in self.records.items() if k.startswith(kind + ":")
              for r in recs]
        return torch.stack(hs).sum(0).tolist() if hs else []

    def remove(self) -> None:
        """Detach every hook the monitor installed; the model runs as before."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
