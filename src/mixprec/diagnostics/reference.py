"""The recipe against fp32, layer by layer (run both for a few steps and
compare gradient norms). Same seed, same data; per-layer gradient norm ratio and cosine
similarity at every step, and both loss curves."""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from mixprec.recipe import Recipe

__all__ = ["LayerComparison", "compare_to_fp32"]


@dataclass(frozen=True)
class LayerComparison:
    """How one layer's gradient under a recipe compares with fp32's over the steps."""

    layer: str
    cosine: float      # worst over the steps
    norm_ratio: float  # recipe / fp32, farthest from 1 over the steps


def _layer(param_name: str) -> str:
    return param_name.rsplit(".", 1)[0] if "." in param_name else param_name


def compare_to_fp32(model_factory: Callable[[], nn.Module],
                    batch_fn: Callable[[nn.Module, int], torch.Tensor],
                    recipe: Recipe | str, steps: int = 3, lr: float = 1e-3
                    ) -> tuple[list[LayerComparison], list[float], list[float]]:
    """Train ``steps`` steps of ``recipe`` and of fp32 from the same factory and batches;
    return (per-layer comparisons sorted worst first, recipe losses, fp32 losses)."""
    from mixprec.engine.facade import MixedPrecision

    runs = {}
    for name, rec in (("fp32", Recipe.coerce("fp32")), ("recipe", Recipe.coerce(recipe))):
        model = model_factory()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=lr), rec)
        names = {id(p): n for n, p in model.named_parameters()}
        grads_per_step, losses = [], []
        for step in range(steps):
            with engine.autocast():
                loss = batch_fn(model, step)
            engine.backward(loss)
            scale = float(engine.scale) if engine.scaler.scaled else 1.0
            g = {}
            for p, buf in zip(engine.param_state.working,
                              engine.param_state.grads):
                if buf is not None:
                    g[names[id(p)]] = buf.detach().double() / scale
            grads_per_step.append(g)
            losses.append(loss.item())
            engine.step()
        runs[name] = (grads_per_step, losses)
    per_layer = defaultdict(lambda: [1.0, 1.0])
    for ga, gb in zip(runs["recipe"][0], runs["fp32"][0]):
        by_layer = defaultdict(lambda: [[], []])
        for n in gb:
            if n in ga:
                by_layer[_layer(n)][0].append(ga[n].flatten())
                by_layer[_layer(n)][1].append(gb[n].flatten())
        for layer, (a, b) in by_layer.items():
            a, b = torch.cat(a), torch.cat(b)
            if not (torch.isfinite(a).all() and b.norm() > 0):
                cos, ratio = -1.0, float("inf")
            else:
                cos = torch.nn.functional.cosine_similarity(a, b, dim=0).item()
                ratio = (a.norm() / b.norm()).item()
            cur = per_layer[layer]
            cur[0] = min(cur[0], cos)
            if abs(ratio - 1) > abs(cur[1] - 1):
                cur[1] = ratio
    table = sorted((LayerComparison(k, c, r) for k, (c, r) in per_layer.items()),
                   key=lambda x: x.cosine)
    return table, runs["recipe"][1], runs["fp32"][1]
