"""MixedPrecision: the one object a training loop drives.

It composes the rooms: the precision context (``context``), master weights and
accumulation buffers (``master``), the loss scaler (``scaler``) and, for fp8 recipes,
the Float8Linear swap and its delayed scales (``fp8``). It holds no math.

Example::

    engine = MixedPrecision(model, torch.optim.AdamW(model.parameters(), fused=True),
                            recipe="bf16", grad_accum_steps=4, max_grad_norm=1.0)
    for x, y in batches:
        with engine.autocast():
            loss = F.cross_entropy(model(x), y)
        engine.backward(loss)
        result = engine.step()     # "accumulating" until 4 micro-batches went through

What ``step()`` does once the micro-batches are in: unscale and check for inf/NaN in
one fused pass -> (if all finite) clip on the true gradients -> optimizer step on the
fp32 parameters -> refresh the low-precision working copy -> update the loss scale ->
zero the buffers. A step with non-finite gradients leaves parameters, masters and
optimizer state bit-identical.

Host synchronisation: none in ``backward()`` or ``step()`` when every optimizer takes
``found_inf`` on the device (torch's Adam, AdamW and SGD with ``fused=True``). For those
the step reads the gradients once (their global norm, which is also the non-finite
check) and the fused kernel unscales and clips as it updates. Any other optimizer costs
one sync per step to decide the skip, as with torch's GradScaler, and an explicit
unscale pass. An
attached LR scheduler costs one too: it advances only on applied steps, so it needs to
know whether the step was skipped.
"""

from __future__ import annotations

import contextlib
import os
import warnings
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from mixprec.checks import (
    check_device,
    check_fp8_filter,
    check_fsdp_units,
    check_model,
    check_optimizers,
    check_parallel_kwargs,
    param_counts,
    takes_found_inf,
)
from mixprec.context import (
    fp32_island_modules,
    make_emulation_mode,
    precision_context,
    recompute_context,
    wrap_fp32_modules,
)
from mixprec.distributed import (
    agree_amax_,
    all_reduce_max_,
    broadcast_module_,
    require_process_group,
    shard_fsdp,
    wrap_ddp,
)
from mixprec.fp8.convert import convert as fp8_convert
from mixprec.fp8.linear import Float8Linear
from mixprec.gradnorm import clip_coef, global_norm
from mixprec.kernels import choices, has_fast_kernels
from mixprec.master import GradState
from mixprec.recipe import Recipe
from mixprec.scaler import LossScaler
from mixprec.watch import SkipLimitError, SkipWatch

__all__ = ["MixedPrecision", "StepResult", "SkipLimitError"]


@dataclass(frozen=True)
class StepResult:
    """What a call to ``step()`` did. Tensors stay on the device: ``bool(r.skipped)``,
    ``float(r.scale)`` and ``float(r.grad_norm)`` are the caller's choice to sync.

    - ``accumulating``: True while fewer than ``grad_accum_steps`` micro-batches went
      through (no update happened; ``skipped`` is then False).
    - ``skipped``: True if gradients were non-finite and the update was skipped.
    - ``scale``: the loss scale after this step's update.
    - ``grad_norm``: global L2 norm of the unscaled gradients before clipping (None
      while accumulating).
    """

    accumulating: bool
    skipped: torch.Tensor | bool
    scale: torch.Tensor
    grad_norm: torch.Tensor | None


def _run_backward(loss: torch.Tensor, retain_graph: bool) -> None:
    """``loss.backward()``, with the precision context's function modes still on.

    ``Tensor.backward`` is itself a call that function modes intercept, and torch pops
    the intercepting mode before the autograd engine runs. So activation-checkpoint
    recomputation inside backward would run without the FP32 islands (and raise
    ``CheckpointError``: its norms would come out bf16). Entering the autograd engine
    one level lower keeps the modes on. Falls back to ``loss.backward()`` if that
    entry point ever moves.
    """
    run = getattr(torch.autograd.graph, "_engine_run_backward", None)
    if run is None:
        loss.backward(retain_graph=retain_graph)
        return
    run((loss,), (torch.ones_like(loss),), retain_graph, False, (),
        allow_unreachable=True, accumulate_grad=True)


class MixedPrecision:
    """Mixed-precision training of any ``nn.Module`` under a ``Recipe``.

    >>> import torch
    >>> model = torch.nn.Linear(4, 2)
    >>> engine = MixedPrecision(model, torch.optim.AdamW(model.parameters(), fused=True),
    ...                         recipe="bf16-master")
    >>> with engine.autocast():
    ...     loss = model(torch.randn(8, 4)).square().mean()
    >>> engine.backward(loss)
    >>> result = engine.step()
    >>> bool(result.skipped), engine.recipe.params, engine.master_params[0].dtype
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
        recipe: a ``Recipe`` or a recipe string (``"bf16"``, ``"fp16,init_scale=1024"``).
        grad_accum_steps: micro-batches per optimizer step; ``backward`` divides the
            loss by it.
        max_grad_norm: clip the global L2 norm of the unscaled gradients to this.
        scheduler: LR scheduler(s) to advance after each *applied* step (costs one host
            sync per step to know whether it was skipped).
        parallel: ``"ddp"`` or ``"fsdp"`` inside an initialised process group (see
            ``mixprec.distributed``); call ``engine.model`` (the wrapped module) then.
        parallel_kwargs: passed on to ``DistributedDataParallel`` (e.g.
            ``find_unused_parameters=True`` for a model that leaves some parameters
            unused) or to ``fully_shard`` (e.g. ``reshard_after_forward=False``); what the
            recipe decides (FSDP's ``mp_policy``, DDP's comm hook) cannot be overridden.
        fsdp_units: which modules become FSDP units (each gathers its full weights only
            while it runs), before the root: a module class or tuple of classes (e.g.
            ``(MyBlock,)``), or a callable ``module -> bool``. Default: each element of
            every ``nn.ModuleList`` (a transformer's blocks).
        fp8_filter: fp8 recipes: ``filter(module, fqn) -> bool``, which eligible Linears
            become Float8Linears (``mixprec.fp8.convert``'s ``filter``; default: all but
            the output head). A model that already holds Float8Linears, converted by
            hand, is left as it is.
        loss_scaler: a ``mixprec.scaler.LossScaler`` policy to use instead of the one the
            recipe names (its own subclass, say: a scale on a schedule). It must live on
            the model's device; checkpoints hold its state under its ``kind``.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
        recipe: Recipe | str = "bf16",
        *,
        grad_accum_steps: int = 1,
        max_grad_norm: float | None = None,
        scheduler=None,
        parallel: str | None = None,
        parallel_kwargs: dict | None = None,
        fsdp_units=None,
        fp8_filter=None,
        loss_scaler: LossScaler | None = None,
    ) -> None:
        self.recipe = r = Recipe.coerce(recipe)
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        self.optimizers = ([optimizer] if isinstance(optimizer, torch.optim.Optimizer)
                           else list(optimizer))
        if not self.optimizers or not all(isinstance(o, torch.optim.Optimizer)
                                          for o in self.optimizers):
            raise TypeError("optimizer must be a torch.optim.Optimizer or a list of them")
        if not isinstance(grad_accum_steps, int) or grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps must be an integer >= 1, got "
                             f"{grad_accum_steps!r}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm!r}")
        self.module = self.model = model
        self.parallel = parallel
        self.world_size = 1
        self.comm_stats = None
        if parallel is not None:
            if r.wgrad == "fp32" and parallel == "fsdp":
                raise NotImplementedError(
                    f"recipe {str(r)!r}: wgrad=fp32 with parallel='fsdp' is not "
                    "supported: FSDP reduce-scatters the gradients of its unsharded "
                    "low-precision parameters. Use parallel='ddp', or drop wgrad.")
        if loss_scaler is not None and not isinstance(loss_scaler, LossScaler):
            raise TypeError(f"loss_scaler must be a mixprec.scaler.LossScaler (a subclass "
                            f"for a policy of your own), got {type(loss_scaler).__name__}")
        check_fp8_filter(fp8_filter, r, model)
        parallel_kwargs = check_parallel_kwargs(parallel, parallel_kwargs)
        units = check_fsdp_units(parallel, fsdp_units, model)
        if parallel is not None:
            require_process_group(parallel)
            self.world_size = dist.get_world_size()
        self.grad_accum_steps = grad_accum_steps
        self.max_grad_norm = max_grad_norm
        self.schedulers = ([] if scheduler is None else
                           list(scheduler) if isinstance(scheduler, (list, tuple))
                           else [scheduler])

        # Everything that can reject the arguments runs before the model is touched
        # (fp8 swap, sharding, casting to the working dtype): nothing lost on failure.
        # frozen now: the optimizers may hold them (they never get a gradient), and
        # step() refuses to go on if one is unfrozen later (see _check_setup_unchanged)
        params, self._frozen = check_model(model)
        # names of the trained parameters, in GradState's order (checkpoints use them)
        self._trainable_names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.device = params[0].device
        #: every hardware-dependent choice for this recipe here, and the measured rates
        self.kernels = choices(r, self.device)
        self.emulating = self.kernels.emulate
        check_device(self.device, r, self.emulating)
        check_optimizers(self.optimizers, params, self._frozen, r, parallel, self.emulating)
        if parallel is not None:
            broadcast_module_(model)  # every rank starts from rank 0's weights
        # one mode for the engine's life: backward must see the tags forward made
        self._emu_mode = make_emulation_mode(r) if self.emulating else None
        self.fp8_report = None
        if r.compute == "fp8":
            # the swap reuses the Parameters, so the optimizer stays valid. Before FSDP:
            # fully_shard must manage the Float8Linears, or they would see sharded weights
            # the route kernels.choices resolved and reports, taken once for every layer
            fr = r.replace(fp8_gemm=self.kernels.fp8_gemm)
            done = {m.scaling for m in model.modules() if isinstance(m, Float8Linear)}
            if not done:
                self.fp8_report = fp8_convert(model, fr, filter=fp8_filter)
            elif done != {r.fp8_scaling}:
                warnings.warn(
                    f"the model's Float8Linears (converted by hand) use fp8_scaling="
                    f"{'/'.join(sorted(done))}, the recipe says {r.fp8_scaling}: each module "
                    "keeps its own. Convert with the engine's recipe to match.", stacklevel=2)
        if parallel == "fsdp":
            model = shard_fsdp(model, r, self.optimizers, units, emulate=self.emulating,
                               **parallel_kwargs)
            r_state = r.replace(params="fp32", master="none", grads="fp32")
        else:
            r_state = r
        params = [p for p in model.parameters() if p.requires_grad]
        self.fp8_modules = [m for m in model.modules() if isinstance(m, Float8Linear)]
        ids = {id(p): i for i, p in enumerate(params)}
        self.grads = GradState(params, r_state, emulate=self.emulating)
        if self._emu_mode is not None and self.grads.round_to is not None:
            self._emu_mode.tag(self.grads.working)  # bf16 values in fp32 tensors
        # the gradients the norm reads are fp32 CPU tensors for the engine's whole life
        # (fp32 buffers, or direct fp32 .grad): decide the norm's method once
        self._cpu_fp32_grads = self.device.type == "cpu" and r_state.grads == "fp32"
        self._one_device = all(p.device == self.device for p in params)
        if self.grads.has_master:
            for o in self.optimizers:
                for g in o.param_groups:
                    g["params"] = [self.grads.masters[ids[id(p)]] if id(p) in ids else p
                                   for p in g["params"]]
                # state that exists already (Adagrad builds it in __init__; or a run of
                # plain fp32 steps) belongs to the fp32 values the masters copy
                for p in list(o.state):
                    if id(p) in ids:
                        o.state[self.grads.masters[ids[id(p)]]] = o.state.pop(p)
        if parallel == "ddp":
            self.grads.announce_grads = True  # wgrad=fp32: DDP must see grads arrive
            self.model, self.comm_stats = wrap_ddp(self.grads, model, r, **parallel_kwargs)
        self._fused = [takes_found_inf(o) for o in self.optimizers]
        self._param_counts = param_counts(self.optimizers)
        self._all_fused = all(self._fused)
        self.scaler = (LossScaler.from_recipe(r, self.device) if loss_scaler is None
                       else loss_scaler)
        undo = wrap_fp32_modules(fp32_island_modules(model, r.keep_fp32), self.device.type
                                 ) if r.has_fp32_islands else (lambda: None)
        # the patched forwards belong to this engine: undone by close() or when the
        # engine is collected (the finalizer holds the undo function, not the engine)
        self._undo_islands = weakref.finalize(self, undo)
        self._micro = self._seen = 0
        self._steps = 0
        self._skips = SkipWatch(self.device)
        self.grads.mark_working()  # after DDP's broadcast of rank 0's weights
        self._warn_kernel_choices()

    def _warn_kernel_choices(self) -> None:
        """Say where an ``auto`` choice left the format's own kernels (measured)."""
        r, k = self.recipe, self.kernels
        if self.emulating and r.emulate is None:
            warnings.warn(
                f"{r.compute} has no fast kernels on {self.device.type}: mixprec emulates "
                f"it exactly on fp32 kernels ({k.describe()}). Set emulate=false to run "
                "the real kernels.",
                stacklevel=3,
            )
        elif k.fp8_rest == "fp32" and r.compute == "fp8":
            warnings.warn(
                f"bf16 has no fast kernels on {self.device.type}: the layers around the fp8 "
                f"Linears compute in fp32 instead of bf16, faster and more exact here "
                f"({k.describe()}).",
                stacklevel=3,
            )
        elif (r.emulate is False and r.emulatable
              and not has_fast_kernels(self.device, r.compute)):
            warnings.warn(
                f"{r.compute} compute with emulate=false on {self.device.type}: this device "
                "has no fast kernel for it (measured); emulate=auto would run it exactly "
                "on fp32 kernels instead.",
                stacklevel=3,
            )

    # --- data parallel ----------------------------------------------------------------

    def _local(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.parallel != "fsdp":  # only FSDP's gradients are DTensors
            return grads
        return [g.to_local() if hasattr(g, "to_local") else g for g in grads]

    # --- the loop ---------------------------------------------------------------------

    @contextmanager
    def autocast(self) -> Iterator[None]:
        """The recipe's precision for the forward pass and the loss."""
        with precision_context(self.recipe, self.device, emulate=self.emulating,
                               mode=self._emu_mode, sink=self.grads):
            yield

    def backward(self, loss: torch.Tensor, *, retain_graph: bool = False) -> None:
        """Backward of ``loss * scale / grad_accum_steps``; grads go to the buffers.

        Gradients that another backward left on this engine's parameters (a GAN's
        generator loss reaching the discriminator) are dropped first: each engine
        accumulates only what its own ``backward`` calls make."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("backward() takes the scalar loss tensor; reduce it first "
                             "(e.g. loss.mean())")
        if not loss.requires_grad:
            raise ValueError("the loss does not require grad: was it computed under "
                             "torch.no_grad(), or from detached outputs?")
        if self._micro >= self.grad_accum_steps:
            raise RuntimeError(
                f"backward() called {self._micro + 1} times since the last update but "
                f"grad_accum_steps={self.grad_accum_steps}; call step() after each backward. "
                "For several losses in one step, backward their sum "
                "(engine.backward(loss0 + loss1)).")
        if self._micro and self.grads.accumulation_cleared():
            raise RuntimeError(
                f"the gradients of the {self._micro} micro-batch(es) accumulated since the "
                "last update were cleared outside the engine (optimizer.zero_grad() or "
                "model.zero_grad() after a step() that returned accumulating?). step() "
                f"applies the update once grad_accum_steps={self.grad_accum_steps} "
                "micro-batches are in and zeroes the gradients itself: zero nothing in "
                "between.")
        scaled = self.scaler.scale_loss(loss, self.grad_accum_steps)
        last = self._micro == self.grad_accum_steps - 1
        self.grads.drop_stray_grads(fresh=self._micro == 0)
        with contextlib.ExitStack() as stack:
            if self.parallel == "ddp" and not last:
                stack.enter_context(self.model.no_sync())  # reduce once, on the last one
            if self.parallel == "fsdp" and not last:
                self.model.set_requires_gradient_sync(False)
                stack.callback(self.model.set_requires_gradient_sync, True)
            if self._emu_mode is not None:  # backward ops round like real kernels do
                stack.enter_context(self._emu_mode)
            # activation checkpointing recomputes forward segments in here
            stack.enter_context(recompute_context(self.recipe, self.device, self.grads))
            _run_backward(scaled, retain_graph)
        self.grads.accumulate()
        if self.grad_accum_steps > 1:
            self.grads.mark_accumulated()
        self._micro += 1

    def step(self) -> StepResult:
        """Finish a micro-batch; update the weights once ``grad_accum_steps`` are in."""
        if self._micro == self._seen:
            raise RuntimeError(
                "step() called without backward() since the last step() (or twice for the "
                "same gradients): each step() consumes the engine.backward(loss) calls "
                "before it (loss.backward() bypasses the engine: no scaling, no buffers)")
        self._seen = self._micro
        if self._micro < self.grad_accum_steps:
            return StepResult(True, False, self.scaler.scale, None)
        self._check_setup_unchanged()
        grads = self._local(self.grads.grads())
        found_inf, norm = self._check(grads)  # one skip decision for every path
        if self._all_fused and self._one_device:
            grad_scale = self._fused_grad_scale(norm)  # the kernel unscales and clips
        else:
            self.scaler.unscale_(grads)  # its own inf check is implied by the norm's
            if self.max_grad_norm is not None:
                torch._foreach_mul_(grads, clip_coef(norm, self.max_grad_norm))
            grad_scale = None
        self.grads.hand_to_optimizer()
        for opt, fused in zip(self.optimizers, self._fused):
            if fused:
                opt.found_inf, opt.grad_scale = found_inf, grad_scale
                try:
                    opt.step()
                finally:
                    del opt.found_inf, opt.grad_scale
            elif not found_inf.item():  # one host sync: this optimizer cannot skip itself
                opt.step()
        self.grads.refresh_working()
        self._agree_amax()
        for m in self.fp8_modules:
            m.update_scales(found_inf)  # a skipped step drops its amaxes
        self.scaler.update(found_inf)
        self.grads.zero()
        self._micro = self._seen = 0
        self._steps += 1
        if self.schedulers and not found_inf.item():
            for s in self.schedulers:
                s.step()
        self._watch_skips()
        return StepResult(False, found_inf > 0, self.scaler.scale, norm)

    def _check_setup_unchanged(self) -> None:
        """A parameter frozen when the engine was built has no buffer, master or place
        in the norm: unfreezing it later would train it unscaled and never zero its
        gradient, so that is refused. So is a param group added to an optimizer after
        the engine was built (its parameters would bypass the masters and buffers), and
        a write to the working copy behind the masters (the next refresh would undo it)."""
        if param_counts(self.optimizers) != self._param_counts:
            raise RuntimeError(
                "an optimizer's param groups changed after MixedPrecision was created "
                f"(parameters per optimizer: {self._param_counts} then, "
                f"{param_counts(self.optimizers)} now); the engine did not re-point the "
                "new ones at masters and buffers. Call add_param_group before creating "
                "the engine, or create a new engine.")
        changed = self.grads.changed_working()
        if changed:
            raise RuntimeError(
                f"{len(changed)} weight(s) of the model (the first of shape "
                f"{tuple(changed[0].shape)}) were written in place outside the engine since "
                "its last update, e.g. by model.load_state_dict() or an in-place op under "
                "torch.no_grad(). Under -master recipes the optimizer updates fp32 masters "
                "and the working copy is rewritten from them at every step, so the write "
                "would be lost. Load weights before creating MixedPrecision (or use "
                "engine.load_state_dict()), and make in-place changes to "
                "engine.master_params.")
        thawed = [p for p in self._frozen if p.requires_grad]
        if thawed:
            raise RuntimeError(
                f"{len(thawed)} parameter(s) (the first of shape {tuple(thawed[0].shape)}) "
                "had requires_grad=False when MixedPrecision was created and require grad "
                "now; the engine does not manage them. Create a new MixedPrecision (with "
                "its optimizer) after changing which parameters train, e.g. from a "
                "checkpoint: engine.state_dict() keeps the weights.")

    def _check(self, grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The one skip decision, for the fused and the unfused paths alike: the global
        norm of the *scaled* gradients is non-finite when any gradient holds inf/NaN and
        when their sum of squares overflows fp32 (finite elements, a norm above ~1.8e19).
        Divided by the scale it is the true norm (exactly, for power-of-2 scales).

        Before, the unfused path took its decision from the elements alone; a norm that
        overflowed then clipped by ``max_norm / inf = 0`` and the step was applied, so
        Adam's moments decayed and its step count advanced where the fused path skipped."""
        norm_scaled = self._global_norm(grads)
        found_inf = self._agree((~torch.isfinite(norm_scaled)).float())
        scaled = self.scaler.scaled
        return found_inf, (norm_scaled / self.scaler.scale if scaled else norm_scaled)

    def _fused_grad_scale(self, norm: torch.Tensor) -> torch.Tensor | None:
        """What fused optimizers divide each gradient by: the loss scale over the clip
        coefficient, so no pass writes the gradients here (None: nothing to divide)."""
        scaled = self.scaler.scaled
        grad_scale = self.scaler.scale if scaled else None
        if self.max_grad_norm is not None:
            grad_scale = (grad_scale if scaled else 1.0) / clip_coef(norm, self.max_grad_norm)
        return grad_scale

    def _agree(self, found_inf: torch.Tensor) -> torch.Tensor:
        """Data parallel: every rank takes the same skip decision (MAX across ranks)."""
        if self.parallel is not None:
            all_reduce_max_(found_inf)
        return found_inf

    def _agree_amax(self) -> None:
        """Data parallel fp8: this step's amaxes become the max over ranks."""
        if self.parallel is not None:
            agree_amax_(self.fp8_modules)

    def _global_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """L2 norm of all gradients; with FSDP the shards' squares are summed across ranks
        (DDP's gradients are already identical on every rank after the all-reduce)."""
        return global_norm(grads, self.device, self._cpu_fp32_grads,
                           dist.all_reduce if self.parallel == "fsdp" else None)

    def _watch_skips(self) -> None:
        self._skips.check(self.scaler, self.recipe)

    def zero_grad(self) -> None:
        """Drop any accumulated gradients and start a fresh accumulation."""
        for p in self.grads.working:
            p.grad = None
        self.grads.zero()
        self._micro = self._seen = 0

    # --- introspection ----------------------------------------------------------------

    @property
    def scale(self) -> torch.Tensor:
        """The current loss scale (a device tensor; 1.0 for recipes without scaling)."""
        return self.scaler.scale

    @property
    def steps(self) -> int:
        """Optimizer steps taken (applied or skipped)."""
        return self._steps

    @property
    def skipped_steps(self) -> torch.Tensor:
        """How many updates were skipped for non-finite gradients (a device tensor)."""
        return self.scaler.skipped_total

    @property
    def master_params(self) -> list[nn.Parameter]:
        """The parameters the optimizer updates (fp32 masters, or the model's own)."""
        return list(self.grads.opt_params)

    # --- checkpoints ------------------------------------------------------------------

    def fp32_state_dict(self, full: bool = False) -> dict[str, torch.Tensor]:
        """The trained weights in fp32, keyed like the original model's ``state_dict``.

        Parameters with an fp32 master give the master's value (the working copy is
        only its rounding); other low-precision parameters are upcast, exactly; buffers
        are copied; fp8 scaling state (amax histories, scales) is left out. So it loads,
        strictly, into a fresh fp32 instance of the model, for evaluation or export.
        Under ``parallel="fsdp"`` the values are the local shards (DTensors), or with
        ``full=True`` the whole tensors (a collective: every rank calls it)."""
        from mixprec.checkpoint import fp32_weights, gather_full

        weights = fp32_weights(self.module, self.grads)
        return gather_full(weights) if full and self.parallel == "fsdp" else weights

    def state_dict(self, full: bool = False) -> dict:
        """Everything to resume bit-identically; loads with ``weights_only=True``.

        Without FSDP every tensor is whole and the state resumes at any world size, with
        or without ``parallel=`` (DDP's replicas are identical). Under FSDP it holds this
        rank's shards, for FSDP at the same world size; ``full=True`` gathers them (a
        collective: every rank calls it) into a state that loads anywhere."""
        from mixprec.checkpoint import engine_state

        return engine_state(self, full)

    def save(self, path, full: bool = False, reshardable: bool = False, **extra) -> None:
        """Write ``state_dict(full)`` (and ``extra``: a step count, a data position...) to
        ``path`` atomically: a crash mid-write leaves the previous file whole.

        Without FSDP any rank may call it (rank 0 alone is enough). Under FSDP, every
        rank calls it: by default each writes its own shards (give each rank its own
        path); with ``full=True`` the shards are gathered and rank 0 writes one file
        that resumes at any world size (a failed write raises on every rank); with
        ``reshardable=True`` ``path`` is a directory of ``torch.distributed.checkpoint``
        shards, written once by their ranks, that FSDP resumes at any world size
        without gathering anything.

        >>> import torch, tempfile, os
        >>> model = torch.nn.Linear(4, 2)
        >>> engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
        >>> engine.save(path, step=100)
        >>> engine.load(path)
        {'step': 100}
        """
        from mixprec.checkpoint import save_engine, save_resharding

        if reshardable:
            save_resharding(self, path, extra)
        else:
            save_engine(self, path, full, extra)

    def load(self, path) -> dict:
        """Restore what ``save`` wrote and return its ``extra``. An unreadable file, or
        one this engine cannot resume (another recipe; FSDP shards of another world
        size), raises before anything changes. A directory is a ``reshardable`` save,
        for FSDP at any world size."""
        from mixprec.checkpoint import CheckpointError, load_checkpoint, restore_resharding

        if os.path.isdir(path) or os.path.isdir(f"{path}.old"):
            return restore_resharding(self, path)
        state = load_checkpoint(path)
        if not isinstance(state, dict) or "engine" not in state:
            raise CheckpointError(f"{str(path)!r} was not written by MixedPrecision.save "
                                  "(no 'engine' entry); use load_state_dict for other files")
        self.load_state_dict(state["engine"])
        return dict(state.get("extra", {}))

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``'s output; refuses another recipe, emulation setting,
        optimizer layout, and FSDP shards of another world size, naming both sides,
        before anything changes.

        A whole state (single process, DDP, or ``full=True``) loads at any world size and
        layout: under FSDP each tensor is cut to this rank's shard. Masters move between
        layouts: under FSDP the fp32 shards are the masters, elsewhere a ``-master``
        recipe keeps them beside a low-precision working copy."""
        from mixprec.checkpoint import restore_engine

        restore_engine(self, state)

    def close(self) -> None:
        """Undo the fp32 wrapping of third-party norm modules (a ``LlamaRMSNorm``'s
        ``forward``). Dropping the engine does it too; calling it twice is harmless."""
        self._undo_islands()
