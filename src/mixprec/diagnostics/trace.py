"""Find where a NaN or inf is born: the first module, in execution order (forward,
then backward), whose output or output-gradient is not finite."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["NonFiniteOrigin", "trace_nonfinite"]


@dataclass(frozen=True)
class NonFiniteOrigin:
    """The first module whose output (or input gradient) went inf/NaN, and the evidence."""

    phase: str            # "forward" or "backward"
    module: str           # fully qualified name
    op: str               # module class
    input_amax: float     # largest finite |input| (forward) or |grad_output| (backward)
    input_dtype: str
    output_amax: float

    def describe(self) -> str:
        """One sentence: phase, module, op, and the input's dtype and max |x|."""
        where = "output" if self.phase == "forward" else "gradient"
        return (f"{self.phase}: {self.module} ({self.op}) produced a non-finite {where}; "
                f"its input was {self.input_dtype} with max |x| = {self.input_amax:.4g}")


def _amax(t) -> float:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.numel() == 0:
        return 0.0
    a = t.detach().float().abs()
    a = a[torch.isfinite(a)]
    return a.max().item() if a.numel() else math.inf


def trace_nonfinite(model: nn.Module, run: Callable[[], Any]) -> NonFiniteOrigin | None:
    """Call ``run()`` (a forward and backward) with hooks on every module and return the
    first non-finite origin, or None if everything stayed finite. Costs host syncs: a
    diagnostic, not for the training loop."""
    found: list[NonFiniteOrigin] = []
    handles = []

    def first(t):
        return t[0] if isinstance(t, (tuple, list)) and t else t

    for name, m in model.named_modules():
        if not name or list(m.children()):
            continue

        def fwd(mod, inp, out, name=name):
            o = first(out)
            if found or not isinstance(o, torch.Tensor) or not o.is_floating_point():
                return
            if not torch.isfinite(o).all():
                i = first(inp)
                found.append(NonFiniteOrigin("forward", name, type(mod).__name__, _amax(i),
                                             str(getattr(i, "dtype", "?")).replace("torch.", ""),
                                             _amax(o)))

        def bwd(mod, gin, gout, name=name):
            g = first(gin)
            if found or not isinstance(g, torch.Tensor):
                return
            if not torch.isfinite(g).all():
                go = first(gout)
                found.append(NonFiniteOrigin("backward", name, type(mod).__name__, _amax(go),
                                             str(getattr(go, "dtype", "?")).replace("torch.",
                                                                                     ""),
                                             _amax(g)))

        handles.append(m.register_forward_hook(fwd))
        handles.append(m.register_full_backward_hook(bwd))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None
