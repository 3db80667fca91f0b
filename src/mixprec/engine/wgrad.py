"""FP32 weight gradients (recipe ``wgrad=fp32``).

Under autocast a Linear's weight gradient is a GEMM in the compute dtype. Its output is
rounded to bf16 (fp16) before any fp32 buffer sees it, so each micro-batch's gradient
carries a relative error of up to 2^-9 (bf16), and accumulation over micro-batches
matches one big batch only to bf16 precision. With ``-master`` recipes the parameters
themselves are bf16, so every parameter's gradient is rounded that way: norm weights,
embeddings, biases.

``wgrad=fp32`` computes those gradients with an fp32 output and adds them to the
engine's fp32 buffers without a detour through a low-precision ``.grad`` (Megatron-LM
calls this gradient-accumulation fusion). A product of two bf16 (or two fp16) numbers
is exact in fp32, so what is left is fp32 summation error:

- ``F.linear`` under autocast: the forward is the same low-precision GEMM; in the
  backward the input gradient stays in the compute dtype, and the weight and bias
  gradients come out in fp32. On CUDA that is ``torch.mm(..., out_dtype=torch.float32)``
  at low-precision speed. CPU torch has no bf16-in, fp32-out GEMM, so there the operands
  are upcast and the weight-gradient GEMMs (a third of a Linear's work) run in fp32.
- ``F.embedding`` of a low-precision table: the gradient rows add up in fp32.
- FP32 islands (norms): a low-precision parameter's upcast passes its fp32 gradient on.

Not covered (their gradients keep the compute dtype's rounding): convolutions, and
weights used outside ``F.linear`` (``x @ w.t()``).

Under DDP the parameter still receives a zero ``.grad``, so the reducer sees it become
ready, and mixprec's comm hook reduces the fp32 buffers. Under ``torch.compile`` the
routed calls run eagerly (one graph break each): their backward's side effect on the
buffers is something a compiled graph would drop.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from mixprec.engine.emulate import WEIGHT_CAST_TAG, unrounded

__all__ = ["GradSink", "Fp32WeightGrads", "upcast_param", "route", "NOT_ROUTED",
           "compile_safe", "ROUTED_FUNCS", "WEIGHT_CAST_TAG"]



class GradSink(Protocol):
    """Where fp32 gradients of low-precision parameters go (the engine's ``ParamState``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # what typing.Protocol's own ``__init__`` does, annotated: a protocol refuses to
        # be instantiated; a class that subclasses it gets the next ``__init__`` it has
        if type(self)._is_protocol:
            raise TypeError("Protocols cannot be instantiated")
        super().__init__(*args, **kwargs)

    def wants_fp32_grad(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is a low-precision parameter with an fp32 buffer (under
        emulation: an fp32 tensor holding low-precision values)."""

    def add_fp32_grad(self, p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor | None:
        """Add the fp32 ``grad`` (already scaled) to ``p``'s buffer; return what autograd
        should still accumulate into ``p.grad`` (None, or zeros where DDP must see a
        gradient arrive to know the parameter is ready)."""


def _route(p: torch.Tensor | None, grad: torch.Tensor, sink: GradSink | None):
    """What to hand autograd for parameter ``p`` given its fp32 gradient."""
    if p is None:
        return None
    if sink is not None and sink.wants_fp32_grad(p):  # emulated bf16/fp16 ones included
        return sink.add_fp32_grad(p, grad)
    if p.dtype == torch.float32:
        return grad  # autograd accumulates it into the fp32 .grad
    return grad.to(p.dtype)  # nowhere to keep fp32: the usual rounding


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of low-precision matrices with an fp32 result, products exact. Under
    emulation the operands are fp32 tensors holding rounded values, and the GEMM runs
    ``unrounded``: the emulated twin of ``mm(out_dtype=fp32)``."""
    if a.is_cuda:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError):  # an older torch without mm(out_dtype=)
            pass
    with unrounded():
        return torch.mm(a.float(), b.float())


def _sum_fp32(g: torch.Tensor) -> torch.Tensor:
    """The bias gradient: rows of ``g`` summed in fp32 (unrounded under emulation)."""
    with unrounded():
        return g.float().sum(0)


def compile_safe() -> None:
    """Once torch.compile is in use, run the routed Functions eagerly under it: they add
    gradients to the engine's buffers as a side effect of backward, which a compiled
    graph would drop (a compiled model with ``wgrad=fp32`` breaks its graph at each
    routed call). ``torch.compiler.disable`` imports torch._dynamo, 2 s of every
    process's start, so this is done when a precision context is entered and dynamo is
    loaded already (``torch.compile`` loads it before any compiled forward runs)."""
    global _LINEAR, _EMBEDDING, _UPCAST, _COMPILE_SAFE
    if _COMPILE_SAFE or "torch._dynamo" not in sys.modules:
        return
    _LINEAR, _EMBEDDING, _UPCAST = (torch.compiler.disable(f.apply, recursive=True)
                                    for f in (_Linear, _Embedding, _Upcast))
    _COMPILE_SAFE = True


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, dtype, sink):
        xc, wc = x.to(dtype), w.to(dtype)
        if wc is not w:
            setattr(wc, WEIGHT_CAST_TAG, True)
        with torch.autocast(x.device.type, enabled=False):  # what autocast would run
            out = F.linear(xc, wc, None if b is None else b.to(dtype))
        ctx.save_for_backward(xc, wc)
        ctx.params, ctx.sink = (w, b), sink
        return out

    @staticmethod
    def backward(ctx, gy):
        xc, wc = ctx.saved_tensors
        w, b = ctx.params
        gy = gy.to(wc.dtype)
        dx = gy @ wc if ctx.needs_input_grad[0] else None
        g2 = gy.reshape(-1, gy.shape[-1])
        dw = db = None
        if ctx.needs_input_grad[1]:
            dw = _route(w, _mm_fp32(g2.t(), xc.reshape(-1, xc.shape[-1])), ctx.sink)
        if b is not None and ctx.needs_input_grad[2]:
            db = _route(b, _sum_fp32(g2), ctx.sink)
        return dx, dw, db, None, None


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, idx, w, padding_idx, sink):
        ctx.save_for_backward(idx)
        ctx.w, ctx.padding_idx, ctx.sink = w, padding_idx, sink
        return F.embedding(idx, w, padding_idx)

    @staticmethod
    def backward(ctx, gy):
        (idx,) = ctx.saved_tensors
        w = ctx.w
        g = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        g.index_add_(0, idx.reshape(-1), gy.reshape(-1, w.shape[-1]).float())
        if ctx.padding_idx is not None:
            g[ctx.padding_idx] = 0
        return None, _route(w, g, ctx.sink), None, None


class _Upcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p, sink):
        ctx.p, ctx.sink = p, sink
        with unrounded():  # under emulation p is fp32 already: a real fp32 copy
            up = p.float() if p.dtype != torch.float32 else p.clone()
        setattr(up, WEIGHT_CAST_TAG, True)
        return up

    @staticmethod
    def backward(ctx, g):
        return _route(ctx.p, g.float(), ctx.sink), None


_LINEAR, _EMBEDDING, _UPCAST = _Linear.apply, _Embedding.apply, _Upcast.apply
_COMPILE_SAFE = False


def upcast_param(x: torch.Tensor, sink: GradSink | None) -> torch.Tensor | None:
    """``x.float()`` whose gradient reaches ``sink`` in fp32, for a low-precision
    parameter the sink buffers; None for any other tensor (upcast it the usual way)."""
    if (sink is not None and isinstance(x, torch.Tensor) and x.requires_grad
            and sink.wants_fp32_grad(x)):
        return _UPCAST(x, sink)
    return None


def _pick(args, kwargs, names):
    return [args[i] if i < len(args) else kwargs.get(n) for i, n in enumerate(names)]


#: returned by ``route`` for a call it leaves alone
NOT_ROUTED = object()

#: the functions ``route`` may take over
ROUTED_FUNCS = frozenset((F.linear, F.embedding))


def route(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
          device_type: str, sink: GradSink | None) -> Any:
    """Run ``F.linear`` / ``F.embedding`` so the weight gradients come out in fp32, or
    return ``NOT_ROUTED``. Linear: where autocast is on for ``device_type`` and grad is
    on. Embedding: a low-precision table that ``sink`` buffers."""
    if not torch.is_grad_enabled():  # evaluation: nothing to route
        return NOT_ROUTED
    if func is F.linear and torch.is_autocast_enabled(device_type):
        x, w, b = _pick(args, kwargs, ("input", "weight", "bias"))
        dtype = torch.get_autocast_dtype(device_type)
        if (isinstance(w, torch.Tensor) and w.requires_grad and w.is_floating_point()
                and isinstance(x, torch.Tensor) and x.is_floating_point()
                and dtype != torch.float32):
            return _LINEAR(x, w, b, dtype, sink)
    elif func is F.embedding and sink is not None:
        idx, w, pad, max_norm, _, by_freq, sparse = _pick(args, kwargs, (
            "input", "weight", "padding_idx", "max_norm", "norm_type",
            "scale_grad_by_freq", "sparse"))
        if (max_norm is None and not by_freq and not sparse
                and isinstance(w, torch.Tensor) and w.requires_grad
                and sink.wants_fp32_grad(w)):
            if pad is not None and pad < 0:
                pad += w.shape[0]
            return _EMBEDDING(idx, w, pad, sink)
    return NOT_ROUTED


class Fp32WeightGrads(TorchFunctionMode):
    """``route`` as a mode of its own, for use without the engine (whose precision
    context routes the same calls in its one mode).

    Low-precision parameters that ``sink`` buffers get their fp32 gradient there; fp32
    parameters get it through autograd as usual.
    """

    def __init__(self, device_type: str, sink: GradSink | None = None) -> None:
        super().__init__()
        self.device_type, self.sink = device_type, sink

    def __enter__(self):
        compile_safe()
        return super().__enter__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in ROUTED_FUNCS:
            out = route(func, args, kwargs, self.device_type, self.sink)
            if out is not NOT_ROUTED:
                return out
        return func(*args, **kwargs)
