"""The per-tensor formats' shared cast: one scale per tensor, GEMMs on
``torch._scaled_mm`` or the dequant routes of ``mixprec.formats.tensor_gemm.fp8_gemm``.

The experts' grouped casts (``segment_cast``): each expert's per-tensor amax is a
segment reduction over its rows (``scatter_reduce`` ``amax``), its scale the format's
scale of that amax, and the whole operand's cast multiplies each row by its expert's
scale: elementwise the same products, clamps and roundings as casting each expert's
slice on its own, so the codes and scales are bit for bit those. Delayed scaling
records, per role, the max over the experts that have tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from mixprec.formats.gemm.base import Margined
from mixprec.formats.grain import ScaleGrain
from mixprec.formats.precast import Fp8Weight
from mixprec.formats.quantized import Quantized
from mixprec.formats.scaling import abs_max, cast_to_fp8, nan_if_not_finite
from mixprec.formats.segments import Segments, segment_amax, stacked_values
from mixprec.formats.shard import Agreement, agreed_amax
from mixprec.formats.tensor_gemm import fp8_gemm

__all__ = ["PerTensor"]


@dataclass(frozen=True, kw_only=True)
class PerTensor(Margined):
    """One scale per tensor; subclasses say where the scale comes from (``_scale``)."""

    scales: ClassVar[ScaleGrain] = ScaleGrain(kind="tensor")

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

    def expert_scales(self, amax: torch.Tensor, role: str, state: dict, record: bool,
                       mask: torch.Tensor | None = None) -> torch.Tensor:
        """The scales of a vector of per-expert amaxes (NaN where an amax is not
        finite, as a cast makes it); with ``record``, delayed scaling records the max of
        the amaxes (of those ``mask`` keeps)."""
        if record and self.has_history:
            kept = amax if mask is None else torch.where(mask, amax, 0)
            self._record(state, role, kept.amax())
        scale = self._scale(amax, role, state, False).expand_as(amax)
        return nan_if_not_finite(scale, amax)

    def segments_apply(self) -> bool:
        """Every per-tensor format casts an experts operand whole."""
        return True

    def segment_cast(self, t: torch.Tensor, role: str, dim: int, seg: Segments,
                     state: dict, record: bool = False, key: object = None
                     ) -> tuple[Quantized, torch.Tensor]:
        """Each row cast with its expert's scale (the module doc; ``dim`` does not
        matter): the cast (each row's inverse scale, rows × 1) and each expert's inverse
        scale, (E + 1,), the last 1 for the rows past the last expert's."""
        amax = segment_amax(t.detach().abs().amax(dim=1).float(), seg.ids,
                            seg.experts + 1)[:seg.experts]
        scales = self.expert_scales(amax, role, state, record)
        scales = torch.cat([scales, scales.new_ones(1)])
        rows = scales[seg.ids].unsqueeze(1)
        return (Quantized(cast_to_fp8(t, rows, self.dtype(role)), torch.reciprocal(rows)),
                torch.reciprocal(scales))

    def segment_weights(self, w: torch.Tensor, dim: int, seg: Segments, state: dict,
                        record: bool = False) -> Quantized:
        """Each expert's weight (E × N × K) on its own scale: the codes and the inverse
        scales (E × 1 × 1); an expert without tokens is cast but not recorded. A weight
        FSDP2 gathered as codes (``Fp8Weight``) is cast already: its codes (copied:
        FSDP frees them) and scales, its agreed amaxes recorded."""
        if isinstance(w, Fp8Weight):
            self.expert_scales(w._amax, "weight", state, record, mask=seg.has_rows)
            return Quantized(w._codes.clone(), torch.reciprocal(w._scale).view(-1, 1, 1))
        amax = w.detach().abs().amax(dim=(1, 2)).float()
        scale = self.expert_scales(amax, "weight", state, record, mask=seg.has_rows)
        scale = scale.view(-1, 1, 1)
        return Quantized(cast_to_fp8(w, scale, self.dtype("weight")),
                         torch.reciprocal(scale))

    def segment_values(self, c: tuple[Quantized, torch.Tensor], seg: Segments
                       ) -> torch.Tensor:
        """Each code times its row's inverse scale, fp32."""
        return c[0].dequant()

    def segment_weight_values(self, c: Quantized, seg: Segments, transposed: bool
                              ) -> torch.Tensor:
        """The weights' codes times their expert's inverse scale, fp32."""
        return stacked_values(c, transposed)

    def segment_wgrad(self, g: tuple, x: tuple, seg: Segments
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The forward's and dgrad's casts serve wgrad: their values as they are."""
        return g[0].dequant(), x[0].dequant(), seg.offs

    def segment_codes(self, c: tuple[Quantized, torch.Tensor]
                      ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The codes, each row's inverse scale and each expert's."""
        return c[0].data, c[0].scale_inv, c[1]
