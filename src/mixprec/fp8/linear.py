"""Float8Linear: a drop-in nn.Linear whose three GEMMs run on fp8 operands.

Forward ``y = x_e4m3 @ w_e4m3ᵀ``; backward ``dgrad = g @ w_e4m3`` and
``wgrad = gᵀ @ x_e4m3`` with ``g`` in e5m2 (``fp8_format="hybrid"``) or e4m3. Every
operand is cast with its own per-tensor scale (``scaling.py``). Accumulation is fp32,
and the bias is added in fp32. The output dtype follows the surrounding autocast (bf16
under the fp8 recipes), else the input's dtype. Backward saves the fp8 copies of ``x``
and ``w``, one byte per element.

Rowwise scaling (``fp8_scaling="rowwise"``) gives each operand one scale per row along
the GEMM's contraction dim, so the scales factor out of the sum:
``y[i, j] = Σ_k x8[i, k] w8[j, k] / (sx[i] sw[j])``. Each GEMM contracts a different
dim, so each tensor is cast along two axes: ``x`` per token (forward) and per input
feature (wgrad, over tokens); ``w`` per output channel (forward) and per input channel
(dgrad, over output channels); ``g`` per token (dgrad) and per output channel (wgrad).
Backward saves the second casts of ``x`` and ``w``, still one byte per element.

Block scaling (``fp8_scaling=block``, DeepSeek-V3) and MXFP8 (``fp8_scaling=mx``) follow
the same axes with a scale per tile of the contracted dim (``mixprec.fp8.blocks``):
``x`` and ``g`` in 1×128 (MX: 1×32) tiles along each GEMM's contracted dim, ``w`` in
128×128 blocks that serve both of its GEMMs (MX: 1×32 tiles along ``in`` for the
forward and along ``out`` for dgrad). Scales no longer factor out of the sum, so these
GEMMs dequantize each operand to fp32 (code × inverse scale: exact for power-of-two
scales, MX's and ``block_scales=pow2``'s, else one fp32 rounding per element) and run one
fp32 GEMM with fp32 accumulation, on the CPU and on CUDA alike. That is exact up to
summation order, where DeepSeek-V3's CUDA kernels accumulate each 128-long tile's
partial product in the tensor cores' limited-precision accumulator and promote it to
fp32 per tile. torch's block-scaled ``_scaled_mm`` is not used yet.

NVFP4 (``fp8_scaling=nvfp4``, ``mixprec.fp8.nvfp4``) casts ``x`` and ``g`` in 1×16
blocks along each GEMM's contracted dim and ``w`` in 16×16 blocks (``nvfp4_2d``; else
1×16 along ``in`` and along ``out``), with e4m3 block scales and an fp32 scale per tensor.
The wgrad GEMM first applies a random 16×16 Hadamard transform along the tokens to both
of its operands (``nvfp4_rht``), and the gradient's elements are rounded stochastically
(``nvfp4_sr``) from a generator whose seed and call count are the ``nvfp4_rng`` buffer,
so a resumed run draws the same numbers. The GEMMs multiply dequantized fp32 operands.
The saved e2m1 codes are kept as e4m3 bytes (every e2m1 value is one).

GEMM backends (``gemm_backend(device, recipe.fp8_gemm)``):

- ``scaled_mm``: ``torch._scaled_mm``, the hardware fp8 GEMM (CUDA sm89+). This
  project's CPU also has it, but only as a reference kernel at ~0.1 GFLOP/s, far too
  slow to train with (see README);
- ``dequant``: the fp8 operands upcast exactly to bf16 (e4m3/e5m2 values are bf16
  values) and multiplied with fp32 accumulation. For fp32 outputs it uses an fp32 GEMM
  and is exact up to summation order. For bf16 outputs it uses a bf16 GEMM, which rounds
  once before the scale is applied, so it is within 1 bf16 ulp of ``_scaled_mm``.
  Rounding, saturation and scales are the fp8 ones in both backends; only the matmul
  instruction differs;
- ``dequant_fp32``: the same upcast, to fp32, and an fp32 GEMM for every output: exact up
  to summation order, then rounded once. On a CPU without fast bf16 (AVX2) it runs ~7x
  faster than ``dequant``'s bf16 GEMM (``benchmarks/cpu_kernels.py``).

``auto`` picks ``scaled_mm`` on CUDA, and on a CPU the fastest route as measured
(``mixprec.kernels.fp8_gemm_route``): CPU ``_scaled_mm`` is a ~0.1 GFLOP/s reference
kernel on one chip and as fast as fp32 on another.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from mixprec.fp8.blocks import BlockCast, _pad_to, cast_blocks, cast_mx, cast_tiles
from mixprec.fp8.gather import Fp8Weight
from mixprec.fp8.nvfp4 import NVFP4Cast, apply_hadamard, cast_nvfp4, hadamard_16
from mixprec.fp8.scaling import (
    FP8_MAX,
    amax_to_scale,
    cast_rowwise,
    cast_to_fp8,
    nan_if_not_finite,
    update_delayed_scales,
)
from mixprec.kernels import fp8_gemm_route, ieee_fp32_matmul
from mixprec.recipe import Recipe

__all__ = ["Float8Linear", "fp8_gemm", "gemm_backend", "fp8_modules", "scaling_buffers"]


def gemm_backend(device: torch.device, choice: str = "auto") -> str:
    """The GEMM backend for ``device``: ``scaled_mm``, ``dequant`` or ``dequant_fp32``
    (``auto``: measured, ``mixprec.kernels.fp8_gemm_route``)."""
    return fp8_gemm_route(device, choice)


def _no_autocast(t: torch.Tensor):
    """Autocast off around the GEMMs, which pick their own dtypes (meta tensors, used to
    check the CUDA calls against torch's meta kernels, have no autocast)."""
    if t.device.type == "meta":
        return contextlib.nullcontext()
    return torch.autocast(t.device.type, enabled=False)


#: torch._scaled_mm needs the contraction dim and the output's columns divisible by 16
SCALED_MM_MULTIPLE = 16


def _scaled_mm_operands(a: torch.Tensor, b: torch.Tensor):
    """``a`` (M, K) row-major and ``b`` (K, N) column-major, with K and N padded with
    zeros to multiples of 16, as ``torch._scaled_mm`` takes them. The weight gradient
    contracts over tokens (``gᵀ @ x``), whose count is any number; fp8's zero byte is
    +0, so the padding changes no sum. Returns ``(a, b, N)``; the output's first N
    columns are the product."""
    m16 = SCALED_MM_MULTIPLE
    a = _pad_to(a.contiguous().view(torch.uint8), 1, m16).view(a.dtype)
    bt = _pad_to(b.t().contiguous().view(torch.uint8), m16, m16).view(b.dtype)  # (N, K)
    return a, bt.t(), b.shape[1]


def fp8_gemm(a: torch.Tensor, b: torch.Tensor, inv_a: torch.Tensor, inv_b: torch.Tensor,
             out_dtype: torch.dtype, backend: str) -> torch.Tensor:
    """(a · inv_a) @ (b · inv_b) for fp8 ``a`` (M, K) and ``b`` (K, N), fp32 accumulation.

    ``inv_a`` and ``inv_b`` are scalars (per-tensor) or one per row of ``a`` (M, 1) and
    per column of ``b`` (1, N) (rowwise). torch's rowwise ``_scaled_mm`` kernels write
    bf16 only, so for other outputs ``scaled_mm`` runs at unit scales into fp32 and
    applies them after: the same sum, one more pass over the output."""
    if backend == "scaled_mm":
        a, b, n = _scaled_mm_operands(a, b)
        if inv_b.numel() > 1 and inv_b.shape[-1] != b.shape[1]:  # rowwise: pad N's scales
            inv_b = torch.cat([inv_b, inv_b.new_ones(1, b.shape[1] - inv_b.shape[-1])], 1)
        if inv_a.numel() == 1 and inv_b.numel() == 1 or out_dtype == torch.bfloat16:
            y = torch._scaled_mm(a, b, scale_a=inv_a, scale_b=inv_b, out_dtype=out_dtype)
            return y if y.shape[1] == n else y[:, :n]
        one = torch.ones((), device=a.device)
        y = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32)
        return (y * (inv_a * inv_b)).to(out_dtype)[:, :n]
    if backend not in ("dequant", "dequant_fp32"):
        raise ValueError(f"fp8 GEMM backend {backend!r}; valid: scaled_mm, dequant, "
                         "dequant_fp32, auto")
    fp32 = out_dtype == torch.float32 or backend == "dequant_fp32"
    if not fp32:
        y = torch.mm(a.to(torch.bfloat16), b.to(torch.bfloat16))
    else:
        with ieee_fp32_matmul():
            y = torch.mm(a.float(), b.float())
    return (y.float() * (inv_a * inv_b)).to(out_dtype)


def is_conv1d(m: nn.Module) -> bool:
    """A GPT-2-style ``Conv1D`` (transformers): ``y = x @ weight + bias``, with weight of
    shape (in, out) and ``nf`` = out. Matched by name: mixprec does not import
    transformers."""
    w = getattr(m, "weight", None)
    return (type(m).__name__ == "Conv1D" and isinstance(w, torch.Tensor) and w.dim() == 2
            and getattr(m, "nf", None) == w.shape[1])


def _input_and_weight_grads(ctx, g_dgrad, g_wgrad, w8, w_inv, x8, x_inv):
    """``dx = g @ w`` and ``dw = gᵀ @ x`` on fp8 operands, each only where autograd needs
    it. ``g_dgrad()`` / ``g_wgrad()`` give the gradient's fp8 cast and inverse scales for
    each GEMM (one cast for both per tensor; per token and per channel rowwise)."""
    mod, dx, dw = ctx.mod, None, None
    if ctx.needs_input_grad[0]:
        g8, g_inv = g_dgrad()
        dx_dtype = ctx.x_dtype if ctx.x_dtype == torch.bfloat16 else torch.float32
        dx = fp8_gemm(g8, w8, g_inv, w_inv, dx_dtype, mod.backend).to(ctx.x_dtype)
    if ctx.needs_input_grad[1]:
        g8, g_inv = g_wgrad()
        dw = fp8_gemm(g8.t(), x8, g_inv.t(), x_inv, torch.float32, mod.backend)
        dw = dw.to(ctx.w_dtype)
    return dx, dw


class _Fp8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, mod, out_dtype, record):
        with _no_autocast(x2d):
            x8, x_inv = mod._cast(x2d, 0, torch.float8_e4m3fn, record)
            w8, w_inv = mod._cast(weight, 1, torch.float8_e4m3fn, record)
            y = fp8_gemm(x8, w8.t(), x_inv, w_inv, out_dtype, mod.backend)
        ctx.save_for_backward(x8, w8, x_inv, w_inv)
        ctx.mod, ctx.x_dtype, ctx.w_dtype = mod, x2d.dtype, weight.dtype
        return y

    @staticmethod
    def backward(ctx, gy):
        x8, w8, x_inv, w_inv = ctx.saved_tensors
        with _no_autocast(gy):
            g = ctx.mod._cast(gy, 2, ctx.mod.grad_dtype, record=True)  # records the amax
            dx, dw = _input_and_weight_grads(ctx, lambda: g, lambda: g, w8, w_inv, x8, x_inv)
        return dx, dw, None, None, None


class _Fp8MatmulRowwise(torch.autograd.Function):
    """The three GEMMs with rowwise scales; see the module doc for the axes."""

    @staticmethod
    def forward(ctx, x2d, weight, mod, out_dtype):
        e4m3, margin = torch.float8_e4m3fn, mod.margin
        with _no_autocast(x2d):
            x8, x_inv = cast_rowwise(x2d, 1, e4m3, margin)      # (M, 1): per token
            w8, w_inv = cast_rowwise(weight, 1, e4m3, margin)   # (N, 1): per out channel
            y = fp8_gemm(x8, w8.t(), x_inv, w_inv.t(), out_dtype, mod.backend)
            del x8, w8
            # backward contracts w over out channels (dgrad) and x over tokens (wgrad)
            wc8, wc_inv = (cast_rowwise(weight, 0, e4m3, margin) if ctx.needs_input_grad[0]
                           else (None, None))
            xc8, xc_inv = (cast_rowwise(x2d, 0, e4m3, margin) if ctx.needs_input_grad[1]
                           else (None, None))
        ctx.save_for_backward(xc8, wc8, xc_inv, wc_inv)
        ctx.mod, ctx.x_dtype, ctx.w_dtype = mod, x2d.dtype, weight.dtype
        return y

    @staticmethod
    def backward(ctx, gy):
        xc8, wc8, xc_inv, wc_inv = ctx.saved_tensors
        fmt, margin = ctx.mod.grad_dtype, ctx.mod.margin
        with _no_autocast(gy):
            dx, dw = _input_and_weight_grads(
                ctx,
                lambda: cast_rowwise(gy, 1, fmt, margin),   # (M, 1): per token
                lambda: cast_rowwise(gy, 0, fmt, margin),   # (1, N): per out channel
                wc8, wc_inv, xc8, xc_inv)
        return dx, dw, None, None


class _Fp8MatmulBlocks(torch.autograd.Function):
    """The three GEMMs on block-scaled operands (block or mx); see the module doc."""

    @staticmethod
    def forward(ctx, x2d, weight, mod, out_dtype):
        with _no_autocast(x2d), ieee_fp32_matmul():
            xs, ws = mod._block_cast(x2d, "x", 1), mod._block_cast(weight, "w", 1)
            y = (xs.dequant() @ ws.dequant().t()).to(out_dtype)
            # backward: w contracted over out channels (dgrad), x over tokens (wgrad)
            wc = (mod._block_cast(weight, "w", 0) if ctx.needs_input_grad[0] else None)
            xc = mod._block_cast(x2d, "x", 0) if ctx.needs_input_grad[1] else None
        # the fp8 codes (one byte per element) and their scales
        ctx.save_for_backward(*(t for c in (xc, wc) for t in
                                ((c.codes, c.inv) if c is not None else (None, None))))
        ctx.blocks = [(c.rows, c.cols) if c is not None else None for c in (xc, wc)]
        ctx.mod, ctx.x_dtype, ctx.w_dtype = mod, x2d.dtype, weight.dtype
        return y

    @staticmethod
    def backward(ctx, gy):
        xq, xi, wq, wi = ctx.saved_tensors
        (xb, wb), mod, dx, dw = ctx.blocks, ctx.mod, None, None
        xc = BlockCast(xq, xi, *xb) if xb is not None else None
        wc = BlockCast(wq, wi, *wb) if wb is not None else None
        with _no_autocast(gy), ieee_fp32_matmul():
            if ctx.needs_input_grad[0]:
                g = mod._block_cast(gy, "g", 1).dequant()  # tiles along out
                dx_dtype = ctx.x_dtype if ctx.x_dtype == torch.bfloat16 else torch.float32
                dx = (g @ wc.dequant()).to(dx_dtype).to(ctx.x_dtype)
            if ctx.needs_input_grad[1]:
                g = mod._block_cast(gy, "g", 0).dequant()  # tiles along tokens
                dw = (g.t() @ xc.dequant()).to(ctx.w_dtype)
        return dx, dw, None, None


def _saved(c: NVFP4Cast) -> tuple:
    """An NVFP4 cast as tensors to save: codes as e4m3 bytes (exact), scales, descale."""
    return c.codes.to(torch.float8_e4m3fn), c.scales, c.descale


def _restored(codes, scales, descale, rows, cols) -> NVFP4Cast:
    return NVFP4Cast(codes.float(), scales, descale, rows, cols)


class _NVFP4Matmul(torch.autograd.Function):
    """The three GEMMs in NVFP4; see the module doc."""

    @staticmethod
    def forward(ctx, x2d, weight, mod, out_dtype):
        with _no_autocast(x2d), ieee_fp32_matmul():
            w = cast_nvfp4(weight, 1, square=mod.nvfp4_2d)
            y = (cast_nvfp4(x2d, 1).dequant() @ w.dequant().t()).to(out_dtype)
            wd = w if mod.nvfp4_2d else cast_nvfp4(weight, 0)  # dgrad: along out
            xw = x2d if not mod.nvfp4_rht else apply_hadamard(x2d, mod._hadamard())
            xc = cast_nvfp4(xw, 0)  # wgrad: blocks along tokens
        ctx.save_for_backward(*_saved(xc), *_saved(wd))
        ctx.shapes = ((xc.rows, xc.cols), (wd.rows, wd.cols))
        ctx.mod, ctx.x_dtype, ctx.w_dtype = mod, x2d.dtype, weight.dtype
        return y

    @staticmethod
    def backward(ctx, gy):
        t = ctx.saved_tensors
        xc, wd = _restored(*t[:3], *ctx.shapes[0]), _restored(*t[3:], *ctx.shapes[1])
        mod, dx, dw = ctx.mod, None, None
        gen = mod._sr_generator(gy.device)
        with _no_autocast(gy), ieee_fp32_matmul():
            if ctx.needs_input_grad[0]:
                g = cast_nvfp4(gy, 1, generator=gen).dequant()
                dx_dtype = ctx.x_dtype if ctx.x_dtype == torch.bfloat16 else torch.float32
                dx = (g @ wd.dequant()).to(dx_dtype).to(ctx.x_dtype)
            if ctx.needs_input_grad[1]:
                gw = gy if not mod.nvfp4_rht else apply_hadamard(gy, mod._hadamard())
                g = cast_nvfp4(gw, 0, generator=gen).dequant()
                dw = (g.t() @ xc.dequant()).to(ctx.w_dtype)
        return dx, dw, None, None


class Float8Linear(nn.Linear):
    """nn.Linear with fp8 GEMMs and per-tensor (or rowwise) scaling; build with
    ``from_linear``.

    Buffers (in ``state_dict``, so a resumed run continues bit-identically):
    ``fp8_amax_history`` (3 roles × ``amax_history_len``: input, weight, grad_output) and
    ``fp8_scale`` (3,). Both dims must be multiples of 16 (the fp8 GEMM's rule).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 recipe: Recipe | str = "fp8", device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._configure(Recipe.coerce(recipe))

    def _configure(self, r: Recipe, seed: int = 0) -> None:
        if self.in_features % 16 or self.out_features % 16:
            raise ValueError(
                f"Float8Linear needs in_features and out_features divisible by 16, got "
                f"{self.in_features} x {self.out_features}; keep this layer in bf16")
        self.scaling = r.fp8_scaling
        self.amax_algo = r.amax_compute_algo
        self.margin = r.margin
        self.grad_dtype = torch.float8_e5m2 if r.fp8_format == "hybrid" else torch.float8_e4m3fn
        self.gemm_choice = r.fp8_gemm
        self.block_pow2 = r.block_scales == "pow2"
        self.mx_rounding = r.mx_rounding
        self.nvfp4_2d, self.nvfp4_rht, self.nvfp4_sr = r.nvfp4_2d, r.nvfp4_rht, r.nvfp4_sr
        if self.scaling == "nvfp4":
            # (seed, backward calls): the stochastic rounding's stream, checkpointed
            self.register_buffer("nvfp4_rng", torch.tensor([seed, 0],
                                                           device=self.weight.device))
        dev = self.weight.device
        self.register_buffer("fp8_amax_history",
                             torch.zeros(3, r.amax_history_len, device=dev))
        self.register_buffer("fp8_scale", torch.ones(3, device=dev))
        maxes = [FP8_MAX[torch.float8_e4m3fn]] * 2 + [FP8_MAX[self.grad_dtype]]
        self.register_buffer("fp8_max", torch.tensor(maxes, device=dev), persistent=False)

    #: the weight is stored (in_features, out_features), as in a GPT-2 ``Conv1D``
    transposed = False
    def _hadamard(self) -> torch.Tensor:
        """The wgrad GEMM's 16×16 random Hadamard transform (fixed)."""
        return hadamard_16(0, self.weight.device)

    def _sr_generator(self, device) -> torch.Generator | None:
        """NVFP4's stochastic rounding: a generator for this backward, seeded from
        ``nvfp4_rng`` (seed, calls) and advancing it; None without ``nvfp4_sr``."""
        if not self.nvfp4_sr:
            return None
        if self._rng_host is None:  # once after construction or a load: one host read
            self._rng_host = [int(v) for v in self.nvfp4_rng.tolist()]
        seed, calls = self._rng_host
        self._rng_host[1] += 1
        self.nvfp4_rng[1] += 1  # the checkpointed copy, on the device: no host sync
        return torch.Generator(device).manual_seed(seed * 1_000_003 + calls)

    _rng_host: list[int] | None = None

    def _load_from_state_dict(self, *args, **kwargs):
        self._rng_host = None  # the loaded nvfp4_rng is read again on the next backward
        super()._load_from_state_dict(*args, **kwargs)

    @classmethod
    def from_linear(cls, linear: nn.Module, recipe: Recipe | str = "fp8",
                    seed: int = 0) -> Float8Linear:
        """A Float8Linear that shares ``linear``'s weight and bias Parameters (so an
        optimizer built over the model still holds them).

        ``linear`` is an ``nn.Linear``, or a GPT-2-style ``Conv1D`` (``y = x @ W + b``
        with ``W`` of shape (in, out)): its weight keeps that layout, so the state dict
        stays loadable by the original model, and the GEMM uses its transpose."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        if is_conv1d(linear):
            new.in_features, new.out_features = linear.weight.shape
            new.transposed = True
        else:
            new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new._configure(Recipe.coerce(recipe), seed)
        return new

    @property
    def backend(self) -> str:
        """The fp8 GEMM that runs: ``"scaled_mm"`` (``torch._scaled_mm``) or
        ``"dequant"`` (fp8 values in bf16, whose products are exact, fp32 accumulation)."""
        return gemm_backend(self.weight.device, self.gemm_choice)

    def _cast(self, t: torch.Tensor, role: int, dtype: torch.dtype, record: bool):
        """``t`` in fp8 with its role's scale, and the inverse scale. Delayed scaling:
        ``record`` adds ``t``'s amax to this step's history slot (max over micro-batches).
        A forward that builds no graph (an evaluation) does not record: it is not part of
        the step, and a checkpoint taken after it must resume like an uninterrupted run.

        A weight FSDP2 gathered as fp8 (``Fp8Weight``, ``mixprec.fp8.gather``) is cast
        already, with this role's scale: its codes are copied (the backward keeps them;
        FSDP frees the gathered bytes), and ``record`` records this rank's shard amax,
        which the step's all-reduce MAX makes the whole weight's."""
        if isinstance(t, Fp8Weight):
            if record and self.scaling == "delayed":
                slot = self.fp8_amax_history[role, 0]
                slot.copy_(torch.maximum(slot, t._amax))
            return t._codes.clone(), torch.reciprocal(t._scale)
        amax = t.detach().abs().amax().float()
        if self.scaling == "current":
            scale = amax_to_scale(amax, self.fp8_max[role], self.margin,
                                  torch.ones((), device=t.device))
        else:
            if record:
                slot = self.fp8_amax_history[role, 0]
                slot.copy_(torch.maximum(slot, amax))
            scale = self.fp8_scale[role]
        scale = nan_if_not_finite(scale, amax)  # an inf must not saturate to a finite max
        return cast_to_fp8(t, scale, dtype), torch.reciprocal(scale)

    def _block_cast(self, t: torch.Tensor, role: str, dim: int) -> BlockCast:
        """``t`` (2-D) cast for one GEMM, contracted along ``dim``: block scaling's
        1×128 tiles for ``x``/``g`` and 128×128 blocks for ``w`` (``dim`` then does not
        matter), or MX 1×32 tiles for all three. ``g`` takes the gradient format."""
        dtype = self.grad_dtype if role == "g" else torch.float8_e4m3fn
        if self.scaling == "mx":
            return cast_mx(t, dim, dtype, self.mx_rounding)
        if role == "w":
            return cast_blocks(t, dtype, margin=self.margin, pow2=self.block_pow2)
        return cast_tiles(t, dim, dtype, margin=self.margin, pow2=self.block_pow2)

    def update_scales(self, found_inf: torch.Tensor | None = None) -> None:
        """Delayed scaling: advance the history once per optimizer step (no-op for current)."""
        if self.scaling == "delayed":
            with torch.no_grad():
                update_delayed_scales(self.fp8_amax_history, self.fp8_scale, self.fp8_max,
                                      algo=self.amax_algo, margin=self.margin,
                                      found_inf=found_inf)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + b`` with x and W cast to e4m3 at their scales (e5m2 or e4m3
        for the gradient in backward); the output is in the autocast dtype."""
        dev = x.device.type
        out_dtype = (torch.get_autocast_dtype(dev) if dev != "meta"
                     and torch.is_autocast_enabled(dev) else x.dtype)
        x2d = x.reshape(-1, x.shape[-1])
        w = self.weight.t() if self.transposed else self.weight  # (out, in) either way
        if self.scaling == "rowwise":
            y = _Fp8MatmulRowwise.apply(x2d, w, self, out_dtype)
        elif self.scaling in ("block", "mx"):
            y = _Fp8MatmulBlocks.apply(x2d, w, self, out_dtype)
        elif self.scaling == "nvfp4":
            y = _NVFP4Matmul.apply(x2d, w, self, out_dtype)
        else:
            # whether to record amaxes is decided here: inside the Function, grad is off
            y = _Fp8Matmul.apply(x2d, w, self, out_dtype, torch.is_grad_enabled())
        if self.bias is not None:
            y = (y.float() + self.bias.float()).to(out_dtype)  # bias in high precision
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        """Linear's repr plus the scaling, the weight layout and the gradient format."""
        layout = "weight=(in, out), " if self.transposed else ""
        return (f"{super().extra_repr()}, scaling={self.scaling}, {layout}"
                f"grad={'e5m2' if self.grad_dtype == torch.float8_e5m2 else 'e4m3'}, "
                f"gemm={self.gemm_choice}")


def fp8_modules(model: nn.Module) -> dict[str, Float8Linear]:
    """The model's Float8Linears by qualified name: the one test for "converted to fp8"
    (by ``convert``, or by hand)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, Float8Linear)}


def scaling_buffers(m: Float8Linear) -> dict[str, torch.Tensor]:
    """The module's fp8 scaling state by buffer name: amax history, scales, fp8 maxima,
    and NVFP4's stochastic-rounding counter (not weights: ``fp32_state_dict`` leaves
    them out; the memory ledger counts them as ``fp8``)."""
    names = ("fp8_amax_history", "fp8_scale", "fp8_max", "nvfp4_rng", "fp8_gather_scale")
    return {n: getattr(m, n) for n in names if getattr(m, n, None) is not None}
