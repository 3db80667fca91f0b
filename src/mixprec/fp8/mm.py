"""The quantized GEMM: ``y = x @ wᵀ`` and its two backward GEMMs on a Linear format's
casts, as a function of (operands, format, route) that a Linear, a grouped expert GEMM
or a tensor-parallel shard can all call.

    >>> import torch
    >>> from mixprec.fp8 import quantized_mm
    >>> from mixprec.fp8.formats import CurrentScaling
    >>> x = torch.randn(8, 32, requires_grad=True)
    >>> w = torch.randn(16, 32, requires_grad=True)
    >>> y = quantized_mm(x, w, CurrentScaling(fp8_gemm="dequant_fp32"))
    >>> y.sum().backward()
    >>> y.shape, x.grad.shape, w.grad.shape
    (torch.Size([8, 16]), torch.Size([8, 32]), torch.Size([16, 32]))
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from mixprec.fp8.formats.base import LinearFormat
from mixprec.fp8.quantized import Quantized

__all__ = ["quantized_mm", "GemmSite"]


def _no_autocast(t: torch.Tensor):
    """Autocast off around the GEMMs, which pick their own dtypes (meta tensors, used to
    check the CUDA calls against torch's meta kernels, have no autocast)."""
    if t.device.type == "meta":
        return contextlib.nullcontext()
    return torch.autocast(t.device.type, enabled=False)


def _pack(casts) -> tuple[list, list]:
    """Casts (or None) as tensors to save and the metadata that rebuilds them. The
    metadata holds no tensor: every byte backward keeps goes through
    ``save_for_backward`` (and so through any saved-tensor hooks, e.g. offloading)."""
    tensors, meta = [], []
    for c in casts:
        tensors += list(c.tensors()) if c is not None else [None] * 3
        meta.append(c.like((None, None, None)) if c is not None else None)
    return tensors, meta


def _unpack(tensors, meta) -> list[Quantized | None]:
    return [c.like(tensors[3 * i:3 * i + 3]) if c is not None else None
            for i, c in enumerate(meta)]


class _QuantizedMatmul(torch.autograd.Function):
    """``y = x @ wᵀ`` and its two backward GEMMs on the module's quantizer's casts.

    Forward casts ``x`` and ``w`` along ``in``; backward needs ``w`` along ``out``
    (dgrad) and ``x`` along the tokens (wgrad). Where the quantizer says a forward cast
    serves the backward too (a per-tensor scale, a 128×128 weight block) it is saved as
    it is; otherwise the second cast is made here and only it is saved. The gradient is
    cast along ``out`` for dgrad and along the tokens for wgrad (once, if it has no
    axis). ``grad_dtype``: the dtype the output's gradient is read in, where the output
    is a wider sum than the Linear's (a tensor-parallel partial sum kept in fp32)."""

    @staticmethod
    def forward(ctx, x2d, weight, mod, out_dtype, record, grad_dtype=None):
        q = mod.quantizer
        with _no_autocast(x2d), q.gemm_context():
            xq = mod.quantize(x2d, "input", 1, record)
            wq = mod.quantize(weight, "weight", 1, record)
            y = q.mm(xq, wq.t(), out_dtype, mod.backend)
            need_dx, need_dw = ctx.needs_input_grad[:2]
            wd = (None if not need_dx else wq if q.reuses("weight")
                  else mod.quantize(weight, "weight", 0))
            del wq
            hp_wgrad = "wgrad" not in q.quantized_gemms  # wgrad on the input as it came
            xw = (None if not need_dw or hp_wgrad else xq if q.reuses("input")
                  else mod.quantize(x2d, "input", 0))
            del xq
        tensors, ctx.casts = _pack((xw, wd))
        # wgrad's operand in the output's dtype (bf16 under autocast), as F.linear saves it
        ctx.save_for_backward(*tensors, x2d.to(out_dtype) if need_dw and hp_wgrad else None)
        ctx.mod, ctx.x_dtype, ctx.w_dtype = mod, x2d.dtype, weight.dtype
        ctx.grad_dtype = grad_dtype
        return y

    @staticmethod
    def backward(ctx, gy):
        *saved, x_hp = ctx.saved_tensors
        if ctx.grad_dtype is not None:  # 16-bit values in fp32: exact
            gy = gy.to(ctx.grad_dtype)
        xw, wd = _unpack(saved, ctx.casts)
        mod, dx, dw = ctx.mod, None, None
        q = mod.quantizer
        gen = mod._sr_generator(gy.device)
        with _no_autocast(gy), q.gemm_context():
            g = None
            if ctx.needs_input_grad[0]:
                g = mod.quantize(gy, "grad_output", 1, True, gen)  # along out
                dx_dtype = ctx.x_dtype if ctx.x_dtype == torch.bfloat16 else torch.float32
                dx = q.mm(g, wd, dx_dtype, mod.backend).to(ctx.x_dtype)
            if ctx.needs_input_grad[1] and x_hp is not None:  # wgrad in gy's 16 bits
                dw = torch.mm(gy.t(), x_hp.to(gy.dtype)).to(ctx.w_dtype)
            elif ctx.needs_input_grad[1]:
                if g is None or not q.reuses("grad_output"):  # along the tokens
                    g = mod.quantize(gy, "grad_output", 0, g is None, gen)
                dw = q.mm(g.t(), xw, torch.float32, mod.backend).to(ctx.w_dtype)
        return dx, dw, None, None, None, None


class GemmSite:
    """What the quantized GEMM needs besides its operands: the format, the route
    (``backend``), the format's state (its ``buffers``, e.g. delayed scaling's amax
    history) and, for stochastic rounding, a generator per backward. ``QuantizedLinear``
    is one; ``quantized_mm`` builds one for callers without a module."""

    def __init__(self, fmt: LinearFormat, backend: str, state: dict | None = None,
                 generator: Callable[[torch.device], torch.Generator | None] | None = None
                 ) -> None:
        self.quantizer, self.backend, self._state = fmt, backend, state or {}
        self._generator = generator

    def quantize(self, t: torch.Tensor, role: str, dim: int, record: bool = False,
                 generator: torch.Generator | None = None) -> Quantized:
        """``t`` cast for ``role`` along ``dim`` by the format, with this site's state."""
        return self.quantizer.cast(t, role, dim, self._state, record, generator)

    def _sr_generator(self, device) -> torch.Generator | None:
        if self._generator is None or not self.quantizer.stochastic_grads:
            return None
        return self._generator(device)


def quantized_mm(x: torch.Tensor, w: torch.Tensor, fmt: LinearFormat, *,
                 backend: str | None = None, state: dict | None = None,
                 out_dtype: torch.dtype | None = None, record: bool | None = None,
                 generator: Callable[[torch.device], torch.Generator | None] | None = None
                 ) -> torch.Tensor:
    """``x @ wᵀ`` (``x`` (M, K), ``w`` (N, K)) with both operands and, in backward, the
    output gradient cast by ``fmt`` for their roles; fp32 accumulation, differentiable.

    ``backend``: the GEMM route (default ``fmt.route(x.device)``, the one decision);
    ``state``: the format's buffers (``fmt.buffers``; a format with history needs them);
    ``out_dtype``: default the autocast dtype, else ``x``'s; ``record``: the casts are
    part of a training step (default: grad enabled); ``generator``: device -> generator
    for stochastic rounding of the gradients (None: round to nearest)."""
    if state is None and fmt.has_history:
        raise ValueError(f"quantized_mm with {type(fmt).__name__}: a format with an "
                         "amax history needs its state; pass state=(its buffers), or use "
                         "a format without history (e.g. CurrentScaling)")
    dev = x.device.type
    if out_dtype is None:
        out_dtype = (torch.get_autocast_dtype(dev) if dev != "meta"
                     and torch.is_autocast_enabled(dev) else x.dtype)
    site = GemmSite(fmt, backend or fmt.route(x.device), state, generator)
    rec = torch.is_grad_enabled() if record is None else record
    return _QuantizedMatmul.apply(x, w, site, out_dtype, rec)
