"""The frameworks' private names the integrations still rely on, where no public hook
does the job: each exists with the signature the integration calls. When a release
renames or reshapes one, this fails naming it, instead of an integration going quietly
wrong (schedulers stepping on skipped steps, checkpoints without the engine)."""

from __future__ import annotations

import inspect

import pytest


def _params(fn) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "self"]


def _needs(owner, name: str, params: list[str]) -> None:
    fn = getattr(owner, name, None)
    assert fn is not None, (
        f"{owner.__module__}.{owner.__qualname__}.{name} is gone: the mixprec integration "
        "overrides it; port it to this release")
    got = _params(fn)
    assert got[:len(params)] == params, (
        f"{owner.__qualname__}.{name}{inspect.signature(fn)} no longer takes "
        f"{params}: the mixprec integration overrides it with that signature")


def test_trainer_methods_the_hugging_face_integration_overrides():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    trainer = transformers.Trainer
    _needs(trainer, "_wrap_model", ["model", "training", "dataloader"])  # the engine's DDP
    _needs(trainer, "_save", ["output_dir", "state_dict"])  # the fp32 masters
    _needs(trainer, "_save_optimizer_and_scheduler", ["output_dir"])  # mixprec_engine.pt
    _needs(trainer, "_load_optimizer_and_scheduler", ["checkpoint"])  # its restore
    # the public calls it routes: Trainer clips through accelerator.clip_grad_norm_
    assert "self.accelerator.clip_grad_norm_" in inspect.getsource(trainer._clip_grad_norm)
    # fsdp=: the engine shards in place of the plugin TrainingArguments builds from it
    _needs(trainer, "create_accelerator_and_postprocess", [])
    src = inspect.getsource(trainer.create_accelerator_and_postprocess)
    assert "self.args.fsdp_plugin_args" in src, (
        "Trainer no longer builds Accelerate's FSDP plugin from args.fsdp_plugin_args: "
        "MixedPrecisionTrainer takes fsdp= from there for the engine's FSDP")
    args = transformers.TrainingArguments("unused", use_cpu=True, report_to=[])
    assert hasattr(args, "fsdp_plugin_args")
    # a wrapper that is not the model keeps Trainer from accelerator.prepare(model)
    assert "use_accelerator_prepare = model is self.model" in inspect.getsource(
        trainer._prepare_for_training), (
        "Trainer no longer skips accelerator.prepare(model) for a model _wrap_model "
        "wrapped: under fsdp= it would add a DDP over the engine's FSDP")


def test_accelerates_skip_flag_that_trainer_reads():
    pytest.importorskip("accelerate")
    from accelerate.optimizer import AcceleratedOptimizer

    # Trainer asks AcceleratedOptimizer.step_was_skipped, which reads _is_overflow: the
    # integration sets it after a skipped engine step so that the scheduler holds
    source = inspect.getsource(AcceleratedOptimizer)
    assert "_is_overflow" in source and "step_was_skipped" in source, (
        "accelerate's AcceleratedOptimizer no longer keeps _is_overflow behind "
        "step_was_skipped: MixedPrecisionTrainer reports skips through it")


def test_lightning_names_the_plugin_relies_on():
    pytest.importorskip("lightning")
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.strategies import DDPStrategy

    _needs(Precision, "_after_closure", ["model", "optimizer"])  # clip + before-step hooks
    _needs(Precision, "clip_gradients", ["optimizer", "clip_val", "gradient_clip_algorithm"])
    assert hasattr(DDPStrategy(), "_ddp_kwargs"), (
        "lightning's DDPStrategy no longer keeps _ddp_kwargs: the plugin passes them to "
        "the engine's own DDP")
