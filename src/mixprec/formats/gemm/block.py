"""Block fp8 (DeepSeek-V3, Transformer Engine's ``Float8BlockScaling``): 1×128 tiles for
activations and gradients, 128×128 blocks for weights (``mixprec.formats.blocks``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from mixprec.formats.blocks import TILE, cast_blocks, cast_tiles
from mixprec.formats.gemm.base import E4M3, Margined, TileScaled
from mixprec.formats.grain import ScaleGrain
from mixprec.formats.padding import KernelSpec
from mixprec.formats.quantized import Quantized
from mixprec.formats.shard import Agreement

__all__ = ["BlockScaling"]


@dataclass(frozen=True, kw_only=True)
class BlockScaling(TileScaled, Margined):
    """128×128 weight blocks serve both of the weight's GEMMs."""

    fp8_format: Literal["hybrid", "e4m3"] = "e4m3"
    #: ``fp32`` scales, or ``pow2``: rounded down to powers of two (exact dequant)
    block_scales: Literal["fp32", "pow2"] = "fp32"

    name: ClassVar[str] = "block"
    #: K and N to 128; M to 4, so the tile scales' leading dimension is 16 bytes
    kernel: ClassVar[KernelSpec] = KernelSpec(
        multiples=(4, 128, 128), tile=128, scales="outer_major",
        name="the 1x128/128x128 block kernel", capability=((9, 0), 9))
    #: 1×128 tiles; a weight's 128×128 blocks serve both of its GEMMs
    scales: ClassVar[ScaleGrain] = ScaleGrain(kind="tile", tile=TILE, square_weight=True)

    @property
    def pow2(self) -> bool:
        """Scales rounded down to powers of two."""
        return self.block_scales == "pow2"

    def shard_rows(self, dim: int) -> int:
        """A 128×128 block spans 128 rows."""
        return TILE

    def kernel_refusal(self) -> str | None:
        """torch's block kernels take e4m3 operands only."""
        if self.fp8_format == "e4m3":
            return None
        return ("torch's 1x128/128x128 block kernels take e4m3 operands only, and "
                "fp8_format=hybrid casts the gradients to e5m2 (fp8_format=e4m3, the "
                "fp8-block preset's, has the kernel)")

    def cast(self, t: torch.Tensor, role: str, dim: int, state: dict, record: bool = False,
             generator: torch.Generator | None = None, agree: Agreement | None = None
             ) -> Quantized:
        """A weight in 128×128 blocks (``dim`` does not matter), else 1×128 tiles along
        ``dim``."""
        if role == "weight":
            return cast_blocks(t, E4M3, margin=self.margin, pow2=self.pow2)
        return cast_tiles(t, dim, self.dtype(role), margin=self.margin, pow2=self.pow2)
