"""Rowwise fp8: one scale per row along the GEMM's contracted dim (torchao's rowwise);
the GEMMs take the per-tensor routes with broadcast inverse scales."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from mixprec.fp8.formats.base import Margined
from mixprec.fp8.gemm import fp8_gemm
from mixprec.fp8.quantized import Quantized
from mixprec.fp8.scaling import cast_rowwise

__all__ = ["RowwiseScaling"]


@dataclass(frozen=True, kw_only=True)
class RowwiseScaling(Margined):
    """Per token for activations and gradients, per output (forward) or input (dgrad)
    channel for weights."""

    name: ClassVar[str] = "rowwise"
    flush_view: ClassVar[str] = "rowwise"
    torchao_recipe: ClassVar[str | None] = "rowwise"

    @classmethod
    def flushed(cls, per_tensor: float, rowwise: float, blockwise: float) -> float:
        """A scale per row: the rowwise share."""
        return rowwise

    def cast(self, t: torch.Tensor, role: str, dim: int, state: dict, record: bool = False,
             generator: torch.Generator | None = None) -> Quantized:
        """Rowwise cast along ``dim`` (``cast_rowwise``); the inverse scales broadcast."""
        codes, inv = cast_rowwise(t, dim, self.dtype(role), self.margin)
        return Quantized(codes, inv)

    def mm(self, a: Quantized, b: Quantized, out_dtype: torch.dtype, backend: str
           ) -> torch.Tensor:
        """``fp8_gemm`` with one inverse scale per row of ``a`` and column of ``b``."""
        return fp8_gemm(a.codes, b.codes, a.inv, b.inv, out_dtype, backend)
