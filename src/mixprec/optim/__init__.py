"""Optimizers whose states and weight writes have a precision you choose.

``mixprec.optim.AdamW`` / ``Adam`` / ``SGD`` take torch's arguments plus:

- ``states``: ``"fp32"`` (torch's result, bit for bit), ``"bf16"``, ``"fp8"``,
  ``"int8"`` or ``"int4"`` (``mixprec.formats.state_formats``: how each is quantized, and
  why small tensors stay fp32);
- ``write``: how an update lands in a bf16/fp16 weight that has no fp32 master:
  ``"nearest"``, ``"stochastic"``, ``"kahan"`` or ``"remainder"``
  (``mixprec.optim.writes``);
- ``seed``: the key of the stochastic writes' counter-based bits (with an applied-step
  counter, checkpointed; the same bits on every rank and at every world size).

Each takes ``found_inf`` / ``grad_scale`` as torch's fused optimizers do, so
``MixedPrecision``'s step stays free of host syncs, and what else an engine hands it
(fp32 gradients of 16-bit weights, the format emulated weights hold) through
``bind(EngineBinding(...))``; used alone, it steps on ``p.grad``. Example::

    opt = mixprec.optim.AdamW(model.parameters(), lr=3e-4, states="int8",
                              write="stochastic")
    engine = MixedPrecision(model, opt, "bf16-sr,states=int8")
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from mixprec.optim.adam import Adam, AdamW
from mixprec.optim.base import EngineBinding, LowPrecisionOptimizer
from mixprec.optim.sgd import SGD
from mixprec.optim.states import STATE_FORMATS
from mixprec.optim.writes import WRITE_RULES
from mixprec.recipe import Recipe

if TYPE_CHECKING:
    from torch.optim.optimizer import ParamsT

__all__ = ["Adam", "AdamW", "SGD", "LowPrecisionOptimizer", "EngineBinding", "STATE_FORMATS",
           "WRITE_RULES", "adamw_for", "recipe_settings"]


def recipe_settings(recipe: Recipe) -> dict[str, str]:
    """The optimizer settings a recipe asks for, ``{"states": ..., "write": ...}``: the
    one place that reads them off a recipe.

    >>> from mixprec.recipe import Recipe
    >>> recipe_settings(Recipe.parse("bf16-lean"))
    {'states': 'int8', 'write': 'stochastic'}
    """
    return {"states": recipe.optim.states, "write": recipe.optim.write}


def adamw_for(recipe: Recipe | str, params: ParamsT, **kwargs: Any) -> torch.optim.Optimizer:
    """The AdamW a recipe trains with: torch's fused one where the recipe keeps fp32
    states and nearest writes, else ``mixprec.optim.AdamW`` with its ``states`` and
    ``write``. ``kwargs`` are AdamW's (``lr``, ``betas``, ``weight_decay``...).

    ``params`` may be ``model.named_parameters()`` (or param groups of such pairs):
    the recipe's ``states:`` rules then set each parameter's state format by its name
    (``set_state_formats``). A recipe whose rules give some parameters other states
    needs the names: with plain parameters it raises (or build
    ``mixprec.optim.AdamW(params, states=..., write=...)`` and let ``MixedPrecision``
    apply the rules).

    >>> import torch
    >>> type(adamw_for("bf16-lean", [torch.nn.Parameter(torch.ones(2))])).__module__
    'mixprec.optim.adam'
    >>> m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    >>> opt = adamw_for("bf16-master,states:0=int8", m.named_parameters())
    >>> opt.state_format(m[0].weight), opt.state_format(m[1].weight)
    ('int8', 'fp32')
    """
    r = Recipe.coerce(recipe)
    params, names = _split_names(params)
    if not r.needs_mixprec_optim:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    settings = recipe_settings(r)
    opt = AdamW(params, **settings, **kwargs)
    rules = [str(x) for x in r.state_rules if x.value != settings["states"]]
    if rules and names is None:
        raise ValueError(
            f"recipe {str(r)!r} has states: rules ({', '.join(rules)}) that match "
            "parameters by name, and adamw_for was given parameters without names: pass "
            "model.named_parameters() (or param groups of (name, parameter) pairs), or "
            f"build mixprec.optim.AdamW(model.parameters(), states={settings['states']!r}, "
            f"write={settings['write']!r}) and let MixedPrecision apply the rules")
    if names is not None and r.state_rules:
        opt.set_state_formats({p: r.state_format(n) for n, p in names})
    return opt


def _split_names(params: Any) -> tuple[Any, list | None]:
    """``params`` without parameter names, and the ``(name, parameter)`` pairs when
    it had them (``model.named_parameters()``, or param groups of such pairs)."""
    if isinstance(params, torch.Tensor):
        return [params], None
    items = list(params)
    groups = items if items and all(isinstance(x, dict) for x in items) else None
    lists = [list(g["params"]) if not isinstance(g["params"], torch.Tensor)
             else [g["params"]] for g in groups] if groups else [items]
    pairs = [x for lst in lists for x in lst if isinstance(x, tuple)]
    if not pairs:
        return items, None
    if len(pairs) != sum(map(len, lists)):
        raise ValueError("adamw_for: some parameters have names and some do not; pass "
                         "model.named_parameters() for all of them, or none")
    if groups is None:
        return [p for _, p in items], pairs
    return [{**g, "params": [p for _, p in lst]} for g, lst in zip(groups, lists)], pairs
