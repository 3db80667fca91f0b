"""Exact emulation: run a low-precision format's numerics on fp32 kernels.

``EmulationMode(fmt, carrier)`` is a ``TorchDispatchMode`` used together with a real
``torch.autocast(dtype=carrier)``. Autocast decides which ops run in low precision, as
it would on hardware. Its casts to ``carrier`` reach this mode as ``aten._to_copy`` and
become fp32 tensors holding the exactly rounded values (``formats.quantize``), tagged as
*virtually* low-precision. Every later op, backward included since backward ops dispatch
here too, runs on fp32 kernels. Its floating outputs are rounded to the format when its
floating inputs are all virtual: the result a real low-precision kernel returns, since it
too computes in fp32 and rounds once. If any input is a real fp32 tensor, type promotion
makes the result fp32, so it is left alone. As in torch, 0-dim tensors defer to
dimensioned ones. fp16 arithmetic then costs fp32 speed plus the rounding passes.
Kernels that round *inside* are replaced by a model of where they round: torch's CPU
flash attention (``mixprec.engine.emulate_attention``).

Tensors under emulation report ``dtype=torch.float32``; their values are the format's.
Backward must run under the same mode instance. ``MixedPrecision.backward`` does that,
and so does ``loss.backward()`` called inside the context. Where an emulated tensor is
upcast, the gradient that comes back must be rounded, as a real cast's backward does;
where an fp32 tensor is cast down, the gradient that comes back is fp32 again and must
no longer be rounded. Autocast's casts down are seen here and hooked (``_hook_casts``).
The FP32 islands (norms, softmax, losses) upcast through ``leave_low_precision``. A
``.float()`` in your own code is a no-op on an fp32 tensor and cannot be seen. Its
gradient then enters the low-precision region unrounded, which is the one known gap.
Compute losses through the islands (``F.cross_entropy``, ``F.mse_loss`` and the rest)
rather than ``y.float()`` by hand.

MX block formats (OCP Microscaling v1.0: fp8/fp6/fp4 elements, one e8m0 scale per 32
elements): ``mx_quantize`` rounds a tensor block by block along a dimension. With
``EmulationMode(mx=fmt)`` every matmul (``mm``, ``addmm``, ``bmm``, ``matmul``) quantizes
each operand along its reduction dimension, computes in fp32, and rounds its output to
the carrier (bf16), as MX hardware returns bf16 or fp32. Convolutions run in bf16.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
import weakref
from collections.abc import Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

from mixprec.engine import emulate_attention
from mixprec.formats import elements as formats
from mixprec.formats.blocks import MX_TILE, cast_mx, mx_exponents
from mixprec.formats.elements import Format
from mixprec.formats.fp32_precision import ieee_fp32_matmul
from mixprec.formats.quantized import block_amax

__all__ = ["EmulationMode", "mx_quantize", "mx_scales", "MX_BLOCK", "round_", "active_mode",
           "leave_low_precision", "unrounded"]

_ACTIVE: list[EmulationMode] = []

#: attribute set on copies of weights that the low-precision region saves for backward
#: (upcasts, casts), so ``mixprec.memory.measure`` counts them as weight casts, as it
#: does autocast's
WEIGHT_CAST_TAG = "_mixprec_weight_cast"


def active_mode() -> EmulationMode | None:
    """The innermost EmulationMode in effect, if any."""
    return _ACTIVE[-1] if _ACTIVE else None


class _LeaveLowPrecision(torch.autograd.Function):
    """Upcast out of an emulated low-precision tensor: forward gives a *real* fp32 copy,
    backward rounds the gradient to the format, as the real cast's backward does."""

    @staticmethod
    def forward(ctx, x, mode):
        ctx.mode = mode
        out = x.clone()
        mode.virtual.pop(out, None)
        if x.is_leaf and x.requires_grad:  # an emulated bf16 weight's upcast
            setattr(out, WEIGHT_CAST_TAG, True)
        return out

    @staticmethod
    def backward(ctx, g):
        mode = ctx.mode
        out = _round(g, mode.fmt if mode.mx is None else mode.out_fmt)
        if active_mode() is mode:
            mode.virtual[out] = True  # a low-precision gradient from here on
        return out, None


@contextlib.contextmanager
def unrounded() -> Iterator[None]:
    """Ops inside run on fp32 kernels with real fp32 outputs, unrounded and untagged.

    For GEMMs that real hardware runs with an fp32 output (``mm(..., out_dtype=fp32)``:
    the ``wgrad=fp32`` weight gradients). A product of two bf16 or fp16 values is exact in
    fp32, so an fp32 GEMM of the emulated (rounded) operands is what such a kernel
    computes, up to summation order. A no-op without an active EmulationMode."""
    mode = active_mode()
    if mode is None:
        yield
        return
    saved, mode.passthrough = mode.passthrough, True
    try:
        yield
    finally:
        mode.passthrough = saved


def leave_low_precision(x: torch.Tensor) -> torch.Tensor:
    """``x.float()`` that keeps emulation exact (used by the FP32 islands)."""
    mode = active_mode()
    if mode is not None and isinstance(x, torch.Tensor) and x in mode.virtual:
        return _LeaveLowPrecision.apply(x, mode)
    return x.float() if x.dtype != torch.float32 else x

aten = torch.ops.aten
MX_BLOCK = MX_TILE
_MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.matmul.default,
            aten.baddbmm.default}
# Ops whose outputs are inputs' values (or zero): representable in, representable out.
_EXACT = {getattr(aten, n) for n in (
    "relu", "threshold_backward", "neg", "abs", "clone", "cat", "stack", "where",
    "index_select", "gather", "embedding", "embedding_dense_backward", "masked_fill",
    "zeros_like", "ones_like", "fill", "copy", "_to_copy", "contiguous", "constant_pad_nd",
    "max_pool2d_with_indices", "flip", "roll", "repeat", "select_backward",
    "slice_backward", "new_zeros", "zero") if hasattr(aten, n)}


_FAST = ("fp16", "bf16")  # rounded by a round trip through their torch dtype
# Kernels that round inside, replaced by a model of where they round.
_FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _tensors(args) -> list[torch.Tensor]:
    """The tensors among an aten op's arguments (top level, or in a list such as cat's):
    what pytree's flatten gives for aten signatures, at a fraction of its cost."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(t for t in a if isinstance(t, torch.Tensor))
    return out


def _round(t: torch.Tensor, f: Format) -> torch.Tensor:
    """quantize(t, f) in fp32; for fp16/bf16 via a round trip through the real dtype
    (the same bits: torch's casts round to nearest-even with IEEE overflow, which
    tests/formats/test_formats.py checks against quantize on 10^6 values)."""
    t = t if t.dtype == torch.float32 else t.float()
    fast = f.torch_dtype if f.name in _FAST else None
    return t.to(fast).float() if fast is not None else formats.quantize(t, f)


def _round_(t: torch.Tensor, f: Format) -> torch.Tensor:
    """``_round`` into ``t`` itself (fp32): no second fp32 tensor is allocated."""
    fast = f.torch_dtype if f.name in _FAST else None
    with torch.no_grad():
        t.copy_(t.to(fast) if fast is not None else formats.quantize(t, f))
    return t


def round_(tensors: Iterable[torch.Tensor], fmt: str | Format) -> None:
    """Round fp32 tensors in place to ``fmt`` (parameters stored in low precision)."""
    f = formats.get(fmt)
    for t in tensors:
        _round_(t.detach(), f)


def _rows(x: torch.Tensor, dim: int, block: int) -> torch.Tensor:
    """``x`` with ``dim`` moved last, as 2-D rows that MX blocks cut along."""
    n = x.shape[dim]
    if n % block:
        raise ValueError(f"MX needs the reduction dimension divisible by {block}, got {n}")
    return x.movedim(dim, -1).reshape(-1, n)


def mx_scales(x: torch.Tensor, fmt: str | Format, dim: int = -1,
              block: int = MX_BLOCK) -> torch.Tensor:
    """Per-block e8m0 scales of the OCP MX spec: ``2^(floor(log2(amax)) - emax_elem)``
    (``mixprec.formats.blocks.mx_exponents`` with ``floor``).

    A block of zeros gets the scale 2^-127 (the spec's choice is free there; any scale
    gives zeros). Shape: ``x`` with ``dim`` moved last and divided by ``block``.
    """
    dim = dim % x.dim()
    rows = _rows(x, dim, block)
    exp = mx_exponents(block_amax(rows, 1, block), formats.get(fmt), "floor")
    shape = x.movedim(dim, -1).shape
    return torch.exp2(exp).to(torch.float32).reshape(*shape[:-1], -1)


def mx_quantize(x: torch.Tensor, fmt: str | Format, dim: int = -1,
                block: int = MX_BLOCK) -> torch.Tensor:
    """The values of ``x`` after MX conversion (``mixprec.formats.blocks.cast_mx`` with the
    spec's ``floor`` rule): scale per block, elements saturated and rounded to
    nearest-even in ``fmt``, then scaled back (fp32 result)."""
    f = formats.get(fmt)
    dim = dim % x.dim()
    rows = _rows(x, dim, block)
    q = cast_mx(rows, 1, f.torch_dtype or f, "floor", block).dequant()
    return q.reshape(x.movedim(dim, -1).shape).movedim(-1, dim)


_WARNED_COMPILE: list[bool] = []


def _warn_if_compiled() -> None:
    """Warn once if a ``torch.compile``d function is running: dynamo runs every frame
    eagerly while a dispatch mode is active, so under emulation it compiles nothing."""
    f = sys._getframe(2)
    while f is not None:
        code = f.f_code
        if code.co_name == "compile_wrapper" and code.co_filename.endswith(_EVAL_FRAME):
            _WARNED_COMPILE.append(True)
            warnings.warn(
                "torch.compile compiles nothing under emulation: mixprec emulates the "
                "16-bit formats this chip has no fast kernels for through a dispatch "
                "mode, and dynamo runs code under a dispatch mode eagerly (the numbers "
                "are the emulation's, the speed eager's). Pin emulate=false to compile "
                "the real 16-bit kernels, or drop torch.compile.", stacklevel=3)
            return
        f = f.f_back


_EVAL_FRAME = os.path.join("_dynamo", "eval_frame.py")


class EmulationMode(TorchDispatchMode):
    """Round to ``fmt`` where a real ``carrier``-dtype kernel would (see module doc).

    Args:
        fmt: the format low-precision tensors hold (fp16, bf16, or any narrower one).
        carrier: the dtype the surrounding ``torch.autocast`` casts to.
        mx: an MX element format: matmul operands are block-quantized along the
            reduction dimension (outputs rounded to ``carrier``'s format).
    """

    def __init__(self, fmt: str | Format, carrier: torch.dtype = torch.float16,
                 mx: str | Format | None = None) -> None:
        super().__init__()
        self.fmt = formats.get(fmt)
        self.carrier = carrier
        self.out_fmt = formats.get(carrier) if mx is not None else self.fmt
        self.mx = formats.get(mx) if mx is not None else None
        self.virtual = WeakTensorKeyDictionary()
        self._casts: list[weakref.ref] = []  # differentiable casts awaiting their node
        self.passthrough = False  # inside ``unrounded()``: ops run as plain fp32
        self._pins: list = []  # the IEEE fp32 matmul pin of each entry
        self._probe_compile = not _WARNED_COMPILE  # look for torch.compile at a matmul

    def __enter__(self):
        _ACTIVE.append(self)
        self._probe_compile = not _WARNED_COMPILE
        # the fp32 GEMMs on rounded operands are exact only in IEEE fp32 (not bf16 or
        # TF32 under set_float32_matmul_precision): pinned while the mode is active
        pin = ieee_fp32_matmul()
        pin.__enter__()
        self._pins.append(pin)
        return super().__enter__()

    def __exit__(self, *exc):
        self._hook_casts()
        if _ACTIVE and _ACTIVE[-1] is self:
            _ACTIVE.pop()
        try:
            return super().__exit__(*exc)
        finally:
            self._pins.pop().__exit__(None, None, None)

    def tag(self, tensors: Iterable[torch.Tensor]) -> None:
        """Mark fp32 tensors that hold this format's values (the working parameters of
        ``-master`` recipes) as virtually low-precision: ops on them then round as the
        real kernels on real bf16/fp16 parameters do."""
        for t in tensors:
            self.virtual[t] = True

    def _hook_casts(self) -> None:
        """Make the backward of each cast into the format leave low precision.

        A real cast's backward converts the gradient back to fp32. Here both dtypes are
        fp32, so autograd passes the very same (emulated) gradient on, and fp32 ops
        downstream of the cast would round as if they ran in the format. A hook on the
        cast's autograd node untags the gradient it hands back. The node exists only
        after this mode returns, so hooks are added at the next dispatch.
        """
        casts, self._casts = self._casts, []
        for ref in casts:
            t = ref()
            if t is not None and t.grad_fn is not None:
                t.grad_fn.register_hook(self._leave_virtual)

    def _leave_virtual(self, grad_inputs, grad_outputs):
        for g in grad_inputs:
            if isinstance(g, torch.Tensor):
                self.virtual.pop(g, None)

    def _q(self, t: torch.Tensor, fmt: Format | None = None) -> torch.Tensor:
        """Round an op's fp32 output to the format, in place, and tag it.

        In place is safe: an output is fresh, or (a view) aliases inputs that are all
        emulated, whose values rounding leaves as they are. It saves an allocation the
        size of every low-precision activation.
        """
        f = fmt or self.out_fmt
        in_place = t.dtype == torch.float32 and not t.requires_grad
        out = _round_(t, f) if in_place else _round(t, f)
        self.virtual[out] = True
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.passthrough:
            return func(*args, **kwargs)
        if self._casts:
            self._hook_casts()
        if self._probe_compile and func in _MATMULS:
            self._probe_compile = False
            _warn_if_compiled()
        if func is aten._to_copy.default and kwargs.get("dtype") == self.carrier:
            src = args[0]
            out = func(src, **{**kwargs, "dtype": torch.float32})
            out = self._q(out, self.fmt if self.mx is None else self.out_fmt)
            if src.requires_grad and src not in self.virtual:
                self._casts.append(weakref.ref(out))
            return out
        if self.mx is not None and func in _MATMULS:
            return self._mx_matmul(func, args, kwargs)
        if func in (_FLASH, _FLASH_BWD):
            modelled = self._flash(func, args, kwargs)
            if modelled is not None:
                return modelled
        tensors = _tensors(args)
        if any(t.dtype == self.carrier for t in tensors) and not (
                func.is_view or func._schema.is_mutable):
            # real bf16/fp16 tensors meet the fp32-carried ones: frozen weights stored in
            # bf16, tensors made in bf16 by a factory call. Their values are the format's, so
            # they join as tagged fp32 copies (an op with a fresh output only: in-place
            # writes and views must keep reaching the real tensor)
            args, kwargs = tree_map(self._lift, (args, kwargs))
            tensors = _tensors(args)
        out = func(*args, **kwargs)
        if "dtype" in kwargs:
            return out
        if not self._all_virtual(tensors):
            return out
        if func.is_view or func.overloadpacket in _EXACT:
            for o in (out,) if isinstance(out, torch.Tensor) else tree_flatten(out)[0]:
                if isinstance(o, torch.Tensor) and o.is_floating_point():
                    self.virtual[o] = True
            return out
        inputs = {id(a) for a in tensors}

        def fix(o):
            if not (isinstance(o, torch.Tensor) and o.is_floating_point()):
                return o
            if id(o) in inputs:  # an in-place op: round the tensor itself
                self.virtual[_round_(o, self.out_fmt)] = True
                return o
            return self._q(o)

        return fix(out) if isinstance(out, torch.Tensor) else tree_map(fix, out)

    def _lift(self, a):
        """A real ``carrier``-dtype tensor as a tagged fp32 copy (exact: same values)."""
        if not (isinstance(a, torch.Tensor) and a.dtype == self.carrier):
            return a
        up = a.float()
        self.virtual[up] = True
        return up

    def _all_virtual(self, tensors: list[torch.Tensor]) -> bool:
        flt = [a for a in tensors if a.is_floating_point()]
        dimensioned = [a for a in flt if a.dim() > 0]
        pool = dimensioned or flt  # torch: 0-dim tensors do not promote dimensioned ones
        return bool(pool) and all(a in self.virtual for a in pool)

    def _flash(self, func, args, kwargs):
        """CPU flash attention through emulate_attention's model of its rounding, when
        its low-precision inputs are all emulated and the call takes the modelled path.
        """
        ea = emulate_attention
        bwd = func is _FLASH_BWD
        grad_out, q, k, v, out, lse, *rest = args if bwd else (None, *args[:3], None, None,
                                                                 *args[3:])
        opt = {**dict(zip(("dropout_p", "is_causal"), rest)), **kwargs}
        low = (grad_out, q, k, v, out) if bwd else (q, k, v)
        if not (ea.modelled(q, k, v, opt.get("dropout_p", 0.0), opt.get("attn_mask"))
                and all(t in self.virtual for t in low)):
            return None

        def rnd(t):
            return _round(t, self.out_fmt)

        causal, scale, mask = opt.get("is_causal", False), opt.get("scale"), opt.get("attn_mask")
        if bwd:
            results = ea.flash_attention_backward(grad_out, q, k, v, out, lse, causal, scale,
                                                  rnd, mask)
        else:
            results = ea.flash_attention_forward(q, k, v, causal, scale, rnd, mask)
        for r in results[:3 if bwd else 1]:  # the forward's logsumexp is a real fp32 tensor
            self.virtual[r] = True
        return results

    def _mx_matmul(self, func, args, kwargs):
        f = self.mx
        if func is aten.addmm.default:
            bias, a, b = args[:3]
            out = torch.mm(mx_quantize(a, f, -1), mx_quantize(b, f, 0))
            beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
            out = alpha * out + beta * bias.float()
        elif func is aten.baddbmm.default:
            bias, a, b = args[:3]
            out = torch.bmm(mx_quantize(a, f, -1), mx_quantize(b, f, -2))
            out = kwargs.get("alpha", 1) * out + kwargs.get("beta", 1) * bias.float()
        else:
            a, b = args[:2]
            out = func(mx_quantize(a, f, -1), mx_quantize(b, f, -2 if b.dim() > 1 else 0))
        return self._q(out)

    def __repr__(self) -> str:
        mx = f", mx={self.mx.name}" if self.mx is not None else ""
        return f"EmulationMode({self.fmt.name}, carrier={self.carrier}{mx})"
