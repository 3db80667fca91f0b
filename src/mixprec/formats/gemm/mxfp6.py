"""MXFP6 (OCP MX v1.0's FP6 E3M2): 1×32 tiles along every GEMM's contracted dim with
e8m0 scales, as MXFP8's (``mixprec.formats.gemm.mx``), and fp6 e3m2 elements (max 28,
no inf or NaN; ``mixprec.formats.elements``) for every role.

torch has no fp6 dtype and no fp6 kernel: each code is kept as the e4m3 byte of its
value (every e3m2 value is an e4m3 value, exactly), and the GEMMs run the exact
dequantizing route (``dequant_fp32``); ``fp8_gemm=scaled_mm`` is refused."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from mixprec.formats.blocks import MX_TILE, cast_mx
from mixprec.formats.gemm.base import E4M3, LinearFormat, TileScaled
from mixprec.formats.grain import ScaleGrain
from mixprec.formats.quantized import Quantized
from mixprec.formats.shard import Agreement

__all__ = ["MXFP6Scaling", "ELEMENTS"]

#: the element format of every role's codes (``mixprec.formats.elements``)
ELEMENTS = "fp6_e3m2"


@dataclass(frozen=True, kw_only=True)
class MXFP6Scaling(TileScaled, LinearFormat):
    """fp6 e3m2 elements under power-of-two scales chosen by ``mx_rounding``."""

    #: the e8m0 exponent rule: ``rceil`` (NVIDIA's), ``floor`` (the OCP spec's, which
    #: saturates a block's largest elements), ``ceil`` or ``even``
    mx_rounding: Literal["rceil", "floor", "ceil", "even"] = "rceil"

    name: ClassVar[str] = "mxfp6"
    #: 1×32 tiles along every contracted dim
    scales: ClassVar[ScaleGrain] = ScaleGrain(kind="tile", tile=MX_TILE)
    elements: ClassVar[str] = ELEMENTS
    #: no torch kernel multiplies fp6 codes
    kernel: ClassVar[None] = None

    @property
    def grad_dtype(self) -> torch.dtype:
        """The gradient codes' carrier: e4m3 bytes holding e3m2 values."""
        return E4M3

    def dtype(self, role: str) -> torch.dtype:
        """e4m3, every role: the byte each e3m2 code is kept in."""
        return E4M3

    def backward_bytes(self, t: int, i: int, o: int, act_bytes: float, route: str
                       ) -> float:
        """The larger of MXFP8's stages (``TileScaled``) and the gradient's e3m2 cast,
        whose rounding (``mixprec.formats.elements.quantize``) takes four fp32 passes
        beyond MXFP8's cast (``21·T·O`` in all), beside the other cast's codes
        (``T·O``)."""
        return max(super().backward_bytes(t, i, o, act_bytes, route), 22 * t * o)

    def shard_rows(self, dim: int) -> int:
        """dgrad's tiles (``dim=0``) span 32 rows; the forward's, one."""
        return MX_TILE if dim == 0 else 1

    def cast(self, t: torch.Tensor, role: str, dim: int, state: dict, record: bool = False,
             generator: torch.Generator | None = None, agree: Agreement | None = None
             ) -> Quantized:
        """1×32 MX tiles along ``dim`` with e3m2 elements (``cast_mx``: saturated,
        rounded to nearest even), each code kept as its e4m3 byte."""
        q = cast_mx(t, dim, ELEMENTS, self.mx_rounding)
        return Quantized(q.data.to(E4M3), q.scale_inv, q.rows, q.cols)
