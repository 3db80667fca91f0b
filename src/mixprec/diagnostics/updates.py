"""Do the optimizer's updates reach the weights, or vanish into their rounding?

A weight ``w`` stored in a format with spacing ``ulp(w)`` keeps an update ``u`` only if
``|u| > ulp(w) / 2``. Otherwise ``w + u`` rounds back to ``w`` and the step did nothing
for that element. In bf16, near |w| = 1 that is any update below 2^-9 ≈
0.002, the size of a typical Adam step at lr 1e-3. This is why the optimizer should
update fp32 master weights. An fp32 master has the same limit, 2^-24 of the weight, which
only matters for large weights with small learning rates: at |w| = 2048, an update of
1e-4 vanishes in fp32 too.

``vanished_updates(engine, step)`` runs one training step and counts, for each tensor
the optimizer updates (the masters, or the model's own parameters), the elements whose
gradient was non-zero but whose stored value did not change. That is the direct
evidence of a lost update, whatever the optimizer. The doctor warns above
``VANISH_FLAG``.

With ``mixprec.optim``'s write rules the stored value is what the optimizer holds:
the weight less its Kahan compensation, or the weight joined with its remainder (an
update kept there has not vanished). Under ``write="stochastic"`` an element that did
not move this step keeps its update in expectation, so those tensors are reported
(``rule``) but never count towards the warning.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mixprec.diagnostics.findings import Finding

if TYPE_CHECKING:
    from mixprec.engine.facade import MixedPrecision

__all__ = ["Vanished", "vanished_updates", "audit_vanished_updates", "VANISH_FLAG"]

#: share of updated elements whose update vanished above which the doctor warns
VANISH_FLAG = 0.10


@dataclass(frozen=True)
class Vanished:
    """One tensor the optimizer updates: how many of its elements had a non-zero gradient,
    and how many of those kept their stored value through the step."""

    name: str
    dtype: str
    updated: int
    vanished: int
    #: the write rule of a ``mixprec.optim`` optimizer ("nearest" for any other)
    rule: str = "nearest"

    @property
    def share(self) -> float:
        """Vanished over updated (0 when nothing had a gradient)."""
        return self.vanished / self.updated if self.updated else 0.0


def vanished_updates(engine: MixedPrecision, step: Callable[[Callable[[], None]], bool],
                     names: list[str] | None = None) -> list[Vanished] | None:
    """Run one training step and compare the optimizer's tensors before and after.

    ``step(capture)`` runs the forward and ``engine.backward``, calls ``capture()``, then
    ``engine.step()``, and returns whether the step was skipped. Returns None for a
    skipped step (a non-finite gradient), since nothing was meant to change then."""
    state = engine.param_state
    params = list(state.opt_params)
    names = names or [f"param {i}" for i in range(len(params))]
    owner = {id(p): o for o in engine.optimizers for g in o.param_groups for p in g["params"]}

    def held(p):  # the value the optimizer holds for p
        o = owner.get(id(p))
        return o.stored_value(p) if hasattr(o, "stored_value") else p.detach().clone()

    before = [held(p) for p in params]
    nonzero: list[torch.Tensor | None] = []

    def capture() -> None:  # which elements the optimizer gets a non-zero gradient for
        grads = state.grads
        nonzero.extend(None if g is None else (g != 0) for g in grads)

    if step(capture):
        return None
    # the format the updated values are stored in (under emulation without masters:
    # fp32 tensors holding bf16/fp16 values)
    stored = {"bf16": "bfloat16", "fp16": "float16"}.get(state.updated_format)
    out = []
    for name, p, old, nz in zip(names, params, before, nonzero):
        if nz is None:
            continue
        same = (held(p) == old) & nz
        rule = getattr(owner.get(id(p)), "write", "nearest")
        out.append(Vanished(name, stored or str(p.dtype).removeprefix("torch."),
                            int(nz.sum()), int(same.sum()), rule))
    return out


def audit_vanished_updates(result: list[Vanished] | None) -> list[Finding]:
    """A warning when more than ``VANISH_FLAG`` of the updated elements did not move,
    with the fix for the dtype the optimizer updates."""
    result = [v for v in (result or []) if v.rule != "stochastic"]
    if not result:
        return []
    updated = sum(v.updated for v in result)
    lost = sum(v.vanished for v in result)
    share = lost / updated if updated else 0.0
    if share <= VANISH_FLAG:
        return []
    worst = sorted(result, key=lambda v: -v.share)[:4]
    low = {v.dtype for v in result} - {"float32", "float64"}
    evidence = (f"{lost} of {updated} elements with a non-zero gradient kept their stored "
                "value through the step; " + ", ".join(
                    f"{v.name} ({v.dtype}): {v.share:.0%}" for v in worst))
    if low:
        advice = (f"the optimizer updates {'/'.join(sorted(low))} weights, whose spacing "
                  "swallows small updates: keep fp32 master weights (a '-master' recipe, "
                  "e.g. 'bf16-master'), fp32 parameters ('bf16'), or write the updates "
                  "by a rule that keeps them ('bf16-sr', 'bf16-kahan', 'bf16-remainder', "
                  "with mixprec.optim)")
    else:
        advice = ("the updates are below half an fp32 ulp of the weights (|update| < "
                  "|w| · 2^-25): the learning rate is too small for weights this large. "
                  "Raise it, or keep the weights small (normalization, a rescaled "
                  "parametrization)")
    return [Finding("warning", "update-vanish",
                    f"{share:.0%} of weight updates vanished into the weights' rounding",
                    evidence, advice, {"share": share})]
