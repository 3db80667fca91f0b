"""Is the run itself unstable? A loss that grows step over step, updates as large as
the weights: the learning rate, not the number format.

A healthy step moves each weight by a small fraction of itself: the update-to-weight
ratio ``||w_after - w_before|| / ||w_before||`` sits near 1e-3 (``UPDATE_RATIO_USUAL``;
AdamW moves every element by about the learning rate, so at lr 1e-3 on weights of
size ~0.02-1 it reads 1e-3 to a few 1e-2). At ``UPDATE_RATIO_FLAG`` (0.1) each step
rewrites a tenth of the weights' norm; at lr 10 the ratio reads in the hundreds, the
loss climbs (2.3 to 2.8e6 to 4.4e7 on an MLP), and past the format's largest value the
loss turns inf/NaN: an overflow the dynamics caused, which no other format would fix.

``WeightWatch`` records, for each step of a training loop, the norm of the tensors the
optimizer updates and of the step's change to them (one copy of those tensors: a
diagnostic, not for the training loop). ``divergence`` reads the losses, the ratios
and the gradient norms of the run and says whether the run diverged, and
``audit_dynamics`` turns it into a finding that names the learning rate, warm-up and
clipping, with the run's numbers. ``grew_before`` tells an overflow the dynamics caused
(the loss or the weights grew over the steps before it) from one the format's range
caused (inf at a loss near where it started).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from mixprec.diagnostics.findings import Finding

__all__ = ["WeightWatch", "Divergence", "divergence", "audit_dynamics", "grew_before",
           "DIVERGE_FACTOR", "UPDATE_RATIO_USUAL", "UPDATE_RATIO_FLAG"]

#: a loss whose magnitude grows beyond this many times its first step's has diverged
#: (a healthy run's loss falls; noise moves it by tens of percent, not 10x)
DIVERGE_FACTOR = 10.0
#: the update-to-weight ratio of a healthy step, the usual rule of thumb
UPDATE_RATIO_USUAL = 1e-3
#: a median ratio above this (100x the usual) is flagged even while the loss holds:
#: AdamW runs at lr 1e-3 to 3e-3 read a median of 0.003 to 0.025 on the workbench GPT
#: and a small MLP over 10 steps, at lr 0.1 0.17 to 0.21 (measured by the doctor)
UPDATE_RATIO_FLAG = 0.1
#: the first step's ratio a suggested learning rate aims at (a healthy run's size)
UPDATE_RATIO_TARGET = 1e-2


class WeightWatch:
    """The optimizer's tensors around each step: ``before()`` ahead of the step,
    ``after(skipped)`` once it ran. ``norms[i]`` is the global L2 norm of the tensors
    before step ``i``; ``ratios[i]`` the step's change over that norm (None for a
    skipped step, which changes nothing by design)."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self.params = [p for p in params]
        self.norms: list[float] = []
        self.ratios: list[float | None] = []
        self._held: list[torch.Tensor] = []

    def before(self) -> None:
        """Copy the tensors (in fp32) and record their norm."""
        self._held = [p.detach().float().clone() for p in self.params]
        self.norms.append(_norm(self._held))

    def after(self, skipped: bool) -> None:
        """Record this step's update-to-weight ratio."""
        if skipped or not self._held:
            self.ratios.append(None)
        else:
            delta = _norm([p.detach().float() - h for p, h in zip(self.params, self._held)])
            self.ratios.append(delta / self.norms[-1] if self.norms[-1] > 0 else math.inf)
        self._held = []

    @property
    def final_norm(self) -> float:
        """The tensors' norm now (after the last step)."""
        return _norm([p.detach().float() for p in self.params])


def _norm(ts: list[torch.Tensor]) -> float:
    if not ts:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(t) for t in ts])))


@dataclass(frozen=True)
class Divergence:
    """What the run's trajectory says. ``growth``: the largest finite loss magnitude
    over the first; ``first_nonfinite``: the first step whose loss was inf/NaN (None);
    ``ratio``: the median update-to-weight ratio of the applied steps and
    ``first_ratio`` the first applied step's (None: none applied); ``weight_growth``:
    the weights' largest finite norm over the run over their norm at the start."""

    losses: tuple[float, ...]
    growth: float
    first_nonfinite: int | None
    ratio: float | None
    first_ratio: float | None
    weight_growth: float
    grad_norms: tuple[float, ...]
    lr: float

    @property
    def diverged(self) -> bool:
        """The loss grew ``DIVERGE_FACTOR`` over its first value and stayed up (or went
        inf/NaN), rather than spiking once and recovering."""
        if self.growth < DIVERGE_FACTOR:
            return False
        last = self.losses[-1]
        return not math.isfinite(last) or abs(last) >= DIVERGE_FACTOR * abs(self.losses[0])

    @property
    def ratio_high(self) -> bool:
        """The median step moved the weights by over ``UPDATE_RATIO_FLAG`` of their norm."""
        return self.ratio is not None and self.ratio > UPDATE_RATIO_FLAG

    def trajectory(self) -> str:
        """The loss at its first step, its largest finite value and its first
        non-finite or last step, e.g. ``2.3 (step 0) → 2.8e+06 (step 1) → NaN (step 2)``."""
        finite = [i for i, v in enumerate(self.losses) if math.isfinite(v)]
        top = max(finite, key=lambda i: abs(self.losses[i])) if finite else 0
        end = (self.first_nonfinite if self.first_nonfinite is not None
               else len(self.losses) - 1)
        return " → ".join(f"{_num(self.losses[i])} (step {i})"
                          for i in sorted({0, top, end}))


def _num(v: float) -> str:
    if not math.isfinite(v):
        return "NaN" if math.isnan(v) else "inf"
    return f"{v:.3g}"


def divergence(losses: list[float], ratios: list[float | None], norms: list[float],
               final_norm: float, grad_norms: list[float], lr: float) -> Divergence:
    """Read a run: ``losses`` per step, ``WeightWatch``'s ``ratios``, ``norms`` and
    ``final_norm``, the gradient norms per step, and the learning rate it ran at."""
    if not losses:
        raise ValueError("divergence needs the losses of at least one step, got none")
    bad = next((i for i, v in enumerate(losses) if not math.isfinite(v)), None)
    first = abs(losses[0])
    finite = [abs(v) for v in losses if math.isfinite(v)]
    growth = (max(finite) / first) if finite and first > 0 and math.isfinite(first) else 1.0
    applied = [r for r in ratios if r is not None and math.isfinite(r)]
    start = norms[0] if norms else 0.0
    seen = [n for n in [*norms, final_norm] if math.isfinite(n)]
    weight_growth = max(seen) / start if start > 0 else 1.0
    return Divergence(tuple(losses), growth, bad,
                      statistics.median(applied) if applied else None,
                      applied[0] if applied else None, weight_growth, tuple(grad_norms), lr)


def grew_before(d: Divergence, step: int) -> bool:
    """Whether the loss grew ``DIVERGE_FACTOR`` over its first value in the steps before
    ``step`` (or the updates were far above the usual there): an overflow at ``step``
    is then the dynamics', not the format's range."""
    head = [abs(v) for v in d.losses[:step] if math.isfinite(v)]
    first = abs(d.losses[0])
    grew = bool(head) and first > 0 and max(head) >= DIVERGE_FACTOR * first
    return grew or d.ratio_high


def audit_dynamics(d: Divergence) -> list[Finding]:
    """``loss-diverging`` (error) for a diverged run, else ``update-ratio`` (warning)
    for updates far above the usual; each names the learning rate, warm-up and
    clipping with the run's numbers. Nothing for a stable run."""
    if not (d.diverged or d.ratio_high):
        return []
    ratio = ("no step was applied" if d.ratio is None else
             f"each step moved the weights by {d.ratio:.3g} of their norm (median; the usual "
             f"is ~{UPDATE_RATIO_USUAL:g})")
    grads = [g for g in d.grad_norms if math.isfinite(g)]
    evidence = (f"loss {d.trajectory()}; {ratio}; the weights' norm grew "
                f"{d.weight_growth:.3g}x" + (f"; gradient norm {_num(grads[0])} at step 0, "
                                             f"up to {_num(max(grads))}" if grads else ""))
    target = (f" (the first step moved the weights by {d.first_ratio:.3g} of their norm; "
              f"about lr {d.lr * UPDATE_RATIO_TARGET / d.first_ratio:.2g} would move them "
              f"by {UPDATE_RATIO_TARGET:g}, a healthy run's size)" if d.first_ratio else "")
    clip = (f"clip the gradient norm (max_grad_norm=1.0; step 0's was {grads[0]:.3g})"
            if grads else "clip the gradient norm (max_grad_norm=1.0)")
    advice = (f"the learning rate is too large: lower lr {d.lr:g}{target}; warm it up "
              "over the first steps (a linear ramp from ~0); " + clip)
    data = {"lr": d.lr, "update_ratio": d.ratio, "loss_growth": d.growth,
            "weight_growth": d.weight_growth, "first_nonfinite": d.first_nonfinite}
    if d.diverged:
        end = ("then inf/NaN" if d.first_nonfinite is not None else
               f"and ended at {_num(d.losses[-1])}")
        advice += (". The loss grew over the steps before any overflow: no number "
                   "format fixes that")
        return [Finding("error", "loss-diverging",
                        f"the loss diverged at lr {d.lr:g}: it grew {d.growth:.3g}x over its "
                        f"first value, {end}", evidence, advice, data)]
    return [Finding("warning", "update-ratio",
                    f"updates at lr {d.lr:g} are {d.ratio:.3g} of the weights per step, "
                    f"far above the usual ~{UPDATE_RATIO_USUAL:g}", evidence, advice, data)]
