"""Per-tensor delayed scaling: the scale from an amax history (Transformer Engine's
``DelayedScaling``; ``mixprec.formats.scaling``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from mixprec.formats.gemm.per_tensor import PerTensor
from mixprec.formats.scaling import FP8_MAX, ROLES, update_delayed_scales

__all__ = ["DelayedScaling"]


@dataclass(frozen=True, kw_only=True)
class DelayedScaling(PerTensor):
    """Per-tensor scales from an amax history; the history and scales are buffers."""

    #: steps of amax the history keeps
    amax_history_len: int = 16
    #: how the history becomes the amax the scale is computed from
    amax_compute_algo: Literal["max", "most_recent"] = "max"

    name: ClassVar[str] = "delayed"
    has_history: ClassVar[bool] = True

    def buffers(self, device: torch.device | str, seed: int = 0
                ) -> dict[str, tuple[torch.Tensor, bool]]:
        """The amax history (3 roles × ``amax_history_len``), the scales and the fp8
        maxima (not saved: they follow from the formats)."""
        maxes = [FP8_MAX[self.dtype(role)] for role in ROLES]
        return {"fp8_amax_history": (torch.zeros(3, self.amax_history_len, device=device),
                                     True),
                "fp8_scale": (torch.ones(3, device=device), True),
                "fp8_max": (torch.tensor(maxes, device=device), False)}

    def _record(self, state: dict, role: str, amax: torch.Tensor) -> None:
        slot = state["fp8_amax_history"][ROLES.index(role), 0]
        slot.copy_(torch.maximum(slot, amax))

    def _scale(self, amax: torch.Tensor, role: str, state: dict, record: bool
               ) -> torch.Tensor:
        if record:
            self._record(state, role, amax)
        return state["fp8_scale"][ROLES.index(role)]

    def update(self, state: dict, found_inf: torch.Tensor | None = None) -> None:
        """Delayed scaling's step (``update_delayed_scales``): a new scale from the
        history, which rolls; a skipped step drops its amaxes."""
        with torch.no_grad():
            update_delayed_scales(state["fp8_amax_history"], state["fp8_scale"],
                                  state["fp8_max"], algo=self.amax_compute_algo,
                                  margin=self.margin, found_inf=found_inf)
