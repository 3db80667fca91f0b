"""The experts' grouped route without a host read (``grouped`` on a CPU).

Each operand is cast whole by the format (``LinearFormat.segment_cast``,
``segment_weights``: ``mixprec.formats.gemm``), every expert's rows scaled, clamped and
rounded as the cast of that expert's slice gives them, so the casts are bit for bit
the per-expert ones; each row's expert comes from the cumulative counts on the device
(``mixprec.formats.segments.Segments``). The dequantized casts go to
``torch._grouped_mm`` with the offsets as they are (``grouped_mm_fp32``): forward and
dgrad on the rows (``rows_product``: the rows past the last expert zero), wgrad per
expert over its rows (``wgrad_product``). Nothing reads a tensor's value on the host,
so ``torch.compile`` traces it as one graph. ``Segmented`` is the layout
``mixprec.formats.mm.QuantizedGemm`` runs it in.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.formats.fp4 import counter_key
from mixprec.formats.mm import GemmLayout
from mixprec.formats.segments import Segments, segment_ids

__all__ = ["Segmented", "segment_ids", "grouped_mm_fp32", "expert_rows", "rows_product",
           "wgrad_product"]


@torch.library.custom_op("mixprec::grouped_mm_fp32", mutates_args=())
def grouped_mm_fp32(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` on fp32 (or 16-bit) operands, as an op ``torch.compile``
    keeps opaque (torch's meta kernel for it accepts bf16 only; the CPU kernel takes
    fp32); the output in the operands' dtype."""
    return torch._grouped_mm(a, b, offs=offs)


@grouped_mm_fp32.register_fake
def _(a, b, offs):
    if a.dim() == 2 and b.dim() == 2:  # wgrad: one (M, N) per group
        return a.new_empty(offs.shape[0], a.shape[0], b.shape[1])
    return a.new_empty(a.shape[0], b.shape[-1])


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    """Zero rows up to 16 bytes of the dtype (16-byte strides for the transposed
    operand: 4 fp32 rows, 8 bf16)."""
    extra = (-t.shape[0]) % (16 // t.element_size())
    return t if not extra else torch.cat([t, t.new_zeros(extra, t.shape[1])])


def expert_rows(offsets: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The offsets as ``grouped_mm_fp32`` takes them (int32) and each row's expert id."""
    offs = offsets.to(torch.int32)
    return offs, segment_ids(offs, rows)


def rows_product(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, ids: torch.Tensor,
                 dtype: torch.dtype) -> torch.Tensor:
    """Each expert's rows of ``a`` times its ``b``, the rows past the last expert's
    (``ids`` E) zero, in ``dtype``."""
    y = grouped_mm_fp32(a, b, offs)
    return torch.where((ids < b.shape[0]).unsqueeze(1), y, 0).to(dtype)


def wgrad_product(g: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, dtype: torch.dtype
                  ) -> torch.Tensor:
    """Each expert's ``gᵀ @ x`` over its rows (E × N × K; zero for an expert without
    rows), in ``g``'s dtype (fp32, or 16 bits), then ``dtype``."""
    dw = grouped_mm_fp32(_pad_rows(g).t().contiguous(), _pad_rows(x), offs)
    has_rows = torch.diff(offs, prepend=offs.new_zeros(1)) > 0
    return torch.where(has_rows.view(-1, 1, 1), dw, 0).to(dtype)


class Segmented(GemmLayout):
    """The experts' GEMMs on whole-operand casts (the module doc); ``site``: the
    ``ExpertsFormat``. Stochastic rounding draws the gradient's numbers from the
    counter stream of this backward's key (``ExpertsFormat._sr_key``) by place: dgrad's
    cast from 0, wgrad's from ``T·N`` on."""

    def __init__(self, site: Any, seg: Segments | None = None) -> None:
        super().__init__(site)
        self.seg = seg

    def bind(self, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> Segmented:
        """Each row's expert, from the counts on the device."""
        return Segmented(self.site, Segments.of(offsets, x.shape[0]))

    def saved(self) -> tuple[object, list[torch.Tensor]]:
        """The counts, the row ids and the layouts the casts derived from them."""
        return self.seg.saved()

    def restore(self, meta: object, tensors: list[torch.Tensor]) -> Segmented:
        """The segments the forward read."""
        return Segmented(self.site, Segments.saved_again(meta, tensors))

    def grad_keys(self, gy: torch.Tensor) -> tuple[object, object]:
        """This backward's key, and wgrad's ``T·N`` numbers on."""
        key = self.site._sr_key(gy.device)
        return key, None if key is None else counter_key(key, gy.numel())

    def cast_x(self, t: torch.Tensor, role: str, dim: int, record: bool = False,
               key: Any = None) -> Any:
        """The tokens (or the gradient) cast whole by the format."""
        return self.fmt.segment_cast(t, role, dim, self.seg, self.site.scaling_state(),
                                     record, key)

    def cast_w(self, w: torch.Tensor, dim: int, record: bool = False) -> Any:
        """The experts' weights cast per expert by the format."""
        return self.fmt.segment_weights(w, dim, self.seg, self.site.scaling_state(), record)

    def forward_mm(self, xq: Any, wq: Any, out_dtype: torch.dtype) -> torch.Tensor:
        """Each expert's rows times its weight's transpose."""
        seg = self.seg
        return rows_product(self.fmt.segment_values(xq, seg),
                            self.fmt.segment_weight_values(wq, seg, True), seg.offs,
                            seg.ids, out_dtype)

    def dgrad_mm(self, g: Any, wd: Any, x_dtype: torch.dtype) -> torch.Tensor:
        """Each expert's gradient rows times its weight."""
        seg = self.seg
        return rows_product(self.fmt.segment_values(g, seg),
                            self.fmt.segment_weight_values(wd, seg, False), seg.offs,
                            seg.ids, x_dtype)

    def wgrad_mm(self, g: Any, xw: Any, w_dtype: torch.dtype) -> torch.Tensor:
        """Each expert's gradient rows, transposed, times its input rows."""
        gv, xv, offs = self.fmt.segment_wgrad(g, xw, self.seg)
        return wgrad_product(gv, xv, offs, w_dtype)

    def hp_wgrad(self, gy: torch.Tensor, x_hp: torch.Tensor, w_dtype: torch.dtype
                 ) -> torch.Tensor:
        """wgrad in the gradient's 16 bits on the input as it came."""
        return wgrad_product(gy, x_hp.to(gy.dtype), self.seg.offs, w_dtype)
