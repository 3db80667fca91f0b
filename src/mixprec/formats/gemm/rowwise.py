"""Rowwise fp8: one scale per row along the GEMM's contracted dim (torchao's rowwise);
the GEMMs take the per-tensor routes with broadcast inverse scales.

The experts' grouped casts (``segment_cast``): a rowwise cast scales each slice along
the contracted dim on its own, so the forward's and dgrad's casts (a scale per token;
per output or input channel of each expert's weight) are taken whole. wgrad contracts
over the tokens: its casts take one scale per (expert, column), each column's amax over
the expert's rows a segment reduction, gathered back per row. Every element meets the
scale, clamp and rounding of the cast of its expert's slice, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from mixprec.formats.gemm.base import Margined
from mixprec.formats.quantized import Quantized
from mixprec.formats.scaling import cast_rowwise, cast_to_fp8, rowwise_scale
from mixprec.formats.segments import Segments, segment_amax, stacked_values
from mixprec.formats.shard import Agreement
from mixprec.formats.tensor_gemm import fp8_gemm

__all__ = ["RowwiseScaling"]


@dataclass(frozen=True, kw_only=True)
class RowwiseScaling(Margined):
    """Per token for activations and gradients, per output (forward) or input (dgrad)
    channel for weights."""

    name: ClassVar[str] = "rowwise"

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

    def _scaled(self, t: torch.Tensor, amax: torch.Tensor, role: str) -> Quantized:
        """``t`` cast under the rowwise scales of ``amax`` (broadcast over ``t``)."""
        scale = rowwise_scale(amax, self.dtype(role), self.margin)
        return Quantized(cast_to_fp8(t, scale, self.dtype(role)), torch.reciprocal(scale))

    def segments_apply(self) -> bool:
        """Grouped casts where every GEMM is quantized."""
        return "wgrad" in self.quantized_gemms

    def segment_cast(self, t: torch.Tensor, role: str, dim: int, seg: Segments,
                     state: dict, record: bool = False, key: object = None
                     ) -> tuple[Quantized, torch.Tensor | None]:
        """Along the hidden dim: the cast (a scale per row) and None. Along the tokens:
        the codes (no row scale) and the inverse scales of each (expert, column),
        (E + 1) × cols, row E for the rows past the last expert's."""
        if dim == 1:
            return self._scaled(t, t.detach().abs().amax(dim=1, keepdim=True).float(),
                                role), None
        src = t.detach().abs().float()
        scale = rowwise_scale(segment_amax(src, seg.ids, seg.experts + 1),
                              self.dtype(role), self.margin)
        codes = cast_to_fp8(t, scale[seg.ids], self.dtype(role))
        return Quantized(codes, None), torch.reciprocal(scale)

    def segment_weights(self, w: torch.Tensor, dim: int, seg: Segments, state: dict,
                        record: bool = False) -> Quantized:
        """Each expert's weight per output channel (``dim=1``) or input channel
        (``dim=0``), cast as one E × N × K tensor."""
        return self._scaled(w, w.detach().abs().amax(dim=2 if dim == 1 else 1,
                                                      keepdim=True).float(), "weight")

    def segment_values(self, c: tuple, seg: Segments) -> torch.Tensor:
        """Each code times its row's inverse scale, fp32."""
        return c[0].dequant()

    def segment_weight_values(self, c: Quantized, seg: Segments, transposed: bool
                              ) -> torch.Tensor:
        """The weights' codes times their channel's inverse scale, fp32."""
        return stacked_values(c, transposed)

    def segment_wgrad(self, g: tuple, x: tuple, seg: Segments
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each code times its (expert, column)'s inverse scale, fp32."""
        return (g[0].data.float() * g[1][seg.ids], x[0].data.float() * x[1][seg.ids],
                seg.offs)

    def segment_codes(self, c: tuple
                      ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The codes, each row's inverse scale (along the hidden dim) and each
        (expert, column)'s (along the tokens)."""
        return c[0].data, c[0].scale_inv, c[1]
