"""Switch a running engine to another recipe at a step boundary, and follow a schedule.

``switch(engine, recipe)`` takes the engine's parts apart and builds them again for the
new recipe over the same model and optimizers, without losing a bit:

- the values the optimizer updates are the truth. Under a ``-master`` recipe the fp32
  masters become the model's fp32 parameters again (the same values, no rounding);
  16-bit parameters without masters are upcast exactly. The new recipe's ``build``
  then makes its masters from them (exact copies) and casts its working copy;
- optimizer state moves with the tensor it belongs to (from each master to its
  parameter, and on to the new master), the same tensors: ``exp_avg`` and
  ``exp_avg_sq`` are bit-identical, and the param groups (their order, their LR) stay
  as they are, so LR schedulers carry on;
- the quantized Linears the engine swapped in are put back (``QuantizedLinear.to_linear``:
  the original modules over the same Parameters) and the new recipe's ``layer:`` rules
  swap again. A Linear quantized in the same format on both sides keeps its fp8 scaling
  state (delayed scaling's amax history and scales, NVFP4's rounding stream) with
  ``fp8_state="keep"``, the default; with ``"reset"``, or where its format changed, it
  starts afresh, as under a new engine;
- the loss scaler is kept where both recipes set the same loss scaling (its scale and
  counts carry on); otherwise the new recipe's starts at its ``init_scale``, with the
  count of skipped steps carried over. A ``loss_scaler`` given to the engine is kept;
- counters, LR schedulers and the skip watch carry on; ``engine.coverage`` and the
  doctor read the new phase.

A switch between ``backward`` and ``step`` (or inside an accumulation window) is refused.
So are: data parallel, FSDP and tensor parallel engines, write rules
(``write=stochastic|kahan|remainder``) and compressed optimizer states on either side,
and models with transformers experts modules under a Linear format (docs/not-there-yet.md).

``Phases`` follows a ``PrecisionSchedule``: after each optimizer step it switches when
the next step belongs to another phase; checkpoints record the phase
(``phase_entry``) and a resume enters it before loading (``enter_saved_phase``).
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
from torch import nn

from mixprec.engine.build import build
from mixprec.engine.coverage import warn_low_coverage
from mixprec.engine.param_state import _cast_
from mixprec.engine.scaler import LossScaler
from mixprec.engine.step import Step
from mixprec.experts.hook import experts_modules
from mixprec.modules.linear import Float8Linear, fp8_modules
from mixprec.recipe import Recipe
from mixprec.recipe.schedule import PrecisionSchedule, is_schedule_text

__all__ = ["switch", "Phases", "resolve", "phase_entry", "enter_saved_phase",
           "check_switchable"]


def resolve(recipe: Recipe | str | PrecisionSchedule,
            schedule: PrecisionSchedule | str | None
            ) -> tuple[PrecisionSchedule | None, Recipe]:
    """The engine's ``(schedule, first recipe)`` from its ``recipe=`` and ``schedule=``
    arguments: a schedule in either (``recipe=`` may be one, or its string form)."""
    if isinstance(recipe, PrecisionSchedule) or is_schedule_text(recipe):
        if schedule is not None:
            raise ValueError(
                f"MixedPrecision(recipe={str(recipe)!r}, schedule={str(schedule)!r}): two "
                "schedules; pass it once, as recipe= or as schedule=")
        schedule = recipe
    if schedule is None:
        return None, Recipe.coerce(recipe)
    s = PrecisionSchedule.coerce(schedule)
    return s, s.recipes[0]


def check_switchable(engine: Any, recipe: Recipe) -> None:
    """Raise, naming the reason and the fix, where ``engine`` cannot switch to ``recipe``
    now; nothing has changed then."""
    c = engine.counters
    if c.micro or c.closed:
        raise RuntimeError(
            f"recipe switch to {str(recipe)!r} after {c.micro} backward call(s) without "
            "their step(): a switch moves the weights, gradients and optimizer state "
            "between formats only at a step boundary. Call engine.step() first (or "
            "engine.zero_grad() to drop the gradients), then switch.")
    if engine.parallel is not None:
        raise NotImplementedError(
            f"recipe switch under parallel={engine.parallel!r}: the switch rebuilds the "
            "engine's parts in one process only. Save with engine.save(), build a new "
            f"engine with recipe {str(recipe)!r} and load the fp32 weights "
            "(engine.load_fp32_state_dict) instead.")
    for r in (engine.recipe, recipe):
        if r.optim.write != "nearest" or r.optim.states != "fp32" or r.state_rules:
            raise NotImplementedError(
                f"recipe switch with recipe {str(r)!r}: its write rule "
                f"(write={r.optim.write}) or optimizer state format "
                f"(states={r.optim.states}) keeps state a switch cannot move exactly; "
                "use recipes with write=nearest and fp32 states (bf16-master, fp8, "
                "nvfp4, ...)")
    if (engine.recipe.linear is not None or recipe.linear is not None) and \
            experts_modules(engine.module):
        raise NotImplementedError(
            "recipe switch on a model with transformers experts modules under a Linear "
            "format: their quantized projections are not swapped back yet. Keep one "
            "recipe for such a model.")
    if engine.recipe.linear is not None and engine.fp8_report is None \
            and fp8_modules(engine.module):
        raise NotImplementedError(
            "recipe switch on a model whose quantized Linears were converted by hand "
            "(before the engine): the engine does not know the modules they replaced. "
            "Let the engine convert them (pass the plain model, and fp8_filter=...).")


def _unbuild(engine: Any) -> dict[str, tuple[object, dict[str, torch.Tensor]]]:
    """Undo ``build`` on the engine's model and optimizers: fp32 parameters holding the
    values the optimizer updated, the optimizers pointed back at them with their state,
    no gradients, the engine's quantized Linears back to the modules they replaced and
    the norm and experts patches undone. Returns each swapped Linear's format and
    scaling state by name, for the Linears of the next phase."""
    ps = engine.param_state
    with torch.no_grad():
        if ps.has_master:
            back = {id(m): p for p, m in zip(ps.working, ps.masters)}
            for p, m in zip(ps.working, ps.masters):
                p.data = m.data  # the fp32 values themselves, no rounding
            for o in engine.optimizers:
                for g in o.param_groups:
                    g["params"] = [back.get(id(q), q) for q in g["params"]]
                for q in list(o.state):
                    if id(q) in back:
                        o.state[back[id(q)]] = o.state.pop(q)
        else:
            for p in ps.working:
                if p.dtype != torch.float32:
                    _cast_(p, torch.float32)  # exact: every 16-bit value is an fp32 one
        for p in ps.working + (ps.masters or []):
            p.grad = None
    engine._undo_islands()
    states = {}
    converted = set(engine.fp8_report.converted) if engine.fp8_report else set()
    for name, m in fp8_modules(engine.module).items():
        if name not in converted:
            continue
        states[name] = (m.fp8_recipe.linear,
                        {k: v.detach().clone() for k, v in m.scaling_state().items()})
        parent_name, _, child = name.rpartition(".")
        parent = engine.module.get_submodule(parent_name) if parent_name else engine.module
        setattr(parent, child, m.to_linear())
    return states


def _carry_fp8_state(module: nn.Module, states: dict, fp8_state: str) -> None:
    """``keep``: each new quantized Linear in the format it had before the switch takes
    its scaling state back."""
    if fp8_state != "keep":
        return
    for name, m in fp8_modules(module).items():
        fmt, saved = states.get(name, (None, None))
        if saved is None or not isinstance(m, Float8Linear) or m.fp8_recipe.linear != fmt:
            continue
        own = m.scaling_state()
        if own.keys() == saved.keys() and all(own[k].shape == v.shape
                                              for k, v in saved.items()):
            with torch.no_grad():
                for k, v in saved.items():
                    own[k].copy_(v)
            m._rng_host = None  # the stream counter is read again on the next backward


def _scaler_for(engine: Any, recipe: Recipe) -> LossScaler:
    """The loss scaler of the next phase: the engine's own where it was given, or where
    both recipes scale alike; else the recipe's, with the skipped-step count carried."""
    old = engine.scaler
    if engine._given_scaler or engine.recipe.loss == recipe.loss:
        return old
    new = LossScaler.from_recipe(recipe, engine.device)
    new.skipped_total = old.skipped_total.clone()
    return new


def _build_quietly(engine: Any, r: Recipe, scaler: LossScaler):
    """``build`` over the engine's model and optimizers; a schedule's recipes said
    their warnings when the engine was built."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build(engine.module, engine.optimizers, r, fp8_filter=engine._fp8_filter,
                     loss_scaler=scaler)


def switch(engine: Any, recipe: Recipe | str, fp8_state: str = "keep") -> None:
    """Move ``engine`` to ``recipe`` at this step boundary (see the module docstring)."""
    r = Recipe.coerce(recipe)
    if r == engine.recipe:
        return
    check_switchable(engine, r)
    engine.settle()  # the schedulers count the last step before the parts change
    scaler = _scaler_for(engine, r)
    old_step = engine._step
    states = _unbuild(engine)
    try:
        parts = _build_quietly(engine, r, scaler)
    except Exception:
        # the new recipe refused the model (it would convert no Linear, say): the
        # engine goes back to its recipe, from the same fp32 values, and raises
        parts = _build_quietly(engine, engine.recipe, engine.scaler)
        _carry_fp8_state(parts.module, states, "keep")
        _take(engine, parts, old_step)
        raise
    _carry_fp8_state(parts.module, states, fp8_state)
    _take(engine, parts, old_step)
    warn_low_coverage(engine.coverage, r, stacklevel=4)


def _take(engine: Any, parts, old_step: Step) -> None:
    """The engine holds ``parts`` and a step over them that carries on the old step's
    counters, skip watch and schedulers."""
    engine._adopt(parts)
    step = Step(engine.optimizers, engine.param_state, engine.scaler, engine.parallelism,
                engine.fp8_modules, old_step.schedulers, engine.max_grad_norm,
                engine.device, parts.recipe)
    step.counters, step.skips = old_step.counters, old_step.skips
    engine._step = step


class Phases:
    """The engine's schedule and the phase it trains in (``schedule`` None: one recipe,
    switched only by hand)."""

    def __init__(self, engine: Any, schedule: PrecisionSchedule | None) -> None:
        self._engine = weakref.ref(engine)
        self.schedule = schedule
        #: the index of the phase the engine trains in (None without a schedule)
        self.index: int | None = 0 if schedule is not None else None
        #: whether the recipe was switched by hand (``set_recipe``)
        self.by_hand = False

    def set_total_steps(self, total_steps: int) -> None:
        """The run's length, for phases that start at a fraction of it."""
        if self.schedule is None:
            raise ValueError("set_total_steps: this engine has no precision schedule")
        self.schedule = self.schedule.with_total_steps(total_steps)
        self.schedule.starts()  # order and length checks, before any step needs them

    def after_step(self) -> None:
        """Right after an optimizer step: switch when the next step's phase differs."""
        if self.schedule is None:
            return
        engine = self._engine()
        nxt = self.schedule.phase_at(engine.counters.steps)
        if nxt != self.index:
            self.enter(nxt)

    def enter(self, index: int) -> None:
        """Switch the engine into phase ``index`` of the schedule."""
        engine = self._engine()
        switch(engine, self.schedule.recipes[index], self.schedule.fp8_state)
        self.index = index

    def set_recipe(self, recipe: Recipe | str) -> None:
        """A switch by hand; a schedule goes on at its next phase's start."""
        fp8_state = self.schedule.fp8_state if self.schedule is not None else "keep"
        switch(self._engine(), recipe, fp8_state)
        self.by_hand = True


def phase_entry(engine: Any) -> dict | None:
    """What a checkpoint records of the schedule: its string form and the phase index
    (None for an engine that never had a schedule nor a switch)."""
    p = engine._phases
    if p.schedule is None and not p.by_hand:
        return None
    return {"schedule": None if p.schedule is None else str(p.schedule),
            "phase": p.index, "recipe": str(engine.recipe)}


def enter_saved_phase(engine: Any, state: dict) -> None:
    """Before a restore: the engine enters the phase the checkpoint was saved in, so the
    recipes agree. A checkpoint of a schedule with other recipes is refused."""
    saved = state.get("phase")
    p = engine._phases
    if saved is None or (p.schedule is None and not p.by_hand and
                         saved["schedule"] is not None):
        if saved is not None:
            raise ValueError(
                f"checkpoint was saved under the precision schedule "
                f"{saved['schedule']!r} but this engine has none; build it with "
                f"MixedPrecision(..., recipe={saved['schedule']!r})")
        return
    if p.schedule is not None and saved["schedule"] is not None:
        theirs = PrecisionSchedule.parse(saved["schedule"]).recipes
        if theirs != p.schedule.recipes:
            raise ValueError(
                f"checkpoint was saved under the precision schedule {saved['schedule']!r} "
                f"but this engine follows {str(p.schedule)!r}; build the engine with the "
                "checkpoint's schedule")
    recipe = state.get("recipe")
    if recipe is not None and recipe.replace(emulate=engine.recipe.precision.emulate) \
            != engine.recipe:
        switch(engine, recipe, "reset")
    if p.schedule is not None:
        p.index = saved["phase"]
    p.by_hand = p.by_hand or saved["schedule"] is None
