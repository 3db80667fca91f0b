"""The grouped route without a host read, for rowwise fp8 (``fp8-rowwise``).

A rowwise cast scales each slice along the GEMM's contracted dim on its own, so most of
an expert's casts do not depend on where its rows end: the forward's input (a scale per
token) and weight (per output channel of each expert), dgrad's gradient (per token) and
weight (per input channel of each expert: an amax over the output dim of the E × N × K
weights) are cast whole. wgrad contracts over the tokens, so its casts of the gradient
and of the input take one scale per (expert, column): each column's amax over the
expert's rows is a segment reduction (``scatter_reduce`` ``amax`` over the row ids of
``segment_ids``; rows past ``offsets[-1]`` reduce into a slot of their own), gathered
back per row. Every element meets the scale, clamp and rounding that the host-read
path's cast of its expert's slice gives it, so the codes and scales are bit for bit
those, and the dequantized values go to ``grouped_mm_fp32`` as ``grouped`` passes
them. Nothing reads a tensor's value on the host, so ``torch.compile`` traces it as one
graph.
"""

from __future__ import annotations

import torch

from mixprec.experts import adapter
from mixprec.experts.format import ExpertsFormat
from mixprec.experts.segments import _values, expert_rows, rows_product, wgrad_product
from mixprec.fp8.formats import RowwiseScaling

__all__ = ["segmented_rowwise_mm", "rowwise_applies"]


def rowwise_applies(fmt: ExpertsFormat) -> bool:
    """Whether ``fmt`` is rowwise fp8 with every GEMM quantized (this module's route)."""
    q = fmt.quantizer
    return isinstance(q, RowwiseScaling) and "wgrad" in q.quantized_gemms


def _amax(t: torch.Tensor, dim: int) -> torch.Tensor:
    return t.detach().abs().amax(dim=dim, keepdim=True).float()


def _cast(fmt, t, amax, role):
    """``t`` cast under the rowwise scales of ``amax`` (broadcast over ``t``): the codes
    and the inverse scales."""
    scale = adapter.rowwise_scales(fmt, amax, role)
    return adapter.cast_scaled(fmt, t, scale, role), torch.reciprocal(scale)


def _columns_cast(fmt, t, ids, n_groups, role):
    """``t`` (rows × cols) cast with one scale per (expert, column): the codes and the
    inverse scales ((E + 1) × cols; row E: the rows past the last expert's)."""
    src = t.detach().abs().float()
    amax = src.new_zeros(n_groups + 1, t.shape[1]).scatter_reduce(
        0, ids.unsqueeze(1).expand_as(src), src, "amax", include_self=True)
    scale = adapter.rowwise_scales(fmt, amax, role)
    return adapter.cast_scaled(fmt, t, scale[ids], role), torch.reciprocal(scale)


class _SegmentedRowwiseMM(torch.autograd.Function):
    """The grouped GEMM and its backward on per-expert rowwise casts, on the device."""

    @staticmethod
    def forward(ctx, x, w, offsets, fmt, out_dtype):
        t, e = x.shape[0], w.shape[0]
        offs, ids = expert_rows(offsets, t)
        need_dx, need_dw = ctx.needs_input_grad[:2]
        with adapter.no_autocast(x):
            xq = _cast(fmt, x, _amax(x, 1), "input")
            wq = _cast(fmt, w, _amax(w, 2), "weight")
            y = rows_product(_values(*xq), _values(*wq).transpose(1, 2).contiguous(), offs,
                             ids, out_dtype)
            wd = _cast(fmt, w, _amax(w, 1), "weight") if need_dx else (None, None)
            xw = _columns_cast(fmt, x, ids, e, "input") if need_dw else (None, None)
        ctx.save_for_backward(*wd, *xw, offs, ids)
        ctx.fmt, ctx.n_experts, ctx.x_dtype, ctx.w_dtype = fmt, e, x.dtype, w.dtype
        return y

    @staticmethod
    def backward(ctx, gy):
        wc, wi, xc, xi, offs, ids = ctx.saved_tensors
        fmt, e = ctx.fmt, ctx.n_experts
        dx = dw = None
        with adapter.no_autocast(gy):
            if ctx.needs_input_grad[0]:
                gd = _values(*_cast(fmt, gy, _amax(gy, 1), "grad_output"))
                dx = rows_product(gd, _values(wc, wi), offs, ids, ctx.x_dtype)
            if ctx.needs_input_grad[1]:
                gc, gi = _columns_cast(fmt, gy, ids, e, "grad_output")
                dw = wgrad_product(_values(gc, gi[ids]), _values(xc, xi[ids]), offs,
                                   ctx.w_dtype)
        return dx, dw, None, None, None


def segmented_rowwise_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
                         fmt: ExpertsFormat, out_dtype: torch.dtype) -> torch.Tensor:
    """``grouped_mm``'s ``grouped`` route for rowwise ``fmt`` (see the module doc)."""
    return _SegmentedRowwiseMM.apply(x, w, offsets, fmt, out_dtype)
