"""Per-tensor current scaling: the scale from the tensor's own amax at cast time
(Transformer Engine's ``Float8CurrentScaling``); no state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from mixprec.formats.gemm.per_tensor import PerTensor
from mixprec.formats.scaling import amax_to_scale, fp8_max_tensor

__all__ = ["CurrentScaling"]


@dataclass(frozen=True, kw_only=True)
class CurrentScaling(PerTensor):
    """Per-tensor scales from the tensor's own amax at cast time."""

    name: ClassVar[str] = "current"

    def _scale(self, amax: torch.Tensor, role: str, state: dict, record: bool
               ) -> torch.Tensor:
        return amax_to_scale(amax, fp8_max_tensor(self.dtype(role), amax.device),
                             self.margin, torch.ones((), device=amax.device))
