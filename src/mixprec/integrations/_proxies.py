"""What a trainer holds in place of the optimizer and schedulers the engine drives.

Framework-free: the Hugging Face and Accelerate integrations share these. A trainer
calls ``optimizer.step()`` and ``zero_grad()`` and reads ``param_groups`` and
``state_dict()``; the proxy sends the step to the engine and everything else to the
wrapped optimizer, so schedulers and checkpoints see the optimizer unchanged.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import torch
from torch import nn

from mixprec.engine.facade import MixedPrecision

__all__ = ["EngineOptimizer", "EngineScheduler", "autocast_forward", "save_fp32_config"]


def autocast_forward(net: nn.Module, engine: MixedPrecision) -> None:
    """``net.forward`` under ``engine.autocast()``: an instance attribute, as Accelerate
    and Lightning wrap a forward for their autocast; the module's class is untouched."""
    inner = net.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        with engine.autocast():
            return inner(*args, **kwargs)

    net.forward = forward


def save_fp32_config(model: nn.Module, directory) -> None:
    """Rewrite a Hugging Face model's saved config to say ``float32``, the dtype of the
    fp32 masters just written beside it: ``save_pretrained`` records the dtype of the
    model's own parameters (under ``-master`` recipes the 16-bit working copy), and
    ``from_pretrained`` would load the masters into that dtype. No config: nothing."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return
    saved = copy.deepcopy(config)
    saved.dtype = "float32"
    saved.save_pretrained(directory)


class EngineOptimizer(torch.optim.Optimizer):
    """``step()`` is ``engine.step()``; ``zero_grad()`` does nothing (the engine keeps
    its own gradient buffers and clears them itself); the rest is ``inner``'s.
    ``on_step(skipped)`` runs after each step that updated (or skipped)."""

    def __init__(self, engine: MixedPrecision, inner: torch.optim.Optimizer,
                 on_step: Callable[[bool], None] | None = None):
        self.engine, self.inner, self.on_step = engine, inner, on_step
        self.defaults = inner.defaults
        self._skipped: torch.Tensor | bool = False

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last update was skipped for non-finite gradients (Accelerate's
        ``AcceleratedOptimizer.step_was_skipped``); False while accumulating. Reading it
        syncs with the device; ``step()`` itself does not, unless ``on_step`` is set."""
        return bool(self._skipped)

    @property
    def param_groups(self):
        """The wrapped optimizer's (schedulers set the learning rate here)."""
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.inner.param_groups = value

    @property
    def state(self):
        """The wrapped optimizer's per-parameter state."""
        return self.inner.state

    def step(self, closure=None):
        """``engine.step()`` (closures are not supported). The skip stays a device
        tensor until ``step_was_skipped`` is read (or ``on_step`` needs it)."""
        if closure is not None:
            raise NotImplementedError("a mixprec engine's optimizer step takes no closure; "
                                      "compute the loss before calling step()")
        out = self.engine.step()
        self._skipped = False if out.accumulating else out.skipped
        if self.on_step is not None and not out.accumulating:
            self.on_step(bool(out.skipped))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: the engine zeroes its buffers after each update."""

    def state_dict(self) -> dict:
        """The wrapped optimizer's state dict."""
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load into the wrapped optimizer."""
        self.inner.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"mixprec engine step over {self.inner!r}"


class EngineScheduler:
    """An LR scheduler the engine advances after each *applied* update (a skipped
    step leaves the learning rate where it was): ``step()`` does nothing, the rest is
    the scheduler's own (``get_last_lr()``, ``last_epoch``, ``state_dict()``)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def step(self, *args, **kwargs) -> None:
        """Nothing: the engine steps the scheduler once per applied update."""

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"mixprec engine-stepped {self.inner!r}"
