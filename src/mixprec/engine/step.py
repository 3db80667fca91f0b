"""One optimizer step, once the micro-batches are in.

``Step.__call__``: check-and-unscale -> clip on the true gradients -> the optimizer
call -> after-step (refresh the working copy, fp8 scales, loss scale, zero, schedulers).

**One skip decision.** The global norm of the *scaled* gradients is non-finite when
any gradient holds inf/NaN and when their sum of squares overflows fp32 (finite
elements, a norm above ~1.8e19). ``found_inf`` comes from it, for the fused and the
unfused paths alike, and every rank agrees on it (MAX). Divided by the loss scale the
norm is the true one (exactly, for power-of-2 scales). Earlier the unfused path took
its decision from the elements alone: a norm that overflowed then clipped by
``max_norm / inf = 0`` and the step was applied, so Adam's moments decayed and its step
count advanced where the fused path skipped.

**A clip is torch's.** A step that clips sums the norm as
``torch.nn.utils.clip_grad_norm_`` does (per-tensor norms, then the norm of those; in
one process) and multiplies the gradients by ``clip_coef`` as it does, before the
optimizer: under ``fp32`` the weights are plain torch's (clip, then the same optimizer)
bit for bit, fused, foreach and for-loop alike. A step that does not clip takes
``gradnorm.global_norm``, faster on the CPU and closer to float64.

**No host sync** when every optimizer takes ``found_inf`` on the device (torch's fused
Adam, AdamW, SGD). The kernel divides each gradient by ``scale / clip_coef`` as it
updates, so no pass writes the gradients here, except to clip unscaled fp32 gradients:
the multiply above (one pass, no sync). Any other optimizer costs one sync (to
decide the skip), as under torch's GradScaler, whose ``_maybe_opt_step`` reads
``found_inf.item()`` for it, and one pass that unscales and clips together: a multiply
by ``clip_coef / scale`` (``unscale_factor``), so the step reads the gradients twice,
the norm and that multiply; on CUDA the engine makes
torch's Adam, AdamW and SGD left at their default implementation fused
(``checks.fuse_default_optimizers``), so only an optimizer configured otherwise pays it.

**Schedulers without a sync.** They advance only on applied steps. On CUDA the step's
``found_inf`` goes to the host asynchronously (``HostMirror``) and the schedulers
advance for it at the start of the next step, before any optimizer runs, or when
their state is read (``settle``: ``engine.schedulers``, ``state_dict``, ``save``).
Waiting then costs only the rest of that step's work, not the queued forward and
backward after it. On the CPU they advance at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixprec.engine.checks import param_counts, takes_found_inf
from mixprec.engine.gradnorm import clip_coef, global_norm, torch_norm
from mixprec.engine.watch import HostMirror, SkipWatch
from mixprec.optim.kinds import step_by_kind

__all__ = ["Counters", "Step", "StepResult", "check_setup_unchanged"]


@dataclass(frozen=True)
class StepResult:
    """What a call to ``step()`` did. Tensors stay on the device: ``bool(r.skipped)``,
    ``float(r.scale)`` and ``float(r.grad_norm)`` are the caller's choice to sync.

    - ``accumulating``: True while fewer than ``grad_accum_steps`` micro-batches went
      through and none ended the window with ``backward(last=True)`` (no update
      happened; ``skipped`` is then False).
    - ``skipped``: True if gradients were non-finite and the update was skipped.
    - ``scale``: the loss scale after this step's update.
    - ``grad_norm``: global L2 norm of the unscaled gradients before clipping (None
      while accumulating).
    """

    accumulating: bool
    skipped: torch.Tensor | bool
    scale: torch.Tensor
    grad_norm: torch.Tensor | None


@dataclass
class Counters:
    """Where the loop is: ``micro`` backward calls since the last update, ``seen`` the
    value of ``micro`` at the last ``step()`` call, ``steps`` optimizer steps taken
    (applied or skipped), ``closed`` whether a ``backward(last=True)`` ended the window
    early. Checkpoints save ``steps``; the rest is zero between steps.

    The one writer of these counts: the engine and the checkpoints call the methods
    below. (Skipped steps and the current run of them are device tensors that the loss
    scaler keeps and moves in ``update``, its one writer: ``skipped_total``,
    ``skip_streak``.)"""

    micro: int = 0
    seen: int = 0
    steps: int = 0
    closed: bool = False

    def backward(self, last: bool, accum_steps: int) -> None:
        """One micro-batch went through backward; ``last``: it ended the window."""
        self.micro += 1
        self.closed = last and self.micro < accum_steps

    def consume(self) -> None:
        """``step()`` took the micro-batches so far."""
        self.seen = self.micro

    def clear(self) -> None:
        """The window's gradients were dropped (``zero_grad``): a fresh window."""
        self.micro = self.seen = 0
        self.closed = False

    def stepped(self) -> None:
        """An optimizer step ran (applied or skipped): count it, open a fresh window."""
        self.clear()
        self.steps += 1

    def restore(self, steps: int) -> None:
        """A checkpoint's step count, in a fresh window."""
        self.clear()
        self.steps = int(steps)


class Step:
    """The optimizer step over the engine's parts (see the module docstring)."""

    def __init__(self, optimizers: list, param_state, scaler, parallel, fp8_modules: list,
                 schedulers: list, max_grad_norm: float | None, device: torch.device,
                 recipe) -> None:
        self.optimizers, self.param_state, self.scaler = optimizers, param_state, scaler
        self.parallel, self.fp8_modules, self.schedulers = parallel, fp8_modules, schedulers
        self.max_grad_norm, self.device, self.recipe = max_grad_norm, device, recipe
        self.fused = [takes_found_inf(o) for o in optimizers]
        one_device = all(p.device == device for p in param_state.working)
        #: fused kernels unscale and clip: nothing writes the gradients before them
        self.in_kernel = all(self.fused) and one_device
        # the norm reads fp32 CPU tensors for the engine's whole life (fp32 buffers, or
        # direct fp32 .grad): its method is decided once
        self._fp32_grads = param_state.recipe.grads == "fp32"
        self._cpu_fp32 = device.type == "cpu" and self._fp32_grads
        self.skips = SkipWatch(device)
        #: the last step's found_inf on its way to the host, for the schedulers; on
        #: CUDA (``cuda``) read at the next step or ``settle``, on the CPU at once
        self._found_host = HostMirror(1, device)
        self.counters = Counters()
        #: ``(found_inf, true norm)`` of the window's gradients, once a framework's clip
        #: call asked for them (``clip``), so the step does not compute them again
        self._checked: tuple[torch.Tensor, torch.Tensor] | None = None
        #: a clip that call asked for: this update's max norm, in place of the engine's
        self._clip_once: float | None = None

    def clip(self, max_norm: float | None) -> torch.Tensor:
        """The true norm of the window's gradients (unscaled, fp32, reduced across
        ranks), and with ``max_norm`` a clip to it at this window's update. Computed
        once: the update reuses it. Non-finite where the update will be skipped."""
        if self._checked is None:
            self._checked = self.check(self.parallel.local(self.param_state.gradients()),
                                       as_torch=True)
        if max_norm is not None:
            self._clip_once = max_norm
        return self._checked[1]

    def forget(self) -> None:
        """Drop a clip call's norm and clip (the gradients were dropped)."""
        self._checked = self._clip_once = None

    def check(self, grads: list[torch.Tensor],
              as_torch: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(found_inf, true norm)``: the one skip decision, agreed across ranks.

        ``as_torch`` (a framework's clip call, or a step that clips): in one process the
        norm is summed as ``torch.nn.utils.clip_grad_norm_`` sums it (per-tensor norms,
        then the norm of those), so in fp32 training the caller reads torch's value and
        clips by torch's coefficient, to the bit. Otherwise it is ``mixprec.engine.gradnorm``'s
        ``global_norm``, exact to fp32 on large tensors."""
        if self.parallel.norm_of is not None:  # DTensor shards: summed by placement
            norm_scaled = self.parallel.norm_of(grads, self.device)
        elif as_torch and self.parallel.norm_reduce is None and grads:
            norm_scaled = torch_norm(grads)
        else:
            norm_scaled = global_norm(grads, self.device, self._cpu_fp32,
                                      self.parallel.norm_reduce)
        found_inf = self.parallel.agree_max_((~torch.isfinite(norm_scaled)).float())
        if self.parallel.norm_of is not None:
            # replicated gradients are counted on each rank alone: a fault in one rank's
            # copy makes the norm non-finite on every rank, as the skip is
            norm_scaled = torch.where(found_inf > 0, torch.inf, norm_scaled)
        return found_inf, (norm_scaled / self.scaler.scale if self.scaler.scaled
                           else norm_scaled)

    def grad_scale(self, grads: list[torch.Tensor], norm: torch.Tensor,
                   max_norm: float | None) -> torch.Tensor | None:
        """What fused optimizers divide each gradient by: the loss scale over the clip
        coefficient (None: nothing to divide). Without a loss scale, fp32 ``grads`` are
        clipped here instead, multiplied as torch's ``clip_grad_norm_`` multiplies them
        (``g * c`` and ``g / (1 / c)`` round differently); 16-bit ones are left to the
        kernel, which divides in fp32 (a multiply in place would round them again)."""
        scaled = self.scaler.scaled
        if max_norm is None:
            return self.scaler.scale if scaled else None
        if not scaled and self._fp32_grads:
            torch._foreach_mul_(grads, clip_coef(norm, max_norm))
            return None
        return (self.scaler.scale if scaled else 1.0) / clip_coef(norm, max_norm)

    def unscale_factor(self, norm: torch.Tensor,
                       max_norm: float | None) -> torch.Tensor | None:
        """What the unfused step multiplies the gradients by, in its one pass after the
        norm: ``clip_coef / scale`` (None: nothing to do). ``clip_coef * (1 / scale)``
        is exact for a power-of-2 scale (every dynamic scale from a power-of-2 start),
        so ``g * (clip_coef / scale)`` has the bits of unscaling first and clipping
        after (torch's GradScaler, then torch's clip), with one rounding fewer for any
        other scale and for 16-bit gradients. Unscaled fp32 gradients are multiplied
        by torch's ``clip_coef`` itself, as its ``clip_grad_norm_`` does."""
        coef = None if max_norm is None else clip_coef(norm, max_norm)
        if not self.scaler.scaled:
            return coef
        inv = torch.reciprocal(self.scaler.scale)
        return inv if coef is None else coef * inv.to(coef.device)

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the step; returns ``(found_inf, grad_norm)`` as device tensors."""
        self.settle()  # the last step's scheduler advance, before this update's LR
        grads = self.parallel.local(self.param_state.gradients())
        checked, self._checked = self._checked, None
        max_norm = self._clip_once if self._clip_once is not None else self.max_grad_norm
        self._clip_once = None
        found_inf, norm = (checked if checked is not None
                           else self.check(grads, as_torch=max_norm is not None))
        if self.in_kernel:
            grad_scale = self.grad_scale(grads, norm, max_norm)
        else:  # the norm decided the skip: one pass unscales and clips
            grad_scale = None
            factor = self.unscale_factor(norm, max_norm)
            if factor is not None:
                _mul_(grads, factor)
        self.param_state.hand_to_optimizer()
        for opt, fused in zip(self.optimizers, self.fused):
            if fused:  # found_inf, grad_scale of each parameter kind's (optim.kinds)
                step_by_kind(opt, found_inf, grad_scale)
            elif not found_inf.item():  # one host sync: this optimizer cannot skip itself
                step_by_kind(opt)
        self.after(found_inf)
        return found_inf, norm

    def after(self, found_inf: torch.Tensor) -> None:
        """Refresh the working copy, move the fp8 scales and the loss scale, zero the
        gradients, count the step, advance the schedulers on an applied step, and watch
        the skips (which may raise ``SkipLimitError``, the step counted)."""
        self.param_state.refresh_working()
        self.parallel.agree_amax(self.fp8_modules)
        for m in self.fp8_modules:
            m.update_scales(found_inf)  # a skipped step drops its amaxes
        self.scaler.update(found_inf)
        self.param_state.zero()
        self.counters.stepped()
        if self.schedulers:
            self._found_host.push(found_inf)
            if not self._found_host.cuda:
                self.settle()
        self.skips.check(self.scaler, self.recipe)

    def settle(self) -> None:
        """Advance the schedulers for the last step if it was applied, once its
        ``found_inf`` is on the host (on CUDA this waits for that step's work only);
        nothing if it was settled already."""
        seen = self._found_host.wait()
        if seen is not None and not seen[0]:
            for s in self.schedulers:
                s.step()


def _mul_(grads: list[torch.Tensor], factor: torch.Tensor) -> None:
    """``g *= factor`` for every gradient, one foreach kernel per device."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    for dev, gs in by_device.items():
        torch._foreach_mul_(gs, factor.to(dev))


def check_setup_unchanged(optimizers: list, counts: list[int], param_state,
                          frozen: list) -> None:
    """Refuse a step whose setup changed behind the engine. A parameter frozen when the
    engine was built has no buffer, master or place in the norm: unfreezing it later
    would train it unscaled and never zero its gradient. A param group added to an
    optimizer would bypass the masters and buffers. A write to the working copy behind
    the masters would be undone by the next refresh."""
    if param_counts(optimizers) != counts:
        raise RuntimeError(
            "an optimizer's param groups changed after MixedPrecision was created "
            f"(parameters per optimizer: {counts} then, {param_counts(optimizers)} now); "
            "the engine did not re-point the new ones at masters and buffers. Call "
            "add_param_group before creating the engine, or create a new engine.")
    changed = param_state.changed_working()
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
    thawed = [p for p in frozen if p.requires_grad]
    if thawed:
        raise RuntimeError(
            f"{len(thawed)} parameter(s) (the first of shape {tuple(thawed[0].shape)}) "
            "had requires_grad=False when MixedPrecision was created and require grad "
            "now; the engine does not manage them. Create a new MixedPrecision (with "
            "its optimizer) after changing which parameters train, e.g. from a "
            "checkpoint: engine.state_dict() keeps the weights.")
