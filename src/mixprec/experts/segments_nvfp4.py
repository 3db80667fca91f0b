"""The grouped route without a host read, for NVFP4 (``nvfp4``).

An NVFP4 cast of an expert's slice has one fp32 descale for the slice (from its amax)
and e4m3 scales per 16 elements along the contracted dim. The forward's input and
dgrad's gradient take their blocks along the hidden dims, one row at a time, so each
is cast whole, with each row's descale from its expert's amax (a segment reduction,
``scatter_reduce`` ``amax`` over the row ids; the rows past ``offsets[-1]`` reduce into
a slot of their own), passed to ``cast_nvfp4`` as the amax. The weights are cast per
expert (the experts' number is known without reading a tensor). wgrad contracts over
the tokens: its 16-token blocks, and the random Hadamard transform over 16 tokens that
precedes them, start at each expert's first token, as the per-expert casts (zero
padded to 16 tokens) have them. Each expert's rows are copied, on the device, into a
buffer of a fixed ``T + (E + 1)·15`` rows where every expert starts on a multiple of
16 (``segments_blocks.tile_aligned_rows``), the buffer is transformed and cast along
the tokens with each block's descale from its expert's amax, and the experts' padded
rows are multiplied as the host-read path stacks them (without the transform, the
rows are gathered back in place).

Stochastic rounding draws the gradient's numbers from the counter stream of this
backward's key (``ExpertsFormat._sr_key``) by place, not by call: dgrad's cast takes
number ``row · N + col`` (the row in the gradient), wgrad's ``T·N + row · N + col``
(the row in the 16-aligned layout), as the host-read ``grouped`` path's per-expert
casts draw them (``stream_keys`` gives them their offsets). So every element meets
the scale, transform, clamp and rounding (random number included) that the host-read
path's cast of its expert's slice gives it, and the values multiplied by
``grouped_mm_fp32`` are bit for bit those. Nothing reads a tensor's value on the host,
so ``torch.compile`` traces it as one graph.
"""

from __future__ import annotations

import torch

from mixprec.experts import adapter
from mixprec.experts.format import ExpertsFormat
from mixprec.experts.segments import expert_rows, rows_product, wgrad_product
from mixprec.experts.segments_blocks import _spread, tile_aligned_rows, weight_casts
from mixprec.fp8.formats.nvfp4 import NVFP4Scaling
from mixprec.fp8.nvfp4 import NVFP4_BLOCK, apply_hadamard, cast_nvfp4, counter_key, hadamard_16

__all__ = ["segmented_nvfp4_mm", "nvfp4_applies", "stream_keys"]


def nvfp4_applies(fmt: ExpertsFormat) -> bool:
    """Whether ``fmt`` is NVFP4 (this module's route)."""
    return isinstance(fmt.quantizer, NVFP4Scaling)


def stream_keys(key: torch.Tensor | torch.Generator | None, bounds: list[tuple[int, int]],
                t: int, n: int) -> tuple[list, list]:
    """Each expert's keys (dgrad's cast, wgrad's) in the counter stream of ``key`` for
    a (``t`` × ``n``) gradient: dgrad's from its first row, wgrad's from ``t`` rows on
    plus its first row in the 16-aligned layout. A generator (drawn from in turn) or
    None (no stochastic rounding) serves every cast as it is."""
    if not isinstance(key, torch.Tensor):
        return [key] * len(bounds), [key] * len(bounds)
    dgrad, wgrad, start = [], [], 0
    for s, end in bounds:
        dgrad.append(counter_key(key, s * n))
        wgrad.append(counter_key(key, (t + start) * n))
        start += -(-(end - s) // NVFP4_BLOCK) * NVFP4_BLOCK
    return dgrad, wgrad


def _rows_cast(t, ids, n_groups, key):
    """``t`` (rows × cols) in NVFP4 along the cols, each row's descale from its group's
    amax (``ids``: each row's group of ``n_groups``), rounded with ``key``."""
    amax = t.detach().float().abs().amax(dim=1)
    seg = amax.new_zeros(n_groups).scatter_reduce(0, ids, amax, "amax", include_self=True)
    return cast_nvfp4(t, 1, generator=key, amax=seg[ids].unsqueeze(1))


def _tokens_cast(fmt, buf, ids, n_groups, key):
    """The 16-aligned ``buf`` (rows × cols, transformed first under ``nvfp4_rht``) in
    NVFP4 along the rows, each 16-row block's descale from its group's amax (``ids``:
    the group of each block's first row), rounded with ``key``."""
    if fmt.quantizer.nvfp4_rht:
        buf = apply_hadamard(buf, hadamard_16(0, buf.device))
    buf = buf.float()
    rows = buf.shape[0] + (-buf.shape[0]) % NVFP4_BLOCK
    blocks = torch.nn.functional.pad(buf, (0, 0, 0, rows - buf.shape[0]))
    amax = blocks.detach().abs().view(-1, NVFP4_BLOCK * buf.shape[1]).amax(dim=1)
    seg = amax.new_zeros(n_groups).scatter_reduce(0, ids, amax, "amax", include_self=True)
    return cast_nvfp4(buf, 0, generator=key, amax=seg[ids].unsqueeze(1))


def _layout(offs: torch.Tensor, t: int):
    """The 16-aligned wgrad layout: each row's place, the buffer's rows, each expert's
    padded end (E,) and each 16-row block's group (E: past the last expert)."""
    dest, bound = tile_aligned_rows(offs, t, NVFP4_BLOCK)
    counts = torch.diff(offs.long(), prepend=offs.new_zeros(1).long())
    ends = torch.cumsum((counts + NVFP4_BLOCK - 1) // NVFP4_BLOCK * NVFP4_BLOCK, 0)
    firsts = torch.arange(0, bound, NVFP4_BLOCK, device=offs.device)
    return dest, bound, ends.to(torch.int32), torch.searchsorted(ends, firsts, right=True)


class _SegmentedNVFP4MM(torch.autograd.Function):
    """The grouped GEMM and its backward on per-expert NVFP4 casts, on the device."""

    @staticmethod
    def forward(ctx, x, w, offsets, fmt, out_dtype):
        t, e = x.shape[0], w.shape[0]
        offs, ids = expert_rows(offsets, t)
        need_dx, need_dw = ctx.needs_input_grad[:2]
        layout = _layout(offs, t) if need_dw else (None, 0, None, None)
        with adapter.no_autocast(x), fmt.quantizer.gemm_context():
            xv = _rows_cast(x, ids, e + 1, None).dequant()
            wq, wd = weight_casts(fmt, w, need_dx)
            y = rows_product(xv, torch.stack([c.dequant().t() for c in wq]), offs, ids,
                             out_dtype)
            xw = [] if not need_dw else [
                _tokens_cast(fmt, _spread(x, layout[0], layout[1]), layout[3], e + 1, None)]
        tensors, ctx.casts = adapter.pack(wd + xw)
        ctx.save_for_backward(*tensors, offs, ids, layout[0], layout[2], layout[3])
        ctx.fmt, ctx.n_experts, ctx.bound = fmt, e, layout[1]
        ctx.x_dtype, ctx.w_dtype = x.dtype, w.dtype
        return y

    @staticmethod
    def backward(ctx, gy):
        *saved, offs, ids, dest, ends, block_ids = ctx.saved_tensors
        casts = adapter.unpack(saved, ctx.casts)
        fmt, e = ctx.fmt, ctx.n_experts
        t, n = gy.shape
        key = fmt._sr_key(gy.device)
        dx = dw = None
        with adapter.no_autocast(gy), fmt.quantizer.gemm_context():
            if ctx.needs_input_grad[0]:
                gd = _rows_cast(gy, ids, e + 1, key).dequant()
                dx = rows_product(gd, torch.stack([c.dequant() for c in casts[:e]]), offs,
                                  ids, ctx.x_dtype)
            if ctx.needs_input_grad[1]:
                wkey = None if key is None else counter_key(key, t * n)
                g = _tokens_cast(fmt, _spread(gy, dest, ctx.bound), block_ids, e + 1, wkey)
                gv, xv = g.dequant(), casts[-1].dequant()
                if fmt.quantizer.nvfp4_rht:  # the transform's padded rows are multiplied
                    dw = wgrad_product(gv, xv, ends, ctx.w_dtype)
                else:
                    dw = wgrad_product(gv[dest], xv[dest], offs, ctx.w_dtype)
        return dx, dw, None, None, None


def segmented_nvfp4_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
                       fmt: ExpertsFormat, out_dtype: torch.dtype) -> torch.Tensor:
    """``grouped_mm``'s ``grouped`` route for NVFP4 ``fmt`` (see the module doc)."""
    return _SegmentedNVFP4MM.apply(x, w, offsets, fmt, out_dtype)
