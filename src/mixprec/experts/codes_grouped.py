"""The ``grouped`` and ``scaled_grouped`` routes where ``torch._grouped_mm`` takes bf16
only (CUDA), without a host read.

torch's CUDA grouped GEMM (and its meta kernel, which mirrors it) takes bf16 operands
with 16-byte strides and writes bf16. The per-tensor and rowwise formats (``fp8``,
``fp8-current``, ``fp8-rowwise``) scale whole rows and columns of each GEMM, so their
scales factor out of the sum: the fp8 codes, widened to bf16 (exact: every e4m3 and
e5m2 value is a bf16 value), go to the kernel, which accumulates in fp32 and rounds
once to bf16, and each output element is then multiplied in fp32 by its row's and
column's inverse scales, as the ``dequant`` GEMM route does
(``mixprec.formats.tensor_gemm.fp8_gemm``). On ``scaled_grouped`` the forward's e4m3 codes and
their scales go to ``torch._scaled_grouped_mm`` instead (``mixprec.experts.scaled_grouped``).

Every cast is taken on the device from the cumulative counts by the format
(``LinearFormat.segment_cast``: each row's expert by ``searchsorted``, per-expert
amaxes by segment reductions), bit for bit the per-expert casts; each GEMM is one
launch for all the experts, and nothing reads a tensor's value on the host. ``Codes``
is the layout ``mixprec.formats.mm.QuantizedGemm`` runs it in.

The layouts are the ones torch's CUDA kernel takes for any routing
(``aten/src/ATen/native/cuda/GroupMMCommon.cuh``): forward and dgrad pass the tokens
row-major (2-D) against the experts' 3-D weights, where a group may start on any row;
wgrad passes the gradient's transpose column-major (``g.t()`` of the (tokens, N)
gradient, as torch's own backward does) against the row-major tokens, so each expert's
first token moves the operands by whole rows of N and K elements, 16-byte aligned for
any count, and an expert without tokens is an empty group. A row-major (N, tokens)
gradient would move by single elements: the kernel asserts unless every count but the
last is a multiple of 8.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.experts import adapter
from mixprec.experts.format import ExpertsFormat
from mixprec.experts.gather_casts import ExpertsCasts
from mixprec.experts.scaled_grouped import scaled_grouped_forward
from mixprec.formats.mm import GemmLayout
from mixprec.formats.quantized import Quantized
from mixprec.formats.segments import Segments

__all__ = ["bf16_only", "codes_apply", "Codes"]

_BF16 = torch.bfloat16


def bf16_only(device: torch.device) -> bool:
    """Whether ``torch._grouped_mm`` on ``device`` takes bf16 operands only (every
    device but the CPU, whose kernel takes fp32 too)."""
    return torch.device(device).type != "cpu"


def codes_apply(fmt: ExpertsFormat) -> bool:
    """Whether ``fmt``'s scales factor out of each GEMM (per-tensor and rowwise fp8)."""
    kernel = fmt.quantizer.kernel  # a KernelSpec (mixprec.formats.padding); int8: None
    return kernel is not None and kernel.scales == "tensor"


def _per_row(inv: torch.Tensor, ids: torch.Tensor, cols: int) -> torch.Tensor:
    """The weights' inverse scales (E × ...) as one row of ``cols`` per token (its
    expert's; 1 past the last expert's)."""
    e = inv.shape[0]
    inv = inv.reshape(e, -1).expand(e, cols)
    return torch.cat([inv, inv.new_ones(1, cols)])[ids]


def _experts_only(y: torch.Tensor, ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Rows past the last expert's (the kernel leaves them unwritten) set to zero."""
    return torch.where((ids < n_experts).unsqueeze(1), y, 0)


def _rows_mm(a, a_inv, b, b_inv, offs, ids) -> torch.Tensor:
    """Each expert's rows of the codes ``a`` (T × K) times its codes ``b`` (E × K × N)
    in bf16, then each element times its row's and column's inverse scales (fp32,
    their product first, as the ``dequant`` route): (T × N) fp32."""
    y = torch._grouped_mm(a.to(_BF16), b.to(_BF16), offs=offs)
    return _experts_only(y.float() * (a_inv * _per_row(b_inv, ids, b.shape[2])), ids,
                         b.shape[0])


class Codes(GemmLayout):
    """The experts' GEMMs on bf16 codes, the scales after each GEMM (``scaled``: the
    forward on torch's fp8 grouped kernel); ``site``: the ``ExpertsFormat``."""

    def __init__(self, site: ExpertsFormat, scaled: bool, seg: Segments | None = None
                 ) -> None:
        super().__init__(site)
        self.scaled, self.seg = scaled, seg

    def bind(self, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> Codes:
        """Each row's expert and which experts have rows, on the device."""
        seg = Segments.of(offsets, x.shape[0])
        seg.has_rows  # noqa: B018 (made now: the backward's wgrad reads it)
        return Codes(self.site, self.scaled, seg)

    def saved(self) -> tuple[object, list[torch.Tensor]]:
        """The counts, the row ids and which experts have rows."""
        return self.seg.saved()

    def restore(self, meta: object, tensors: list[torch.Tensor]) -> Codes:
        """The segments the forward read."""
        return Codes(self.site, self.scaled, Segments.saved_again(meta, tensors))

    def grad_keys(self, gy: torch.Tensor) -> tuple[object, object]:
        """Round to nearest (the formats here have no stochastic rounding)."""
        return None, None

    def keep(self, cast: object) -> object:
        """A token cast without its rows' inverse scales (wgrad reads the groups')."""
        if not isinstance(cast, tuple):
            return cast
        q, groups = cast
        return q.like((q.data, None, q.outer)), groups

    def cast_x(self, t: torch.Tensor, role: str, dim: int, record: bool = False,
               key: Any = None) -> Any:
        """The tokens (or the gradient) cast whole by the format."""
        return self.fmt.segment_cast(t, role, dim, self.seg, self.site.scaling_state(),
                                     record, key)

    def cast_w(self, w: torch.Tensor, dim: int, record: bool = False) -> Any:
        """The experts' weights cast per expert along ``dim`` (1: K, forward; 0: N,
        dgrad): codes (E × N × K) and inverse scales (E × 1 × 1, E × N × 1 or
        E × 1 × K); a weight gathered as each expert's casts, stacked."""
        if isinstance(w, ExpertsCasts) and not self.fmt.per_tensor:
            casts = [adapter.cast(self.site, w[i], "weight", dim) for i in range(w.shape[0])]
            return Quantized(torch.stack([c.codes for c in casts]),
                             torch.stack([c.inv for c in casts]))
        return self.fmt.segment_weights(w, dim, self.seg, self.site.scaling_state(), record)

    def forward_mm(self, xq: Any, wq: Any, out_dtype: torch.dtype) -> torch.Tensor:
        """Each expert's rows times its weight's transpose."""
        xc, xi, _ = self.fmt.segment_codes(xq)
        wc, wi, seg = wq.data, wq.scale_inv, self.seg
        e = wc.shape[0]
        if self.scaled:
            cols = wi.reshape(e, -1).expand(e, wc.shape[1]).contiguous()
            y = _experts_only(scaled_grouped_forward(xc, xi.reshape(-1), wc, cols, seg.offs),
                              seg.ids, e)
        else:
            y = _rows_mm(xc, xi, wc.transpose(1, 2), wi.transpose(1, 2), seg.offs, seg.ids)
        return y.to(out_dtype)

    def dgrad_mm(self, g: Any, wd: Any, x_dtype: torch.dtype) -> torch.Tensor:
        """Each expert's gradient rows times its weight."""
        gc, gi, _ = self.fmt.segment_codes(g)
        return _rows_mm(gc, gi, wd.data, wd.scale_inv, self.seg.offs,
                        self.seg.ids).to(x_dtype)

    def wgrad_mm(self, g: Any, xw: Any, w_dtype: torch.dtype) -> torch.Tensor:
        """The gradient's transpose, column-major (an expert's first token moves it by
        whole columns of N elements: the module doc), times the tokens, then each
        (expert, row, column)'s inverse scales."""
        gc, _, g_groups = self.fmt.segment_codes(g)
        xc, _, x_groups = self.fmt.segment_codes(xw)
        seg, e = self.seg, self.seg.experts
        scales = g_groups[:e].reshape(e, -1, 1) * x_groups[:e].reshape(e, 1, -1)
        dw = torch._grouped_mm(gc.to(_BF16).t(), xc.to(_BF16), offs=seg.offs)
        return torch.where(seg.has_rows.view(-1, 1, 1), dw.float() * scales, 0).to(w_dtype)
