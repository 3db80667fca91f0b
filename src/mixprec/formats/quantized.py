"""A quantized 2-D tensor: codes, inverse scales and the block shape they cover.

Every cast in ``mixprec.formats`` (per tensor, rowwise, 1×128 / 128×128 block, MX, NVFP4)
returns a ``Quantized``. Its value is ``code × inverse scale``, where the inverse scale
is one of:

- a scalar (per-tensor scaling) or a vector shaped to broadcast over the codes
  (rowwise: ``(rows, 1)`` or ``(1, cols)``), ``rows = cols = 0``;
- one value per ``rows × cols`` block of the codes (a tile along dim 1 is ``rows=1``),
  times an optional per-tensor factor ``outer`` (NVFP4's fp32 descale).

``t()`` is the transpose as a GEMM takes it: the same bytes, read the other way. The
block helpers here (zero padding to whole blocks, per-block amax, per-block values
repeated over their elements) serve every block-scaled cast.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

__all__ = ["Quantized", "block_amax", "expand_blocks", "pad_to"]


@dataclass(frozen=True)
class Quantized:
    """``data`` (the codes as cast), ``scale_inv`` (see the module doc), the block shape
    ``rows × cols`` in ``data``'s orientation (0 × 0: ``scale_inv`` broadcasts), the
    per-tensor factor ``outer`` and whether this is the transpose of ``data``."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    rows: int = 0
    cols: int = 0
    outer: torch.Tensor | None = None
    transposed: bool = False

    @property
    def codes(self) -> torch.Tensor:
        """The codes in this tensor's orientation (a view: no copy)."""
        return self.data.t() if self.transposed else self.data

    @property
    def inv(self) -> torch.Tensor:
        """The inverse scales in this tensor's orientation."""
        return self.scale_inv.t() if self.transposed else self.scale_inv

    def t(self) -> Quantized:
        """The transpose: the same codes and scales, read the other way."""
        return dataclasses.replace(self, transposed=not self.transposed)

    def dequant(self) -> torch.Tensor:
        """``code × inverse scale`` in fp32 (exact for power-of-two scales, else one
        fp32 rounding per element), in this tensor's orientation."""
        s = self.scale_inv if self.outer is None else self.scale_inv * self.outer
        if self.rows or self.cols:
            s = expand_blocks(s, self.rows, self.cols, self.data.shape)
        d = self.data.float() * s
        return d.t() if self.transposed else d

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The tensors to save for backward; ``like(tensors)`` rebuilds this cast."""
        return self.data, self.scale_inv, self.outer

    def like(self, tensors: tuple | list) -> Quantized:
        """This cast's shape and orientation over saved ``tensors`` (see ``tensors``)."""
        data, scale_inv, outer = tensors
        return dataclasses.replace(self, data=data, scale_inv=scale_inv, outer=outer)


def expand_blocks(s: torch.Tensor, rows: int, cols: int, shape: tuple | torch.Size
                  ) -> torch.Tensor:
    """Per-block values ``s`` repeated over their ``rows × cols`` blocks, cut to
    ``shape`` (a last partial block keeps its own value)."""
    if rows > 1:
        s = s.repeat_interleave(rows, dim=0)[:shape[0]]
    if cols > 1:
        s = s.repeat_interleave(cols, dim=1)[:, :shape[1]]
    return s


def pad_to(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """2-D ``t`` padded with zeros at the end to multiples of ``rows`` and ``cols``."""
    m, n = t.shape
    return torch.nn.functional.pad(t, (0, (-n) % cols, 0, (-m) % rows))


def block_amax(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """amax of each ``rows × cols`` block of 2-D ``t`` (zero padding at the edges),
    fp32, shape ``(⌈M/rows⌉, ⌈N/cols⌉)``."""
    p = pad_to(t.detach().float().abs(), rows, cols)
    m, n = p.shape
    return p.view(m // rows, rows, n // cols, cols).amax(dim=(1, 3))
