"""How much each Linear loses in each format, measured on real batches.

``layer_numerics(model, batches, loss_fn, formats)`` runs the model in fp32 on each
calibration batch with hooks on its Linears, keeping every Linear's input ``x`` and
output gradient ``g``. Then, per Linear and format, the same weights run the three GEMMs
of a training step on those tensors:

- the reference is bf16: operands rounded to bf16, products accumulated in fp32 (what
  bf16 autocast computes, up to summation order);
- an fp8/fp4 format runs a ``Float8Linear`` built with that format's recipe, forward and
  backward, casts included (delayed scaling sees the batches in order, after one
  unscored pass over the first, so its scale comes from the earlier batches' amax
  history, as in training).

For each GEMM the signal-to-quantization-noise ratio against bf16,
``SQNR = 10·log10(Σ ref² / Σ (ref − out)²)`` in dB, is taken at its worst over the
batches; the layer's score is the worst of output, dgrad and wgrad. Also kept: the share
of the input's and gradient's non-zero elements that the format's cast flushes to zero,
and, for delayed scaling, the amax headroom: by how many binades a batch's amax fell
below (positive) or rose above (negative) the history's maximum. A negative headroom
means delayed scaling saturates that batch.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mixprec.modules.linear import Float8Linear, is_conv1d
from mixprec.planner.timing import BF16, recipe_for_format
from mixprec.recipe import Recipe

__all__ = ["LayerNumerics", "layer_numerics", "sqnr_db", "linear_names", "backward_all",
           "captured"]


@dataclass(frozen=True)
class LayerNumerics:
    """One Linear in one format, at its worst over the calibration batches: SQNR (dB)
    of output, dgrad and wgrad against bf16, the share flushed to zero, and delayed
    scaling's amax headroom in binades (None for scalings that need no history)."""

    sqnr_out: float
    sqnr_dgrad: float
    sqnr_wgrad: float
    flushed: float
    headroom: float | None

    @property
    def sqnr(self) -> float:
        """The worst of the three GEMMs' SQNR, in dB."""
        return min(self.sqnr_out, self.sqnr_dgrad, self.sqnr_wgrad)


def sqnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    """``10·log10(Σ ref² / Σ (ref − out)²)`` in float64 (inf where they are equal)."""
    ref, out = ref.double(), out.double()
    noise = (ref - out).pow(2).sum().item()
    signal = ref.pow(2).sum().item()
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10 * math.log10(signal / noise)


def linear_names(model: nn.Module) -> list[str]:
    """The names of the Linears (and GPT-2 ``Conv1D``\\ s) a recipe's rules can name."""
    return [n for n, m in model.named_modules()
            if type(m) is nn.Linear or is_conv1d(m)]


def _capture(model, batches, loss_fn):
    """Per Linear: its inputs and output gradients on each batch (fp32, 2-D)."""
    names = linear_names(model)
    got: dict[str, list] = {n: [] for n in names}
    handles = []
    for n in names:
        m = model.get_submodule(n)

        def fwd(mod, args, out, n=n):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            pair = [x, None]
            got[n].append(pair)
            if out.requires_grad:
                def keep(g, pair=pair):
                    pair[1] = g.detach().reshape(-1, g.shape[-1]).float()
                out.register_hook(keep)
        handles.append(m.register_forward_hook(fwd))
    backward_all(model, batches, loss_fn, handles)
    return got


def captured(model: nn.Module, batches: Sequence[Any],
             loss_fn: Callable[[nn.Module, Any], torch.Tensor],
             capture: Callable) -> tuple[nn.Module, Any]:
    """An fp32 training copy of ``model`` and what ``capture(copy, batches, loss_fn)``
    took from it (``model`` is left in its mode)."""
    was = model.training
    ref = copy.deepcopy(model).float().train()
    try:
        return ref, capture(ref, batches, loss_fn)
    finally:
        model.train(was)


def backward_all(model: nn.Module, batches: Sequence[Any],
                 loss_fn: Callable[[nn.Module, Any], torch.Tensor], handles: list) -> None:
    """The loss's backward on each batch with the capturing ``handles`` on, which are
    removed after (and the gradients cleared), whatever happens."""
    try:
        for b in batches:
            model.zero_grad(set_to_none=True)
            loss_fn(model, b).backward()
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)


def _weight(m: nn.Module) -> torch.Tensor:
    w = m.weight.detach().float()
    return w.t() if is_conv1d(m) else w


def _bf16(x, w, g):
    """bf16 GEMMs on bf16-rounded operands with fp32 accumulation: y, dgrad, wgrad."""
    xb, wb, gb = (t.bfloat16().float() for t in (x, w, g))
    return xb @ wb.t(), gb @ wb, gb.t() @ xb


def _flushed(t: torch.Tensor, q: torch.Tensor) -> tuple[int, int]:
    nz = t != 0
    return int((nz & (q == 0)).sum()), int(nz.sum())


def layer_numerics(model: nn.Module, batches: Sequence, loss_fn: Callable,
                   formats: Sequence[str], recipe: Recipe
                   ) -> dict[tuple[str, str], LayerNumerics]:
    """``{(linear name, format): LayerNumerics}`` for every Linear (any dims: the
    routes pad) and every fp8/fp4 format (the module docstring says
    what is measured). ``loss_fn(model, batch)`` returns the
    loss; ``recipe``: the fp8 recipe whose other settings (margin, history) the casts
    use. The model is left as it was."""
    fmts = [f for f in formats if f != BF16]
    ref_model, got = captured(model, batches, loss_fn, _capture)
    out = {}
    for name, pairs in got.items():
        pairs = [(x, g) for x, g in pairs if g is not None]
        if not pairs:
            continue
        lin = ref_model.get_submodule(name)
        w = _weight(lin)
        refs = [_bf16(x, w, g) for x, g in pairs]
        for f in fmts:
            out[(name, f)] = _score(lin, w, pairs, refs, recipe_for_format(recipe, f))
    return out


def _score(lin, w, pairs, refs, r: Recipe) -> LayerNumerics:
    d_out, d_in = w.shape
    plain = nn.Linear(d_in, d_out, bias=False)
    with torch.no_grad():
        plain.weight.copy_(w)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        f8 = Float8Linear.from_linear(plain, r)
    s_out, s_dx, s_dw, lost, total, headroom = [], [], [], 0, 0, None
    history = {"input": 0.0, "grad_output": 0.0}
    skip = 1 if f8.quantizer.has_history else 0
    if skip:
        # training's first step has no history to scale by; from the second on the
        # scale is the history's: warm it on the first batch, score every batch after
        pairs, refs = [pairs[0], *pairs], [refs[0], *refs]
    for i, ((x, g), (y0, dx0, dw0)) in enumerate(zip(pairs, refs)):
        xi = x.clone().requires_grad_(True)
        f8.weight.grad = None
        y = f8(xi)
        y.backward(g)
        s_out.append(sqnr_db(y0, y.detach()))
        s_dx.append(sqnr_db(dx0, xi.grad))
        s_dw.append(sqnr_db(dw0, f8.weight.grad))
        for t, role in ((x, "input"), (g, "grad_output")):
            if i < skip:
                break
            with torch.no_grad():
                q = f8.quantize(t, role, 1).dequant().float()
            a, b = _flushed(t, q)
            lost, total = lost + a, total + b
            if f8.quantizer.has_history:
                amax = t.abs().max().item()
                if i > 0 and amax > 0 and history[role] > 0:
                    h = math.log2(history[role] / amax)
                    headroom = h if headroom is None else min(headroom, h)
                history[role] = max(history[role], amax)
    return LayerNumerics(min(s_out[skip:]), min(s_dx[skip:]), min(s_dw[skip:]),
                         lost / total if total else 0.0, headroom)
