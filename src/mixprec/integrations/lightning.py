"""A Lightning precision plugin that runs mixprec's engine under ``Trainer``.

    trainer = lightning.Trainer(plugins=[MixedPrecisionPlugin("bf16-master")],
                                gradient_clip_val=1.0, accumulate_grad_batches=4)

The LightningModule stays as written for plain Lightning. The plugin builds a
``MixedPrecision`` engine over it and the optimizers of ``configure_optimizers`` once
Lightning has set them up (``Precision.connect``), and from then on:

- every forward (training, validation, test, predict) runs under ``engine.autocast()``;
- each backward is ``engine.backward``: loss scaling, fp32 gradient buffers. Lightning
  has already divided the loss by ``accumulate_grad_batches``, so the engine's
  ``grad_accum_steps`` is that number and it only scales (``divided=True``);
- Lightning's clip (``gradient_clip_val``, through the precision plugin's
  ``clip_gradients``, also from a module's ``configure_gradient_clipping``) clips the
  unscaled fp32 gradients by norm (``engine.clip_grad_norm_``; by value raises);
- the optimizer step is ``engine.step()``: the non-finite check, the clip, the
  optimizer on the fp32 masters, and a skipped step that leaves everything as it was.
  Lightning's LR schedulers do not advance on a skipped step;
- checkpoints: the plugin's state is the engine's whole ``state_dict`` (masters, loss
  scale, counters, fp8 state), and the checkpoint's ``state_dict`` is replaced by the
  fp32 weights (``engine.fp32_state_dict()``), so a fresh LightningModule loads it
  strictly and ``Trainer.fit(ckpt_path=...)`` resumes bit for bit; ``validate``/
  ``test``/``predict`` after ``fit`` keep its engine, their ``ckpt_path=`` loads into it.

- **accumulation windows** follow Lightning's: the backward inside the optimizer step's
  closure ends the window, so the short window Lightning closes at an epoch's end
  updates there (``engine.backward(last=True)``), divided as Lightning divides it;
- **DDP** (``strategy="ddp"``, or ``"ddp_spawn"``, on CPU or GPU): Lightning wraps the
  module in its ``DistributedDataParallel`` before the plugin sees it. The plugin
  unwraps it and returns the engine's own DDP over the cast module in its place
  (Lightning's DDP keyword arguments pass through), so every rank reduces the
  gradients once per window and agrees on each skipped step.

- **sharded** (``strategy=ModelParallelStrategy(data_parallel_size=N,
  tensor_parallel_size=1)``): ``configure_model`` builds the layers and leaves them
  unsharded; the engine shards them (FSDP2, ``parallel="fsdp"``: each ``ModuleList``
  element and each child of the LightningModule is a unit) and Lightning drives. Its
  checkpoints (one file, or ``save_distributed_checkpoint=True``'s one shard file per
  rank) hold the gathered fp32 weights and the engine's gathered state, and resume bit
  for bit (one file: not yet where the swapped Linears hold buffers, NVFP4's rounding
  stream; docs/not-there-yet.md).

What it does not do: Lightning's ``FSDPStrategy`` (FSDP1) accepts only its own
``FSDPPrecision`` plugin and wraps the module in flat parameters before any plugin sees
it; DeepSpeed shards it too; tensor parallelism is not sharded by mixprec. All three are
refused, naming ``ModelParallelStrategy`` as the route. Manual optimization
(``automatic_optimization = False``) is refused too.

A precision schedule (``MixedPrecisionPlugin("nvfp4>bf16-master@0.8")`` or a
``PrecisionSchedule``) switches at step boundaries inside the engine's step; phases given
as fractions are shares of ``trainer.estimated_stepping_batches`` (the optimizer steps
of the fit), and checkpoints resume in their phase.

Fabric: ``mixprec.integrations.fabric.setup_fabric``, importable from here too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.plugins.precision import Precision
from torch import nn

from mixprec.engine.facade import MixedPrecision
from mixprec.engine.switch import resolve as resolve_schedule
from mixprec.integrations.fabric import setup_fabric
from mixprec.recipe import Recipe
from mixprec.recipe.schedule import PrecisionSchedule

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.utilities.types import Steppable
    from lightning.pytorch.utilities import GradClipAlgorithmType

__all__ = ["MixedPrecisionPlugin", "setup_fabric"]


class MixedPrecisionPlugin(Precision):
    """Lightning ``Precision`` plugin for a mixprec ``recipe`` (a name or a ``Recipe``,
    or a ``PrecisionSchedule`` or its string form).
    ``engine_kwargs`` go to ``MixedPrecision`` (``fp8_filter``, ``loss_scaler``...);
    clipping and accumulation come from the Trainer's own arguments."""

    precision = "32-true"  # what Lightning sees: the module and its inputs stay fp32

    def __init__(self, recipe: Recipe | str | PrecisionSchedule, **engine_kwargs: Any) -> None:
        super().__init__()
        #: the precision schedule (None: one recipe) and the recipe the fit starts in
        self.schedule, self.recipe = resolve_schedule(recipe, None)
        for k in ("grad_accum_steps", "max_grad_norm", "parallel"):
            if k in engine_kwargs:
                raise ValueError(
                    f"MixedPrecisionPlugin(..., {k}=...): Lightning owns it; use the "
                    "Trainer's accumulate_grad_batches / gradient_clip_val, and "
                    "strategy='ddp' for data parallel")
        self.engine_kwargs = engine_kwargs
        self.engine: MixedPrecision | None = None
        self._pending: dict | None = None
        self._skipped = False
        self._gather = False  # the engine shards (FSDP): checkpoints gather
        self._closing = False  # inside optimizer_step's closure: the window's last backward

    # --- set-up ----------------------------------------------------------------------

    def connect(self, model: nn.Module, optimizers: list[torch.optim.Optimizer],
                lr_schedulers: list[Any]
                ) -> tuple[nn.Module, list[torch.optim.Optimizer], list[Any]]:
        """Build the engine over the LightningModule and its optimizers (Lightning calls
        this once they exist), and make the LR schedulers skip-aware."""
        import lightning.pytorch as pl
        from torch.nn.parallel import DistributedDataParallel

        ddp = (isinstance(model, DistributedDataParallel)
               and isinstance(model.module, pl.LightningModule))
        if ddp:
            model = model.module  # Lightning's DDP is dropped: the engine builds its own
        if not isinstance(model, pl.LightningModule):
            raise NotImplementedError(
                f"MixedPrecisionPlugin under a strategy that shards the module "
                f"({type(model).__name__}): Lightning's FSDP and DeepSpeed shard it "
                "before the plugin can cast it, which mixprec does not support. Use "
                "strategy=ModelParallelStrategy() with a configure_model that builds "
                "the layers without sharding them (the engine shards them, FSDP2), "
                "strategy='ddp', or one device.")
        sharded = _sharded_by_engine(model.trainer)
        if not optimizers or model.trainer.state.fn != "fit":
            # not fitting (validate, test, predict, even with the optimizers of an earlier
            # fit still held): the engine fit built, if any, serves as it is
            return model, optimizers, lr_schedulers
        if not model.automatic_optimization:
            raise NotImplementedError(
                "MixedPrecisionPlugin with manual optimization: call engine.backward / "
                "engine.step yourself (plugin.engine) or use automatic optimization")
        trainer = model.trainer
        algorithm = getattr(trainer.gradient_clip_algorithm, "value",
                            trainer.gradient_clip_algorithm)
        if algorithm not in (None, "norm"):
            raise NotImplementedError(
                f"gradient_clip_algorithm={algorithm!r}: mixprec clips by norm only "
                "(unscaled, inside engine.step). Use gradient_clip_algorithm='norm'.")
        parallel = {}
        if ddp:
            parallel = {"parallel": "ddp",
                        "parallel_kwargs": dict(getattr(trainer.strategy, "_ddp_kwargs", {}))}
        elif sharded and trainer.world_size > 1:
            # the engine shards (FSDP2); Lightning drives
            parallel = {"parallel": "fsdp", "fsdp_units": _lightning_units(model)}
            self._gather = True
        kwargs = {**parallel, **self.engine_kwargs}  # a user's own fsdp_units win
        self.engine = MixedPrecision(model, optimizers, self.schedule or self.recipe,
                                     grad_accum_steps=trainer.accumulate_grad_batches,
                                     **kwargs)
        if self.schedule is not None and self.schedule.fractional \
                and self.schedule.total_steps is None:
            self.engine.set_total_steps(_fit_steps(trainer))
        if self._pending is not None:
            self.engine.load_state_dict(self._pending)
            self._pending = None
        self._skip_aware(model)
        if not self._gather:  # the sharded strategies load through their own path
            self._route_weight_loads(trainer.strategy)
        return self.engine.model if ddp else model, optimizers, lr_schedulers

    def _skip_aware(self, module) -> None:
        """The module's ``lr_scheduler_step`` hook (which Lightning calls to step each
        scheduler) holds a per-step (``interval="step"``) scheduler after a skipped
        optimizer step: a skip holds back exactly that step's advance. Per-epoch
        schedulers advance at the epoch's end whatever its last step did. Set on the
        instance, so neither the scheduler's state nor the checkpoint holds it."""
        step = module.lr_scheduler_step

        def lr_scheduler_step(scheduler, metric=None):
            if self._skipped and _interval(module.trainer, scheduler) == "step":
                return None
            return step(scheduler, metric)

        module.lr_scheduler_step = lr_scheduler_step

    def _route_weight_loads(self, strategy) -> None:
        """Lightning's load of a checkpoint's weights into the cast module (``ckpt_path=``
        of ``validate``/``test``/``predict`` after ``fit``) sets the engine's masters and
        working copy (``load_fp32_state_dict``) and that step's fp8 scaling state (the
        plugin's entry). Set on the strategy instance, once."""
        if getattr(strategy, "_mixprec_loads", False):
            return
        load = strategy.load_model_state_dict

        def load_model_state_dict(checkpoint, strict=True):
            if self.engine is None:
                return load(checkpoint, strict=strict)
            weights = checkpoint["state_dict"]
            self.engine.load_fp32_state_dict(weights)
            saved = (checkpoint.get(type(self).__qualname__) or {}).get("model", {})
            self.engine.module.load_state_dict(
                {k: v for k, v in saved.items() if k not in weights}, strict=False)

        strategy.load_model_state_dict = load_model_state_dict
        strategy._mixprec_loads = True

    # --- the step ----------------------------------------------------------------------

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        """Every forward under the engine's autocast (plain before the engine exists)."""
        with self.engine.autocast() if self.engine is not None else contextlib.nullcontext():
            yield

    def backward(self, tensor: torch.Tensor, model: pl.LightningModule,
                 optimizer: Steppable | None, *args: Any, **kwargs: Any) -> None:
        """``engine.backward`` of Lightning's loss (already divided for accumulation)."""
        if self.engine is None:
            raise RuntimeError("MixedPrecisionPlugin: backward before the engine was "
                               "built (Trainer.fit builds it)")
        self.engine.backward(tensor, divided=True, last=True if self._closing else None,
                             **kwargs)

    def optimizer_step(self, optimizer: Steppable, model: pl.LightningModule,
                       closure: Callable[[], Any], **kwargs: Any) -> Any:
        """Run Lightning's closure (training step and backward), then ``engine.step()``:
        one step for all the engine's optimizers, skipped on non-finite gradients."""
        self._closing = True
        try:
            result = closure()
        finally:
            self._closing = False
        self._after_closure(model, optimizer)
        out = self.engine.step()
        self._skipped = bool(out.skipped)
        return result

    def clip_gradients(self, optimizer: torch.optim.Optimizer, clip_val: int | float = 0.0,
                       gradient_clip_algorithm: GradClipAlgorithmType | str | None = None
                       ) -> None:
        """Lightning's clip (``gradient_clip_val``, or a module's own
        ``configure_gradient_clipping`` calling ``self.clip_gradients``): the engine
        clips this update's unscaled fp32 gradients to ``clip_val`` by norm
        (``engine.clip_grad_norm_``). On an overflow step the step is skipped, nothing
        raises. Clipping by value is refused, naming the fix."""
        if not clip_val:
            return
        algorithm = getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm)
        if algorithm not in (None, "norm"):
            raise NotImplementedError(
                f"gradient_clip_algorithm={algorithm!r}: mixprec clips by norm only "
                "(unscaled, inside engine.step). Use gradient_clip_algorithm='norm'.")
        self.engine.clip_grad_norm_(float(clip_val))

    # --- checkpoints -------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The engine's whole state (``MixedPrecision.state_dict``); under the engine's
        FSDP gathered (every rank calls it: Lightning dumps checkpoints on every rank),
        as only rank 0 writes this part of a checkpoint."""
        if self.engine is None:
            return {}
        return self.engine.state_dict(full=self._gather)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the engine (after Lightning restores the fp32 weights); before the
        engine exists the state waits for ``connect``."""
        if not state_dict:
            return
        if self.engine is None:
            self._pending = state_dict
        else:
            self.engine.load_state_dict(state_dict)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The checkpoint's weights become the fp32 ones, keyed as the module's own. A
        distributed checkpoint (``ModelParallelStrategy``'s default) also keeps the
        swapped Linears' buffers (fp8 scaling state, stochastic rounding's stream):
        Lightning's load asks for every entry of the module's ``state_dict``."""
        if self.engine is None:
            return
        weights = self.engine.fp32_state_dict(full=self._gather)
        module = self.engine.module
        if self._gather and getattr(module.trainer.strategy,
                                    "_save_distributed_checkpoint", False):
            weights.update({k: v for k, v in module.state_dict().items()
                            if k not in weights})
        checkpoint["state_dict"] = weights

    @property
    def skipped_last_step(self) -> bool:
        """Whether the last optimizer step was skipped (non-finite gradients)."""
        return self._skipped

    def __repr__(self) -> str:
        return f"MixedPrecisionPlugin({str(self.schedule or self.recipe)!r})"


def _fit_steps(trainer) -> int:
    """The optimizer steps of the fit, for a schedule's fractional phases."""
    steps = trainer.estimated_stepping_batches
    if not isinstance(steps, int) and not (isinstance(steps, float) and steps.is_integer()):
        raise ValueError(
            f"a precision schedule with phases at fractions of the run under a fit of "
            f"{steps} optimizer steps: set Trainer(max_steps=...) or max_epochs, or give "
            "the phases' starts in steps")
    return int(steps)


def _sharded_by_engine(trainer) -> bool:
    """Whether the Trainer's strategy is Lightning's ``ModelParallelStrategy``, where the
    engine itself shards the module (FSDP2) once ``configure_model`` has built it. The
    module must reach the plugin unsharded, and data parallel only."""
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import FSDPModule

    strategy = trainer.strategy
    if not isinstance(strategy, ModelParallelStrategy):
        return False
    module = strategy.lightning_module
    if any(isinstance(m, FSDPModule) for m in module.modules()):
        raise NotImplementedError(
            "MixedPrecisionPlugin under ModelParallelStrategy with a configure_model that "
            "calls fully_shard: the engine casts the layers and shards them itself (FSDP2, "
            "each ModuleList element a unit), so configure_model must build the layers "
            "without sharding them. Remove the fully_shard calls.")
    mesh = strategy.device_mesh
    if "tensor_parallel" in (mesh.mesh_dim_names or ()) and mesh["tensor_parallel"].size() > 1:
        raise NotImplementedError(
            f"MixedPrecisionPlugin with tensor parallelism (tensor_parallel_size="
            f"{mesh['tensor_parallel'].size()}): mixprec shards data parallel only. Use "
            "ModelParallelStrategy(data_parallel_size=<devices>, tensor_parallel_size=1).")
    return True


def _lightning_units(module):
    """FSDP units for a LightningModule: each ``ModuleList`` element (a transformer's
    blocks) and each direct child that holds parameters (a direct ``ModuleList`` or
    ``ModuleDict`` child, which has no forward: its elements instead). Lightning calls
    ``training_step``, not the LightningModule's ``forward``, so a unit's weights are
    gathered only where a submodule's forward runs: the LightningModule itself must hold
    no parameters of its own."""
    import torch.nn as nn

    own = [n for n, _ in module.named_parameters(recurse=False)]
    if own:
        raise NotImplementedError(
            f"MixedPrecisionPlugin under ModelParallelStrategy: the LightningModule holds "
            f"parameters of its own ({', '.join(own)}). Lightning runs training_step, not "
            "the module's forward, so FSDP would never gather them. Move them into a "
            "submodule (an nn.Module attribute whose forward uses them).")
    chosen = {id(b) for m in module.modules() if isinstance(m, nn.ModuleList) for b in m}
    for child in module.children():
        if not any(True for _ in child.parameters()):
            continue
        if _container(child):  # FSDP2 refuses a unit without a forward: its elements
            chosen |= {id(c) for c in child.children()}
        else:
            chosen.add(id(child))
    return lambda m: id(m) in chosen


def _container(module) -> bool:
    """A ``ModuleList`` or ``ModuleDict`` without a forward of its own (what
    ``fully_shard`` refuses as a unit)."""
    import torch.nn as nn

    return (isinstance(module, (nn.ModuleList, nn.ModuleDict))
            and type(module).forward is nn.Module.forward)


def _interval(trainer, scheduler) -> str:
    """The ``interval`` ("step" or "epoch") Lightning steps ``scheduler`` at."""
    for config in trainer.lr_scheduler_configs:
        if config.scheduler is scheduler:
            return config.interval
    return "step"
