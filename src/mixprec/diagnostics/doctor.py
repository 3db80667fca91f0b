"""``mixprec.doctor``: run a few steps, look everywhere, say what to change.

    report = mixprec.doctor(model_factory, batch_fn, "fp16", steps=20)
    print(report); report.to_json()

``model_factory()`` builds the model (called once per run, so the fp32 reference starts
from the same weights). ``batch_fn(model, step)`` returns the loss for batch ``step``,
which makes the doctor work on any model and data.

Checks, each turned into a finding with evidence and advice:

1. kernel speed of this device in fp32/bf16/fp16 (measured);
2. the training dynamics at the given learning rate: a diverging loss, updates far
   above ~1e-3 of the weights per step (``dynamics.py``);
3. non-finite steps: the first module whose output or gradient went inf/NaN (tracer),
   and whether the dynamics (the loss grew before) or the format's range caused it;
4. gradient underflow: a fp32 pass measures how many gradient elements would flush to
   zero in fp16 at the recipe's loss scale; for fp8 recipes, how many elements of each
   fp8 Linear's input and output gradient its casts flush to zero, per tensor against
   rowwise (``fp8range.py``);
5. dtype audit of what the optimizer updates, its states and the gradient buffers;
6. the loss-scale history (the run's own, or one you pass);
7. the recipe against fp32, layer by layer (gradient cosine and norm ratio);
8. low-precision coverage of the matmul FLOPs;
9. where a step's time goes: the share in matmuls bounds what lower precision can gain
   (Amdahl), and the biggest other ops are named (``timeshare.py``); no bound where the
   profiled rounds disagree (``noise.py``);
10. whether updates reach the weights: one step, the share of elements with a non-zero
    gradient whose stored value did not move (``updates.py``);
11. communication: what a low-precision format sent in 16 bits instead, and why
    (``engine.comm_stats.fallbacks``; ``audit.audit_comm``);
12. given a plan (``mixprec.plan``'s ``Plan``, or its JSON file) in place of the recipe:
    training runs under the plan's recipe, and each fp8/fp4 Linear's SQNR against bf16,
    measured as the planner does on the trained weights and the run's batches, is held
    to the plan's floor (``mixprec.planner.check``, imported only for a plan).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

import mixprec.optim as mo
from mixprec.diagnostics.audit import (
    audit_comm,
    audit_dtypes,
    audit_kernel_speed,
    audit_scale_history,
    matmul_coverage,
)
from mixprec.diagnostics.dynamics import (
    Divergence,
    WeightWatch,
    audit_dynamics,
    divergence,
    grew_before,
)
from mixprec.diagnostics.findings import Finding, Report
from mixprec.diagnostics.fp8range import audit_fp8_ranges
from mixprec.diagnostics.monitor import NumericsMonitor
from mixprec.diagnostics.plots import draw_plots
from mixprec.diagnostics.reference import compare_to_fp32
from mixprec.diagnostics.timeshare import audit_time_shares, time_shares
from mixprec.diagnostics.trace import trace_nonfinite
from mixprec.diagnostics.updates import audit_vanished_updates, vanished_updates
from mixprec.engine.facade import MixedPrecision
from mixprec.formats import elements as formats
from mixprec.planner.check import as_plan, audit_plan, check_layers
from mixprec.recipe import Recipe
from mixprec.recipe.schedule import PrecisionSchedule, is_schedule_text

__all__ = ["doctor", "COSINE_FLAG", "RATIO_FLAG"]

#: a layer whose gradient's cosine similarity to fp32 falls below this is flagged
COSINE_FLAG = 0.99
#: ... or whose gradient norm differs from fp32's by more than this factor
RATIO_FLAG = 1.25


def doctor(model_factory: Callable[[], nn.Module] | nn.Module,
           batch_fn: Callable[[nn.Module, int], torch.Tensor],
           recipe: Recipe | str | os.PathLike | Any = "bf16", *, steps: int = 10, lr: float = 1e-3,
           reference_steps: int = 3, scale_history: list[float] | None = None,
           plots: str | Path | None = None, optimizer: str = "adamw") -> Report:
    """Diagnose ``recipe`` on a model; see the module docstring.

    ``batch_fn(model, step)`` returns the step's loss; the doctor calls it under the
    recipe's precision context. ``recipe`` may be a ``Plan`` or a plan file (``.json``):
    the doctor then trains under the plan's recipe and flags each fp8/fp4 Linear whose
    SQNR falls below the plan's floor (``plan-floor``). Example::

        report = doctor(lambda: MyNet(), lambda m, i: F.cross_entropy(m(x[i]), y[i]),
                        "fp16", steps=20)
        print(report)             # findings: severity, evidence, advice
    """
    plan = None
    if isinstance(recipe, PrecisionSchedule) or is_schedule_text(recipe):
        phases = PrecisionSchedule.coerce(recipe).recipes
        raise ValueError(
            f"doctor(recipe={str(recipe)!r}): a precision schedule; the doctor diagnoses "
            f"one recipe at a time. Diagnose each phase: "
            f"{', '.join(repr(str(r)) for r in phases)} (schedule.recipes)")
    if _is_plan(recipe):  # the planner sits above the diagnostics: imported only here
        plan = as_plan(recipe)
        recipe = plan.recipe
    r = Recipe.coerce(recipe)
    if isinstance(model_factory, nn.Module):
        _refuse_deepspeed(model_factory)  # before a copy drops ZeRO-3's marks
        import copy

        template = model_factory
        model_factory = lambda: copy.deepcopy(template)  # noqa: E731
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if optimizer not in ("adamw", "sgd"):
        raise ValueError(f"optimizer {optimizer!r}: valid are 'adamw' (torch's defaults) "
                         "and 'sgd' (no momentum)")
    facts: dict = {"steps": steps}
    model = model_factory()
    _refuse_deepspeed(model)
    if plan is not None:
        check_layers(plan, model)
    findings, kfacts = audit_kernel_speed(next(model.parameters()).device, r)
    facts.update(kfacts)
    engine, opt, error = _engine(model, r, optimizer, lr)
    if engine is None:  # the recipe cannot run on this model
        findings += audit_dtypes(model, opt, r) or [Finding(
            "error", "engine", "the recipe cannot run on this model", error,
            "see the message", {})]
        return Report(str(r), findings, {**facts, "engine_error": error})
    watch = WeightWatch(engine.param_state.opt_params)
    scales, losses, skipped_at, grad_norms = _train(engine, model, batch_fn, steps, watch)
    dyn = divergence(losses, watch.ratios, watch.norms, watch.final_norm, grad_norms, lr)
    facts.update(losses=losses, scales=scales, skipped=skipped_at, grad_norms=grad_norms,
                 update_ratios=watch.ratios, weight_norms=[*watch.norms, watch.final_norm])
    findings += audit_dynamics(dyn)
    if plan is not None:
        findings += _plan_floor(plan, model_factory, engine, batch_fn, steps, facts)
    if skipped_at:
        findings.append(_trace_first_skip(engine, model, batch_fn, r, skipped_at, steps,
                                          dyn))
    findings += _underflow(model_factory, batch_fn, r)
    if r.linear is not None:
        f8, ranges = audit_fp8_ranges(model_factory(), lambda m: batch_fn(m, 0), r)
        findings += f8
        facts["fp8_ranges"] = [asdict(x) for x in ranges]
    findings += audit_dtypes(model, engine, r) + audit_comm(engine)
    findings += audit_scale_history(scale_history if scale_history is not None else scales, r)
    if reference_steps and r.precision.compute != "fp32":
        findings += _reference(model_factory, batch_fn, r, reference_steps, lr, facts)
    if r.uses_autocast:
        findings += _coverage(engine, model, batch_fn, facts)
    vanished = vanished_updates(engine, _measured_step(engine, model, batch_fn, steps - 1),
                                engine.param_state.names)
    facts["vanished_updates"] = None if vanished is None else [
        {**asdict(v), "share": v.share} for v in vanished]
    findings += audit_vanished_updates(vanished)
    facts["time_shares"] = time_shares(
        lambda: _measured_step(engine, model, batch_fn, 0)(lambda: None), 3)
    findings += audit_time_shares(facts["time_shares"], str(r))
    order = {"error": 0, "warning": 1, "info": 2}
    findings.sort(key=lambda f: order[f.severity])
    report = Report(str(r), findings, facts)
    if plots:
        facts["plots"] = draw_plots(model_factory, batch_fn, r, scales, Path(plots))
    return report


def _refuse_deepspeed(model: nn.Module) -> None:
    """The doctor trains the recipe with mixprec's own engine on one process; a model
    inside DeepSpeed's engine, or whose parameters ZeRO-3 partitioned at load
    (``deepspeed.zero.Init``: they carry ``ds_id``), cannot be trained so."""
    inside = type(model).__name__ == "DeepSpeedEngine"
    if inside or any(hasattr(p, "ds_id") for p in model.parameters()):
        raise NotImplementedError(
            f"doctor on {'DeepSpeed' if inside else 'ZeRO-3 partitioned'} model "
            f"{type(model).__name__}: the doctor diagnoses a recipe on one process with "
            "mixprec's own engine, not inside DeepSpeed. Pass a factory that builds the "
            "model unpartitioned (before deepspeed.initialize and outside "
            "TrainingArguments(deepspeed=...) / zero.Init): the recipe's formats are the "
            "same under DeepSpeed")


def _is_plan(recipe) -> bool:
    """A ``Plan`` (duck-typed: the diagnostics do not import the planner) or a plan
    file's path (``.json``)."""
    if isinstance(recipe, (str, os.PathLike)):
        return os.fspath(recipe).endswith(".json")
    return not isinstance(recipe, Recipe) and hasattr(recipe, "layer_floor")


def _plan_floor(plan, model_factory, engine, batch_fn, steps: int,
                facts: dict) -> list[Finding]:
    """``plan-floor`` findings: the plan's fp8/fp4 Linears measured on the trained
    weights (fp32, plain Linears: a fresh model with the engine's fp32 weights) and
    the run's last few batches."""
    fresh = model_factory()
    fresh.load_state_dict(engine.fp32_state_dict())
    batches = list(range(max(0, steps - 3), steps))
    found, checks = audit_plan(plan, fresh, batch_fn, batches)
    facts["plan_sqnr"] = [{**asdict(c), "below": c.below} for c in checks]
    return found


def _engine(model: nn.Module, r: Recipe, optimizer: str, lr: float):
    """``(engine, optimizer, None)``, or ``(None, optimizer, why)`` where the engine
    refuses the model."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = _optimizer(model, r, optimizer, lr)
        try:
            return MixedPrecision(model, opt, r), opt, None
        except ValueError as e:  # e.g. a model already in bf16 under a -master recipe
            return None, opt, str(e)


def _optimizer(model: nn.Module, r: Recipe, optimizer: str, lr: float):
    """torch's AdamW (its defaults) or plain SGD; ``mixprec.optim``'s where the recipe
    stores states or writes weights by a rule, with each parameter's state format as
    the recipe's ``states:`` rules give its name."""
    if not r.needs_mixprec_optim:
        cls = torch.optim.AdamW if optimizer == "adamw" else torch.optim.SGD
        return cls(model.parameters(), lr=lr)
    cls = mo.AdamW if optimizer == "adamw" else mo.SGD
    opt = cls(model.parameters(), lr=lr, **mo.recipe_settings(r))
    if r.state_rules:
        opt.set_state_formats({p: r.state_format(n) for n, p in model.named_parameters()
                               if p.requires_grad})
    return opt


def _train(engine, model, batch_fn, steps: int, watch: WeightWatch):
    """``steps`` training steps: the scale after each, the losses, the skipped steps,
    the gradient norms; ``watch`` sees the optimizer's tensors around each step."""
    scales, losses, skipped_at, grad_norms = [], [], [], []
    for step in range(steps):
        with engine.autocast():
            loss = batch_fn(model, step)
        engine.backward(loss)
        watch.before()
        res = engine.step()
        watch.after(bool(res.skipped))
        scales.append(float(res.scale))
        losses.append(loss.item())
        grad_norms.append(math.nan if res.grad_norm is None else float(res.grad_norm))
        if bool(res.skipped):
            skipped_at.append(step)
    return scales, losses, skipped_at, grad_norms


def _trace_first_skip(engine, model, batch_fn, r: Recipe, skipped_at: list[int],
                      steps: int, dyn: Divergence) -> Finding:
    """Re-run the first skipped step with the non-finite tracer on."""
    step = skipped_at[0]

    def rerun():
        with engine.autocast():
            loss = batch_fn(model, step)
        (loss.float() * float(engine.scale)).backward()

    origin = trace_nonfinite(model, rerun)
    for p in model.parameters():
        p.grad = None
    engine.zero_grad()
    return _nonfinite_finding(r, origin, len(skipped_at), steps, dyn, step)


def _reference(model_factory, batch_fn, r: Recipe, steps: int, lr: float,
               facts: dict) -> list[Finding]:
    """Per-layer gradients against an fp32 run of the same steps."""
    table, rec_losses, ref_losses = compare_to_fp32(model_factory, batch_fn, r, steps, lr)
    facts["reference"] = [vars(t) for t in table]
    facts["reference_losses"] = {"recipe": rec_losses, "fp32": ref_losses}
    bad = [t for t in table if t.cosine < COSINE_FLAG
           or not (1 / RATIO_FLAG <= t.norm_ratio <= RATIO_FLAG)]
    if not bad:
        return []
    worst = bad[0]
    return [Finding(
        "warning", "reference-divergence",
        f"{len(bad)} layer(s) compute gradients far from fp32; worst: {worst.layer}",
        "; ".join(f"{t.layer}: cosine {t.cosine:.4f}, norm ratio {t.norm_ratio:.3f}"
                  for t in bad[:5]),
        f"keep {worst.layer} in fp32 (a norm or softmax there belongs in keep_fp32; "
        "a custom module can run under torch.autocast(enabled=False)), or use bf16",
        {"layers": [t.layer for t in bad]})]


def _coverage(engine, model, batch_fn, facts: dict) -> list[Finding]:
    """The share of matmul FLOPs that ran in a low-precision dtype."""
    by_format = []
    cov = matmul_coverage(lambda: by_format.append(
        engine.coverage_flops(lambda: _forward(engine, model, batch_fn))))
    low = sum(v for k, v in cov.items() if k in ("bfloat16", "float16",
                                                 "float8_e4m3fn", "float8_e5m2"))
    facts["matmul_flops_by_dtype"] = cov
    # the engine's view: the matmul weights' formats per module kind (experts too), by
    # parameters and by this forward's FLOPs (experts by the tokens routed to them)
    facts["matmul_weights_by_format"] = engine.coverage.by_kind()
    facts["matmul_weights_low_precision"] = engine.coverage.low_precision_share
    facts["matmul_flops_by_format"] = by_format[0].by_kind()
    facts["matmul_flops_low_precision"] = by_format[0].low_precision_share
    if low >= 0.5:
        return []
    return [Finding(
        "warning", "coverage", f"only {low:.0%} of matmul FLOPs ran in low precision",
        f"FLOPs by input dtype: {cov}",
        "run the forward inside engine.autocast(); custom ops may need inputs cast", {})]


def _measured_step(engine, model, batch_fn, i):
    """One training step on batch ``i`` that calls ``capture()`` between backward and
    step, and returns whether the step was skipped."""
    def run(capture):
        with engine.autocast():
            loss = batch_fn(model, i)
        engine.backward(loss)
        capture()
        return bool(engine.step().skipped)
    return run


def _forward(engine, model, batch_fn):
    with torch.no_grad(), engine.autocast():
        batch_fn(model, 0)


def _nonfinite_finding(r: Recipe, origin, n: int, steps: int, dyn: Divergence,
                       first: int) -> Finding:
    """Where the inf/NaN of the first skipped step (``first``) came from, and its cause:
    the dynamics where the loss or the updates grew before it (``grew_before``), else
    the format's range (or the data, where no module produced it)."""
    dynamics = grew_before(dyn, first)
    cause = {"cause": "dynamics" if dynamics else "range"}
    before = [v for v in dyn.losses[:first] if math.isfinite(v)]
    grown = (f"; before step {first} the loss went {dyn.losses[0]:.3g} → {max(before, key=abs):.3g}"
             if before else "")
    lr_advice = (f"the overflow follows from the training dynamics, not the format's range: "
                 f"the learning rate ({dyn.lr:g}) is too large (see loss-diverging / "
                 "update-ratio); lower it, warm it up, clip the gradient norm")
    if origin is None:
        return Finding("warning", "nonfinite", f"{n} of {steps} steps had non-finite gradients",
                       "the tracer found no module output or gradient that was non-finite "
                       "on a re-run: the loss or the data itself may be non-finite" + grown,
                       lr_advice if dynamics else
                       "check the batch for NaN/inf and the loss for log(0) or 0/0", cause)
    fmt = {"fp16": "fp16", "bf16": "bf16"}.get(r.precision.compute, "fp16")
    limit = formats.get(fmt).max
    overflow = origin.phase == "forward"
    if dynamics:
        advice = lr_advice
    elif r.precision.compute == "fp16":
        advice = (f"{origin.module} overflows {fmt} (max {limit:g}) at a modest loss: the "
                  f"format's range is the cause. Use bf16 (fp32's range), or keep "
                  f"{origin.module} in fp32")
    else:
        advice = f"keep {origin.module} in fp32 and check its inputs"
    return Finding(
        "error", "nonfinite-origin",
        f"{n} of {steps} steps skipped; inf/NaN first appears in {origin.module}",
        origin.describe() + grown, advice,
        {"module": origin.module, "phase": origin.phase, "op": origin.op,
         "forward_overflow": overflow, **cause})


def _underflow(model_factory, batch_fn, r: Recipe) -> list[Finding]:
    """fp32 pass at the recipe's loss scale: share of gradient elements that would flush
    to zero in fp16 (when compute, params or grads are fp16)."""
    if "fp16" not in (r.precision.compute, r.precision.grads, r.precision.params):
        return []  # bf16 has fp32's range; fp8's casts are scaled (fp8range.py)
    fmt = "fp16"
    scale = r.loss.init_scale if r.loss.kind != "none" else 1.0
    model = model_factory()
    mon = NumericsMonitor(model)
    with mon.sample(0):
        loss = batch_fn(model, 0)
        (loss.float() * scale).backward()
    mon.remove()
    summary = mon.summary()
    tot = under = 0.0
    for key, st in summary.items():
        if key.startswith("param_grad:"):
            tot += st["numel"]
            under += st["numel"] * st[f"{fmt}_to_zero"]
    share = under / tot if tot else 0.0
    if share < 0.05:
        return []
    sev = "error" if share > 0.5 else "warning"
    fix = ("enable dynamic loss scaling (preset 'fp16') or use bf16" if r.loss.kind == "none"
           else "raise init_scale, or use bf16")
    return [Finding(sev, "grad-underflow",
                    f"{share:.0%} of gradient elements underflow to zero in {fmt}",
                    f"fp32 reference at loss scale {scale:g}: {under:.0f} of {tot:.0f} "
                    f"gradient elements are below {fmt}'s smallest subnormal "
                    f"({formats.get(fmt).min_subnormal:.3g}) / 2",
                    fix, {"share": share})]
