"""The per-layer precision planner: measured speed, numerics and bytes -> a recipe.

``mixprec.plan(model, sample_batch, goal=..., memory=..., max_loss=...)`` returns a
``Plan``: a ``Recipe`` with per-module rules and the table behind it
(``mixprec.planner.planning``). The parts: ``survey`` (everything measured about
one model, which prices any configuration), ``timing`` (each Linear shape in each format,
on this device, cached), ``numerics`` (SQNR against bf16, flushed share, delayed
headroom on real batches), ``choose`` (the choice, a pure function of those numbers).
"""

from mixprec.planner.choose import NoPlanFits
from mixprec.planner.planning import (
    CANDIDATES,
    DEFAULT_MIN_SQNR,
    Plan,
    PlanRow,
    plan,
    plan_from,
)
from mixprec.planner.steps import call_loss, measure_step, measure_steps
from mixprec.planner.survey import Survey

__all__ = ["plan", "plan_from", "Plan", "PlanRow", "NoPlanFits", "CANDIDATES",
           "DEFAULT_MIN_SQNR", "Survey", "measure_step", "measure_steps", "call_loss"]
