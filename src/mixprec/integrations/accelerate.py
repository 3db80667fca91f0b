"""Accelerate under a mixprec recipe: ``prepare`` in place of ``accelerator.prepare``.

    accelerator = Accelerator(gradient_accumulation_steps=4)   # mixed_precision="no"
    model, optimizer, loader, scheduler = prepare(
        accelerator, model, optimizer, loader, scheduler, recipe="bf16-master",
        max_grad_norm=1.0)
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = model(x, y)           # the forward runs under the recipe
            accelerator.backward(loss)   # the engine's backward
            optimizer.step()             # the engine's step: skips, clipping, masters
            scheduler.step()             # nothing: the engine advances it
            optimizer.zero_grad()        # nothing: the engine zeroes its buffers

A training loop written for Accelerate keeps its shape; only the ``prepare`` call
changes. What ``prepare`` does:

- **Objects, in the order given** (as ``accelerator.prepare``): one ``nn.Module`` and
  one optimizer over its parameters become a ``MixedPrecision`` engine; LR schedulers
  are handed to the engine, which steps them after each *applied* update only (a
  skipped step leaves the learning rate), unless the Accelerator was built with
  ``step_scheduler_with_optimizer=False``: then they come back as they are and the
  loop steps them itself (per epoch, say). Everything else (data loaders) goes through
  ``accelerator.prepare``, which shards it over the processes.
- **The model** is moved to ``accelerator.device`` and, under a multi-process launch,
  wrapped in the engine's own data parallelism (``parallel="ddp"``, or ``"fsdp"``),
  where every rank agrees on each skipped step. Its ``forward`` runs under
  ``engine.autocast()``; compute the loss inside it, or under
  ``optimizer.engine.autocast()``, so norms, softmax and loss get the recipe's fp32.
- **Backward and accumulation.** ``accelerator.backward(loss)`` is
  ``engine.backward(loss, last=accelerator.sync_gradients)``: the engine accumulates
  over ``Accelerator(gradient_accumulation_steps=k)`` micro-batches, reduces once per
  window, and ends a window where ``accumulate`` does (early at a data loader's end),
  dividing by ``k`` as Accelerate does.
- **Clipping.** ``accelerator.clip_grad_norm_(model.parameters(), max_norm)`` is
  ``engine.clip_grad_norm_(max_norm)``: it returns the true total norm (unscaled, fp32,
  reduced across processes) and clips the window's update to ``max_norm``. On an
  overflow it returns inf and the step is skipped. Call it under
  ``if accelerator.sync_gradients:``. ``clip_grad_value_`` is refused, naming the fix.
- **Export.** ``accelerator.get_state_dict(model)``, ``accelerator.save_model(model,
  dir)`` and ``accelerator.unwrap_model(model).save_pretrained(dir)`` write the fp32
  masters (``engine.export_state_dict()``) under the model's own names, which load
  strictly into the plain fp32 model; ``save_pretrained``'s config says float32.
- **Checkpoints.** The engine is registered with ``register_for_checkpointing``:
  ``accelerator.save_state(dir)`` holds its whole state (model, fp32 masters,
  optimizer, loss scale, counters, schedulers) beside Accelerate's RNG and sampler
  states, and ``load_state(dir)`` resumes bit for bit, on any number of processes.

``Accelerator(mixed_precision=...)`` must stay ``"no"``: the recipe is the precision,
and Accelerate's autocast or GradScaler on top of it would cast and scale twice.
Accelerate's FSDP plugin (``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(
fsdp_version=2))``, ``accelerate launch --use_fsdp --fsdp_version 2``): mixprec works
over Accelerate's sharding (``mixprec.integrations.fsdp_plugin``): ``prepare`` hands the
model and optimizer to ``accelerator.prepare`` first, which applies ``fully_shard``,
then builds the engine over the shards (``parallel=`` is not used); FSDP version 1 and
the settings it cannot honour are refused, naming them.

**DeepSpeed** (``Accelerator(deepspeed_plugin=...)``, an ``accelerate launch`` DeepSpeed
config; ZeRO 1, 2, 3): ``prepare`` swaps in the recipe's Linear formats and hands the
rest to DeepSpeed (``mixprec.integrations.deepspeed``): the objects come back from
``accelerator.prepare``, and ``accelerator.backward``, ``optimizer.step()`` and the
clip are DeepSpeed's. ``mixed_precision`` is then DeepSpeed's dtype (``"bf16"``);
``max_grad_norm`` becomes its ``gradient_clipping``; ``mixprec.integrations.deepspeed
.coverage(model)`` says which Linears run in which format. On a machine without GPUs
(DeepSpeed's CPU accelerator) Accelerate's state has no backend and counts one process on
every rank of the launch; ``prepare`` gives it DeepSpeed's process group's rank and size
first (said in one warning), so its data loaders shard and its main process is rank 0.

Megatron-LM and XLA are refused: use ``parallel="fsdp"`` or the FSDP2 plugin for sharding.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import DistributedType
from torch import nn

from mixprec.engine.facade import MixedPrecision
from mixprec.integrations import deepspeed as ds
from mixprec.integrations._proxies import (
    EngineOptimizer,
    EngineScheduler,
    autocast_forward,
    save_fp32_config,
)
from mixprec.integrations.fsdp_plugin import check_accelerate_plugin, shard_with_accelerate
from mixprec.recipe import Recipe

__all__ = ["prepare", "EngineCheckpoint"]

_PLAIN = {DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU}
_PARALLEL = ("ddp", "fsdp")


def _deepspeed_processes(accelerator: Accelerator) -> None:
    """Accelerate's state under DeepSpeed without GPUs: no backend, one process counted
    on every rank (its loaders would give each rank every batch, every rank would be the
    main one). DeepSpeed's process group has them all: the state takes its rank and size."""
    dist = torch.distributed
    if not dist.is_initialized() or accelerator.state.backend is not None:
        return
    world, rank = dist.get_world_size(), dist.get_rank()
    if accelerator.num_processes == world and accelerator.process_index == rank:
        return
    local = int(os.environ.get("LOCAL_RANK", rank))
    fix = {"num_processes": world, "process_index": rank, "local_process_index": local,
           "backend": dist.get_backend()}
    PartialState._shared_state.update(fix)
    accelerator.state.__dict__.update(fix)
    if rank == 0:
        warnings.warn(
            f"mixprec: Accelerate counted 1 process under DeepSpeed on a machine without "
            f"GPUs (its state has no backend there); DeepSpeed's {fix['backend']} group "
            f"has {world}: Accelerate's state now counts {world}, rank 0 the main "
            "process, so its data loaders shard", stacklevel=3)


class EngineCheckpoint:
    """What ``register_for_checkpointing`` holds: the engine's whole state
    (``state_dict(full=True)``, gathered under FSDP, so Accelerate's main process
    writes all of it), loaded at any world size."""

    def __init__(self, engine: MixedPrecision) -> None:
        self.engine = engine

    def state_dict(self) -> dict:
        """``engine.state_dict(full=True)`` (a collective under FSDP)."""
        return self.engine.state_dict(full=True)

    def load_state_dict(self, state: dict) -> None:
        """``engine.load_state_dict(state)``."""
        self.engine.load_state_dict(state)


def _split(objects: tuple) -> tuple[int, int, list[int], list[int]]:
    """Positions of the one module, the one optimizer, the schedulers, the rest."""
    modules = [i for i, o in enumerate(objects) if isinstance(o, nn.Module)]
    opts = [i for i, o in enumerate(objects) if isinstance(o, torch.optim.Optimizer)]
    scheds = [i for i, o in enumerate(objects)
              if isinstance(o, torch.optim.lr_scheduler.LRScheduler)]
    if len(modules) != 1 or len(opts) != 1:
        raise ValueError(
            f"mixprec.integrations.accelerate.prepare takes one nn.Module and one "
            f"optimizer (got {len(modules)} and {len(opts)}); for several models, build "
            "one MixedPrecision engine per model and optimizer")
    taken = {modules[0], opts[0], *scheds}
    return modules[0], opts[0], scheds, [i for i in range(len(objects)) if i not in taken]


def _check(accelerator: Accelerator, parallel: str, engine_kwargs: dict) -> None:
    if accelerator.mixed_precision != "no":
        raise ValueError(
            f"Accelerator(mixed_precision={accelerator.mixed_precision!r}) would add "
            "Accelerate's autocast (and GradScaler) on top of the recipe; build it with "
            "mixed_precision='no' and let the recipe set the precision")
    if accelerator.distributed_type not in _PLAIN \
            and accelerator.distributed_type != DistributedType.FSDP:  # FSDP2: checked
        raise NotImplementedError(
            f"Accelerate's {accelerator.distributed_type.value} is not supported under a "
            "mixprec recipe: launch plain data parallel (accelerate launch "
            "--num_processes N, --cpu on the CPU) and pass parallel='ddp' or 'fsdp' "
            "to prepare")
    if parallel not in _PARALLEL:
        raise ValueError(f"parallel={parallel!r}; valid: {', '.join(_PARALLEL)}")
    for key, where in (("grad_accum_steps", "Accelerator(gradient_accumulation_steps=)"),
                       ("scheduler", "the objects passed to prepare"),
                       ("parallel", "prepare's parallel=")):
        if key in engine_kwargs:
            raise ValueError(f"prepare(..., {key}=...): set it through {where}")


_LAUNCHED = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")


def _warn_single_cpu_launch(accelerator: Accelerator) -> None:
    """``accelerate launch --cpu --num_processes N`` (N > 1) without mpirun starts one
    process, with MASTER_ADDR set and no rank environment: say so, and how to get N."""
    if accelerator.num_processes == 1 and "MASTER_ADDR" in os.environ \
            and os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true") \
            and not any(k in os.environ for k in _LAUNCHED):
        warnings.warn(
            "mixprec: this looks like 'accelerate launch --cpu --num_processes N' that "
            "started a single process: accelerate's CPU launcher starts several only "
            "through mpirun (--mpirun_hostfile). For N processes over gloo run "
            "'ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N "
            "script.py' (torchrun underneath). Training goes on with 1 process.",
            stacklevel=3)


def _route_clip_and_export(accelerator: Accelerator, engine: MixedPrecision) -> None:
    """Accelerate's clip and export calls on this accelerator go to the engine: the
    norm of the true gradients (which have left the parameters' ``.grad`` for the
    engine's buffers), and the fp32 masters in place of the 16-bit working copy."""
    def clip_grad_norm_(parameters, max_norm, norm_type=2):
        if not accelerator.sync_gradients:
            raise RuntimeError(
                "accelerator.clip_grad_norm_ inside an accumulation window: under a "
                "mixprec recipe the gradients are complete (and reduced) only at the "
                "window's end. Clip under `if accelerator.sync_gradients:`, as "
                "Accelerate's gradient accumulation guide does.")
        return engine.clip_grad_norm_(max_norm, norm_type)

    def clip_grad_value_(parameters, clip_value):
        raise NotImplementedError(
            "accelerator.clip_grad_value_ under a mixprec recipe: the engine clips by "
            "norm, inside its step, on the unscaled fp32 gradients. Use "
            "accelerator.clip_grad_norm_(model.parameters(), max_norm), or "
            "prepare(..., max_grad_norm=...).")

    inner_get = accelerator.get_state_dict

    def get_state_dict(model, unwrap: bool = True):
        if accelerator.unwrap_model(model) is engine.module:
            return engine.export_state_dict()
        return inner_get(model, unwrap=unwrap)

    accelerator.clip_grad_norm_ = clip_grad_norm_
    accelerator.clip_grad_value_ = clip_grad_value_
    accelerator.get_state_dict = get_state_dict  # save_model writes what this returns
    _export_pretrained(engine)


def _export_pretrained(engine: MixedPrecision) -> None:
    """A Hugging Face model's own ``save_pretrained`` (``accelerator.unwrap_model(m)
    .save_pretrained(dir)``, the documented export) writes the fp32 masters, and a
    config that says float32, unless it is given a ``state_dict`` of the caller's."""
    model = engine.module
    inner = getattr(model, "save_pretrained", None)
    if inner is None or not callable(inner):
        return

    def save_pretrained(save_directory, *args, state_dict=None, **kwargs):
        if state_dict is not None:
            return inner(save_directory, *args, state_dict=state_dict, **kwargs)
        out = inner(save_directory, *args, state_dict=engine.export_state_dict(), **kwargs)
        if kwargs.get("is_main_process", True):
            save_fp32_config(model, save_directory)
        return out

    model.save_pretrained = save_pretrained


def prepare(accelerator: Accelerator, *objects: Any, recipe: Recipe | str,
            parallel: str = "ddp", **engine_kwargs: Any) -> Any:
    """``objects`` prepared as ``accelerator.prepare`` would, in the same order, with
    the module and optimizer run by a ``MixedPrecision`` engine under ``recipe``.

    Returns the module to call (the model, or its data-parallel wrapper under a
    multi-process launch), an ``EngineOptimizer`` (``.engine`` is the engine), an
    ``EngineScheduler`` per LR scheduler, and the rest from ``accelerator.prepare``.
    Under DeepSpeed: the recipe's formats swapped in, then everything from
    ``accelerator.prepare`` (``mixprec.integrations.deepspeed.prepare``).
    ``engine_kwargs`` go to ``MixedPrecision`` (``max_grad_norm``, ``fp8_filter``...).
    """
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        if parallel != "ddp":
            raise ValueError(f"prepare(..., parallel={parallel!r}) under DeepSpeed: ZeRO "
                             "shards; drop parallel= and set zero_optimization.stage")
        _deepspeed_processes(accelerator)
        return ds.prepare(accelerator, objects, recipe, engine_kwargs)
    # Accelerate's FSDP2 plugin: refused settings first, then Accelerate shards
    fsdp2 = accelerator.distributed_type == DistributedType.FSDP
    if fsdp2:
        check_accelerate_plugin(accelerator.state.fsdp_plugin,
                                "mixprec.integrations.accelerate.prepare")
    _check(accelerator, parallel, engine_kwargs)
    _warn_single_cpu_launch(accelerator)
    mi, oi, scheds, rest = _split(objects)
    model, inner = objects[mi], objects[oi]
    model.to(accelerator.device)
    if fsdp2:
        model, inner = shard_with_accelerate(accelerator, model, inner)
    # Accelerator(step_scheduler_with_optimizer=False): the loop steps its schedulers
    # itself (per epoch, say), so the engine leaves them alone
    by_engine = scheds if accelerator.step_scheduler_with_optimizer else []
    engine = MixedPrecision(
        model, inner, recipe, grad_accum_steps=accelerator.gradient_accumulation_steps,
        scheduler=[objects[i] for i in by_engine] or None,
        parallel=parallel if accelerator.num_processes > 1 and not fsdp2 else None,
        **engine_kwargs)
    net = engine.model
    autocast_forward(net, engine)

    def backward(loss: torch.Tensor, **kwargs: Any) -> None:
        engine.backward(loss, last=bool(accelerator.sync_gradients),
                        retain_graph=kwargs.pop("retain_graph", False))
        if kwargs:
            raise TypeError(f"accelerator.backward under mixprec takes retain_graph only, "
                            f"not {sorted(kwargs)}")

    accelerator.backward = backward
    _route_clip_and_export(accelerator, engine)
    accelerator.register_for_checkpointing(EngineCheckpoint(engine))
    out = list(objects)
    out[mi], out[oi] = net, EngineOptimizer(engine, inner)
    for i in by_engine:
        out[i] = EngineScheduler(objects[i])
    if rest:
        prepared = accelerator.prepare(*(objects[i] for i in rest))
        for i, p in zip(rest, prepared if len(rest) > 1 else (prepared,)):
            out[i] = p
    return tuple(out)
