"""mixprec's low-precision formats inside DeepSpeed's engine (ZeRO 1, 2, 3).

    # Accelerate (Accelerator(deepspeed_plugin=...) or an `accelerate launch` DeepSpeed
    # config): mixprec.integrations.accelerate.prepare comes here
    model, optimizer, loader = prepare(accelerator, model, optimizer, loader,
                                       recipe="fp8-current")
    for x, y in loader:
        loss = model(x, y)
        accelerator.backward(loss)     # DeepSpeed's backward (its loss scaling)
        optimizer.step()               # DeepSpeed's step (its fp32 masters, ZeRO)
        optimizer.zero_grad()
    print(coverage(model))             # the Linears in fp8-current

As Accelerate composes torchao's and Transformer Engine's fp8 with DeepSpeed, mixprec
swaps the modules first and DeepSpeed's engine owns the rest. The split:

- **mixprec runs** the recipe's Linear formats: the fp8 swap (``mixprec.engine.convert``:
  every eligible Linear becomes the recipe's quantized Linear, the head and ``layer:``
  rules' ``bf16`` stay) and the transformers experts modules' projections, before
  ``deepspeed.initialize``. The swap keeps the Parameters, so DeepSpeed partitions
  them (ZeRO-3 too) and the optimizer built over the model stays valid.
- **DeepSpeed runs** everything else: the working weights in its ``bf16``/``fp16``
  dtype (fp32 without either) and the layers around the Linears in it, the fp32 masters,
  the optimizer step and its states, loss scaling (``fp16``'s dynamic scaler; none under
  ``bf16``), gradient clipping (``gradient_clipping``), the gradients' reduction.

``split`` reads what the recipe asks against the DeepSpeed config: what DeepSpeed does
as the recipe asks, or differently but to the same end (the storage of the weights and
masters, the loss scale, the fp32 norms and loss, ``max_grad_norm``), is handed over,
said in one warning that names which component runs what; what DeepSpeed cannot do
(``write=`` rules, optimizer states below fp32, Kahan-summed gradients, a compute
dtype other than DeepSpeed's, ``mixprec.optim`` optimizers, a ``loss_scaler``) is
refused, all of it in one ``ValueError`` naming each bad value, the valid ones and the
fix. ``coverage(model)`` reads the formats off the model at any time (ZeRO-3's
partitioned parameters counted whole). Neither DeepSpeed nor Accelerate is imported
here: the integrations that call this module hold them.

Scaling state: mixprec's engine moves delayed scaling's history and scales once per
optimizer step; under DeepSpeed ``step_scales`` does it after each step DeepSpeed's
engine takes (the ranks' amaxes agreed by an all-reduce MAX first, as one process records
the whole batch's; a step DeepSpeed skipped for an overflow drops its amaxes).

Checkpoints: DeepSpeed's checkpoint holds the weights, masters, optimizer, scheduler and
loss scale, and the module's buffers as rank 0 has them. ``save_state`` adds mixprec's
part beside it: ``mixprec_deepspeed.json`` (the recipe, DeepSpeed's dtype and stage, the
step, each Linear's format) and each rank's fp8 scaling state (delayed scaling's amax
history and scales) in ``mixprec_scaling_rank{R}.pt``; ``load_state`` checks the recipe
and restores each rank's. The HF Trainer's checkpoints and ``accelerator.save_state``
/ ``load_state`` (hooks ``prepare`` registers) call them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mixprec.engine.convert import ConvertReport, convert
from mixprec.engine.coverage import Coverage
from mixprec.engine.coverage import coverage as read_coverage
from mixprec.experts.format import experts_formats
from mixprec.experts.hook import convert_experts
from mixprec.modules.linear import fp8_modules, scaling_buffers
from mixprec.optim.base import LowPrecisionOptimizer
from mixprec.parallel.comm import agree_amax_
from mixprec.recipe import Recipe

__all__ = ["DeepSpeedFormats", "ds_dtype", "ds_stage", "split", "swap", "coverage",
           "prepare", "save_state", "load_state", "step_scales", "ACCEPTED_KWARGS",
           "RECORD_FILE", "SCALING_FILE"]

#: what the integrations' ``engine_kwargs`` may hold under DeepSpeed (the rest is
#: DeepSpeed's: ``split`` names where each goes)
ACCEPTED_KWARGS = ("fp8_filter", "max_grad_norm")

#: the engine's arguments DeepSpeed takes over, and where each is set instead
_DS_OWNS = {
    "loss_scaler": "the DeepSpeed config's fp16 section (loss_scale, "
                   "initial_scale_power, loss_scale_window, hysteresis, min_loss_scale)",
    "grad_accum_steps": "the DeepSpeed config's gradient_accumulation_steps",
    "scheduler": "the objects passed to prepare (DeepSpeed steps them)",
    "parallel": "the DeepSpeed config's zero_optimization.stage",
    "parallel_kwargs": "the DeepSpeed config's zero_optimization section",
    "fsdp_units": "the DeepSpeed config's zero_optimization section",
}

_ATTR = "_mixprec_deepspeed"  # where the swap leaves its record on the module

#: mixprec's record beside DeepSpeed's checkpoint (the main process writes it)
RECORD_FILE = "mixprec_deepspeed.json"
#: each rank's fp8 scaling state beside DeepSpeed's checkpoint (``.format(rank=R)``)
SCALING_FILE = "mixprec_scaling_rank{rank}.pt"


@dataclass(frozen=True, kw_only=True)
class DeepSpeedFormats:
    """What mixprec did to a model DeepSpeed then trains (left on the module, read by
    ``coverage``)."""

    #: the recipe whose formats the model runs
    recipe: Recipe
    #: DeepSpeed's dtype around the Linears and of the working weights: bf16, fp16, fp32
    dtype: str
    #: ZeRO's stage (0 to 3)
    stage: int
    #: the fp8 swap's report (converted Linears, each kept one and why)
    report: ConvertReport
    #: each transformers experts module's format by name (``bf16``: kept)
    experts: Mapping[str, str]
    #: the hand-over, as the warning said it
    message: str


def ds_dtype(config: Mapping, auto: str = "fp32") -> str:
    """DeepSpeed's training dtype from its config: ``bf16``, ``fp16`` or ``fp32``
    (neither enabled). ``auto`` is what an ``"auto"`` ``enabled`` resolves to (the
    launcher's mixed precision)."""
    for name, key in (("bf16", "bf16"), ("bf16", "bfloat16"), ("fp16", "fp16")):
        on = (config.get(key) or {}).get("enabled", False)
        if on == "auto" and auto == name or on is True:
            return name
    return "fp32"


def ds_stage(config: Mapping) -> int:
    """ZeRO's stage in a DeepSpeed config (0 where it has none)."""
    return int((config.get("zero_optimization") or {}).get("stage", 0) or 0)


def _refusals(r: Recipe, dtype: str, optimizer, engine_kwargs: Mapping) -> list[str]:
    """Each thing the recipe (or the call) asks that DeepSpeed cannot do: the bad value,
    the valid ones, the fix."""
    out = []
    compute = r.precision.compute
    if r.linear is None and compute not in (dtype, "tf32" if dtype == "fp32" else dtype):
        out.append(
            f"compute={compute!r}: DeepSpeed computes in its config's dtype, {dtype}; "
            f"valid: {dtype} or a Linear format (fp8-current, mxfp8, ...). Fix: enable "
            f"{compute} in the DeepSpeed config (\"{compute}\": {{\"enabled\": true}}; "
            f"TrainingArguments({compute}=True) or Accelerator(mixed_precision="
            f"'{compute}')), or use a recipe that computes in {dtype}")
    if r.optim.write != "nearest":
        out.append(
            f"write={r.optim.write!r}: DeepSpeed rounds its fp32 masters to the working "
            "dtype to nearest; valid: nearest. Fix: drop write= from the recipe "
            "(DeepSpeed's fp32 masters keep the updates)")
    states = sorted(({r.optim.states} | {x.value for x in r.state_rules}) - {"fp32"})
    if states:
        out.append(
            f"states={'/'.join(states)}: DeepSpeed's optimizer keeps its states (fp32 "
            "with torch's optimizers); valid: fp32. Fix: drop states= and states: rules "
            "from the recipe")
    if r.precision.grad_accum != "plain":
        out.append(
            f"grad_accum={r.precision.grad_accum!r}: DeepSpeed adds gradients plainly; "
            "valid: plain. Fix: drop grad_accum= from the recipe")
    if isinstance(optimizer, LowPrecisionOptimizer):
        out.append(
            f"optimizer {type(optimizer).__name__} (mixprec.optim): it updates through "
            "mixprec's engine, which DeepSpeed replaces; valid: torch's optimizers or "
            "DeepSpeed's. Fix: pass torch.optim.AdamW (DeepSpeed keeps its states)")
    for key, where in _DS_OWNS.items():
        if key in engine_kwargs:
            out.append(f"{key}=...: DeepSpeed owns it; set it in {where}")
    other = sorted(set(engine_kwargs) - set(_DS_OWNS) - set(ACCEPTED_KWARGS))
    if other:
        out.append(f"{', '.join(other)}: not an argument under DeepSpeed; valid: "
                   f"{', '.join(ACCEPTED_KWARGS)}. Fix: remove it")
    return out


def _handed_over(r: Recipe, dtype: str, stage: int, clip: float | str | None
                 ) -> list[str]:
    """What DeepSpeed runs of what the recipe asks, said against the recipe."""
    p = r.precision
    master = "fp32 masters" if dtype != "fp32" else "no masters"
    asked = f"params={p.params}, master={p.master}"
    said = [f"the working weights in {dtype} with {master}, ZeRO-{stage} partitioned "
            f"(the recipe's {asked})"]
    if r.linear is not None:
        said.append(f"the layers around the Linears in {dtype}")
    if r.has_fp32_islands:
        said.append(f"norms, softmax and the loss as the model computes them in {dtype} "
                    f"(the recipe's keep_fp32={'+'.join(p.keep_fp32)})")
    said.append("the optimizer step and its fp32 states")
    scale = {"fp16": "its dynamic loss scale", "bf16": "no loss scaling",
             "fp32": "no loss scaling"}[dtype]
    said.append(f"{scale} (the recipe's loss_scale={r.loss.kind})")
    said.append("gradient clipping as the launcher fills gradient_clipping='auto'"
                if clip == "auto" else f"gradient clipping to {clip:g}" if clip
                else "no gradient clipping")
    said.append(f"the gradients' reduction (the recipe's grads={p.grads}, comm={p.comm})")
    return said


def split(recipe: Recipe | str, config: Mapping, *, auto: str = "fp32",
          optimizer: Any = None, engine_kwargs: Mapping | None = None,
          warn: bool = True) -> str:
    """Check ``recipe`` against DeepSpeed ``config`` (module docstring): raise one
    ``ValueError`` listing everything DeepSpeed cannot do as asked, else return (and,
    with ``warn``, warn) the one message naming what mixprec and DeepSpeed each run.
    ``auto``: what the config's ``"auto"`` dtype resolves to; ``optimizer``: the one
    passed to DeepSpeed; ``engine_kwargs``: the integration's extra arguments.

    >>> try:
    ...     split("fp8-current,params=bf16,write=stochastic", {"bf16": {"enabled": True}})
    ... except ValueError as e:
    ...     print(str(e).split(": ", 2)[2][:53])
    write='stochastic': DeepSpeed rounds its fp32 masters
    """
    r = Recipe.coerce(recipe)
    kwargs = dict(engine_kwargs or {})
    dtype, stage = ds_dtype(config, auto), ds_stage(config)
    refused = _refusals(r, dtype, optimizer, kwargs)
    where = f"recipe {str(r)!r} under DeepSpeed (ZeRO-{stage}, {dtype})"
    if refused:
        raise ValueError(f"{where}: DeepSpeed cannot run {len(refused)} of its settings: "
                         + "; ".join(refused))
    clip = kwargs.get("max_grad_norm")  # handed to gradient_clipping where it says auto
    have = config.get("gradient_clipping")
    if have is not None and (have != "auto" or clip is None):
        clip = have if have == "auto" else float(have)
    mine = (f"the recipe's Linear format ({r.fp8_name}{', layer: rules' * bool(r.layer_rules)}) "
            "on the eligible Linears and the experts" if r.linear is not None
            else "nothing (the recipe has no Linear format)")
    message = (f"mixprec: {where}: mixprec runs {mine}; DeepSpeed runs "
               + "; ".join(_handed_over(r, dtype, stage, clip)) + ".")
    if warn:
        warnings.warn(message, stacklevel=3)
    return message


def swap(model: nn.Module, recipe: Recipe | str, config: Mapping, *, auto: str = "fp32",
         optimizer: Any = None, engine_kwargs: Mapping | None = None
         ) -> DeepSpeedFormats:
    """``split``, then the recipe's formats on ``model`` in place (the fp8 swap and the
    experts), before DeepSpeed wraps it; the record is left on the module for
    ``coverage``. A model swapped already (a second ``train()``) is left as it is."""
    if (done := vars(model).get(_ATTR)) is not None:
        return done
    r = Recipe.coerce(recipe)
    kwargs = dict(engine_kwargs or {})
    message = split(r, config, auto=auto, optimizer=optimizer, engine_kwargs=kwargs)
    fp8_filter: Callable | None = kwargs.get("fp8_filter")
    report = (convert(model, r, filter=fp8_filter, allow_none=True)
              if r.linear is not None else ConvertReport((), ()))
    experts = convert_experts(model, r) if r.linear is not None else {}
    formats = DeepSpeedFormats(recipe=r, dtype=ds_dtype(config, auto),
                               stage=ds_stage(config), report=report, experts=experts,
                               message=message)
    setattr(model, _ATTR, formats)
    return formats


def _unwrap(model: nn.Module) -> nn.Module:
    """The module the swap recorded on, under DeepSpeed's and DDP's wrappers."""
    m = model
    # DeepSpeed's engine answers its module's attributes: look in each one's own
    while _ATTR not in vars(m) and isinstance(getattr(m, "module", None), nn.Module):
        m = m.module
    return m


def _formats(model: nn.Module, what: str) -> tuple[nn.Module, DeepSpeedFormats]:
    m = _unwrap(model)
    formats = vars(m).get(_ATTR)
    if formats is None:
        raise ValueError(
            f"{type(model).__name__} carries no mixprec formats: {what} reads a model "
            "prepared by mixprec.integrations.accelerate.prepare or trained by "
            "MixedPrecisionTrainer under DeepSpeed. Prepare it through them")
    return m, formats


def _scaling(m: nn.Module) -> dict[str, torch.Tensor]:
    """Every quantized Linear's and experts projection's scaling state by
    ``module.buffer`` (empty for scalings without history, such as fp8-current)."""
    out = {f"{name}.{b}": t for name, mod in fp8_modules(m).items()
           for b, t in scaling_buffers(mod).items()}
    out.update({f"{name}.{b}": t for name, mod in experts_formats(m).items()
                for b, t in mod.scaling_state().items()})
    return out


def step_scales(engine: Any, model: nn.Module) -> bool:
    """Wrap DeepSpeed ``engine``'s ``step`` (once) so that after each optimizer step it
    takes, the scaling state of ``model``'s quantized Linears and experts moves as
    mixprec's engine moves it: the amaxes agreed over the ranks, then each module's
    ``update_scales`` (skipped step: its amaxes dropped). A model whose formats keep no
    state (fp8-current) is left alone. Returns whether the step was wrapped."""
    mods = [x for x in (*fp8_modules(model).values(), *experts_formats(model).values())
            if x.scaling_state()]
    if not mods or vars(engine).get("_mixprec_scales"):
        return False
    inner = engine.step

    def step(*args: Any, **kwargs: Any) -> Any:
        boundary = engine.is_gradient_accumulation_boundary()
        out = inner(*args, **kwargs)
        if boundary:  # DeepSpeed stepped (or skipped) the optimizer here
            if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
                agree_amax_(mods)
            found = torch.tensor(0.0 if engine.was_step_applied() else 1.0)
            for x in mods:
                x.update_scales(found)
        return out

    engine.step = step
    engine._mixprec_scales = True
    return True


def save_state(model: nn.Module, directory: str, *, rank: int = 0, main: bool = True,
               step: int | None = None) -> None:
    """mixprec's part of a DeepSpeed checkpoint in ``directory`` (module docstring):
    the record (written where ``main``) and this ``rank``'s scaling state. Every rank
    calls it after DeepSpeed's ``save_checkpoint``."""
    m, formats = _formats(model, "save_state")
    os.makedirs(directory, exist_ok=True)
    state = _scaling(m)
    if state:
        torch.save({k: v.detach().clone() for k, v in state.items()},
                   os.path.join(directory, SCALING_FILE.format(rank=rank)))
    if main:
        record = {"recipe": str(formats.recipe), "dtype": formats.dtype,
                  "stage": formats.stage, "step": step, "scaling_state": bool(state),
                  "formats": {r.name: r.format for r in coverage(m).rows}}
        with open(os.path.join(directory, RECORD_FILE), "w") as f:
            json.dump(record, f, indent=1)


def load_state(model: nn.Module, directory: str, *, rank: int = 0) -> dict | None:
    """Restore mixprec's part of the DeepSpeed checkpoint in ``directory`` into
    ``model`` after DeepSpeed's ``load_checkpoint``: the recipe must be the one saved
    (else ``ValueError`` naming both and the fix), and this ``rank``'s scaling state is
    copied back (DeepSpeed restored rank 0's on every rank). Returns the record; a
    checkpoint without one (saved without mixprec) returns None, with a warning."""
    m, formats = _formats(model, "load_state")
    path = os.path.join(directory, RECORD_FILE)
    if not os.path.exists(path):
        warnings.warn(f"mixprec: {directory} holds no {RECORD_FILE} (a DeepSpeed "
                      "checkpoint saved without mixprec): the fp8 scaling state is as "
                      "DeepSpeed restored it", stacklevel=2)
        return None
    with open(path) as f:
        record = json.load(f)
    now = str(formats.recipe)
    if record["recipe"] != now:
        raise ValueError(
            f"the DeepSpeed checkpoint {directory} was saved under recipe "
            f"{record['recipe']!r}, this run's is {now!r}: its scaling state and formats "
            f"are the saved recipe's; valid: {record['recipe']!r}. Fix: resume with "
            f"recipe={record['recipe']!r}, or load the weights alone (from_pretrained) "
            "to train them under another recipe")
    state = _scaling(m)
    mine = os.path.join(directory, SCALING_FILE.format(rank=rank))
    if state and os.path.exists(mine):
        saved = torch.load(mine, weights_only=True)
        missing = sorted(set(state) ^ set(saved))
        if missing:
            raise ValueError(
                f"{mine}: the scaling state of {', '.join(missing[:4])} is not both saved "
                "and in the model (a different fp8_filter or model); valid: the saved "
                "modules. Fix: resume with the model and fp8_filter of the saved run")
        with torch.no_grad():
            for k, t in state.items():
                t.copy_(saved[k])
    elif state:
        warnings.warn(f"mixprec: {mine} is missing (saved on fewer ranks): rank {rank} "
                      "keeps the scaling state DeepSpeed restored (rank 0's)",
                      stacklevel=2)
    return record


def coverage(model: nn.Module) -> Coverage:
    """Which share of ``model``'s matmul weights runs in which format
    (``mixprec.engine.coverage``), read off the model as it trains under DeepSpeed
    (the engine DeepSpeed returned, or the module inside it). ZeRO-3's partitioned
    parameters count whole (``ds_numel``). A model ``swap`` never saw raises."""
    m, formats = _formats(model, "coverage")
    cov = read_coverage(m, formats.recipe, dict(formats.report.skipped))
    named = dict(m.named_modules())
    rows = []
    for row in cov.rows:
        owner, _, proj = row.name.rpartition(".")
        p = (getattr(named[row.name], "weight", None) if row.name in named
             else getattr(named.get(owner), proj, None))
        full = getattr(p, "ds_numel", None)
        rows.append(dataclasses.replace(row, params=int(full)) if full else row)
    return Coverage(tuple(rows), cov.high, cov.unit)


def prepare(accelerator: Any, objects: tuple, recipe: Recipe | str,
            engine_kwargs: Mapping) -> tuple:
    """``mixprec.integrations.accelerate.prepare`` under Accelerate's DeepSpeed: the
    checks and the swap on the one module, a ``max_grad_norm`` handed to DeepSpeed's
    ``gradient_clipping``, then ``accelerator.prepare`` of every object (DeepSpeed's
    engine, its optimizer and scheduler wrappers, the data loaders), in order."""
    plugin = accelerator.state.deepspeed_plugin
    config = plugin.deepspeed_config
    modules = [o for o in objects if isinstance(o, nn.Module)]
    opts = [o for o in objects if hasattr(o, "param_groups") and not isinstance(o, nn.Module)]
    if len(modules) != 1:
        raise ValueError(
            f"mixprec.integrations.accelerate.prepare under DeepSpeed takes one nn.Module "
            f"(got {len(modules)}); prepare each model with its own call")
    kwargs = dict(engine_kwargs)
    clip = kwargs.get("max_grad_norm")
    have = config.get("gradient_clipping", "auto")
    if clip is not None and have not in ("auto", None, clip) and float(have) != clip:
        raise ValueError(
            f"prepare(..., max_grad_norm={clip}) and the DeepSpeed config's "
            f"gradient_clipping={have}: DeepSpeed clips, once; valid: the same value or "
            "one of them. Fix: drop max_grad_norm or set gradient_clipping to it")
    mixed = {"bf16": "bf16", "fp16": "fp16"}.get(str(accelerator.mixed_precision), "fp32")
    swap(modules[0], recipe, config, auto=mixed, optimizer=opts[0] if opts else None,
         engine_kwargs=kwargs)
    if clip is not None:
        config["gradient_clipping"] = clip
    out = accelerator.prepare(*objects)
    out = out if isinstance(out, tuple) else (out,)
    engine = next((o for o in out if hasattr(o, "global_steps")), None)
    if engine is not None:
        step_scales(engine, modules[0])
    _checkpoint_hooks(accelerator, modules[0], engine)
    return out


def _checkpoint_hooks(accelerator: Any, module: nn.Module, engine: Any) -> None:
    """``accelerator.save_state`` / ``load_state`` carry mixprec's part of the
    checkpoint (both hooks run after DeepSpeed's own save and load)."""
    def save(models, weights, output_dir):
        save_state(module, output_dir, rank=accelerator.process_index,
                   main=accelerator.process_index == 0,
                   step=getattr(engine, "global_steps", None))

    def load(models, input_dir):
        load_state(module, input_dir, rank=accelerator.process_index)

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)
