"""Does fp8 scaling fit each Linear's inputs and gradients? Per tensor, rowwise, per block.

An fp8 cast maps a tensor's amax onto the format's max. Every element ``v`` lands at
``|v| · max / amax``: below half the smallest subnormal it flushes to zero, below the
smallest normal it keeps fewer mantissa bits. With one scale per tensor a single large
token sets the scale for all the others. With one scale per row (per token) it only
sets its own. e4m3 spans 2^17.8 from its smallest subnormal to its max (448 / 2^-9), so
values more than ~2^17 (~2e5) below the amax are lost. e5m2 spans 2^31.8 (57344 / 2^-16).

``fp8_ranges(model, loss_fn, recipe)`` runs one fp32 forward and backward with hooks on
the Linears that ``engine.convert`` would convert. For each input (e4m3) and output
gradient (e5m2 under ``fp8_format=hybrid``, else e4m3) it gives the share of non-zero
elements that flush to zero under per-tensor, rowwise and block scaling (one scale per
tile of the last dim: 128 elements, 32 under ``fp8_scaling=mx``). The doctor turns a
share above ``FLUSH_FLAG`` under the recipe's scaling into a finding. Delayed scaling
takes its amax from a history that is at least the current one, so its real share can
only be higher. NVFP4 is not audited: its e2m1 elements span only 2^3.6 below a block's
amax, so flushing small elements is the format's design, not a misfit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from mixprec.diagnostics.findings import Finding
from mixprec.engine.convert import plan as convert_plan
from mixprec.formats import elements as formats
from mixprec.formats.gemm import FORMATS
from mixprec.modules.linear import fp8_modules
from mixprec.recipe import Recipe

__all__ = ["Fp8Range", "fp8_ranges", "audit_fp8_ranges", "FLUSH_FLAG"]

#: share of a tensor's non-zero elements flushed to zero above which the doctor warns
FLUSH_FLAG = 0.01


@dataclass(frozen=True)
class Fp8Range:
    """One Linear's input or output gradient: the share of non-zero elements that an fp8
    cast flushes to zero with a per-tensor scale and with a per-row scale."""

    layer: str
    tensor: str          # "input" or "grad_output"
    fmt: str             # "fp8_e4m3" or "fp8_e5m2"
    per_tensor: float
    rowwise: float
    spread: float        # amax / the smallest non-zero |value|, as log2
    blockwise: float = 0.0  # one scale per tile of the last dim
    scaling: str = ""    # the layer's fp8 scaling (its layer: rule's, or the recipe's)


def _flushed(t: torch.Tensor, fmt: str, tile: int = 128
             ) -> tuple[float, float, float, float]:
    """Shares of non-zero elements flushed to zero per tensor and per row, the log2 of
    the tensor's amax over its smallest non-zero magnitude, and the share flushed with a
    scale per ``tile`` elements of a row."""
    f = formats.get(fmt)
    a = t.detach().float().abs().reshape(-1, t.shape[-1])
    nonzero = (a > 0) & torch.isfinite(a)
    n = int(nonzero.sum())
    if n == 0:
        return 0.0, 0.0, 0.0
    limit = f.min_subnormal / 2 / f.max  # |v| / amax below this flushes
    amax = a[nonzero].max()
    rows = a.amax(dim=1, keepdim=True)
    per_tensor = int((nonzero & (a < limit * amax)).sum()) / n
    rowwise = int((nonzero & (a < limit * rows)).sum()) / n
    spread = math.log2(float(amax) / float(a[nonzero].min()))
    pad = torch.nn.functional.pad(torch.where(nonzero, a, 0.0), (0, (-a.shape[1]) % tile))
    tiles = pad.view(a.shape[0], -1, tile)
    tile_amax = tiles.amax(dim=-1, keepdim=True)
    blockwise = int(((tiles > 0) & (tiles < limit * tile_amax)).sum()) / n
    return per_tensor, rowwise, spread, blockwise


def fp8_ranges(model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor],
               recipe: Recipe | str = "fp8") -> list[Fp8Range]:
    """One fp32 forward and backward of ``loss_fn(model)`` with hooks on the Linears that
    ``mixprec.engine.convert`` would convert (and any Float8Linear already there); the
    model's gradients are left as they were."""
    r = Recipe.coerce(recipe)
    seen: list[Fp8Range] = []
    handles = []

    def record(name: str, kind: str, fmt: str, t: torch.Tensor, lr: Recipe) -> None:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
            pt, rw, spread, bw = _flushed(t, fmt, lr.linear.tile)
            seen.append(Fp8Range(name, kind, fmt, pt, rw, spread, bw, lr.linear.name))

    # each Linear with the recipe it runs (its layer: rule's scaling, or its own)
    mods = [(n, m, r.for_layer(n)) for n, m, why in convert_plan(model, rules=r.layer_rules)
            if why is None]
    mods += [(n, m, m.fp8_recipe) for n, m in fp8_modules(model).items()]
    for name, mod, lr in mods:
        grad_fmt = "fp8_e5m2" if lr.linear.grad_dtype == torch.float8_e5m2 else "fp8_e4m3"
        handles.append(mod.register_forward_pre_hook(
            lambda m, args, name=name, lr=lr: record(name, "input", "fp8_e4m3", args[0],
                                                     lr)))
        handles.append(mod.register_full_backward_hook(
            lambda m, gin, gout, name=name, lr=lr, fmt=grad_fmt:
            record(name, "grad_output", fmt, gout[0], lr)))
    saved = {p: p.grad for p in model.parameters()}
    try:
        loss_fn(model).float().backward()
    finally:
        for h in handles:
            h.remove()
        for p, g in saved.items():
            p.grad = g
    return seen


def audit_fp8_ranges(model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor],
                     recipe: Recipe | str) -> tuple[list[Finding], list[Fp8Range]]:
    """A finding when an fp8 Linear's input or output gradient loses more than
    ``FLUSH_FLAG`` of its elements to zero under the recipe's scaling, advising rowwise
    scaling where that keeps them, else keeping the layer out of fp8."""
    r = Recipe.coerce(recipe)
    ranges = fp8_ranges(model, loss_fn, r)
    def fmt(x: Fp8Range):  # each layer is judged by its own format
        return FORMATS.get(x.scaling, type(r.linear))

    def mode(x: Fp8Range) -> str:
        return fmt(x).flush_view

    def lost(x: Fp8Range) -> float:
        return fmt(x).flushed(x.per_tensor, x.rowwise, x.blockwise)

    # fp4 flushes small elements by design (module doc): its layers are not judged
    bad = sorted((x for x in ranges if mode(x) and lost(x) > FLUSH_FLAG), key=lost,
                 reverse=True)
    if not bad:
        return [], ranges
    worst = bad[0]
    evidence = "; ".join(
        f"{x.layer} {x.tensor} ({x.fmt}): {lost(x):.1%} flushed {mode(x)}"
        + ("" if not fmt(x).per_tensor else
           f", {x.rowwise:.1%} rowwise, {x.blockwise:.1%} per 128-block")
        + f", amax / smallest = 2^{x.spread:.1f}" for x in bad[:5])
    helps = all(fmt(x).per_tensor and x.rowwise <= FLUSH_FLAG for x in bad)
    layers = sorted({x.layer for x in bad})
    if helps:
        advice = ("use rowwise scaling (recipe 'fp8-rowwise'), or block scaling "
                  "('fp8-block'): a few large rows (tokens) set the per-tensor scale, and "
                  "a scale per row or per 128-element tile keeps the others")
    else:
        advice = (f"keep {', '.join(layers[:3])} out of fp8 (a recipe rule "
                  f"'layer:{layers[0]}=bf16', mixprec.engine.convert.convert(model, recipe, "
                  "filter=...), or MixedPrecision(..., fp8_filter=...)), or use bf16"
                  + ("" if r.linear.grad_dtype == torch.float8_e5m2
                     or worst.tensor != "grad_output"
                     else "; e5m2 gradients (fp8_format=hybrid) have 2^14 more range"))
    return [Finding("warning", "fp8-range",
                    f"fp8 casts flush {lost(worst):.0%} of {worst.layer}'s {worst.tensor} "
                    "to zero", evidence, advice, {"layers": layers})], ranges
