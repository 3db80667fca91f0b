"""Does a plan still hold in training? Each fp8/fp4 Linear's SQNR, measured again.

A plan chooses a layer's format from its SQNR against bf16 on the calibration batches
at the initial weights. Training moves the weights and the activations, and a layer
that cleared the floor then can fall below it later. ``plan_sqnr`` measures each fp8/fp4
Linear of the plan in its chosen format exactly as the planner does
(``numerics.layer_numerics``: output, dgrad and wgrad against bf16, the worst of the
three) on the given weights and batches; ``audit_plan`` turns each layer below the
plan's floor into a ``plan-floor`` finding. The doctor calls it when it is handed a
plan (it imports this module only then: the planner sits above the diagnostics).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mixprec.diagnostics.findings import Finding
from mixprec.experts.hook import experts_modules
from mixprec.planner import Plan
from mixprec.planner.experts import experts_numerics
from mixprec.planner.numerics import layer_numerics, linear_names
from mixprec.planner.timing import BF16

__all__ = ["LayerCheck", "as_plan", "check_layers", "plan_sqnr", "audit_plan"]


@dataclass(frozen=True)
class LayerCheck:
    """One fp8/fp4 Linear of a plan: its format, the SQNR (dB) measured now against
    bf16 (the worst of its three GEMMs), the plan's floor, and the SQNR it was
    planned with (None where the plan file has none)."""

    layer: str
    fmt: str
    sqnr: float
    floor: float
    planned: float | None

    @property
    def below(self) -> bool:
        """Whether the measured SQNR falls below the floor."""
        return self.sqnr < self.floor


def as_plan(obj: Plan | str | os.PathLike) -> Plan:
    """``obj`` itself, or the plan file it names (``Plan.load``)."""
    if isinstance(obj, Plan):
        return obj
    if not os.path.exists(obj):
        raise FileNotFoundError(f"plan file {os.fspath(obj)!r} does not exist; write one "
                                "with mixprec.plan(...).save(path) or `mixprec plan`")
    return Plan.load(obj)


def check_layers(plan: Plan, model: nn.Module) -> None:
    """Raise if a layer of ``plan`` is not a Linear or experts module of ``model`` (a
    plan made for another model)."""
    have = set(linear_names(model)) | set(experts_modules(model))
    missing = [r.layer for r in plan.rows if r.layer not in have]
    if missing:
        raise ValueError(f"the plan names layers this model has no Linear called: "
                         f"{missing[:4]}; its Linears are {sorted(have)[:6]}... Make the "
                         "plan for this model (mixprec.plan(model, batch))")


def plan_sqnr(plan: Plan, model: nn.Module, batch_fn: Callable[[nn.Module, Any], torch.Tensor],
              batches: Iterable[Any]) -> list[LayerCheck]:
    """Each fp8/fp4 Linear and experts module of ``plan``, measured in its planned
    format on ``model``'s current weights (an fp32 model with plain Linears) and
    ``batches`` (``planner.experts`` scores the experts modules):
    ``batch_fn(model, batch)`` returns the loss (the doctor passes step indices)."""
    check_layers(plan, model)
    batches = list(batches)
    floors = plan.layer_floor()
    chosen = {r.layer: r for r in plan.rows if r.layer in floors}
    if not chosen:
        return []
    fmts = sorted({r.choice for r in chosen.values()} - {BF16})
    got = layer_numerics(model, batches, batch_fn, fmts, plan.recipe)
    if any(n in chosen for n in experts_modules(model)):
        got.update(experts_numerics(model, batches, batch_fn, fmts, plan.recipe))
    out = []
    for name, r in chosen.items():
        q = got.get((name, r.choice))
        if q is not None:  # no gradient reached it on these batches: nothing to judge
            out.append(LayerCheck(name, r.choice, q.sqnr, floors[name], r.sqnr))
    return out


def audit_plan(plan: Plan, model: nn.Module,
               batch_fn: Callable[[nn.Module, Any], torch.Tensor],
               batches: Iterable[Any] = (0,)) -> tuple[list[Finding], list[LayerCheck]]:
    """``(findings, checks)``: one ``plan-floor`` warning for each fp8/fp4 Linear of
    ``plan`` whose SQNR on ``model``'s weights and ``batches`` (``plan_sqnr``) falls
    below the plan's floor, naming the layer, the SQNR, the floor and the fix.

    >>> import torch, mixprec                                     # doctest: +SKIP
    >>> found, checks = audit_plan(p, model, lambda m, b: m(*b), batches)  # doctest: +SKIP
    """
    checks = plan_sqnr(plan, model, batch_fn, batches)
    found = []
    for c in sorted((c for c in checks if c.below), key=lambda c: c.sqnr):
        planned = "" if c.planned is None else f" (planned at {c.planned:.1f} dB)"
        found.append(Finding(
            "warning", "plan-floor",
            f"{c.layer} in {c.fmt}: SQNR {c.sqnr:.1f} dB, below the plan's floor "
            f"{c.floor:g} dB",
            f"{c.layer}'s worst GEMM (output, dgrad or wgrad) in {c.fmt} against bf16 "
            f"measures {c.sqnr:.1f} dB on the trained weights{planned}; the plan "
            f"requires {c.floor:g} dB",
            f"move it to bf16 with the rule 'layer:{c.layer}=bf16' in the recipe, or "
            f"re-plan (mixprec.plan / `mixprec plan`) with a lower --min-sqnr than "
            f"{c.floor:g}",
            {"layer": c.layer, "format": c.fmt, "sqnr": c.sqnr, "floor": c.floor,
             "planned": c.planned}))
    return found, checks
