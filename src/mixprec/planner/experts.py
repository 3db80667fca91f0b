"""The planner's experts modules: routed token counts, grouped-GEMM timings, numerics.

A transformers experts module (``mixprec.experts.hook``: 3-D expert weights run through
``mixprec.experts.grouped_mm``) is a candidate as a Linear is, one format for all its
experts (``layer:<name>=<format>``):

- ``experts_shapes``: what its time depends on, read from one forward of the sample
  batch: its weights' shapes, top-k, and the tokens the router sent to each expert
  (``ExpertsShape.counts``, as the router gave them: skewed, never a uniform split);
- ``experts_costs``: its forward + backward timed in each format (``timing``'s
  interleaved rounds, measured again while they disagree, cached) on a copy of the
  module behind a real engine, with routing that sends each expert exactly its
  counted tokens: the grouped GEMMs of a low-precision format
  (``mixprec.experts.hook.experts_forward``), the module's own implementation under
  the recipe's autocast for ``bf16``;
- ``experts_numerics``: per format, each projection's three grouped GEMMs (output,
  dgrad, wgrad) on its real inputs and output gradients from the calibration batches
  against bf16 (operands rounded to bf16, fp32 products, per expert), as SQNR
  (``numerics.LayerNumerics``: the worst GEMM of either projection), as a Linear's
  GEMMs are scored; delayed scaling is warmed on the first batch and steps its history
  after each, as in training.
"""

from __future__ import annotations

import copy
import math
import warnings
import zlib
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from mixprec.experts import adapter
from mixprec.experts.format import ExpertsFormat
from mixprec.experts.grouped import grouped_mm
from mixprec.experts.hook import _projections, experts_modules
from mixprec.planner.numerics import (
    LayerNumerics,
    _flushed,
    backward_all,
    captured,
    sqnr_db,
)
from mixprec.planner.timing import (
    BF16,
    LayerCost,
    layer_costs,
    recipe_for_format,
    timed_step,
)
from mixprec.recipe import Recipe
from mixprec.recipe.layer_rules import LayerRule

__all__ = ["ExpertsShape", "experts_shapes", "experts_costs", "experts_numerics",
           "kept_in_bf16", "widths"]


class ExpertsShape(NamedTuple):
    """One experts module as its timing sees it: its class, the shapes of its two
    projections' weights, its top-k, and the tokens routed to each expert."""

    kind: str
    up: tuple[int, ...]
    down: tuple[int, ...]
    top_k: int
    counts: tuple[int, ...]

    @property
    def tokens(self) -> int:
        """The tokens of the batch (each routed to ``top_k`` experts)."""
        return sum(self.counts) // max(1, self.top_k)

    @property
    def label(self) -> str:
        """How a timing message names it."""
        return (f"{self.kind} {len(self.counts)} experts at {self.tokens} tokens "
                f"(counts {list(self.counts)})")


def kept_in_bf16(recipe: Recipe, names: Iterable[str]) -> Recipe:
    """``recipe`` with a ``layer:<name>=bf16`` rule per experts module in ``names``:
    the fp8 recipe with none of them converted (a Linear's fp8_filter does not reach
    them)."""
    rules = tuple(LayerRule("layer", n, BF16) for n in names)
    return recipe.replace(layers=recipe.layers + rules) if rules else recipe


def experts_shapes(model: nn.Module, run: Callable[[], Any]) -> dict[str, ExpertsShape]:
    """Each experts module's ``ExpertsShape``, its counts read from its top-k indices
    in the forward ``run()`` makes (an expert the batch never reaches: 0 tokens; a
    module it never reaches: none at all)."""
    mods = experts_modules(model)
    out, handles = {}, []
    for name, m in mods.items():
        up, down = _projections(m)

        def hook(mod, args, res, name=name, up=up, down=down):
            if len(args) < 3:  # not called as (hidden, top_k_index, top_k_weights)
                return
            idx = args[1].reshape(-1)
            counts = torch.bincount(idx[idx < mod.num_experts], minlength=mod.num_experts)
            out[name] = ExpertsShape(type(mod).__name__, tuple(getattr(mod, up).shape),
                                     tuple(getattr(mod, down).shape), int(args[1].shape[-1]),
                                     tuple(int(c) for c in counts.tolist()))
        handles.append(m.register_forward_hook(hook))
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    for name, m in mods.items():
        if name not in out:
            up, down = _projections(m)
            out[name] = ExpertsShape(type(m).__name__, tuple(getattr(m, up).shape),
                                     tuple(getattr(m, down).shape), 1, (0,) * m.num_experts)
    return out


def experts_costs(modules: dict[ExpertsShape, nn.Module], formats: Iterable[str],
                  recipe: Recipe, device: torch.device | str = "cpu", *,
                  seconds: float = 0.25, cache_file: str | Path | None = None
                  ) -> dict[tuple[ExpertsShape, str], LayerCost]:
    """``{(shape, format): LayerCost}`` for each experts module (one per distinct
    shape, counts included) in each format (module docstring; ``recipe``: the fp8
    recipe around them). A module no token reached costs nothing in any format."""
    formats = list(formats)
    out = layer_costs([s for s in modules if s.tokens], formats, recipe, device,
                      seconds=seconds, cache_file=cache_file,
                      build=lambda s, f, r, d: _one_experts(s, modules[s], f, r, d))
    return {**out, **{(s, f): LayerCost(0.0, 0, "none") for s in modules if not s.tokens
                      for f in formats}}


class _Routed(nn.Module):
    """An experts module called on given routing: ``experts(hidden, index, weights)``."""

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.experts = experts

    def forward(self, hidden, index, weights):
        return self.experts(hidden, index, weights)


def _routing(shape: ExpertsShape, hidden: int, device, g: torch.Generator):
    """Inputs that send each expert exactly ``shape.counts`` rows: hidden states, the
    top-k index (the experts' ids, shuffled) and the top-k weights."""
    e = len(shape.counts)
    ids = torch.repeat_interleave(torch.arange(e), torch.tensor(shape.counts))
    ids = ids[torch.randperm(ids.numel(), generator=g)]
    t = shape.tokens
    index = ids[:t * shape.top_k].view(t, shape.top_k)
    weights = torch.softmax(torch.randn(t, shape.top_k, generator=g), -1)
    x = torch.randn(t, hidden, generator=g)
    return x.to(device), index.to(device), weights.to(device)


def _one_experts(shape: ExpertsShape, module: nn.Module, fmt: str, recipe: Recipe,
                 device):
    """A copy of ``module`` in ``fmt`` behind a real engine on routing with the
    shape's counts, and the step to time (``timing.layer_costs``' ``build``)."""
    from mixprec.engine.facade import MixedPrecision

    m = copy.deepcopy(module).float().to(device)
    for proj in _projections(m):
        m.__dict__.pop(f"{proj}_fp8", None)
        m._modules.pop(f"{proj}_fp8", None)
    model = _Routed(m)
    r = (kept_in_bf16(recipe.base, ["experts"]) if fmt == BF16
         else recipe_for_format(recipe, fmt))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no Linear to convert, kernel notes
        engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.0), r)
    g = torch.Generator().manual_seed(0)
    x, index, weights = _routing(shape, _hidden(m), device, g)
    x.requires_grad_(True)
    dy = torch.randn(x.shape, generator=g).to(device)
    route = "native"
    f8 = getattr(m, "down_proj_fp8", None)
    if isinstance(f8, ExpertsFormat):
        from mixprec.experts.grouped import _route

        w = m.down_proj
        n, k = (w.shape[2], w.shape[1]) if m.is_transposed else (w.shape[1], w.shape[2])
        route = _route("auto", f8, torch.device(device), k, n)
        route = f8.backend(device) if route == "loop" else route

    return (*timed_step(engine, model, (x, index, weights), dy, device), route)


def _hidden(m: nn.Module) -> int:
    """The experts' input width (the model's hidden size)."""
    return widths(m)[0]


def widths(m: nn.Module) -> tuple[int, int]:
    """An experts module's (hidden, intermediate) widths: its first projection's input
    and its down projection's input (a plan row's shape)."""
    up, down = (getattr(m, p) for p in _projections(m))
    if m.is_transposed:  # (E, in, out)
        return int(up.shape[1]), int(down.shape[1])
    return int(up.shape[2]), int(down.shape[2])


def _capture(model: nn.Module, batches: Sequence, loss_fn: Callable) -> dict[str, list]:
    """Per experts module: its inputs (hidden states, top-k index and weights) and its
    output's gradient on each batch (fp32)."""
    got: dict[str, list] = {n: [] for n in experts_modules(model)}
    handles = []
    for n in got:
        def fwd(mod, args, out, n=n):
            if len(args) < 3:  # not called as (hidden, top_k_index, top_k_weights)
                return
            item = [args[0].detach().float(), args[1].detach(), args[2].detach().float(),
                    None]
            got[n].append(item)
            if out.requires_grad:
                def keep(g, item=item):
                    item[3] = g.detach().float()
                out.register_hook(keep)
        handles.append(model.get_submodule(n).register_forward_hook(fwd))
    backward_all(model, batches, loss_fn, handles)
    return got


def _gemms(m: nn.Module, x, index, weights, g) -> dict[str, tuple]:
    """Per projection: its input rows sorted by expert, the cumulative counts, its
    weight (E × out × in) and its output's gradient, from the routed forward
    (``experts_forward``'s, per expert in fp32) and its backward on ``g``."""
    k, e = index.shape[-1], m.num_experts
    ids, perm = torch.sort(index.reshape(-1))
    keep = ids < e  # expert parallelism's sentinels route nowhere
    ids, perm = ids[keep], perm[keep]
    counts = torch.bincount(ids, minlength=e)
    bounds = [(int(a - c), int(a)) for a, c in zip(counts.cumsum(0).tolist(),
                                                    counts.tolist())]
    got = {}

    def lin(proj, a):
        w = getattr(m, proj).detach()
        w = w.transpose(1, 2) if m.is_transposed else w
        y = torch.cat([a[s:t] @ w[i].t() for i, (s, t) in enumerate(bounds)])
        if m.has_bias:
            y = y + getattr(m, f"{proj}_bias").detach()[ids]
        y.retain_grad()
        got[proj] = (a.detach(), counts.cumsum(0), w, y)
        return y

    up, down = _projections(m)
    with torch.enable_grad():
        h = lin(up, x.detach().requires_grad_(True)[perm // k])
        h = m._apply_gate(h) if m.has_gate else m.act_fn(h)
        h = lin(down, h)
        if m.has_post_expert_norm:
            h = m.post_expert_norm(h)
        h = h * weights.reshape(-1)[perm].unsqueeze(-1)
        out = torch.zeros_like(x).index_add(0, perm // k, h)
        out.backward(g)
    return {p: (a, offs, w, y.grad) for p, (a, offs, w, y) in got.items()}


def _bf16(a, offs, w, g):
    """Per expert: bf16-rounded operands, fp32 products: y, dgrad, wgrad (E × out ×
    in)."""
    ab, wb, gb = (t.bfloat16().float() for t in (a, w, g))
    start, ys, dxs, dws = 0, [], [], []
    for i, end in enumerate(offs.tolist()):
        ys.append(ab[start:end] @ wb[i].t())
        dxs.append(gb[start:end] @ wb[i])
        dws.append(gb[start:end].t() @ ab[start:end])
        start = end
    return torch.cat(ys), torch.cat(dxs), torch.stack(dws)


def experts_numerics(model: nn.Module, batches: Sequence, loss_fn: Callable,
                     formats: Sequence[str], recipe: Recipe
                     ) -> dict[tuple[str, str], LayerNumerics]:
    """``{(experts module name, format): LayerNumerics}`` for every experts module the
    batches reach with a gradient and every fp8/fp4 format: each projection's grouped
    GEMMs (output, dgrad, wgrad) on its real inputs and output gradients against bf16,
    per expert, the module's score the worst of them (a Linear's GEMMs are scored
    alike: ``numerics``); ``recipe``: the fp8 recipe whose other settings the casts
    use. The model is left as it was."""
    fmts = [f for f in formats if f != BF16]
    if not fmts or not experts_modules(model):
        return {}
    ref_model, got = captured(model, batches, loss_fn, _capture)
    out = {}
    for name, items in got.items():
        mod = ref_model.get_submodule(name)
        runs = [_gemms(mod, x, i, w, g) for x, i, w, g in items if g is not None]
        if not runs:
            continue
        for f in fmts:
            r = recipe_for_format(recipe, f)
            scores = [_score(f"{name}.{p}", [run[p] for run in runs], r)
                      for p in _projections(mod)]
            out[(name, f)] = LayerNumerics(
                *(min(getattr(s, k) for s in scores)
                  for k in ("sqnr_out", "sqnr_dgrad", "sqnr_wgrad")),
                max(s.flushed for s in scores),
                min((s.headroom for s in scores if s.headroom is not None), default=None))
    return out


def _score(name: str, gemms, r: Recipe) -> LayerNumerics:
    """One projection's grouped GEMMs in ``r``'s format against bf16 over the batches
    (delayed scaling warmed on the first, its history stepped after each)."""
    fmt = ExpertsFormat(r, seed=zlib.crc32(name.encode()), device=gemms[0][0].device)
    history = fmt.quantizer.has_history
    if history:  # the first step has no history to scale by: warm it on the first batch
        gemms = [gemms[0], *gemms]
    s_out, s_dx, s_dw, lost, total, headroom, seen = [], [], [], 0, 0, None, {}
    for k, (a, offs, w, g) in enumerate(gemms):
        x, wl = a.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y = grouped_mm(x, wl, offs, fmt)
        y.backward(g)
        fmt.update_scales()  # the optimizer step's: delayed scaling's history moves
        if k < int(history):
            continue
        y0, dx0, dw0 = _bf16(a, offs, w, g)
        s_out.append(sqnr_db(y0, y.detach()))
        s_dx.append(sqnr_db(dx0, x.grad))
        s_dw.append(sqnr_db(dw0, wl.grad))
        for t, role in ((a, "input"), (g, "grad_output")):
            with torch.no_grad():
                q = adapter.cast(fmt, t, role, 1).dequant().float()
            n_lost, n_all = _flushed(t, q)
            lost, total = lost + n_lost, total + n_all
            amax = t.abs().max().item()
            if history and seen.get(role, 0) > 0 and amax > 0:
                h = math.log2(seen[role] / amax)
                headroom = h if headroom is None else min(headroom, h)
            seen[role] = max(seen.get(role, 0.0), amax)
    return LayerNumerics(min(s_out), min(s_dx), min(s_dw),
                         lost / total if total else 0.0, headroom)
