"""Hugging Face ``Trainer`` under a mixprec recipe: ``MixedPrecisionTrainer``.

    trainer = MixedPrecisionTrainer(recipe="bf16-master", model=model, args=args,
                                    train_dataset=ds)
    trainer.train()                      # resume_from_checkpoint=... continues exactly

A ``transformers.Trainer`` whose optimizer step, backward and forward go through a
``MixedPrecision`` engine, built over the model and the optimizer ``create_optimizer``
makes (or the one passed in ``optimizers``), with ``TrainingArguments``'
``gradient_accumulation_steps`` and ``max_grad_norm``. Leave ``bf16``/``fp16`` in
``TrainingArguments`` off: the recipe is the precision. Through Trainer's own extension
points:

- ``compute_loss_context_manager``: the forward runs under ``engine.autocast()``;
- the backward is ``engine.backward(loss, divided=True)``: Trainer has already divided
  the loss for accumulation (or normalised it by the window's token count). The
  micro-batch Trainer syncs on ends the engine's window, so the short window at an
  epoch's end updates there;
- Trainer's clip (``accelerator.clip_grad_norm_`` with ``max_grad_norm``) is
  ``engine.clip_grad_norm_``: the true norm of the unscaled fp32 gradients, logged as
  ``grad_norm``, and the clip of that update;
- the optimizer Trainer steps is a proxy whose ``step()`` is ``engine.step()``: the
  non-finite check, the clip, the update of the fp32 masters. A skipped step is reported to
  Accelerate as one, so Trainer does not advance the LR scheduler;
- Trainer's training logs carry ``loss_scale`` and ``skipped_steps`` beside ``loss`` and
  ``grad_norm`` (``log``), so every reporting integration records them;
- ``save_steps`` checkpoints hold the fp32 weights as the model's (``save_pretrained``
  loads them into a fresh model) and the engine's state (``mixprec_engine.pt``: masters,
  loss scale, counters), which ``resume_from_checkpoint`` restores. The random streams
  are Trainer's to save and restore (its ``rng_state`` files), so the engine's file
  leaves them out. With
  ``load_best_model_at_end`` the best checkpoint's engine state is restored at the end
  (a ``TrainerCallback``), so ``save_model`` writes the best masters.
- a precision schedule (``recipe="nvfp4>bf16-master@0.8"`` or a ``PrecisionSchedule``)
  switches at step boundaries inside the engine's step; phases given as fractions are
  shares of Trainer's ``max_steps``, and checkpoints resume in their phase.

Data parallel: under a multi-process launch (``torchrun``, ``accelerate launch``) the
engine is built with ``parallel="ddp"`` and Trainer runs the engine's own
``DistributedDataParallel`` (``_wrap_model``), so Accelerate wraps only the optimizer and
the data loaders: every rank reduces once per window and agrees on each skipped step.
The main process writes ``mixprec_engine.pt``; every rank reads it on resume.

Sharded: ``TrainingArguments(fsdp="full_shard")`` under a multi-process launch. The
engine shards (``parallel="fsdp"``, FSDP2 with the recipe's policy; the units are
``fsdp_config``'s ``transformer_layer_cls_to_wrap``, by default each ``ModuleList``
element) in place of Accelerate's FSDP plugin, and Trainer drives. ``save_model`` and
the checkpoints gather on every rank and the main process writes whole fp32 files
(``mixprec_engine.pt`` holds the optimizer's state too). ``accelerate launch
--use_fsdp --fsdp_version 2`` (Accelerate's FSDP plugin from the environment) is taken
over the same way, from its ``FSDP_*`` settings; mixprec says so in one log line
(``mixprec.integrations.fsdp_plugin``). FSDP version 1 raises
``NotImplementedError``.

DeepSpeed: ``TrainingArguments(deepspeed=config)`` (ZeRO 1, 2, 3). The recipe's Linear
formats are swapped in at ``__init__`` and DeepSpeed's engine runs the rest
(``mixprec.integrations.deepspeed``): Trainer's own DeepSpeed path trains, with no
mixprec engine (``trainer.engine`` is None); ``bf16=True`` is DeepSpeed's dtype there,
``max_grad_norm`` its ``gradient_clipping``; ``trainer.deepspeed_formats`` holds what
was swapped and ``mixprec.integrations.deepspeed.coverage(trainer.model)`` the coverage.
Delayed scaling's history moves after each of DeepSpeed's steps
(``mixprec.integrations.deepspeed.step_scales``, at ``on_train_begin``).
``save_steps`` checkpoints add mixprec's record and each rank's fp8 scaling state to
DeepSpeed's (``mixprec.integrations.deepspeed.save_state``), which
``resume_from_checkpoint`` checks and restores.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

import torch

from mixprec.engine.facade import MixedPrecision
from mixprec.engine.switch import resolve as resolve_schedule
from mixprec.integrations import deepspeed as ds
from mixprec.integrations import quiet_peer_import
from mixprec.integrations._proxies import EngineOptimizer, save_fp32_config
from mixprec.integrations.fsdp_plugin import plugin_args_from_env, say
from mixprec.recipe import Recipe
from mixprec.recipe.schedule import PrecisionSchedule

with quiet_peer_import():  # transformers' model code imports torchao where installed
    from transformers import Trainer, TrainerCallback

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

__all__ = ["MixedPrecisionTrainer"]

ENGINE_FILE = "mixprec_engine.pt"


SCHEDULER_FILE = "scheduler.pt"  # Trainer's own name for its scheduler's state


def _engine_fsdp(plugin: dict) -> dict:
    """``TrainingArguments(fsdp=..., fsdp_config=...)``'s plugin arguments as the
    engine's FSDP: ``transformer_layer_cls_to_wrap`` names the units (default: each
    ``ModuleList`` element), ``reshard_after_forward`` passes on. What the engine's FSDP
    does not do is refused, naming the setting."""
    if int(plugin.get("fsdp_version", 2)) != 2:
        raise NotImplementedError(
            f"MixedPrecisionTrainer with fsdp_config={{'version': "
            f"{plugin.get('fsdp_version')}}}: the engine shards with FSDP2 only (valid: "
            "2); set fsdp_config={'fsdp_version': 2} or drop it (2 is the default), "
            "or launch with accelerate launch --use_fsdp --fsdp_version 2")
    refused = [k for k in ("cpu_offload", "activation_checkpointing",
                           "cpu_ram_efficient_loading") if plugin.get(k)]
    policy = str(plugin.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP"))
    if policy not in ("TRANSFORMER_BASED_WRAP", "NO_WRAP"):
        refused.append(f"auto_wrap_policy={policy!r}")
    if "FULL_STATE_DICT" not in str(plugin.get("state_dict_type", "FULL_STATE_DICT")):
        refused.append(f"state_dict_type={plugin['state_dict_type']!r}")
    if refused:
        raise NotImplementedError(
            f"MixedPrecisionTrainer with fsdp_config {', '.join(refused)}: the engine's "
            "FSDP does not do it (valid: cpu_offload, activation_checkpointing and "
            "cpu_ram_efficient_loading false; auto_wrap_policy TRANSFORMER_BASED_WRAP "
            "or NO_WRAP; state_dict_type FULL_STATE_DICT: its checkpoints are whole fp32 "
            "files, its units transformer_layer_cls_to_wrap's classes). Remove it from "
            "fsdp_config (under accelerate launch --use_fsdp: the --fsdp_* flag that set "
            "it, e.g. --fsdp_state_dict_type FULL_STATE_DICT, --fsdp_offload_params false)")
    out: dict = {"parallel_kwargs": {
        "reshard_after_forward": bool(plugin.get("reshard_after_forward", True))}}
    names = plugin.get("transformer_cls_names_to_wrap")
    if names and policy != "NO_WRAP":
        wanted = set(str(names).split(","))
        out["fsdp_units"] = lambda m: type(m).__name__ in wanted
    elif policy == "NO_WRAP":
        out["fsdp_units"] = lambda m: False
    return out


class _Sharded(torch.nn.Module):
    """The engine's FSDP model as Trainer's ``model_wrapped``: a module that is not the
    model itself, so Trainer prepares only the optimizer with Accelerate."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class _DeepSpeedScales(TrainerCallback):
    """Under DeepSpeed: once its engine is built, delayed scaling's state moves after
    each of its steps (``mixprec.integrations.deepspeed.step_scales``)."""

    def __init__(self, trainer: MixedPrecisionTrainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        ds.step_scales(self.trainer.model_wrapped, self.trainer.model)


class _BestMasters(TrainerCallback):
    """``load_best_model_at_end``: Trainer has loaded the best checkpoint's model files
    into the working copy; the engine then restores that checkpoint's own state
    (masters, working copy, optimizer, scale), so what is saved and trained next is
    the best model, not the last step's masters."""

    def __init__(self, trainer: MixedPrecisionTrainer) -> None:
        self.trainer = trainer

    def on_train_end(self, args, state, control, **kwargs):
        engine, best = self.trainer.engine, state.best_model_checkpoint
        if engine is None or not args.load_best_model_at_end or not best:
            return
        path = os.path.join(best, ENGINE_FILE)
        if os.path.exists(path):
            engine.load(path, rng_state=False)


class MixedPrecisionTrainer(Trainer):
    """``transformers.Trainer`` with ``recipe`` (a name or ``Recipe``) run by mixprec's
    engine, or a ``PrecisionSchedule`` (or its string form); ``engine_kwargs`` go to
    ``MixedPrecision`` (``fp8_filter``...)."""

    def __init__(self, *args: Any, recipe: Recipe | str | PrecisionSchedule,
                 engine_kwargs: dict | None = None, **kwargs: Any) -> None:
        self._fsdp: dict | None = None  # TrainingArguments(fsdp=...): the engine's FSDP
        super().__init__(*args, **kwargs)
        #: the precision schedule (None: one recipe) and the recipe the run starts in
        self.schedule, self.recipe = resolve_schedule(recipe, None)
        self.engine_kwargs = dict(engine_kwargs or {})
        if "parallel" in self.engine_kwargs:
            raise ValueError(
                "MixedPrecisionTrainer(engine_kwargs={'parallel': ...}): the launch decides "
                "it (torchrun / accelerate launch: DDP; TrainingArguments(fsdp="
                "'full_shard'): the engine's FSDP)")
        self.engine: MixedPrecision | None = None
        #: under DeepSpeed: the formats swapped in (DeepSpeed's engine runs the rest)
        self.deepspeed_formats: ds.DeepSpeedFormats | None = None
        if self.is_deepspeed_enabled:
            if self.schedule is not None:
                raise NotImplementedError(
                    f"MixedPrecisionTrainer(recipe={str(self.schedule)!r}) under DeepSpeed: "
                    "DeepSpeed's engine owns the weights, so a precision schedule cannot "
                    "switch them; pass one recipe (e.g. "
                    f"{str(self.schedule.recipes[0])!r}), or drop deepspeed= to schedule")
            self.deepspeed_formats = ds.swap(
                self.model, self.recipe, self.args.hf_deepspeed_config.config,
                auto="bf16" if self.args.bf16 else "fp16" if self.args.fp16 else "fp32",
                optimizer=self.optimizer, engine_kwargs={
                    **self.engine_kwargs, "max_grad_norm": self.args.max_grad_norm})
            self.add_callback(_DeepSpeedScales(self))
            return
        if self.is_fsdp_enabled:  # a plugin create_accelerator_and_postprocess missed
            raise NotImplementedError(
                "MixedPrecisionTrainer under an Accelerator that carries Accelerate's FSDP "
                "plugin: the engine takes the plugin over (it shards, FSDP2) only from "
                "TrainingArguments(fsdp=..., fsdp_config=...) or accelerate launch "
                "--use_fsdp. Pass the FSDP settings there")
        if self.args.bf16 or self.args.fp16:
            raise ValueError(
                "MixedPrecisionTrainer: TrainingArguments(bf16=True / fp16=True) would "
                "add Accelerate's autocast on top of the recipe; leave them False and "
                f"let recipe={str(self.recipe)!r} set the precision")
        self.accelerator.backward = self._backward
        self._plain_clip = self.accelerator.clip_grad_norm_
        self.accelerator.clip_grad_norm_ = self._clip_grad_norm_
        self.add_callback(_BestMasters(self))

    # --- the engine ----------------------------------------------------------------

    def create_accelerator_and_postprocess(self) -> None:
        """Trainer's Accelerator, without Accelerate's FSDP plugin where
        ``TrainingArguments(fsdp=...)`` asks for sharding: the engine shards instead
        (``parallel="fsdp"``, FSDP2 with the recipe's policy), after casting, and
        Accelerate wraps only the optimizer and the data loaders. ``accelerate launch
        --use_fsdp`` (the plugin in the environment) is taken over alike."""
        plugin = self.args.fsdp_plugin_args
        from_env = plugin is None and os.environ.get(
            "ACCELERATE_USE_FSDP", "false").lower() in ("1", "true")
        if from_env:
            plugin = plugin_args_from_env()
        if plugin is None:
            return super().create_accelerator_and_postprocess()
        self._fsdp = _engine_fsdp(plugin)
        say("mixprec takes over Accelerate's FSDP2 plugin"
            f"{' (accelerate launch --use_fsdp)' if from_env else ''}: the engine shards "
            "(parallel='fsdp', FSDP2 with the recipe's policy, reshard_after_forward="
            f"{self._fsdp['parallel_kwargs']['reshard_after_forward']}); Accelerate "
            "prepares only the optimizer and the data loaders")
        self.args.fsdp_plugin_args = None
        if from_env:
            os.environ["ACCELERATE_USE_FSDP"] = "false"
        try:
            super().create_accelerator_and_postprocess()
        finally:
            self.args.fsdp_plugin_args = None if from_env else plugin
            if from_env:
                os.environ["ACCELERATE_USE_FSDP"] = "true"

    def create_optimizer(self, model: torch.nn.Module | None = None
                         ) -> torch.optim.Optimizer:
        """Trainer's optimizer (or the one given), then the engine over the model and
        it; Trainer gets the proxy that steps the engine."""
        # a second train() on this Trainer: the engine and its optimizer (by then wrapped
        # by Accelerate) carry on; Trainer resets the optimizer to None where it
        # re-initialises the model (model_init), and a new engine is built then
        if self.deepspeed_formats is not None:  # DeepSpeed steps Trainer's optimizer
            return super().create_optimizer(model)
        if isinstance(self.optimizer, EngineOptimizer) or (
                self.engine is not None and self.optimizer is not None):
            return self.optimizer
        inner = super().create_optimizer(model)
        parallel: dict = {"parallel": "ddp"} if self.args.world_size > 1 else {}
        if self._fsdp is not None:
            parallel = {"parallel": "fsdp", **self._fsdp}
        self.engine = MixedPrecision(
            self.model, inner, self.schedule or self.recipe,
            grad_accum_steps=self.args.gradient_accumulation_steps,
            # Trainer's max_grad_norm comes by its own clip call
            **{**parallel, **self.engine_kwargs})
        self.optimizer = EngineOptimizer(self.engine, inner, self._record_skip)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int,
                         optimizer: torch.optim.Optimizer | None = None
                         ) -> torch.optim.lr_scheduler.LRScheduler:
        """Trainer's LR scheduler; and the run's length (``max_steps``) for a precision
        schedule whose phases start at fractions of it, before a resumed checkpoint is
        loaded."""
        out = super().create_scheduler(num_training_steps, optimizer)
        if self.engine is not None and self.engine.schedule is not None \
                and self.engine.schedule.fractional:
            self.engine.set_total_steps(num_training_steps)
        return out

    def _record_skip(self, skipped: bool) -> None:
        # Trainer asks Accelerate whether the step was skipped before the scheduler step
        opt = self.optimizer
        if hasattr(opt, "_is_overflow"):
            opt._is_overflow = skipped

    def _backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        # Trainer marks each micro-batch that ends a window (its sync_gradients), the
        # short one at an epoch's end included, and has divided the loss for it
        self.engine.backward(loss, divided=True,
                             last=bool(self.accelerator.gradient_state.sync_gradients))

    def compute_loss_context_manager(self) -> AbstractContextManager:
        """The forward under ``engine.autocast()`` (before the engine: Trainer's own)."""
        return (self.engine.autocast() if self.engine is not None
                else super().compute_loss_context_manager())

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        """For training across processes: the engine's own DDP (so Accelerate does not
        wrap the model again); otherwise Trainer's own choice."""
        if training and self.engine is not None and self.engine.parallel == "ddp":
            return self.engine.model
        if training and self.engine is not None and self.engine.parallel == "fsdp":
            # sharded in place: a wrapper that is not the model, so that Trainer does
            # not hand the model to accelerator.prepare (which would add a DDP)
            return _Sharded(self.engine.model)
        return super()._wrap_model(model, training, dataloader)

    def _clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """Trainer's clip (``accelerator.clip_grad_norm_``, with ``max_grad_norm``, or
        with inf for the logged norm alone): the engine's true norm (unscaled, fp32,
        reduced across processes), which Trainer logs as ``grad_norm``, and the clip
        of this update. An overflow step returns inf and is skipped; nothing raises."""
        if self.engine is None:
            return self._plain_clip(parameters, max_norm, norm_type)
        return self.engine.clip_grad_norm_(None if math.isinf(max_norm) else max_norm,
                                           norm_type)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Trainer's log, with the engine's ``loss_scale`` and ``skipped_steps`` (updates
        skipped for non-finite gradients since the start) beside the training loss, as
        ``grad_norm`` is: in ``state.log_history`` and every reporting callback."""
        if self.engine is not None and "loss" in logs:
            logs = {**logs, "loss_scale": float(self.engine.scale),
                    "skipped_steps": int(self.engine.skipped_steps)}
        super().log(logs, *args, **kwargs)

    # --- checkpoints ----------------------------------------------------------------

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The model's files hold the fp32 weights (masters, no fp8 scaling state), and
        its config says so: ``save_pretrained`` records the dtype of the model's own
        parameters, which under a ``-master`` recipe are the 16-bit working copy, and
        ``from_pretrained`` would load the fp32 weights into that dtype."""
        if self.engine is None or state_dict is not None:
            super()._save(output_dir, state_dict=state_dict)
            return
        # every rank gathers (Trainer calls _save on every rank; the main one writes)
        super()._save(output_dir, state_dict=self.engine.export_state_dict())
        if self.args.should_save:
            save_fp32_config(self.accelerator.unwrap_model(self.model),
                             output_dir if output_dir is not None else self.args.output_dir)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False,
                   quantized: bool = False) -> None:
        """Trainer's ``save_model`` (the fp32 masters); ``quantized=True`` writes the
        model in the format it trained in instead (``engine.save_pretrained``:
        docs/guides/serve.md). Every process calls it; the main one writes."""
        if not quantized:
            super().save_model(output_dir, _internal_call)
            return
        if self.engine is None:
            raise ValueError("save_model(quantized=True) before train(): the engine that "
                             "knows the trained format starts with training")
        self.engine.save_pretrained(output_dir if output_dir is not None
                                    else self.args.output_dir, quantized=True)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        path = os.path.join(output_dir, ENGINE_FILE)
        if self.engine is not None and self.engine.parallel == "fsdp":
            # the engine's gathered state holds the optimizer's (its own file would
            # hold rank 0's shards only); every rank gathers, the main one writes
            self.engine.save(path, full=True, rng_state=False)
            if self.args.should_save:
                torch.save(self.lr_scheduler.state_dict(),
                           os.path.join(output_dir, SCHEDULER_FILE))
            return
        super()._save_optimizer_and_scheduler(output_dir)
        if self.deepspeed_formats is not None:  # every rank: its own scaling state
            ds.save_state(self.model, output_dir, rank=self.args.process_index,
                          main=self.args.should_save, step=self.state.global_step)
        if self.engine is not None and self.args.should_save:  # the main process
            self.engine.save(path, rng_state=False)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        path = os.path.join(checkpoint, ENGINE_FILE) if checkpoint else None
        if self.engine is not None and self.engine.parallel == "fsdp":
            if path and os.path.exists(path):
                self.engine.load(path, rng_state=False)
                self.lr_scheduler.load_state_dict(torch.load(
                    os.path.join(checkpoint, SCHEDULER_FILE), weights_only=True))
            return
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint and self.deepspeed_formats is not None:  # after DeepSpeed's load
            ds.load_state(self.model, checkpoint, rank=self.args.process_index)
        if path and os.path.exists(path) and self.engine is not None:
            self.engine.load(path, rng_state=False)
