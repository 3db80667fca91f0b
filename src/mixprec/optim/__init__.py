"""Optimizers whose states and weight writes have a precision you choose.

``mixprec.optim.AdamW`` / ``Adam`` / ``SGD`` take torch's arguments plus:

- ``states``: ``"fp32"`` (torch's result, bit for bit), ``"bf16"``, ``"fp8"``,
  ``"int8"`` or ``"int4"`` (``mixprec.optim.states``: how each is quantized, and why small tensors
  stay fp32);
- ``write``: how an update lands in a bf16/fp16 weight that has no fp32 master:
  ``"nearest"``, ``"stochastic"``, ``"kahan"`` or ``"remainder"``
  (``mixprec.optim.writes``);
- ``seed``: the key of the stochastic writes' counter-based bits (with an applied-step
  counter, checkpointed; the same bits on every rank and at every world size).

Each takes ``found_inf`` / ``grad_scale`` as torch's fused optimizers do, so
``MixedPrecision``'s step stays free of host syncs. Example::

    opt = mixprec.optim.AdamW(model.parameters(), lr=3e-4, states="int8",
                              write="stochastic")
    engine = MixedPrecision(model, opt, "bf16-sr,states=int8")
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from mixprec.optim.adam import Adam, AdamW
from mixprec.optim.base import LowPrecisionOptimizer
from mixprec.optim.sgd import SGD
from mixprec.optim.states import STATE_FORMATS
from mixprec.optim.writes import WRITE_RULES

if TYPE_CHECKING:
    from torch.optim.optimizer import ParamsT

    from mixprec.recipe import Recipe

__all__ = ["Adam", "AdamW", "SGD", "LowPrecisionOptimizer", "STATE_FORMATS", "WRITE_RULES",
           "adamw_for"]


def adamw_for(recipe: Recipe | str, params: ParamsT, **kwargs: Any) -> torch.optim.Optimizer:
    """The AdamW a recipe trains with: torch's fused one where the recipe keeps fp32
    states and nearest writes, else ``mixprec.optim.AdamW`` with its ``states`` and
    ``write``. ``kwargs`` are AdamW's (``lr``, ``betas``, ``weight_decay``...).

    >>> import torch
    >>> type(adamw_for("bf16-lean", [torch.nn.Parameter(torch.ones(2))])).__module__
    'mixprec.optim.adam'
    """
    from mixprec.recipe import Recipe

    r = Recipe.coerce(recipe)
    if not r.needs_mixprec_optim:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    return AdamW(params, states=r.states, write=r.write, **kwargs)
