"""SDPA's backward in fp32 on the CPU (opt-in: ``keep_fp32=...+attention_backward``).

torch's CPU flash-attention kernel (``aten._scaled_dot_product_flash_attention_for_cpu``),
run in bf16/fp16, accumulates dQ, dK and dV in buffers of that format, block by block
(``mixprec.engine.emulate_attention`` models it). Its fp32 instance accumulates in fp32. Upcasting
bf16 inputs to fp32 is exact, so running the backward in fp32 and rounding dQ, dK and dV
once gives gradients as close as the format allows. Relative error against float64, for
dQ / dK / dV of a causal head dim of 64, where rounding float64 to bf16 gives 1.7e-3:

| T | bf16 kernel | fp32 backward |
|---|---|---|
| 256 | 2.6e-3 / 3.5e-3 / 3.4e-3 | 1.9e-3 / 1.9e-3 / 1.7e-3 |
| 4096 | 2.8e-3 / 6.4e-3 / 6.4e-3 | 1.8e-3 / 1.8e-3 / 1.7e-3 |

It costs time: 1.1–1.5x the bf16 kernel's backward on this project's CPU (interleaved
medians, T = 256 to 4096), so it is not on by default. CUDA's flash kernels accumulate in
fp32 already; there the option does nothing.

The forward pass is the same kernel SDPA would run in the compute dtype, with the same
output and the same saved tensors. Only the plain case is taken: no mask, no dropout,
equal head counts and head dims, flash attention enabled
(``torch.backends.cuda.flash_sdp_enabled()``, which governs the CPU kernel too). Every
other call goes to ``F.scaled_dot_product_attention`` as usual.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from mixprec.engine.emulate import leave_low_precision

__all__ = ["ROUTED", "NOT_TAKEN", "route_attention"]

#: returned by ``route_attention`` for a call it leaves to SDPA
NOT_TAKEN = object()

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default

#: the function this module takes over
ROUTED = F.scaled_dot_product_attention


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, is_causal, scale, dtype):
        qc, kc, vc = (t.to(dtype) for t in (q, k, v))  # what autocast gives SDPA
        with torch.autocast("cpu", enabled=False):
            out, lse = _FWD(qc, kc, vc, 0.0, is_causal, scale=scale)
        ctx.save_for_backward(qc, kc, vc, out, lse)
        ctx.is_causal, ctx.scale, ctx.dtype = is_causal, scale, dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        qc, kc, vc, out, lse = ctx.saved_tensors
        # exact upcasts (under emulation: real fp32 copies, so the fp32 kernel runs)
        up = [leave_low_precision(t) for t in (grad_out, qc, kc, vc, out)]
        with torch.autocast("cpu", enabled=False):
            grads = _BWD(*up, lse, 0.0, ctx.is_causal, scale=ctx.scale)
        # rounded once, to the compute dtype (under emulation: onto its grid, in fp32)
        return (*(g.to(ctx.dtype) for g in grads), None, None, None)


_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
          "enable_gqa")


def route_attention(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run an SDPA call through the fp32 backward, or return ``NOT_TAKEN``.

    The caller checks that autocast is on for the CPU with a 16-bit dtype."""
    got = {n: (args[i] if i < len(args) else kwargs.get(n)) for i, n in enumerate(_NAMES)}
    q, k, v = got["query"], got["key"], got["value"]
    dtype = torch.get_autocast_dtype("cpu")
    if not (torch.is_grad_enabled() and torch.backends.cuda.flash_sdp_enabled()
            and dtype in (torch.bfloat16, torch.float16)
            and all(isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() == 4
                    and t.device.type == "cpu" for t in (q, k, v))
            and got["attn_mask"] is None and not got["dropout_p"] and not got["enable_gqa"]
            and q.shape[1] == k.shape[1] == v.shape[1]
            and q.shape[-1] == k.shape[-1] == v.shape[-1]
            and any(t.requires_grad for t in (q, k, v))):
        return NOT_TAKEN
    return _Attention.apply(q, k, v, bool(got["is_causal"]), got["scale"], dtype)
