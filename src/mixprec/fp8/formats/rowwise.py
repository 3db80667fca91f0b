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
from mixprec.fp8.tp_agree import Agreement

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
             generator: torch.Generator | None = None, agree: Agreement | None = None
             ) -> Quantized:
        """Rowwise cast along ``dim`` (``cast_rowwise``); the inverse scales broadcast."""
        codes, inv = cast_rowwise(t, dim, self.dtype(role), self.margin, agree=agree)
        return Quantized(codes, inv)

    def gather_amax(self, shard: torch.Tensor) -> torch.Tensor | None:
        """The shard's column amaxes ``(1, in)``: dgrad's scales span every row, so the
        ranks' max is the whole weight's."""
        if shard.shape[0] == 0:
            return shard.new_zeros((1, shard.shape[1]), dtype=torch.float32)
        return shard.detach().abs().amax(dim=0, keepdim=True).float()

    def cast_shard(self, shard: torch.Tensor, dim: int, amax: torch.Tensor | None
                   ) -> Quantized:
        """The forward's rows scale themselves; dgrad's columns take the agreed amax."""
        codes, inv = cast_rowwise(shard, dim, self.dtype("weight"), self.margin,
                                  amax if dim == 0 else None)
        return Quantized(codes, inv)

    def mm(self, a: Quantized, b: Quantized, out_dtype: torch.dtype, backend: str
           ) -> torch.Tensor:
        """``fp8_gemm`` with one inverse scale per row of ``a`` and column of ``b``."""
        return fp8_gemm(a.codes, b.codes, a.inv, b.inv, out_dtype, backend)
