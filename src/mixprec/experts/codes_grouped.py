"""The ``grouped`` and ``scaled_grouped`` routes where ``torch._grouped_mm`` takes bf16
only (CUDA), without a host read.

torch's CUDA grouped GEMM (and its meta kernel, which mirrors it) takes bf16 operands
with 16-byte strides and writes bf16. The per-tensor and rowwise formats (``fp8``,
``fp8-current``, ``fp8-rowwise``) scale whole rows and columns of each GEMM, so their
scales factor out of the sum: the fp8 codes, widened to bf16 (exact: every e4m3 and
e5m2 value is a bf16 value), go to the kernel, which accumulates in fp32 and rounds
once to bf16, and each output element is then multiplied in fp32 by its row's and
column's inverse scales, as the ``dequant`` GEMM route does
(``mixprec.fp8.gemm.fp8_gemm``). On ``scaled_grouped`` the forward's e4m3 codes and
their scales go to ``torch._scaled_grouped_mm`` instead (``mixprec.experts.scaled_grouped``).

Every cast is taken on the device from the cumulative counts (``segments``,
``segments_rowwise``: each row's expert by ``searchsorted``, per-expert amaxes by
segment reductions), bit for bit the per-expert casts; each GEMM is one launch for
all the experts, and nothing reads a tensor's value on the host.

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

import torch

from mixprec.experts import adapter
from mixprec.experts.format import ExpertsFormat
from mixprec.experts.gather_casts import ExpertsCasts
from mixprec.experts.scaled_grouped import scaled_grouped_forward
from mixprec.experts.segments import _weights_cast, expert_rows, expert_scales
from mixprec.experts.segments_rowwise import _amax, _cast, _columns_cast

__all__ = ["bf16_only", "codes_apply", "codes_grouped_mm"]

_BF16 = torch.bfloat16


def bf16_only(device: torch.device) -> bool:
    """Whether ``torch._grouped_mm`` on ``device`` takes bf16 operands only (every
    device but the CPU, whose kernel takes fp32 too)."""
    return torch.device(device).type != "cpu"


def codes_apply(fmt: ExpertsFormat) -> bool:
    """Whether ``fmt``'s scales factor out of each GEMM (per-tensor and rowwise fp8)."""
    kernel = fmt.quantizer.kernel  # a KernelSpec (mixprec.fp8.padding); int8: None
    return kernel is not None and kernel.scales == "tensor"


def _tokens(fmt, t, ids, e, role, record):
    """The tokens ``t`` cast along their hidden dim (one scale per expert, or per row):
    codes, each row's inverse scale (T × 1) and, per tensor, each expert's ((E + 1),
    the last for the rows past the last expert's; rowwise: None)."""
    if not fmt.quantizer.per_tensor:
        return (*_cast(fmt, t, _amax(t, 1), role), None)
    scales = expert_scales(fmt, t, ids, e, role, record)
    rows = scales[ids].unsqueeze(1)
    return (adapter.cast_scaled(fmt, t, rows, role), torch.reciprocal(rows),
            torch.reciprocal(scales))


def _weights(fmt, w, has_rows, dim: int, record: bool):
    """The experts' weights cast per expert along ``dim`` (1: K, forward; 0: N, dgrad):
    codes (E × N × K) and inverse scales (E × 1 × 1, E × N × 1 or E × 1 × K)."""
    if fmt.quantizer.per_tensor:
        return _weights_cast(fmt, w, has_rows, "weight", record)
    if isinstance(w, ExpertsCasts):  # each expert's casts, gathered: stacked
        casts = [adapter.cast(fmt, w[i], "weight", dim) for i in range(w.shape[0])]
        return torch.stack([c.codes for c in casts]), torch.stack([c.inv for c in casts])
    return _cast(fmt, w, _amax(w, 2 if dim == 1 else 1), "weight")


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


class _CodesGroupedMM(torch.autograd.Function):
    """The grouped GEMM and its backward on bf16 codes, scales after each GEMM."""

    @staticmethod
    def forward(ctx, x, w, offsets, fmt, out_dtype, record, scaled):
        t, e = x.shape[0], w.shape[0]
        offs, ids = expert_rows(offsets, t)
        has_rows = torch.diff(offs, prepend=offs.new_zeros(1)) > 0
        need_dx, need_dw = ctx.needs_input_grad[:2]
        per_tensor = fmt.quantizer.per_tensor
        with adapter.no_autocast(x):
            xc, xi, x_experts = _tokens(fmt, x, ids, e, "input", record)
            wc, wi = _weights(fmt, w, has_rows, 1, record)
            if scaled:
                cols = wi.reshape(e, -1).expand(e, w.shape[1]).contiguous()
                y = _experts_only(scaled_grouped_forward(xc, xi.reshape(-1), wc, cols, offs),
                                  ids, e)
            else:
                y = _rows_mm(xc, xi, wc.transpose(1, 2), wi.transpose(1, 2), offs, ids)
            y = y.to(out_dtype)
            wd = (None, None)
            if need_dx:  # per tensor: the forward's cast serves (one scale per expert)
                wd = (wc, wi) if per_tensor else _weights(fmt, w, has_rows, 0, False)
            xw = (None, None)
            if need_dw:
                xw = ((xc, x_experts[:e]) if per_tensor
                      else _columns_cast(fmt, x, ids, e, "input"))
        ctx.save_for_backward(*wd, *xw, offs, ids, has_rows)
        ctx.fmt, ctx.x_dtype, ctx.w_dtype = fmt, x.dtype, w.dtype
        return y

    @staticmethod
    def backward(ctx, gy):
        wc, wi, xc, xi, offs, ids, has_rows = ctx.saved_tensors
        fmt, e = ctx.fmt, has_rows.shape[0]
        per_tensor = fmt.quantizer.per_tensor
        dx = dw = None
        with adapter.no_autocast(gy):
            if per_tensor or ctx.needs_input_grad[0]:
                gc, gi, g_experts = _tokens(fmt, gy, ids, e, "grad_output", True)
            if ctx.needs_input_grad[0]:
                dx = _rows_mm(gc, gi, wc, wi, offs, ids).to(ctx.x_dtype)
            if ctx.needs_input_grad[1]:
                if per_tensor:  # one scale per expert: the dgrad cast serves
                    scales = (g_experts[:e] * xi).view(e, 1, 1)
                else:  # along the tokens: one scale per (expert, column)
                    gc, g_cols = _columns_cast(fmt, gy, ids, e, "grad_output")
                    scales = g_cols[:e].unsqueeze(2) * xi[:e].unsqueeze(1)
                # the gradient's transpose, column-major: an expert's first token moves
                # it by whole columns of N elements (module doc)
                dw = torch._grouped_mm(gc.to(_BF16).t(), xc.to(_BF16), offs=offs)
                dw = torch.where(has_rows.view(-1, 1, 1), dw.float() * scales, 0)
                dw = dw.to(ctx.w_dtype)
        return dx, dw, None, None, None, None, None


def codes_grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
                     fmt: ExpertsFormat, out_dtype: torch.dtype, record: bool,
                     scaled: bool = False) -> torch.Tensor:
    """``grouped_mm``'s ``grouped`` route (``scaled``: ``scaled_grouped``, the forward on
    torch's fp8 grouped kernel) on a device whose grouped kernel takes bf16 only, for
    a format ``codes_apply`` accepts (see the module doc)."""
    return _CodesGroupedMM.apply(x, w, offsets, fmt, out_dtype, record, scaled)
