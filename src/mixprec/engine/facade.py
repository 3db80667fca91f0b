"""MixedPrecision: the one object a training loop drives.

A facade: ``setup.build`` makes the parts (the parameter state of ``master``, the loss
scaler, the ``parallel`` mode, the fp8 swap, the precision context's emulation mode),
``step.Step`` runs the optimizer step, ``persist.Checkpoints`` (the checkpoint and
export methods it inherits) saves and restores the parts. It holds no numerics.

Example::

    engine = MixedPrecision(model, torch.optim.AdamW(model.parameters(), fused=True),
                            recipe="bf16", grad_accum_steps=4, max_grad_norm=1.0)
    for x, y in batches:
        with engine.autocast():
            loss = F.cross_entropy(model(x), y)
        engine.backward(loss)
        result = engine.step()     # "accumulating" until 4 micro-batches went through

``step()`` (``mixprec.engine.step``): one check for inf/NaN -> clip on the true gradients ->
optimizer step on the fp32 parameters -> refresh the working copy -> update the loss
scale -> zero the buffers. A skipped step leaves parameters, masters and optimizer
state bit-identical. No host sync when every optimizer takes ``found_inf`` (torch's
fused Adam, AdamW, SGD, which torch's default Adam, AdamW and SGD become on CUDA);
others cost one per step. LR schedulers cost none on CUDA: they advance for a step at
the next one (``engine.schedulers`` and checkpoints see them up to date).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mixprec.engine.build import as_optimizers, build, check_loop_args, warn_kernel_choices
from mixprec.engine.checks import check_backward, warn_low_precision_loss
from mixprec.engine.context import precision_context, recompute_context, run_backward
from mixprec.engine.coverage import Coverage, step_flops, warn_low_coverage
from mixprec.engine.persist import Checkpoints
from mixprec.engine.scaler import LossScaler
from mixprec.engine.step import Step, StepResult, check_setup_unchanged
from mixprec.engine.switch import Phases, resolve
from mixprec.engine.watch import SkipLimitError
from mixprec.recipe import Recipe
from mixprec.recipe.schedule import PrecisionSchedule

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler

__all__ = ["MixedPrecision", "StepResult", "SkipLimitError"]


class MixedPrecision(Checkpoints):
    """Mixed-precision training of any ``nn.Module`` under a ``Recipe``.

    >>> import torch
    >>> model = torch.nn.Linear(4, 2)
    >>> engine = MixedPrecision(model, torch.optim.AdamW(model.parameters(), fused=True),
    ...                         recipe="bf16-master")
    >>> with engine.autocast():
    ...     loss = model(torch.randn(8, 4)).square().mean()
    >>> engine.backward(loss)
    >>> result = engine.step()
    >>> bool(result.skipped), engine.recipe.precision.params, engine.master_params[0].dtype
    (False, 'bf16', torch.float32)

    (``model.weight`` is then bf16: a real bf16 tensor, or under emulation, on a CPU
    without bf16 units, an fp32 tensor holding bf16 values.)

    Args:
        model: the module to train; ``-master`` recipes cast its parameters to the
            recipe's ``params`` dtype in place and keep fp32 masters for the optimizer.
        optimizer: one optimizer or a list, built over ``model.parameters()`` (before
            the engine exists). For ``-master`` recipes their param groups are pointed
            at the fp32 masters, so optimizer states are fp32; state they already hold
            (Adagrad's, or earlier fp32 steps') moves to the masters. Frozen parameters
            may be in them; unfreezing one later makes ``step()`` raise.
        recipe: a ``Recipe`` or a recipe string (``"bf16"``, ``"fp16,init_scale=1024"``),
            or a ``PrecisionSchedule`` (or its string form, ``"nvfp4>bf16-master@0.8"``):
            recipes by step, switched at step boundaries (``mixprec.engine.switch``).
        grad_accum_steps: micro-batches per optimizer step; ``backward`` divides the
            loss by it.
        max_grad_norm: clip the global L2 norm of the unscaled gradients to this.
        scheduler: LR scheduler(s) to advance after each *applied* step. On CUDA,
            without a host sync: a step's advance happens at the start of the next
            ``step()`` (before its update), so read them through ``engine.schedulers``
            (or call ``engine.settle()``), not through your own references, to see the
            last step counted.
        parallel: ``"ddp"``, ``"fsdp"``, ``"tp"`` or ``"pp"`` inside an initialised
            process group (see ``mixprec.parallel.distributed``); call ``engine.model``
            (the wrapped module) then. A model split by torch's ``parallelize_module``
            (DTensor parameters) runs as ``"tp"`` when none is given; ``"fsdp"`` with
            ``parallel_kwargs={"mesh": mesh["dp"]}`` shards it on a 2-D mesh. ``"pp"``:
            a stage of torch's pipelining, whose schedule runs the backward of
            ``pipeline_loss`` (``mixprec.parallel.pipeline``).
        parallel_kwargs: passed on to ``DistributedDataParallel`` (e.g.
            ``find_unused_parameters=True`` for a model that leaves some parameters
            unused) or to ``fully_shard`` (e.g. ``reshard_after_forward=False``); what the
            recipe decides (FSDP's ``mp_policy``, DDP's comm hook) cannot be overridden.
        fsdp_units: which modules become FSDP units (each gathers its full weights only
            while it runs), before the root: a module class or tuple of classes (e.g.
            ``(MyBlock,)``), or a callable ``module -> bool``. Default: each element of
            every ``nn.ModuleList`` (a transformer's blocks).
        fp8_filter: fp8 recipes: ``filter(module, fqn) -> bool``, which eligible Linears
            become Float8Linears (``mixprec.engine.convert``'s ``filter``; default: all but
            the output head). A model that already holds Float8Linears, converted by
            hand, is left as it is.
        loss_scaler: a ``mixprec.engine.scaler.LossScaler`` policy to use instead of the one the
            recipe names (its own subclass, say: a scale on a schedule). It must live on
            the model's device; checkpoints hold its state under its ``kind``.
        schedule: a ``PrecisionSchedule`` (or its string form), in place of ``recipe``.

    The parts, for diagnostics and tools: ``param_state``
    (``mixprec.engine.param_state.ParamState``: names, working copy, masters, buffers,
    index by index), ``scaler``, ``parallelism`` (``mixprec.parallel.layouts``),
    ``kernels`` (``mixprec.engine.devices.KernelChoices``), ``counters``.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
        recipe: Recipe | str | PrecisionSchedule = "bf16",
        *,
        grad_accum_steps: int = 1,
        max_grad_norm: float | None = None,
        scheduler: LRScheduler | list[LRScheduler] | tuple[LRScheduler, ...] | None = None,
        parallel: str | None = None,
        parallel_kwargs: dict | None = None,
        fsdp_units: type[nn.Module] | tuple[type[nn.Module], ...]
        | Callable[[nn.Module], bool] | None = None,
        fp8_filter: Callable[[nn.Module, str], bool] | None = None,
        loss_scaler: LossScaler | None = None,
        schedule: PrecisionSchedule | str | None = None,
    ) -> None:
        schedule, r = resolve(recipe, schedule)
        check_loop_args(model, grad_accum_steps, max_grad_norm, loss_scaler)
        self.optimizers = as_optimizers(optimizer)
        self.grad_accum_steps, self.max_grad_norm = grad_accum_steps, max_grad_norm
        schedulers = ([] if scheduler is None else list(scheduler)
                      if isinstance(scheduler, (list, tuple)) else [scheduler])
        parts = build(model, self.optimizers, r, parallel=parallel,
                      parallel_kwargs=parallel_kwargs, fsdp_units=fsdp_units,
                      fp8_filter=fp8_filter, loss_scaler=loss_scaler)
        self._fp8_filter, self._given_scaler = fp8_filter, loss_scaler is not None
        self._adopt(parts)
        warn_low_coverage(self._coverage, r)
        self._step = Step(self.optimizers, self.param_state, self.scaler, self.parallelism,
                          self.fp8_modules, schedulers, max_grad_norm, self.device, r)
        #: ``micro`` / ``seen`` / ``steps`` (``mixprec.engine.step.Counters``)
        self.counters = self._step.counters
        #: the precision schedule and the phase the engine trains in
        self._phases = Phases(self, schedule)
        self._warned_loss = False
        self._unsynced = False  # the last forward ran under no_sync() (DDP)
        warn_kernel_choices(r, self.kernels, self.device)

    def _adopt(self, parts) -> None:
        """Hold the parts ``build`` made (at construction, and at a recipe switch)."""
        self.recipe, self.module, self.model, self.device = parts.recipe, parts.module, \
            parts.model, parts.device
        #: every hardware-dependent choice for this recipe here, and the measured rates
        self.kernels = parts.kernels
        self.emulating = parts.kernels.emulate
        self.emulation_mode = parts.emulation_mode
        #: the parallel mode (``mixprec.parallel.layouts``), and its name as given
        self.parallelism = parts.parallel
        self.parallel, self.world_size = parts.parallel.name, parts.parallel.world_size
        self.comm_stats = parts.parallel.comm_stats
        self.param_state, self.scaler = parts.param_state, parts.scaler
        self.fp8_report, self.fp8_modules = parts.fp8_report, parts.fp8_modules
        self._coverage = parts.coverage
        self._frozen, self._param_counts = parts.frozen, parts.param_counts
        # the patched forwards belong to this engine: undone by close() or when the
        # engine is collected (the finalizer holds the undo function, not the engine)
        self._undo_islands = weakref.finalize(self, parts.undo_islands)

    # --- precision schedules ----------------------------------------------------------

    def set_recipe(self, recipe: Recipe | str) -> None:
        """Train in ``recipe`` from the next step on: fp32 masters, optimizer state and
        loss scale carry over exactly (``mixprec.engine.switch``). Only at a step
        boundary (after ``step()``, before the next ``backward``). A schedule switches
        again at its next phase's start."""
        self._phases.set_recipe(recipe)

    @property
    def schedule(self) -> PrecisionSchedule | None:
        """The precision schedule the engine follows (None: one recipe)."""
        return self._phases.schedule

    @property
    def phase(self) -> int | None:
        """The index of the schedule's phase the engine trains in (None: no schedule)."""
        return self._phases.index

    def set_total_steps(self, total_steps: int) -> None:
        """The run's optimizer steps, for a schedule whose phases start at fractions of
        it (the Trainer and Lightning integrations call it from ``max_steps``)."""
        self._phases.set_total_steps(total_steps)

    # --- the loop ---------------------------------------------------------------------

    @contextmanager
    def autocast(self) -> Iterator[None]:
        """The recipe's precision for the forward pass and the loss. Under DDP, a
        forward whose backward will not end the window runs under ``no_sync()`` (DDP
        decides in the forward), so one reduction serves the window."""
        c = self.counters
        last = c.closed or c.micro >= self.grad_accum_steps - 1
        if torch.is_grad_enabled():
            self._unsynced = not last
        with self.parallelism.forward(self.model, last), \
                precision_context(self.recipe, self.device, emulate=self.emulating,
                                  mode=self.emulation_mode, sink=self.param_state,
                                  rest=self.kernels.fp8_rest):
            yield

    def backward(self, loss: torch.Tensor, *, retain_graph: bool = False,
                 divided: bool = False, last: bool | None = None) -> None:
        """Backward of ``loss * scale / grad_accum_steps``; grads go to the buffers.
        ``divided``: ``loss`` is already divided by ``grad_accum_steps`` (a trainer
        that accumulates, such as Lightning), so only the scale is applied.

        ``last``: whether this micro-batch ends the accumulation window. None: the
        ``grad_accum_steps``-th does. True ends it here, early (the short window at the
        end of an epoch, as Accelerate's ``accumulate`` ends it): data parallel reduces
        now and the next ``step()`` updates, with the sum of the window's gradients
        still divided by ``grad_accum_steps``, as Accelerate and a loop that divides
        each loss do. False on the ``grad_accum_steps``-th micro-batch raises.

        Gradients that another backward left on this engine's parameters (a GAN's
        generator loss reaching the discriminator) are dropped first: each engine
        accumulates only what its own ``backward`` calls make."""
        c, state = self.counters, self.param_state
        if self.parallel == "pp":
            raise RuntimeError(
                "backward() under parallel='pp': torch's pipeline schedule runs the "
                "backward. Give it loss_fn=engine.pipeline_loss(loss_fn), run "
                "schedule.step(...) under engine.autocast(), then call engine.step()")
        check_backward(loss, c.micro, self.grad_accum_steps, state, c.closed, last)
        if not self._warned_loss:
            self._warned_loss = warn_low_precision_loss(loss, self.recipe)
        scaled = self.scaler.scale_loss(loss, 1 if divided else self.grad_accum_steps)
        last = c.micro == self.grad_accum_steps - 1 if last is None else last
        state.drop_stray_grads(fresh=c.micro == 0)
        with contextlib.ExitStack() as stack:
            if not last:  # data parallel: reduce once, on the last micro-batch
                stack.enter_context(self.parallelism.no_reduce(self.model))
            if self.emulation_mode is not None:  # backward ops round like real kernels do
                stack.enter_context(self.emulation_mode)
            # activation checkpointing recomputes forward segments in here
            stack.enter_context(recompute_context(self.recipe, self.device, state))
            run_backward(scaled, retain_graph)
        state.accumulate()
        if last and self._unsynced:  # an early end after a forward under no_sync()
            self.parallelism.reduce(state)
        self._unsynced = False
        if self.grad_accum_steps > 1:
            state.mark_accumulated()
        c.backward(last, self.grad_accum_steps)

    def step(self) -> StepResult:
        """Finish a micro-batch; update the weights once ``grad_accum_steps`` are in."""
        c = self.counters
        self._count_schedule_backwards()
        if c.micro == c.seen:
            raise RuntimeError(
                "step() called without backward() since the last step() (or twice for the "
                "same gradients): each step() consumes the engine.backward(loss) calls "
                "before it (loss.backward() bypasses the engine: no scaling, no buffers)")
        c.consume()
        if c.micro < self.grad_accum_steps and not c.closed:
            return StepResult(True, False, self.scaler.scale, None)
        check_setup_unchanged(self.optimizers, self._param_counts, self.param_state,
                              self._frozen)
        found_inf, norm = self._step()
        result = StepResult(False, found_inf > 0, self.scaler.scale, norm)
        self._phases.after_step()  # a schedule's next phase starts at a step boundary
        return result

    def clip_grad_norm_(self, max_norm: float | None = None,
                        norm_type: float = 2.0) -> torch.Tensor:
        """The true total norm of this window's gradients, and with ``max_norm`` a clip
        to it at the update: what ``torch.nn.utils.clip_grad_norm_`` returns and does in
        fp32 training. The gradients are the ones the optimizer will see: unscaled (the
        loss scale divided out), fp32, summed over micro-batches and reduced across
        ranks. The norm is a device tensor (no host sync); reading it syncs.

        Call it after the window's last ``backward`` and before ``step()``; the clip
        applies to that step only, in place of ``max_grad_norm``. Where a gradient is
        non-finite the norm is inf or NaN and the step will be skipped; nothing raises
        (torch's ``error_if_nonfinite`` would). The frameworks' clip calls
        (``mixprec.integrations``) come here. Only the L2 norm: other ``norm_type``
        values raise."""
        if norm_type != 2.0:
            raise NotImplementedError(
                f"norm_type={norm_type!r}: the engine's norm is the L2 norm (its skip "
                "decision and its clip use it); clip with norm_type=2")
        if max_norm is not None and not max_norm > 0:
            raise ValueError(f"max_norm must be > 0 or None, got {max_norm!r}")
        c = self.counters
        self._count_schedule_backwards()
        if c.micro == 0 or (c.micro < self.grad_accum_steps and not c.closed):
            raise RuntimeError(
                f"clip_grad_norm_ after {c.micro} of {self.grad_accum_steps} micro-batches: "
                "the gradients are complete (and reduced across ranks) only after the "
                "window's last backward. Clip there, just before step().")
        return self._step.clip(max_norm)

    def pipeline_loss(self, loss_fn: Callable[..., torch.Tensor]) -> Callable[..., Any]:
        """The ``loss_fn`` for torch's pipeline schedule under ``parallel="pp"``: the
        loss times the loss scale, divided by ``grad_accum_steps``, as ``backward``
        takes it (``mixprec.parallel.pipeline.PipelineLoss``; its ``take()`` gives the
        micro-batches' own losses)."""
        if self.parallel != "pp":
            raise ValueError(f"pipeline_loss with parallel={self.parallel!r}: it is the "
                             "loss of torch's pipeline schedules; build the engine with "
                             "parallel='pp', or call engine.backward(loss)")
        return self.parallelism.loss(loss_fn, self.scaler, self.grad_accum_steps)

    def _count_schedule_backwards(self) -> None:
        """The micro-batches a pipeline schedule ran the backward of join the window."""
        for _ in range(self.parallelism.backwards_run(self.counters.micro,
                                                      self.grad_accum_steps)):
            self.counters.backward(False, self.grad_accum_steps)

    def zero_grad(self) -> None:
        """Drop any accumulated gradients and start a fresh accumulation."""
        self._step.forget()
        self.parallelism.drop_window()
        self.param_state.zero_grad()
        self.counters.clear()

    # --- introspection ----------------------------------------------------------------

    @property
    def coverage(self) -> Coverage:
        """The share of the model's matmul weights in each format, per module kind
        (Linears, experts, attention, head, routers), and what stayed in 16 bits and
        why (``mixprec.engine.coverage``): ``print(engine.coverage)``."""
        return self._coverage

    def coverage_flops(self, run: Callable[[], Any]) -> Coverage:
        """``coverage`` by the matmul FLOPs of ``run()``, a forward of a real batch
        (``lambda: model(x)``, under ``autocast()``): dense layers by their tokens,
        experts by the tokens routed to them (``mixprec.engine.coverage.step_flops``)."""
        return self._coverage.weighted(step_flops(self.module, self._coverage, run))

    @property
    def scale(self) -> torch.Tensor:
        """The current loss scale (a device tensor; 1.0 for recipes without scaling)."""
        return self.scaler.scale

    @property
    def schedulers(self) -> list:
        """The LR schedulers, advanced for every applied step so far (``settle``)."""
        self._step.settle()
        return self._step.schedulers

    def settle(self) -> None:
        """Advance the schedulers for the last step, if it was applied and they have
        not yet: on CUDA ``step()`` leaves that to the next step, to avoid a host sync.
        Waits for the last step's work (not for work queued after it)."""
        self._step.settle()

    @property
    def steps(self) -> int:
        """Optimizer steps taken (applied or skipped)."""
        return self.counters.steps

    @property
    def skipped_steps(self) -> torch.Tensor:
        """How many updates were skipped for non-finite gradients (a device tensor)."""
        return self.scaler.skipped_total

    @property
    def master_params(self) -> list[nn.Parameter]:
        """The parameters the optimizer updates (fp32 masters, or the model's own)."""
        return list(self.param_state.opt_params)

    def close(self) -> None:
        """Undo the fp32 wrapping of third-party norm modules (a ``LlamaRMSNorm``'s
        ``forward``) and give transformers' experts configs back the experts
        implementation they had. Dropping the engine does it too; calling it twice is
        harmless."""
        self._undo_islands()
