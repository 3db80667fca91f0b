"""The grouped route without a host read, for INT8 rowwise (``int8-rowwise``).

Every int8 cast scales one slice along its GEMM's contracted dim, and none of those
slices crosses an expert's rows: the forward's input and dgrad's gradient take a scale
per token, the weights one per output channel (forward) or per input channel (dgrad)
of each expert. So each operand is cast whole: the tokens as they come, the E × N × K
weights as one (E·N) × K tensor (a row per output channel) or one N × (E·K) tensor (a
column per input channel). Each element meets the scale and rounding that the
host-read path's cast of its expert's slice gives it, so the dequantized values that
``grouped_mm_fp32`` multiplies are bit for bit those. wgrad stays in the gradient's
16-bit dtype (the format leaves it out of its quantized GEMMs): the gradient times
the input saved in the output's dtype, on the same grouped kernel as the host-read
path (``segments.wgrad_product``). Nothing reads a tensor's value on the host, so
``torch.compile`` traces it as one graph.
"""

from __future__ import annotations

import torch

from mixprec.experts import adapter
from mixprec.experts.format import ExpertsFormat
from mixprec.experts.segments import expert_rows, rows_product, wgrad_product
from mixprec.fp8.formats.int8 import Int8Rowwise

__all__ = ["segmented_int8_mm", "int8_applies"]


def int8_applies(fmt: ExpertsFormat) -> bool:
    """Whether ``fmt`` is INT8 rowwise (this module's route)."""
    return isinstance(fmt.quantizer, Int8Rowwise)


def _weights(fmt: ExpertsFormat, w: torch.Tensor, dim: int):
    """The E × N × K weights cast per expert along ``dim`` of each (1: K, per output
    channel; 0: N, per input channel), as one 2-D cast."""
    e, n, k = w.shape
    if dim == 1:
        return adapter.cast(fmt, w.reshape(e * n, k), "weight", 1)
    return adapter.cast(fmt, w.transpose(0, 1).reshape(n, e * k), "weight", 0)


def _weight_values(c, e: int, n: int, k: int, dim: int) -> torch.Tensor:
    """``_weights``' cast dequantized back to E × N × K (fp32)."""
    v = c.dequant()
    return v.view(e, n, k) if dim == 1 else v.view(n, e, k).transpose(0, 1)


class _SegmentedInt8MM(torch.autograd.Function):
    """The grouped GEMM and its backward on per-expert int8 casts, on the device."""

    @staticmethod
    def forward(ctx, x, w, offsets, fmt, out_dtype):
        t, (e, n, k) = x.shape[0], w.shape
        offs, ids = expert_rows(offsets, t)
        need_dx, need_dw = ctx.needs_input_grad[:2]
        with adapter.no_autocast(x), fmt.quantizer.gemm_context():
            xv = adapter.cast(fmt, x, "input", 1).dequant()
            wv = _weight_values(_weights(fmt, w, 1), e, n, k, 1)
            y = rows_product(xv, wv.transpose(1, 2).contiguous(), offs, ids, out_dtype)
            wd = [_weights(fmt, w, 0)] if need_dx else []
        tensors, ctx.casts = adapter.pack(wd)
        # wgrad's operand in the output's dtype (bf16 under autocast), as a Linear saves it
        ctx.save_for_backward(*tensors, x.to(out_dtype) if need_dw else None, offs, ids)
        ctx.fmt, ctx.shape, ctx.x_dtype, ctx.w_dtype = fmt, (e, n, k), x.dtype, w.dtype
        return y

    @staticmethod
    def backward(ctx, gy):
        *saved, x_hp, offs, ids = ctx.saved_tensors
        casts = adapter.unpack(saved, ctx.casts)
        fmt = ctx.fmt
        dx = dw = None
        with adapter.no_autocast(gy), fmt.quantizer.gemm_context():
            if ctx.needs_input_grad[0]:
                gd = adapter.cast(fmt, gy, "grad_output", 1, True).dequant()
                wd = _weight_values(casts[0], *ctx.shape, 0)
                dx = rows_product(gd, wd.contiguous(), offs, ids, ctx.x_dtype)
            if ctx.needs_input_grad[1]:  # in the gradient's 16 bits
                dw = wgrad_product(gy, x_hp.to(gy.dtype), offs, ctx.w_dtype)
        return dx, dw, None, None, None


def segmented_int8_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
                      fmt: ExpertsFormat, out_dtype: torch.dtype) -> torch.Tensor:
    """``grouped_mm``'s ``grouped`` route for INT8 rowwise ``fmt`` (see the module doc)."""
    return _SegmentedInt8MM.apply(x, w, offsets, fmt, out_dtype)
