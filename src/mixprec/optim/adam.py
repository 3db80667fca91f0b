"""Adam and AdamW with low-precision states and weight writes (``mixprec.optim.base``).

The update is torch's single-tensor Adam, op for op (``torch.optim.adam``): with
fp32 states and fp32 weights the result equals ``torch.optim.Adam`` / ``AdamW`` (their
default, non-fused implementation on the CPU) bit for bit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mixprec.optim.base import LowPrecisionOptimizer
from mixprec.optim.sharding import is_dtensor
from mixprec.optim.states import stored_format

if TYPE_CHECKING:
    from torch.optim.optimizer import ParamsT

__all__ = ["Adam", "AdamW"]


class Adam(LowPrecisionOptimizer):
    """``torch.optim.Adam``'s arguments, plus ``states``, ``write`` and ``seed``.
    ``fused=True`` steps fp32 parameters with fp32 states in torch's own fused kernel
    (equal to ``torch.optim.Adam(fused=True)``); the others, every quantized state and
    ``amsgrad`` take the per-tensor path, torch's single-tensor update op for op.
    ``amsgrad`` keeps the running maximum of the second moment as a third state (stored
    like it). ``foreach`` and ``capturable`` are accepted and change no number (the
    per-tensor path is torch's for-loop; it makes no host sync on a device either way);
    ``differentiable=True`` is refused. ``decoupled_weight_decay=True`` is AdamW.

    >>> import torch
    >>> p = torch.nn.Parameter(torch.ones(64, 64, dtype=torch.bfloat16))
    >>> opt = Adam([p], lr=1e-4, states="int8", write="stochastic")
    >>> p.grad = torch.ones_like(p)
    >>> opt.step()
    >>> sorted(opt.state[p])
    ['exp_avg.q', 'exp_avg.s', 'exp_avg_sq.q', 'exp_avg_sq.s', 'step']
    """

    _STATES = (("exp_avg", True), ("exp_avg_sq", False), ("max_exp_avg_sq", False))
    _decoupled = False

    def __init__(self, params: ParamsT, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, *,
                 foreach: bool | None = None, maximize: bool = False,
                 capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = False, decoupled_weight_decay: bool = False,
                 states: str = "fp32", write: str = "nearest", seed: int = 0) -> None:
        if differentiable:
            raise NotImplementedError(
                f"{type(self).__name__}(differentiable=True): mixprec's step runs under "
                "no_grad on decoded states; use torch.optim for a differentiable step")
        if decoupled_weight_decay:
            self._decoupled = True
        fused = bool(fused)
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        for i, b in enumerate(betas):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {b}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        amsgrad=bool(amsgrad), maximize=maximize, fused=fused,
                        foreach=foreach, capturable=capturable)
        super().__init__(params, defaults, states=states, write=write, seed=seed)

    def _init_state(self, p, state, fmt) -> None:
        super()._init_state(p, state, fmt)
        device = p.device if self.sync_free or p.device.type != "cpu" else "cpu"
        state["step"] = torch.tensor(0.0, dtype=torch.float32, device=device)

    def _creates(self, group: dict) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())

    def _fused_step(self, group, found_inf, grad_scale) -> set[int]:
        if group["amsgrad"]:
            return set()  # the per-tensor path, torch's single-tensor amsgrad
        ps = [p for p in group["params"]  # each parameter's own state format decides
              if p.dtype == torch.float32 and self.emulated_format is None
              and stored_format(self._own_format(p), p.shape) == "fp32"
              and not is_dtensor(p)
              and (g := self._grad(p)) is not None and g.dtype == torch.float32]
        if not ps:
            return set()
        for p in ps:
            st = self.state[p]
            if not st:
                self._init_state(p, st, "fp32")
                st["step"] = st["step"].to(p.device)
            for n in ("exp_avg", "exp_avg_sq"):
                if n not in st:
                    st[n] = torch.zeros_like(p, memory_format=torch.preserve_format)
        steps = [self.state[p]["step"] for p in ps]
        torch._foreach_add_(steps, 1)
        kernel = torch._fused_adamw_ if self._decoupled else torch._fused_adam_
        (beta1, beta2) = group["betas"]
        kernel(ps, [self._grad(p) for p in ps], [self.state[p]["exp_avg"] for p in ps],
               [self.state[p]["exp_avg_sq"] for p in ps], [], steps, amsgrad=False,
               lr=group["lr"], beta1=beta1, beta2=beta2,
               weight_decay=group["weight_decay"], eps=group["eps"],
               maximize=group["maximize"], grad_scale=grad_scale, found_inf=found_inf)
        if found_inf is not None:
            torch._foreach_sub_(steps, [found_inf.to(steps[0].device)] * len(steps))
        return {id(p) for p in ps}

    def _math(self, w, g, values, group, state, step, skip) -> dict:
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
        wd = group["weight_decay"]
        if group["maximize"]:
            g = -g
        if wd != 0:
            if self._decoupled:
                w.mul_(1 - lr * wd)
            else:
                g = g.add(w, alpha=wd)
        m = values.get("exp_avg")
        v = values.get("exp_avg_sq")
        m = torch.zeros_like(w, memory_format=torch.preserve_format) if m is None else m
        v = torch.zeros_like(w, memory_format=torch.preserve_format) if v is None else v
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        out = {"exp_avg": m, "exp_avg_sq": v}
        if group["amsgrad"]:
            vmax = values.get("max_exp_avg_sq")
            vmax = torch.zeros_like(v) if vmax is None else vmax
            torch.maximum(vmax, v, out=vmax)
            out["max_exp_avg_sq"] = vmax
            v = vmax  # the denominator uses the running maximum, as torch's does
        if skip is None and step.device.type == "cpu":
            n = step.item()  # a CPU tensor: no device sync
            bias_correction1 = 1 - beta1**n
            bias_correction2_sqrt = (1 - beta2**n) ** 0.5
            denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
            w.addcdiv_(m, denom, value=-(lr / bias_correction1))
        else:  # on the device, as torch's capturable path computes it
            step_size = lr / (1 - beta1**step)
            denom = (v.sqrt() / ((1 - beta2**step).sqrt() * -step_size)).add_(
                eps / -step_size)
            w.addcdiv_(m, denom)
        return out


class AdamW(Adam):
    """``torch.optim.AdamW`` (decoupled weight decay, default 1e-2), plus ``states``,
    ``write`` and ``seed``."""

    _decoupled = True

    def __init__(self, params: ParamsT, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 maximize: bool = False, foreach: bool | None = None,
                 capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = False, states: str = "fp32", write: str = "nearest",
                 seed: int = 0) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         foreach=foreach, capturable=capturable,
                         differentiable=differentiable, fused=fused, states=states,
                         write=write, seed=seed)
