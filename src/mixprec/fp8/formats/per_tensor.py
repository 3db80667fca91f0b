"""The per-tensor formats' shared cast: one scale per tensor, GEMMs on
``torch._scaled_mm`` or the dequant routes of ``mixprec.fp8.gemm.fp8_gemm``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from mixprec.fp8.formats.base import Margined
from mixprec.fp8.gather import Fp8Weight
from mixprec.fp8.gemm import fp8_gemm
from mixprec.fp8.quantized import Quantized
from mixprec.fp8.scaling import ROLES, abs_max, cast_to_fp8, nan_if_not_finite
from mixprec.fp8.tp_agree import Agreement, agreed_amax

__all__ = ["PerTensor"]


@dataclass(frozen=True, kw_only=True)
class PerTensor(Margined):
    """One scale per tensor; subclasses say where the scale comes from (``_scale``)."""

    reused_roles: ClassVar[tuple[str, ...]] = ROLES
    per_tensor: ClassVar[bool] = True
    torchao_recipe: ClassVar[str | None] = "tensorwise"

    def mm(self, a: Quantized, b: Quantized, out_dtype: torch.dtype, backend: str
           ) -> torch.Tensor:
        """``fp8_gemm`` on the codes and inverse scales (per tensor: scalars; rowwise:
        one per row of ``a`` and per column of ``b``)."""
        return fp8_gemm(a.codes, b.codes, a.inv, b.inv, out_dtype, backend)

    def _scale(self, amax: torch.Tensor, role: str, state: dict, record: bool
               ) -> torch.Tensor:
        raise NotImplementedError(type(self).__name__)

    def _record(self, state: dict, role: str, amax: torch.Tensor) -> None:
        """Delayed scaling: ``amax`` into this step's history slot."""

    def cast(self, t: torch.Tensor, role: str, dim: int, state: dict, record: bool = False,
             generator: torch.Generator | None = None, agree: Agreement | None = None
             ) -> Quantized:
        """Per-tensor cast. A weight FSDP2 gathered as fp8 (``Fp8Weight``) is cast
        already with this role's scale: its codes are copied (the backward keeps them;
        FSDP frees the gathered bytes), and the shard's amax it carries is recorded,
        which the step's all-reduce MAX makes the whole weight's."""
        if isinstance(t, Fp8Weight):
            if record:
                self._record(state, role, t._amax)
            return Quantized(t._codes.clone(), torch.reciprocal(t._scale))
        amax = agreed_amax(abs_max(t).float(), agree=agree)  # a TP shard: the whole's
        scale = self._scale(amax, role, state, record)
        scale = nan_if_not_finite(scale, amax)  # an inf must not saturate to a finite max
        return Quantized(cast_to_fp8(t, scale, self.dtype(role)), torch.reciprocal(scale))
