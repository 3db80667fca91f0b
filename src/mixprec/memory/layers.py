"""Each Linear's compute format, for the memory estimate: which Linears a recipe runs in fp8
and with which quantizer, its ``layer:`` rules applied (the one rule is
``mixprec.engine.convert.layer_formats``; this module only reads it)."""

from __future__ import annotations

from torch import nn

from mixprec.engine.convert import layer_formats
from mixprec.memory.transient import linear_shapes
from mixprec.modules.linear import Float8Linear
from mixprec.recipe import Recipe

__all__ = ["layer_recipes", "fp8_share"]


def layer_recipes(model: nn.Module, r: Recipe) -> dict[str, Recipe | None]:
    """Each Linear's fp8 recipe under recipe ``r`` (None: kept in high precision), as
    ``mixprec.engine.convert.layer_formats`` decides and ``Recipe.for_layer`` gives it: its
    ``layer:`` rule's preset, or ``r``'s own, or a hand-converted Float8Linear's."""
    out: dict[str, Recipe | None] = {}
    for fqn, fmt in layer_formats(model, r).items():
        m = model.get_submodule(fqn) if fqn else model
        if isinstance(m, Float8Linear):
            out[fqn] = m.fp8_recipe
        elif r.linear is None or fmt == "bf16":
            out[fqn] = None
        else:
            out[fqn] = r.for_layer(fqn)
    return out


def fp8_share(model: nn.Module, r: Recipe) -> float:
    """The share of the Linears' inputs (weighted by ``in_features``) that fp8 recipe
    ``r`` with ``layer:`` rules saves in fp8, among the Linears it would run in fp8
    without them (the rest, the head among them, the activation formula already
    prices as it did)."""
    shapes = {fqn: i for fqn, i, _ in linear_shapes(model)}
    own, base = layer_recipes(model, r), layer_recipes(model, r.base)
    pool = [fqn for fqn, rec in base.items() if rec is not None and fqn in shapes]
    total = sum(shapes[f] for f in pool)
    if not total:
        return 1.0
    return sum(shapes[f] for f in pool if own.get(f) is not None) / total
