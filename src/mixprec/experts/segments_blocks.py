"""The grouped route without a host read, for the tile-scaled fp8 formats (``fp8-block``,
``mxfp8``).

The forward's and dgrad's token casts take their tiles along the hidden dims, one row
at a time, so the whole operand is cast at once; the weights are cast per expert (the
experts' number is known without reading a tensor). wgrad contracts over the tokens,
and its tiles (128 tokens for ``fp8-block``, 32 for ``mxfp8``) start at each expert's
first token: each expert's rows are copied, on the device, into a buffer of a fixed
``T + (E + 1)·(tile − 1)`` rows where every expert starts on a whole tile (its tail
padded with zeros, as a cast of its slice pads it), the buffer is cast along the
tokens, and the dequantized rows are gathered back in place. Every element meets the
scale, clamp and rounding that the host-read path's cast of its expert's slice gives
it, so the values multiplied by ``grouped_mm_fp32`` are bit for bit those. Nothing
reads a tensor's value on the host, so ``torch.compile`` traces it as one graph.
"""

from __future__ import annotations

import torch

from mixprec.experts import adapter
from mixprec.experts.format import ExpertsFormat
from mixprec.experts.segments import expert_rows, rows_product, segment_ids, wgrad_product
from mixprec.fp8.formats import BlockScaling, MXScaling

__all__ = ["segmented_blocks_mm", "blocks_apply", "tile_aligned_rows", "weight_casts"]


def blocks_apply(fmt: ExpertsFormat) -> bool:
    """Whether ``fmt`` is ``fp8-block`` or MX fp8 with every GEMM quantized."""
    q = fmt.quantizer
    return isinstance(q, (BlockScaling, MXScaling)) and "wgrad" in q.quantized_gemms


def tile_aligned_rows(offsets: torch.Tensor, rows: int, tile: int
                      ) -> tuple[torch.Tensor, int]:
    """Where each of ``rows`` rows goes in a layout where every expert (and the rows
    past ``offsets[-1]``, a group of their own) starts on a multiple of ``tile``, on the
    device, and that layout's fixed number of rows."""
    ends = torch.cat([offsets.long(), offsets.new_full((1,), rows).long()])
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (counts + tile - 1) // tile * tile
    shift = (torch.cumsum(padded, 0) - padded) - (ends - counts)  # new start - old start
    dest = torch.arange(rows, device=offsets.device) + shift[segment_ids(offsets, rows)]
    return dest, rows + ends.numel() * (tile - 1)


def _spread(t: torch.Tensor, dest: torch.Tensor, bound: int) -> torch.Tensor:
    return t.new_zeros(bound, t.shape[1]).index_copy(0, dest, t)


def weight_casts(fmt: ExpertsFormat, w: torch.Tensor, need_dx: bool
                 ) -> tuple[list, list]:
    """Each expert's weight cast for the forward (along K) and, where dgrad runs, for
    dgrad (the forward's where the format reuses it, else along N)."""
    wq = [adapter.cast(fmt, w[i], "weight", 1) for i in range(w.shape[0])]
    wd = [] if not need_dx else wq if adapter.reuses(fmt, "weight") else [
        adapter.cast(fmt, w[i], "weight", 0) for i in range(w.shape[0])]
    return wq, wd


class _SegmentedBlocksMM(torch.autograd.Function):
    """The grouped GEMM and its backward on per-expert tile casts, on the device."""

    @staticmethod
    def forward(ctx, x, w, offsets, fmt, out_dtype):
        t, e = x.shape[0], w.shape[0]
        offs, ids = expert_rows(offsets, t)
        need_dx, need_dw = ctx.needs_input_grad[:2]
        dest, bound = tile_aligned_rows(offs, t, fmt.quantizer.tile) if need_dw else (None, 0)
        with adapter.no_autocast(x), fmt.quantizer.gemm_context():
            xv = adapter.cast(fmt, x, "input", 1).dequant()
            wq, wd = weight_casts(fmt, w, need_dx)
            y = rows_product(xv, torch.stack([c.dequant().t() for c in wq]), offs, ids,
                             out_dtype)
            xw = [adapter.cast(fmt, _spread(x, dest, bound), "input", 0)] if need_dw else []
        tensors, ctx.casts = adapter.pack(wd + xw)
        ctx.save_for_backward(*tensors, offs, ids, dest)
        ctx.fmt, ctx.n_experts, ctx.bound = fmt, e, bound
        ctx.x_dtype, ctx.w_dtype = x.dtype, w.dtype
        return y

    @staticmethod
    def backward(ctx, gy):
        *saved, offs, ids, dest = ctx.saved_tensors
        casts = adapter.unpack(saved, ctx.casts)
        fmt, e = ctx.fmt, ctx.n_experts
        dx = dw = None
        with adapter.no_autocast(gy), fmt.quantizer.gemm_context():
            if ctx.needs_input_grad[0]:
                gd = adapter.cast(fmt, gy, "grad_output", 1, True).dequant()
                wd = torch.stack([c.dequant() for c in casts[:e]])
                dx = rows_product(gd, wd, offs, ids, ctx.x_dtype)
            if ctx.needs_input_grad[1]:
                g0 = adapter.cast(fmt, _spread(gy, dest, ctx.bound), "grad_output", 0, True)
                dw = wgrad_product(g0.dequant()[dest], casts[-1].dequant()[dest], offs,
                                   ctx.w_dtype)
        return dx, dw, None, None, None


def segmented_blocks_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
                        fmt: ExpertsFormat, out_dtype: torch.dtype) -> torch.Tensor:
    """``grouped_mm``'s ``grouped`` route for ``fp8-block`` and MX fp8 (module doc)."""
    return _SegmentedBlocksMM.apply(x, w, offsets, fmt, out_dtype)
