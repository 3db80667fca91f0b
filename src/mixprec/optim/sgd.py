"""SGD (with momentum, dampening, Nesterov) with a low-precision momentum buffer and
weight writes (``mixprec.optim.base``). The update is torch's single-tensor SGD, op
for op: with fp32 states and weights it equals ``torch.optim.SGD`` bit for bit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mixprec.optim.base import LowPrecisionOptimizer

if TYPE_CHECKING:
    from torch.optim.optimizer import ParamsT

__all__ = ["SGD"]


class SGD(LowPrecisionOptimizer):
    """``torch.optim.SGD``'s arguments, plus ``states``, ``write`` and ``seed``.

    >>> import torch
    >>> p = torch.nn.Parameter(torch.ones(3))
    >>> opt = SGD([p], lr=0.5, momentum=0.9)
    >>> p.grad = torch.ones(3)
    >>> opt.step()
    >>> p.detach().tolist()
    [0.5, 0.5, 0.5]
    """

    _STATES = (("momentum_buffer", True),)

    def __init__(self, params: ParamsT, lr: float = 1e-3, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False,
                 *, maximize: bool = False, foreach: bool | None = None,
                 differentiable: bool = False, fused: bool | None = None,
                 states: str = "fp32", write: str = "nearest", seed: int = 0) -> None:
        if differentiable or fused:
            raise NotImplementedError(
                f"SGD({'differentiable' if differentiable else 'fused'}=True): mixprec's "
                "SGD steps per tensor under no_grad; use torch.optim.SGD for it")
        if lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov, maximize=maximize,
                        foreach=foreach)
        super().__init__(params, defaults, states=states, write=write, seed=seed)

    def _creates(self, group: dict) -> tuple[str, ...]:
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    def _math(self, w, g, values, group, state, step, skip) -> dict:
        lr, momentum = group["lr"], group["momentum"]
        if group["maximize"]:
            g = -g
        if group["weight_decay"] != 0:
            g = g.add(w, alpha=group["weight_decay"])
        out = {}
        if momentum != 0:
            buf = values.get("momentum_buffer")
            if skip is not None:
                buf = self._device_momentum(buf, g, group, state, skip)
            elif buf is None:
                buf = g.detach().clone()
            else:
                buf.mul_(momentum).add_(g, alpha=1 - group["dampening"])
            out["momentum_buffer"] = buf
            g = g.add(buf, alpha=momentum) if group["nesterov"] else buf
        w.add_(g, alpha=-lr)
        return out

    @staticmethod
    def _device_momentum(buf, g, group, state, skip) -> torch.Tensor:
        """The no-sync path's momentum: torch copies the gradient at the buffer's first
        step, which a skipped step must not count, so a 0-dim ``momentum_started`` flag
        (on this path only) says whether the buffer holds a value yet."""
        started = state.setdefault("momentum_started",
                                   torch.zeros((), dtype=torch.bool, device=g.device))
        if buf is None:
            buf = torch.zeros_like(g)
        new = torch.where(started, buf.mul(group["momentum"]).add_(
            g, alpha=1 - group["dampening"]), g)
        started.copy_(started | ~skip)
        return new
