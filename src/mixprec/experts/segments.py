"""The grouped route without a host read, for per-tensor formats (``fp8``, ``fp8-current``).

Each row of ``x`` (tokens sorted by expert) gets its expert's id from the cumulative
counts on the device (``searchsorted``; rows past ``offsets[-1]`` get the id E). Each
expert's per-tensor amax is a segment reduction (``scatter_reduce`` ``amax`` over the
ids), its scale the quantizer's scale of that amax, and the cast of the whole operand
multiplies each row by its expert's scale: elementwise the same products, clamps and
roundings as casting each expert's slice on its own (``grouped``'s host-read path), so
the codes and scales are bit for bit those. The dequantized casts go to
``torch._grouped_mm`` with the offsets as they are. Nothing reads a tensor's value on
the host, so ``torch.compile`` traces it as one graph.

Delayed scaling records, per role, the max over the experts that have tokens (what the
per-expert casts record one by one); an evaluation records nothing.
"""

from __future__ import annotations

import torch

from mixprec.experts import adapter
from mixprec.experts.format import ExpertsFormat
from mixprec.fp8.gather import Fp8Weight

__all__ = ["segmented_mm", "segment_ids", "expert_scales", "grouped_mm_fp32", "expert_rows",
           "rows_product", "wgrad_product"]


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


def segment_ids(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """The expert id of each of ``rows`` rows from cumulative ``offsets`` (E,), on the
    device; a row past ``offsets[-1]`` gets E."""
    pos = torch.arange(rows, device=offsets.device, dtype=offsets.dtype)
    return torch.searchsorted(offsets.contiguous(), pos, right=True)


def expert_scales(fmt: ExpertsFormat, t: torch.Tensor, ids: torch.Tensor, n_groups: int,
                  role: str, record: bool) -> torch.Tensor:
    """Each expert's per-tensor scale of ``t``'s rows (``ids``: each row's expert), then
    1 for the rows past the last expert's: (E + 1,)."""
    amax = t.detach().abs().amax(dim=1).float()
    seg = torch.zeros(n_groups + 1, device=t.device).scatter_reduce(
        0, ids, amax, "amax", include_self=True)[:n_groups]
    scale = adapter.segment_scales(fmt, seg, role, record)  # (E,)
    return torch.cat([scale, scale.new_ones(1)])


def _rows_cast(fmt, t, ids, n_groups, role, record):
    """``t`` (rows × cols) cast with its expert's per-tensor scale on each row: the codes
    and each row's inverse scale (rows × 1; rows past the last expert: 1)."""
    scale = expert_scales(fmt, t, ids, n_groups, role, record)[ids].unsqueeze(1)
    return adapter.cast_scaled(fmt, t, scale, role), torch.reciprocal(scale)


def _weights_cast(fmt, w, has_rows, role, record):
    """Each expert's weight (E × N × K) cast on its own per-tensor scale: the codes and
    the inverse scales (E × 1 × 1). An expert without tokens is cast too (it is not
    multiplied) but not recorded. A weight FSDP2 gathered as codes (``Fp8Weight``,
    ``mixprec.experts.gather``) is cast already: its codes (copied: FSDP frees them)
    and scales, its agreed amaxes recorded."""
    if isinstance(w, Fp8Weight):
        adapter.segment_scales(fmt, w._amax, role, record, mask=has_rows)
        return w._codes.clone(), torch.reciprocal(w._scale).view(-1, 1, 1)
    amax = w.detach().abs().amax(dim=(1, 2)).float()
    scale = adapter.segment_scales(fmt, amax, role, record, mask=has_rows).view(-1, 1, 1)
    return adapter.cast_scaled(fmt, w, scale, role), torch.reciprocal(scale)


def _values(codes: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """``code × inverse scale`` in fp32 (as ``Quantized.dequant``)."""
    return codes.float() * inv


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


class _SegmentedMM(torch.autograd.Function):
    """The grouped GEMM and its backward on per-expert per-tensor casts, on the device."""

    @staticmethod
    def forward(ctx, x, w, offsets, fmt, out_dtype, record):
        t, e = x.shape[0], w.shape[0]
        offs = offsets.to(torch.int32)
        ids = segment_ids(offs, t)
        counts = torch.diff(offs, prepend=offs.new_zeros(1))
        has_rows = counts > 0
        with adapter.no_autocast(x):
            xq = _rows_cast(fmt, x, ids, e, "input", record)
            wq = _weights_cast(fmt, w, has_rows, "weight", record)
            y = grouped_mm_fp32(_values(*xq), _values(*wq).transpose(1, 2).contiguous(),
                                offs)
            y = torch.where((ids < e).unsqueeze(1), y, 0).to(out_dtype)
        ctx.save_for_backward(*xq, *wq, offs, ids, has_rows)
        ctx.fmt, ctx.x_dtype, ctx.w_dtype = fmt, x.dtype, w.dtype
        return y

    @staticmethod
    def backward(ctx, gy):
        xc, xi, wc, wi, offs, ids, has_rows = ctx.saved_tensors
        fmt, e = ctx.fmt, wc.shape[0]
        dx = dw = None
        with adapter.no_autocast(gy):
            gd = _values(*_rows_cast(fmt, gy, ids, e, "grad_output", True))
            if ctx.needs_input_grad[0]:
                dx = grouped_mm_fp32(gd, _values(wc, wi), offs)
                dx = torch.where((ids < e).unsqueeze(1), dx, 0).to(ctx.x_dtype)
            if ctx.needs_input_grad[1]:
                dw = grouped_mm_fp32(_pad_rows(gd).t().contiguous(),
                                     _pad_rows(_values(xc, xi)), offs)
                dw = torch.where(has_rows.view(-1, 1, 1), dw, 0).to(ctx.w_dtype)
        return dx, dw, None, None, None, None


def segmented_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
                 fmt: ExpertsFormat,
                 out_dtype: torch.dtype, record: bool) -> torch.Tensor:
    """``grouped_mm``'s ``grouped`` route for a per-tensor ``fmt`` (see the module doc)."""
    return _SegmentedMM.apply(x, w, offsets, fmt, out_dtype, record)
