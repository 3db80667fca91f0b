"""The quantized GEMM: ``y = x @ wᵀ`` and its two backward GEMMs on a Linear format's
casts, as a function of (operands, format, route) that a Linear, a grouped expert GEMM
or a tensor-parallel shard can all call.

``QuantizedGemm`` is the one autograd Function of them all: it owns the skeleton (the
forward's casts and GEMM, what the backward saves, which casts serve the backward, the
gradient's casts, dgrad and wgrad, and the GEMMs the format leaves out of its
``quantized_gemms``); a ``GemmLayout`` places the casts and GEMMs (``Dense`` here; the
experts' ``PerExpert``, ``Segmented`` and ``Codes`` in ``mixprec.experts``), and the
format makes every cast.

    >>> import torch
    >>> from mixprec.formats.mm import quantized_mm
    >>> from mixprec.formats.gemm import CurrentScaling
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
from typing import Any

import torch

from mixprec.formats.gemm.base import LinearFormat
from mixprec.formats.quantized import Quantized

__all__ = ["quantized_mm", "GemmSite", "QuantizedGemm", "GemmLayout", "Dense"]


def _no_autocast(t: torch.Tensor):
    """Autocast off around the GEMMs, which pick their own dtypes (meta tensors, used to
    check the CUDA calls against torch's meta kernels, have no autocast)."""
    if t.device.type == "meta":
        return contextlib.nullcontext()
    return torch.autocast(t.device.type, enabled=False)


def _pack(obj, tensors: list) -> object:
    """``obj`` (a cast, a tensor, None, or a tuple or list of them) as tensors appended
    to ``tensors`` and the metadata that rebuilds it. The metadata holds no tensor:
    every byte backward keeps goes through ``save_for_backward`` (and so through any
    saved-tensor hooks, e.g. offloading)."""
    if isinstance(obj, Quantized):
        tensors.extend(obj.tensors())
        return obj.like((None, None, None))
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return _TENSOR
    if isinstance(obj, (tuple, list)):
        return type(obj), [_pack(o, tensors) for o in obj]
    if obj is not None:
        raise TypeError(f"a quantized GEMM saves casts, tensors or None, not {obj!r}")
    return None


def _unpack(meta: object, tensors) -> object:
    """``_pack``'s object back from its metadata over the iterator ``tensors``."""
    if isinstance(meta, Quantized):
        return meta.like((next(tensors), next(tensors), next(tensors)))
    if meta is _TENSOR:
        return next(tensors)
    if isinstance(meta, tuple):
        kind, items = meta
        return kind(_unpack(m, tensors) for m in items)
    return None


_TENSOR = object()


class GemmLayout:
    """How a quantized GEMM's operands split into GEMMs, and what it casts and
    multiplies for each step of ``QuantizedGemm``: ``Dense`` (one GEMM, a Linear's),
    the experts' per-expert GEMMs and grouped kernels (``mixprec.experts``). The
    format (``site.quantizer``) makes every cast; a layout only places them."""

    def __init__(self, site: Any) -> None:
        self.site = site
        self.fmt: LinearFormat = site.quantizer

    def bind(self, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor | None
             ) -> GemmLayout:
        """Before the forward's casts: this layout with what it reads of this call's
        operands (a new object: ``torch.compile`` traces no mutation of an argument)."""
        return self

    def saved(self) -> tuple[object, list[torch.Tensor]]:
        """What the backward needs besides the casts: metadata and tensors."""
        return None, []

    def restore(self, meta: object, tensors: list[torch.Tensor]) -> GemmLayout:
        """In the backward: the bound layout again, from ``saved``'s tensors."""
        return self

    def keep(self, cast: object) -> object:
        """What the backward keeps of a cast (default: all of it)."""
        return cast

    def grad_keys(self, gy: torch.Tensor) -> tuple[object, object]:
        """The stochastic rounding of the gradient's casts, dgrad's and wgrad's."""
        gen = self.site._sr_generator(gy.device)
        return gen, gen

    def cast_x(self, t: torch.Tensor, role: str, dim: int, record: bool = False,
               key: object = None) -> object:
        """The tokens (``input``) or the output's gradient (``grad_output``) cast by the
        format along ``dim`` (1: the hidden dim; 0: the tokens, wgrad's); ``key``: the
        gradient's stochastic rounding (``grad_keys``)."""
        raise NotImplementedError(type(self).__name__)

    def cast_w(self, w: torch.Tensor, dim: int, record: bool = False) -> object:
        """The weight cast by the format along ``dim`` (1: the forward's, 0: dgrad's)."""
        raise NotImplementedError(type(self).__name__)

    def forward_mm(self, xq: object, wq: object, out_dtype: torch.dtype) -> torch.Tensor:
        """``x @ wᵀ`` on the casts, in ``out_dtype``."""
        raise NotImplementedError(type(self).__name__)

    def dgrad_mm(self, g: object, wd: object, x_dtype: torch.dtype) -> torch.Tensor:
        """``g @ w`` on the casts, in the input's dtype."""
        raise NotImplementedError(type(self).__name__)

    def wgrad_mm(self, g: object, xw: object, w_dtype: torch.dtype) -> torch.Tensor:
        """``gᵀ @ x`` on the casts along the tokens, in the weight's dtype."""
        raise NotImplementedError(type(self).__name__)

    def hp_wgrad(self, gy: torch.Tensor, x_hp: torch.Tensor, w_dtype: torch.dtype
                 ) -> torch.Tensor:
        """``gᵀ @ x`` in the gradient's 16 bits on the input as it came (a format that
        leaves wgrad out of its ``quantized_gemms``)."""
        raise NotImplementedError(type(self).__name__)


class Dense(GemmLayout):
    """One GEMM: ``x`` (M, K) times ``w`` (N, K)ᵀ on the site's route."""

    def cast_x(self, t: torch.Tensor, role: str, dim: int, record: bool = False,
               key: torch.Generator | None = None) -> Quantized:
        """The tokens (or the gradient) cast for ``role`` along ``dim``."""
        return self.site.quantize(t, role, dim, record, key)

    def cast_w(self, w: torch.Tensor, dim: int, record: bool = False) -> Quantized:
        """The weight cast along ``dim`` (1: the forward's, 0: dgrad's)."""
        return self.site.quantize(w, "weight", dim, record)

    def forward_mm(self, xq: Quantized, wq: Quantized, out_dtype: torch.dtype
                   ) -> torch.Tensor:
        """``x @ wᵀ``."""
        return self.fmt.mm(xq, wq.t(), out_dtype, self.site.backend)

    def dgrad_mm(self, g: Quantized, wd: Quantized, x_dtype: torch.dtype) -> torch.Tensor:
        """``g @ w`` (bf16 for a bf16 input, else fp32, then the input's dtype)."""
        dx_dtype = x_dtype if x_dtype == torch.bfloat16 else torch.float32
        return self.fmt.mm(g, wd, dx_dtype, self.site.backend).to(x_dtype)

    def wgrad_mm(self, g: Quantized, xw: Quantized, w_dtype: torch.dtype) -> torch.Tensor:
        """``gᵀ @ x`` in fp32, then the weight's dtype."""
        return self.fmt.mm(g.t(), xw, torch.float32, self.site.backend).to(w_dtype)

    def hp_wgrad(self, gy: torch.Tensor, x_hp: torch.Tensor, w_dtype: torch.dtype
                 ) -> torch.Tensor:
        """``gᵀ @ x`` in the gradient's 16 bits, on the input as it came."""
        return torch.mm(gy.t(), x_hp.to(gy.dtype)).to(w_dtype)


class _QuantizedMatmul(torch.autograd.Function):
    """``y = x @ wᵀ`` and its two backward GEMMs on the format's casts: every quantized
    GEMM's one autograd Function (a Linear's, a tensor-parallel shard's, the experts'
    on each route), the ``layout`` placing the casts and GEMMs (default ``Dense``).

    Forward casts ``x`` and ``w`` along ``in``; backward needs ``w`` along ``out``
    (dgrad) and ``x`` along the tokens (wgrad). Where the format says a forward cast
    serves the backward too (a per-tensor scale, a 128×128 weight block) it is saved as
    it is; otherwise the second cast is made here and only it is saved. The gradient is
    cast along ``out`` for dgrad and along the tokens for wgrad (once, if it has no
    axis). A GEMM the format leaves out of its ``quantized_gemms`` (wgrad) runs in the
    gradient's 16-bit dtype on the input as it came. ``grad_dtype``: the dtype the
    output's gradient is read in, where the output is a wider sum than the Linear's (a
    tensor-parallel partial sum kept in fp32); ``offsets``: the experts' cumulative
    token counts."""

    @staticmethod
    def forward(ctx: Any, x2d: torch.Tensor, weight: torch.Tensor, site: Any,
                out_dtype: torch.dtype, record: bool, grad_dtype: torch.dtype | None = None,
                offsets: torch.Tensor | None = None,
                layout: GemmLayout | None = None) -> torch.Tensor:
        lay = (layout if layout is not None else Dense(site)).bind(x2d, weight, offsets)
        q = lay.fmt
        need_dx, need_dw = ctx.needs_input_grad[:2]
        hp_wgrad = "wgrad" not in q.quantized_gemms  # wgrad on the input as it came
        with _no_autocast(x2d), q.gemm_context():
            xq = lay.cast_x(x2d, "input", 1, record)
            wq = lay.cast_w(weight, 1, record)
            y = lay.forward_mm(xq, wq, out_dtype)
            wd = (None if not need_dx else wq if q.reuses("weight")
                  else lay.cast_w(weight, 0))
            del wq
            xw = (None if not need_dw or hp_wgrad else xq if q.reuses("input")
                  else lay.cast_x(x2d, "input", 0))
            del xq
        tensors: list = []
        ctx.casts = _pack((lay.keep(xw), lay.keep(wd)), tensors)
        ctx.layout_meta, extra = lay.saved()
        # wgrad's operand in the output's dtype (bf16 under autocast), as F.linear saves it
        ctx.save_for_backward(*tensors, x2d.to(out_dtype) if need_dw and hp_wgrad else None,
                              *extra)
        ctx.n_casts, ctx.layout = len(tensors), lay
        ctx.x_dtype, ctx.w_dtype, ctx.grad_dtype = x2d.dtype, weight.dtype, grad_dtype
        return y

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple:
        saved = ctx.saved_tensors
        n, lay = ctx.n_casts, ctx.layout
        x_hp = saved[n]
        xw, wd = _unpack(ctx.casts, iter(saved[:n]))
        lay = lay.restore(ctx.layout_meta, list(saved[n + 1:]))
        if ctx.grad_dtype is not None:  # 16-bit values in fp32: exact
            gy = gy.to(ctx.grad_dtype)
        q, dx, dw = lay.fmt, None, None
        key1, key0 = lay.grad_keys(gy)
        with _no_autocast(gy), q.gemm_context():
            g = None
            if ctx.needs_input_grad[0]:
                g = lay.cast_x(gy, "grad_output", 1, True, key1)  # along out
                dx = lay.dgrad_mm(g, wd, ctx.x_dtype)
            if ctx.needs_input_grad[1] and x_hp is not None:  # wgrad in gy's 16 bits
                dw = lay.hp_wgrad(gy, x_hp, ctx.w_dtype)
            elif ctx.needs_input_grad[1]:
                if g is None or not q.reuses("grad_output"):  # along the tokens
                    g = lay.cast_x(gy, "grad_output", 0, g is None, key0)
                dw = lay.wgrad_mm(g, xw, ctx.w_dtype)
        return dx, dw, None, None, None, None, None, None


#: the one autograd Function of the quantized GEMMs (its backward nodes keep the
#: private name ``_QuantizedMatmulBackward``)
QuantizedGemm = _QuantizedMatmul


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
    return QuantizedGemm.apply(x, w, site, out_dtype, rec)
