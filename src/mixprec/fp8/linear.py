"""Float8Linear: a drop-in nn.Linear whose three GEMMs run on fp8 operands.

Forward ``y = x_e4m3 @ w_e4m3ᵀ``; backward ``dgrad = g @ w_e4m3`` and
``wgrad = gᵀ @ x_e4m3`` with ``g`` in e5m2 (``fp8_format="hybrid"``) or e4m3. Every
operand is cast with its own per-tensor scale (``scaling.py``). Accumulation is fp32,
and the bias is added in fp32. The output dtype follows the surrounding autocast (bf16
under the fp8 recipes), else the input's dtype. Backward saves the fp8 copies of ``x``
and ``w``, one byte per element, where it needs them.

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
forward and along ``out`` for dgrad). Scales no longer factor out of the sum. On a GPU
with torch's block-scaled kernel for the scaling (``mixprec.fp8.route``), and once a
probe there agreed, the GEMMs run on it (``mixprec.fp8.scaled_mm``), which accumulates
in the tensor cores' limited-precision accumulator and promotes to fp32 as DeepSeek-V3's
kernels do. Everywhere else they dequantize each operand to fp32 (code × inverse scale:
exact for power-of-two scales, MX's and ``block_scales=pow2``'s, else one fp32 rounding
per element) and run one fp32 GEMM with fp32 accumulation: exact up to summation order.

NVFP4 (``fp8_scaling=nvfp4``, ``mixprec.fp8.nvfp4``) casts ``x`` and ``g`` in 1×16
blocks along each GEMM's contracted dim and ``w`` in 16×16 blocks (``nvfp4_2d``; else
1×16 along ``in`` and along ``out``), with e4m3 block scales and an fp32 scale per tensor.
The wgrad GEMM first applies a random 16×16 Hadamard transform along the tokens to both
of its operands (``nvfp4_rht``), and the gradient's elements are rounded stochastically
(``nvfp4_sr``) from a generator whose seed and call count are the ``nvfp4_rng`` buffer,
so a resumed run draws the same numbers. The GEMMs take the block scalings' routes.
The saved e2m1 codes are kept as e4m3 bytes (every e2m1 value is one).

Every scaling is a quantizer (``mixprec.fp8.quantizers``) and all of them run through
one autograd Function here: the quantizer casts each operand for its role and axis,
says which forward casts serve the backward GEMMs, and multiplies two casts on its
route. Backward saves only the casts it will use: no weight copy for a layer whose input
needs no gradient, no input copy for one whose weight is frozen.

The route a Linear's GEMMs take (``backend``: ``scaled_mm``, ``dequant``,
``dequant_fp32``) is ``mixprec.fp8.route``'s one decision for the recipe's ``fp8_gemm``.
The per-tensor and rowwise routes are ``mixprec.fp8.gemm``'s: ``dequant``'s bf16 GEMM
rounds once before the scale is applied, so it is within 1 bf16 ulp of ``_scaled_mm``;
on a CPU without fast bf16 (AVX2) ``dequant_fp32`` runs ~7x faster
(``benchmarks/cpu_kernels.py``). ``auto`` takes ``_scaled_mm`` on GPUs that have it
(sm89+), and on a CPU the fastest route as measured. The block, MX and NVFP4 casts run
torch's block-scaled kernels (``mixprec.fp8.scaled_mm``) on the GPUs that have them once
a probe has matched them to the exact dequantizing GEMM there, which they use
everywhere else.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from mixprec.fp8.quantized import Quantized
from mixprec.fp8.quantizers import quantizer_for
from mixprec.recipe import Recipe

__all__ = ["Float8Linear", "fp8_modules", "scaling_buffers", "legacy_scaling_keys"]


def _no_autocast(t: torch.Tensor):
    """Autocast off around the GEMMs, which pick their own dtypes (meta tensors, used to
    check the CUDA calls against torch's meta kernels, have no autocast)."""
    if t.device.type == "meta":
        return contextlib.nullcontext()
    return torch.autocast(t.device.type, enabled=False)


def is_conv1d(m: nn.Module) -> bool:
    """A GPT-2-style ``Conv1D`` (transformers): ``y = x @ weight + bias``, with weight of
    shape (in, out) and ``nf`` = out. Matched by name: mixprec does not import
    transformers."""
    w = getattr(m, "weight", None)
    return (type(m).__name__ == "Conv1D" and isinstance(w, torch.Tensor) and w.dim() == 2
            and getattr(m, "nf", None) == w.shape[1])


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
    axis)."""

    @staticmethod
    def forward(ctx, x2d, weight, mod, out_dtype, record):
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
        return y

    @staticmethod
    def backward(ctx, gy):
        *saved, x_hp = ctx.saved_tensors
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
        return dx, dw, None, None, None


class Float8Linear(nn.Linear):
    """nn.Linear whose three GEMMs run on fp8 (or fp4) operands cast by the recipe's
    quantizer (``mixprec.fp8.quantizers``); build with ``from_linear``.

    Buffers are the quantizer's state only (in ``state_dict``, so a resumed run continues
    bit-identically): delayed scaling's ``fp8_amax_history`` (3 roles ×
    ``amax_history_len``: input, weight, grad_output) and ``fp8_scale`` (3,); NVFP4's
    ``nvfp4_rng``. Any dims: the GEMM routes pad where a kernel needs it
    (``mixprec.fp8.padding``).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 recipe: Recipe | str = "fp8", device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._configure(Recipe.coerce(recipe))

    def _configure(self, r: Recipe, seed: int = 0) -> None:
        self.fp8_recipe = r
        self.quantizer = quantizer_for(r)
        self.gemm_choice = r.fp8_gemm
        state = self.quantizer.buffers(self.weight.device, seed)
        for name, (t, persistent) in state.items():
            self.register_buffer(name, t, persistent=persistent)
        self._state_names = tuple(state)

    #: the weight is stored (in_features, out_features), as in a GPT-2 ``Conv1D``
    transposed = False

    @property
    def scaling(self) -> str:
        """The quantizer's name: the recipe's ``fp8_scaling``."""
        return self.quantizer.name

    @property
    def grad_dtype(self) -> torch.dtype:
        """The output gradient's fp8 dtype."""
        return self.quantizer.grad_dtype

    @property
    def margin(self) -> int:
        """Scales are ``max / amax / 2^margin``."""
        return self.quantizer.margin

    @property
    def block_pow2(self) -> bool:
        """The recipe's ``block_scales=pow2`` (block scaling only)."""
        return self.fp8_recipe.block_scales == "pow2"

    @property
    def mx_rounding(self) -> str:
        """The recipe's ``mx_rounding`` (MX scaling only)."""
        return self.fp8_recipe.mx_rounding

    def scaling_state(self) -> dict[str, torch.Tensor]:
        """The quantizer's buffers by name (empty for a scaling without history)."""
        return {n: getattr(self, n) for n in self._state_names}

    def quantize(self, t: torch.Tensor, role: str, dim: int, record: bool = False,
                 generator: torch.Generator | None = None) -> Quantized:
        """``t`` (2-D) cast for ``role`` along ``dim`` by this module's quantizer.
        ``record``: part of a training step (delayed scaling records the amax). A
        forward that builds no graph (an evaluation) does not record: it is not part of
        the step, and a checkpoint taken after it must resume like an uninterrupted run."""
        return self.quantizer.cast(t, role, dim, self.scaling_state(), record, generator)

    def _sr_generator(self, device) -> torch.Generator | torch.Tensor | None:
        """Stochastic rounding of the gradients: a generator for this backward, seeded
        from ``nvfp4_rng`` (seed, calls) and advancing it; None where the quantizer
        rounds to nearest.

        A compiled backward cannot make a generator: there the key ``seed · 1000003 +
        calls`` (a tensor) is returned for ``nvfp4.counter_uniform``, and the count
        advances on the device, inside the graph. Compiled and eager runs draw different
        random bits, each reproducible and resumable from the same buffer (a module that
        switches between the two within one run continues its eager count from its
        last eager backward; a checkpoint or ``load_state_dict`` re-reads it)."""
        if not self.quantizer.stochastic_grads or torch.device(device).type == "meta":
            return None  # (meta tensors: shapes only, rounded to nearest)
        if torch.compiler.is_compiling():
            rng = self.nvfp4_rng
            key = rng[0] * 1_000_003 + rng[1]
            rng[1:] += 1
            return key
        if self._rng_host is None:  # once after construction or a load: one host read
            self._rng_host = [int(v) for v in self.nvfp4_rng.tolist()]
        seed, calls = self._rng_host
        self._rng_host[1] += 1
        self.nvfp4_rng[1] += 1  # the checkpointed copy, on the device: no host sync
        return torch.Generator(device).manual_seed(seed * 1_000_003 + calls)

    _rng_host: list[int] | None = None

    #: buffers every Float8Linear of mixprec 0.2 saved, whatever its scaling
    _V02_BUFFERS = ("fp8_amax_history", "fp8_scale")

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """Also loads a state dict saved by mixprec 0.2, whose Float8Linears held
        delayed-scaling buffers under every scaling: a scaling without history reads
        nothing from them, so they are dropped."""
        self._rng_host = None  # the loaded nvfp4_rng is read again on the next backward
        own = self.scaling_state()
        for name in self._V02_BUFFERS:
            if name not in own:
                state_dict.pop(prefix + name, None)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

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
        """The GEMM route that runs (``mixprec.fp8.route.gemm_route`` for ``fp8_gemm``):
        ``"scaled_mm"`` (torch's scaled matmul: ``torch._scaled_mm`` per tensor and
        rowwise, the block-scaled kernels for block, MX and NVFP4), ``"dequant"`` (fp8
        values in bf16, whose products are exact, fp32 accumulation) or
        ``"dequant_fp32"``."""
        return self.quantizer.route(self.weight.device, self.gemm_choice)

    def update_scales(self, found_inf: torch.Tensor | None = None) -> None:
        """Once per optimizer step: the quantizer's update (delayed scaling advances its
        history; a no-op for the others)."""
        self.quantizer.update(self.scaling_state(), found_inf)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + b`` with x, W and (in backward) the gradient cast by the
        quantizer; the output is in the autocast dtype."""
        dev = x.device.type
        out_dtype = (torch.get_autocast_dtype(dev) if dev != "meta"
                     and torch.is_autocast_enabled(dev) else x.dtype)
        x2d = x.reshape(-1, x.shape[-1])
        w = self.weight.t() if self.transposed else self.weight  # (out, in) either way
        # whether to record amaxes is decided here: inside the Function, grad is off
        y = _QuantizedMatmul.apply(x2d, w, self, out_dtype, torch.is_grad_enabled())
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


def legacy_scaling_keys(model: nn.Module, state: dict) -> set[str]:
    """Keys of ``state`` (a ``model.state_dict()`` saved by mixprec 0.2) that name the
    delayed-scaling buffers every Float8Linear held there, for modules whose scaling
    keeps no history now; ``load_state_dict`` drops them."""
    out = set()
    for name, m in fp8_modules(model).items():
        own = m.scaling_state()
        for b in Float8Linear._V02_BUFFERS:
            key = f"{name}.{b}" if name else b
            if b not in own and key in state:
                out.add(key)
    return out


def scaling_buffers(m: Float8Linear) -> dict[str, torch.Tensor]:
    """The module's fp8 scaling state by buffer name: amax history, scales, fp8 maxima,
    and NVFP4's stochastic-rounding counter (not weights: ``fp32_state_dict`` leaves
    them out; the memory ledger counts them as ``fp8``)."""
    out = m.scaling_state()
    if getattr(m, "fp8_gather_scale", None) is not None:
        out["fp8_gather_scale"] = m.fp8_gather_scale
    return out
