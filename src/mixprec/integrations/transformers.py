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
- ``save_steps`` checkpoints hold the fp32 weights as the model's (``save_pretrained``
  loads them into a fresh model) and the engine's state (``mixprec_engine.pt``: masters,
  loss scale, counters), which ``resume_from_checkpoint`` restores. With
  ``load_best_model_at_end`` the best checkpoint's engine state is restored at the end
  (a ``TrainerCallback``), so ``save_model`` writes the best masters.

Data parallel: under a multi-process launch (``torchrun``, ``accelerate launch``) the
engine is built with ``parallel="ddp"`` and Trainer runs the engine's own
``DistributedDataParallel`` (``_wrap_model``), so Accelerate wraps only the optimizer and
the data loaders: every rank reduces once per window and agrees on each skipped step.
The main process writes ``mixprec_engine.pt``; every rank reads it on resume. FSDP and
DeepSpeed (Trainer's ``fsdp=`` / ``deepspeed=``) raise ``NotImplementedError``.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from mixprec.engine import MixedPrecision
from mixprec.integrations._proxies import EngineOptimizer, save_fp32_config
from mixprec.recipe import Recipe

__all__ = ["MixedPrecisionTrainer"]

ENGINE_FILE = "mixprec_engine.pt"


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
            engine.load(path)


class MixedPrecisionTrainer(Trainer):
    """``transformers.Trainer`` with ``recipe`` (a name or ``Recipe``) run by mixprec's
    engine; ``engine_kwargs`` go to ``MixedPrecision`` (``fp8_filter``...)."""

    def __init__(self, *args, recipe: Recipe | str, engine_kwargs: dict | None = None,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.recipe = Recipe.coerce(recipe)
        self.engine_kwargs = dict(engine_kwargs or {})
        self.engine: MixedPrecision | None = None
        if self.is_fsdp_enabled or self.is_deepspeed_enabled:
            raise NotImplementedError(
                "MixedPrecisionTrainer under Trainer's FSDP or DeepSpeed: they shard the "
                "model before the engine can cast it. Use plain data parallel (torchrun "
                "or accelerate launch without fsdp/deepspeed), or mixprec's own FSDP "
                "through mixprec.integrations.accelerate or MixedPrecision("
                "parallel='fsdp')")
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

    def create_optimizer(self, model=None):
        """Trainer's optimizer (or the one given), then the engine over the model and
        it; Trainer gets the proxy that steps the engine."""
        # a second train() on this Trainer: the engine and its optimizer (by then wrapped
        # by Accelerate) carry on; Trainer resets the optimizer to None where it
        # re-initialises the model (model_init), and a new engine is built then
        if isinstance(self.optimizer, EngineOptimizer) or (
                self.engine is not None and self.optimizer is not None):
            return self.optimizer
        inner = super().create_optimizer(model)
        parallel = "ddp" if self.args.world_size > 1 else None
        self.engine = MixedPrecision(
            self.model, inner, self.recipe,
            grad_accum_steps=self.args.gradient_accumulation_steps,
            parallel=parallel,  # Trainer's max_grad_norm comes by its own clip call
            **self.engine_kwargs)
        self.optimizer = EngineOptimizer(self.engine, inner, self._record_skip)
        return self.optimizer

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

    def compute_loss_context_manager(self):
        """The forward under ``engine.autocast()`` (before the engine: Trainer's own)."""
        return (self.engine.autocast() if self.engine is not None
                else super().compute_loss_context_manager())

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        """For training across processes: the engine's own DDP (so Accelerate does not
        wrap the model again); otherwise Trainer's own choice."""
        if training and self.engine is not None and self.engine.parallel == "ddp":
            return self.engine.model
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

    # --- checkpoints ----------------------------------------------------------------

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The model's files hold the fp32 weights (masters, no fp8 scaling state), and
        its config says so: ``save_pretrained`` records the dtype of the model's own
        parameters, which under a ``-master`` recipe are the 16-bit working copy, and
        ``from_pretrained`` would load the fp32 weights into that dtype."""
        if self.engine is None or state_dict is not None:
            super()._save(output_dir, state_dict=state_dict)
            return
        super()._save(output_dir, state_dict=self.engine.fp32_state_dict())
        if self.args.should_save:
            save_fp32_config(self.accelerator.unwrap_model(self.model),
                             output_dir if output_dir is not None else self.args.output_dir)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if self.engine is not None and self.args.should_save:  # the main process
            self.engine.save(os.path.join(output_dir, ENGINE_FILE))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        path = os.path.join(checkpoint, ENGINE_FILE) if checkpoint else None
        if path and os.path.exists(path) and self.engine is not None:
            self.engine.load(path)
