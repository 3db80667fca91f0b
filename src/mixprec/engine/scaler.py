"""LossScaler: none, static and dynamic loss scaling with state on the device.

One interface for every policy, so the training loop has no ``if fp16:`` branch:
``scale_loss(loss)``, ``unscale_(grads) -> found_inf``, ``update(found_inf)``. The
policies are classes (none, static, dynamic); a new one is one subclass.

Every piece of state is a tensor on the gradients' device: the scale, the count of
clean steps since the last change (growth tracker), the count of consecutive
overflows (for hysteresis), and the count of consecutive skipped steps. Unscaling
and the non-finite check are one fused pass
(``torch._amp_foreach_non_finite_check_and_unscale_``) and the update is a handful
of tensor ops, so nothing here waits for the device.

Dynamic rule (as torch's GradScaler and the literature state it):
any inf/NaN -> the step is skipped; after ``hysteresis`` consecutive overflows the
scale is multiplied by ``backoff_factor``, never below ``min_scale``; after
``growth_interval`` consecutive clean steps it is multiplied by ``growth_factor``,
never above ``max_scale``. Clamping keeps the scale away from 0 and inf (torch's
GradScaler reaches 0.0 after ~166 consecutive overflows from 2^16 and never recovers).
With ``hysteresis=1`` and no clamp in play, the sequence of scales equals GradScaler's.

Example::

    >>> import torch
    >>> s = LossScaler("dynamic", init_scale=8.0, growth_interval=2)
    >>> g = [torch.tensor([8.0, float("inf")])]
    >>> found = s.unscale_(g); s.update(found); float(s.scale)
    4.0
"""

from __future__ import annotations

from typing import Literal

import torch

from mixprec.recipe import Recipe

__all__ = ["LossScaler", "NoLossScale", "StaticLossScale", "DynamicLossScale"]

Kind = Literal["none", "static", "dynamic"]


class LossScaler:
    """A loss scale: the one interface the engine drives (jmp's idea), and the factory
    of the three policies, ``LossScaler(kind, ...)``: ``NoLossScale`` ("none"),
    ``StaticLossScale`` ("static"), ``DynamicLossScale`` ("dynamic").

    The interface: ``scale`` (a device tensor), ``scaled`` (whether the loss is
    multiplied), ``scale_loss``, ``unscale_`` (-> found_inf), ``update(found_inf)``,
    ``skip_streak`` / ``skipped_total`` and ``state_dict`` / ``load_state_dict``. A new
    policy is one subclass: override ``_next_scale`` (tensor ops only, no host sync), and
    hand an instance to ``MixedPrecision(..., loss_scaler=)``.

    >>> import torch
    >>> s = LossScaler("dynamic", init_scale=2.0**16, growth_interval=2)
    >>> s.update(torch.tensor(1.0))      # inf/NaN found: skip, back off
    >>> s.update(torch.tensor(0.0)); s.update(torch.tensor(0.0))  # 2 clean steps: grow
    >>> float(s.scale), int(s.skipped_total)
    (65536.0, 1)
    """

    #: the policy's name in checkpoints and recipes
    kind: str = ""
    #: whether ``scale_loss`` multiplies the loss (False: the scale is 1)
    scaled: bool = True

    def __new__(cls, kind: Kind | None = None, **kwargs):
        if cls is LossScaler:
            policies = {"none": NoLossScale, "static": StaticLossScale,
                        "dynamic": DynamicLossScale}
            kind = "dynamic" if kind is None else kind
            if kind not in policies:
                raise ValueError(f"LossScaler kind {kind!r}; valid: none, static, dynamic")
            cls = policies[kind]
        return super().__new__(cls)

    def __init__(
        self,
        kind: Kind | None = None,
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        device: torch.device | str = "cpu",
    ) -> None:
        if kind is not None and kind != self.kind:
            raise ValueError(f"{type(self).__name__} is kind {self.kind!r}, not {kind!r}")
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        dev = torch.device(device)
        start = float(init_scale) if self.scaled else 1.0
        self.scale = torch.full((), start, dtype=torch.float32, device=dev)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=dev)
        self.overflow_streak = torch.zeros((), dtype=torch.int32, device=dev)
        self.skip_streak = torch.zeros((), dtype=torch.int32, device=dev)
        self.skipped_total = torch.zeros((), dtype=torch.int64, device=dev)

    @classmethod
    def from_recipe(cls, recipe: Recipe, device: torch.device | str = "cpu") -> LossScaler:
        """The recipe's policy with its settings."""
        r = recipe
        return LossScaler(r.loss_scale, init_scale=r.init_scale, growth_factor=r.growth_factor,
                          backoff_factor=r.backoff_factor, growth_interval=r.growth_interval,
                          hysteresis=r.hysteresis, min_scale=r.min_scale,
                          max_scale=r.max_scale, device=device)

    @property
    def device(self) -> torch.device:
        """Where the scale and counters live."""
        return self.scale.device

    def scale_loss(self, loss: torch.Tensor, divide_by: int = 1) -> torch.Tensor:
        """loss * scale / divide_by, in fp32 (the product can exceed fp16's range)."""
        out = loss.float()
        if self.scaled:
            out = out * self.scale.to(out.device)
        return out / divide_by if divide_by != 1 else out

    def unscale_(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Divide grads by the scale in place; return found_inf (1.0 if any is inf/NaN).

        Runs the non-finite check for every policy, ``none`` included, so a recipe
        without scaling (bf16) still skips a step whose gradients are not finite.
        """
        found_inf = torch.zeros((), dtype=torch.float32, device=self.device)
        if not grads:
            return found_inf
        inv = torch.reciprocal(self.scale) if self.scaled else torch.ones_like(self.scale)
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for g in grads:
            by_device.setdefault(g.device, []).append(g)
        for dev, gs in by_device.items():
            f = found_inf if dev == self.device else torch.zeros((), device=dev)
            torch._amp_foreach_non_finite_check_and_unscale_(gs, f, inv.to(dev))
            if f is not found_inf:
                found_inf = torch.maximum(found_inf, f.to(self.device))
        return found_inf

    def update(self, found_inf: torch.Tensor) -> None:
        """Advance the state after a step; tensor ops only: the skip counters, then the
        policy's ``_next_scale``."""
        found = found_inf.to(self.device) > 0
        zero = torch.zeros_like(self.skip_streak)
        self.skip_streak = torch.where(found, self.skip_streak + 1, zero)
        self.skipped_total = self.skipped_total + found.to(torch.int64)
        self._next_scale(found)

    def _next_scale(self, found: torch.Tensor) -> None:
        """The policy: move ``self.scale`` (and its own counters) after a step; ``found``
        is a bool device tensor, True when the step was skipped. Default: keep it."""

    def state_dict(self) -> dict[str, object]:
        """Kind, scale and counters (cloned tensors; loads with weights_only=True)."""
        return {
            "kind": self.kind,
            "scale": self.scale.clone(),
            "growth_tracker": self.growth_tracker.clone(),
            "overflow_streak": self.overflow_streak.clone(),
            "skip_streak": self.skip_streak.clone(),
            "skipped_total": self.skipped_total.clone(),
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore ``state_dict()``'s output; refuses a state of another kind."""
        if state.get("kind") != self.kind:
            raise ValueError(f"loss scaler state is for kind {state.get('kind')!r}, this "
                             f"scaler is {self.kind!r}; use the recipe the state was saved with")
        for key in ("scale", "growth_tracker", "overflow_streak", "skip_streak",
                    "skipped_total"):
            cur = getattr(self, key)
            setattr(self, key, torch.as_tensor(state[key]).to(cur.device, cur.dtype).clone())

    def __repr__(self) -> str:
        return f"LossScaler({self.kind!r}, device={self.device})"


class NoLossScale(LossScaler):
    """No scaling (bf16, fp32): the scale is 1; the non-finite check still runs."""

    kind, scaled = "none", False


class StaticLossScale(LossScaler):
    """A constant scale, ``init_scale``."""

    kind = "static"


class DynamicLossScale(LossScaler):
    """The dynamic rule of the module docstring: back off after ``hysteresis``
    consecutive overflows, grow after ``growth_interval`` clean steps, clamped."""

    kind = "dynamic"

    def _next_scale(self, found: torch.Tensor) -> None:
        zero = torch.zeros_like(self.overflow_streak)
        streak = torch.where(found, self.overflow_streak + 1, zero)
        backoff = found & (streak >= self.hysteresis)
        tracker = torch.where(found, zero, self.growth_tracker + 1)
        grow = tracker >= self.growth_interval
        scale = torch.where(backoff, self.scale * self.backoff_factor, self.scale)
        scale = torch.where(grow, scale * self.growth_factor, scale)
        self.scale = scale.clamp(self.min_scale, self.max_scale)
        self.growth_tracker = torch.where(grow, zero, tracker)
        self.overflow_streak = streak
