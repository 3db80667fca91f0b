"""MXFP8 (OCP; Transformer Engine's ``MXFP8BlockScaling``): 1×32 tiles along every
GEMM's contracted dim with e8m0 scales (``mixprec.formats.blocks``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from mixprec.formats.blocks import MX_TILE, cast_mx
from mixprec.formats.gemm.base import Fp8Elements, TileScaled
from mixprec.formats.grain import ScaleGrain
from mixprec.formats.padding import KernelSpec
from mixprec.formats.quantized import Quantized
from mixprec.formats.shard import Agreement

__all__ = ["MXScaling"]


@dataclass(frozen=True, kw_only=True)
class MXScaling(TileScaled, Fp8Elements):
    """Scales are powers of two chosen by ``mx_rounding`` (no margin)."""

    fp8_format: Literal["hybrid", "e4m3"] = "e4m3"
    #: the e8m0 exponent rule: ``rceil`` (NVIDIA's), ``floor`` (the OCP spec's, which
    #: saturates a block's largest elements), ``ceil`` or ``even``
    mx_rounding: Literal["rceil", "floor", "ceil", "even"] = "rceil"

    name: ClassVar[str] = "mx"
    #: K to 32, N to 16; e8m0 scales swizzled (padded with unit scales to 128 × 4 tiles)
    kernel: ClassVar[KernelSpec] = KernelSpec(
        multiples=(1, MX_TILE, 16), tile=MX_TILE, scales="swizzled",
        scale_dtype=torch.float8_e8m0fnu, name="the MXFP8 block-scaled kernel",
        capability=((10, 0), None))
    #: 1×32 tiles along every contracted dim
    scales: ClassVar[ScaleGrain] = ScaleGrain(kind="tile", tile=MX_TILE)

    @property
    def rounding(self) -> str:
        """The e8m0 exponent rule (``mx_rounding``)."""
        return self.mx_rounding

    def shard_rows(self, dim: int) -> int:
        """dgrad's tiles (``dim=0``) span 32 rows; the forward's, one."""
        return MX_TILE if dim == 0 else 1

    def cast(self, t: torch.Tensor, role: str, dim: int, state: dict, record: bool = False,
             generator: torch.Generator | None = None, agree: Agreement | None = None
             ) -> Quantized:
        """1×32 MX tiles along ``dim`` (``cast_mx``)."""
        return cast_mx(t, dim, self.dtype(role), self.mx_rounding)
