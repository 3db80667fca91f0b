"""Watching for runs that keep skipping, without waiting for the device.

``SkipWatch`` reads the scaler's skip streak and scale through ``HostMirror``, an async
device-to-host copy that is read once it has landed, so ``step()`` never blocks on it.
After ``recipe.skip_limit`` consecutive skipped steps it warns or raises
(``recipe.on_skip_limit``), saying how long the run has skipped and at what scale.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mixprec.engine.scaler import LossScaler
    from mixprec.recipe import Recipe

__all__ = ["SkipLimitError", "SkipWatch", "HostMirror"]


class SkipLimitError(RuntimeError):
    """Raised when a run has skipped ``recipe.skip_limit`` steps in a row."""


class HostMirror:
    """An async device->host copy of a small tensor, read when it has landed.

    On CUDA the copy goes into pinned memory with an event; ``read()`` returns None
    until the event has completed, so nothing ever waits. On the CPU it is immediate.
    """

    def __init__(self, n: int, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.buf = torch.zeros(n, dtype=torch.float64, pin_memory=self.cuda)
        self.event = torch.cuda.Event() if self.cuda else None
        self.pending = False

    def push(self, t: torch.Tensor) -> None:
        """Start copying ``t`` (a few device values) to the host, without waiting."""
        self.buf.copy_(t.to(torch.float64), non_blocking=self.cuda)
        if self.event is not None:
            self.event.record()
        self.pending = True

    def read(self) -> list[float] | None:
        """The last pushed values once their copy has landed, else None (never waits)."""
        if not self.pending or (self.event is not None and not self.event.query()):
            return None
        self.pending = False
        return self.buf.numpy().tolist()

    def wait(self) -> list[float] | None:
        """The last pushed values, waiting for their copy to land (on CUDA: for the work
        queued before the push, nothing later); None if nothing is pending."""
        if self.pending and self.event is not None:
            self.event.synchronize()
        return self.read()


class SkipWatch:
    """Warn or raise once a skip streak reaches the recipe's ``skip_limit``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._mirror = HostMirror(2, device)
        self._warned_streak = 0

    def check(self, scaler: LossScaler, recipe: Recipe) -> None:
        """Look at the skip streak one step late (no sync); warn or raise
        ``SkipLimitError`` per ``recipe.on_skip_limit`` once it reaches ``skip_limit``."""
        limit = recipe.skip_limit
        if not limit:
            return
        seen = self._mirror.read()
        self._mirror.push(torch.stack([scaler.skip_streak.double(),
                                       scaler.scale.double()]))
        if seen is None and self.device.type == "cpu":
            seen = self._mirror.read()
        if seen is None:
            return
        streak, scale = int(seen[0]), seen[1]
        if streak < limit:
            self._warned_streak = 0
            return
        if self._warned_streak and streak < self._warned_streak + limit:
            return
        self._warned_streak = streak
        msg = (f"{streak} consecutive steps skipped for non-finite gradients (loss scale "
               f"now {scale:g}, recipe {str(recipe)!r}): the weights have not moved. "
               "Look for NaN/inf in the data or loss, lower the learning rate, or keep "
               "the overflowing layer in fp32 / use bf16.")
        if recipe.on_skip_limit == "raise":
            raise SkipLimitError(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=4)  # at the caller of step()
