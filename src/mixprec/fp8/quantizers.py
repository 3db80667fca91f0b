"""Quantizers: one object per fp8 / fp4 scaling, and the one registry of them.

A quantizer casts a 2-D tensor for a *role* (``input``, ``weight``, ``grad_output``)
along the GEMM's contracted dim ``dim`` and returns a ``Quantized`` (codes, inverse
scales, dequantize, transpose), and multiplies two of its casts on a GEMM route. It is
frozen configuration: what a scaling keeps between steps (delayed scaling's amax
history, NVFP4's stochastic-rounding counter) it declares as ``buffers``, which the
owning module registers, checkpoints and hands back to ``cast``; a scaling without
history declares none, so it carries, saves and all-reduces nothing.

==============  ==================================================================
``delayed``     per tensor, scale from an amax history (Transformer Engine's
                ``DelayedScaling``); ``mixprec.fp8.scaling``
``current``     per tensor, scale from this tensor's amax (``Float8CurrentScaling``)
``rowwise``     one scale per row along the contracted dim (torchao's rowwise)
``block``       1×128 tiles, 128×128 weight blocks (``Float8BlockScaling``,
                DeepSeek-V3); ``mixprec.fp8.blocks``
``mx``          MXFP8: 1×32 tiles, e8m0 scales (``MXFP8BlockScaling``)
``nvfp4``       e2m1 in 1×16 (weights 16×16) blocks with e4m3 scales and an fp32
                scale per tensor (``NVFP4BlockScaling``); ``mixprec.fp8.nvfp4``
==============  ==================================================================

``quantizer_for(recipe)`` reads the recipe's ``fp8_scaling`` and its settings; nothing
else in mixprec branches on that name. The rest asks the quantizer: ``reuses(role)``
(the forward's cast serves the backward GEMM), ``per_tensor`` (FSDP2 can gather the
weight as fp8), ``exact_fp32`` (its GEMMs run on dequantized fp32 operands),
``kernel`` (which of torch's scaled-matmul kernels multiplies its casts: the GEMM route,
``route``, is ``mixprec.fp8.route``'s), ``memory_route`` and ``tile`` (for the memory
planner and the diagnostics).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ClassVar

import torch

from mixprec.fp8.blocks import MX_TILE, TILE, cast_blocks, cast_mx, cast_tiles
from mixprec.fp8.gather import Fp8Weight
from mixprec.fp8.gemm import fp8_gemm
from mixprec.fp8.nvfp4 import apply_hadamard, cast_nvfp4, hadamard_16
from mixprec.fp8.padding import run_or_fall_back
from mixprec.fp8.quantized import Quantized
from mixprec.fp8.route import gemm_route
from mixprec.fp8.scaled_mm import block_scaled_mm
from mixprec.fp8.scaling import (
    FP8_MAX,
    ROLES,
    amax_to_scale,
    cast_rowwise,
    cast_to_fp8,
    fp8_max_tensor,
    nan_if_not_finite,
    update_delayed_scales,
)
from mixprec.fp32_precision import ieee_fp32_matmul
from mixprec.recipe import Recipe

__all__ = ["Quantizer", "DelayedScaling", "CurrentScaling", "RowwiseScaling",
           "BlockScaling", "MXScaling", "NVFP4Scaling", "QUANTIZERS", "quantizer_for"]

_E4M3 = torch.float8_e4m3fn


@dataclass(frozen=True)
class Quantizer:
    """The interface (see the module doc). ``grad_dtype``: the output gradient's fp8
    dtype (e5m2 under ``fp8_format=hybrid``); ``margin``: scales are ``max / amax /
    2^margin``."""

    grad_dtype: torch.dtype = torch.float8_e5m2
    margin: int = 0

    name: ClassVar[str]
    #: the forward's casts serve the backward GEMMs (a per-tensor scale has no axis)
    reused_roles: ClassVar[tuple[str, ...]] = ()
    #: one scale per tensor: FSDP2 may gather the weight as fp8 codes
    per_tensor: ClassVar[bool] = False
    #: an amax history in ``fp8_amax_history`` that the ranks agree on every step
    has_history: ClassVar[bool] = False
    #: the GEMMs multiply dequantized fp32 operands (full fp32 precision pinned)
    exact_fp32: ClassVar[bool] = False
    #: elements per scale along the contracted dim, as the diagnostics judge underflow
    tile: ClassVar[int] = TILE
    #: how the memory planner counts this scaling's backward (``mixprec.memory``)
    memory_route: ClassVar[str] = "fp8"
    #: which of torch's scaled-matmul kernels multiplies its casts (``mixprec.fp8.route``):
    #: ``tensor`` (``_scaled_mm``, per tensor and rowwise), ``block``, ``mx``, ``nvfp4``
    kernel: ClassVar[str] = "tensor"
    #: which of the diagnostics' flush shares applies ("" for none: fp4 flushes by design)
    flush_view: ClassVar[str] = "per-tensor"
    #: the GEMMs this format quantizes (``forward``, ``dgrad``, ``wgrad``); one left out
    #: runs in the gradient's 16-bit dtype on the saved high-precision input
    quantized_gemms: ClassVar[tuple[str, ...]] = ("forward", "dgrad", "wgrad")

    @classmethod
    def from_recipe(cls, r: Recipe) -> Quantizer:
        """This scaling's quantizer with ``r``'s settings."""
        return cls(**cls._settings(r))

    @staticmethod
    def _settings(r: Recipe) -> dict:
        grad = torch.float8_e5m2 if r.fp8_format == "hybrid" else _E4M3
        return {"grad_dtype": grad, "margin": r.margin}

    @property
    def stochastic_grads(self) -> bool:
        """The backward rounds gradients stochastically (from the module's generator)."""
        return False

    def dtype(self, role: str) -> torch.dtype:
        """The fp8 dtype of ``role``'s codes."""
        return self.grad_dtype if role == "grad_output" else _E4M3

    def buffers(self, device: torch.device | str, seed: int = 0
                ) -> dict[str, tuple[torch.Tensor, bool]]:
        """What this scaling keeps between steps: name -> (initial tensor, persistent)."""
        return {}

    def reuses(self, role: str) -> bool:
        """Whether the forward's cast of ``role`` serves its backward GEMM too."""
        return role in self.reused_roles

    def cast(self, t: torch.Tensor, role: str, dim: int, state: dict, record: bool = False,
             generator: torch.Generator | None = None) -> Quantized:
        """``t`` (2-D) cast for ``role`` with scales along ``dim``, the GEMM's contracted
        dim. ``state``: the module's buffers of ``buffers``; ``record``: this cast is
        part of a training step (delayed scaling records its amax)."""
        raise NotImplementedError(type(self).__name__)

    def gemm_context(self) -> contextlib.AbstractContextManager:
        """Around a Linear's casts and GEMMs: full-precision fp32 matmul for the
        dequantizing quantizers (``mixprec.fp32_precision.ieee_fp32_matmul``)."""
        return ieee_fp32_matmul() if self.exact_fp32 else contextlib.nullcontext()

    def route(self, device: torch.device | str, choice: str = "auto") -> str:
        """The GEMM route ``mm`` takes on ``device`` for the recipe's ``fp8_gemm``
        ``choice``: ``mixprec.fp8.route.gemm_route``, the one decision."""
        return gemm_route(device, self, choice)

    def mm(self, a: Quantized, b: Quantized, out_dtype: torch.dtype, backend: str
           ) -> torch.Tensor:
        """``a @ b`` (``a`` (M, K), ``b`` (K, N), each scaled along K) in ``out_dtype``,
        fp32 accumulation: torch's block-scaled kernel where ``backend`` is
        ``scaled_mm``, else the exact dequantizing GEMM."""
        exact = lambda: (a.dequant() @ b.dequant()).to(out_dtype)  # noqa: E731
        if backend == "scaled_mm":  # a shape the kernel refuses: this GEMM runs exact
            return run_or_fall_back(lambda: block_scaled_mm(a, b, out_dtype, self.kernel),
                                    exact, f"the {self.kernel} kernel",
                                    (a.codes.shape[0], a.codes.shape[1], b.codes.shape[1]),
                                    a.data.device)
        return exact()

    def update(self, state: dict, found_inf: torch.Tensor | None = None) -> None:
        """Once per optimizer step (delayed scaling's history); nothing by default."""


@dataclass(frozen=True)
class _PerTensor(Quantizer):
    """One scale per tensor; the GEMM runs on ``torch._scaled_mm`` or the dequant
    routes of ``mixprec.fp8.gemm.fp8_gemm``."""

    reused_roles: ClassVar[tuple[str, ...]] = ROLES
    per_tensor: ClassVar[bool] = True

    def mm(self, a: Quantized, b: Quantized, out_dtype: torch.dtype, backend: str
           ) -> torch.Tensor:
        """``fp8_gemm`` on the codes and inverse scales (per tensor: scalars; rowwise:
        one per row of ``a`` and per column of ``b``)."""
        return fp8_gemm(a.codes, b.codes, a.inv, b.inv, out_dtype, backend)

    def _scale(self, amax: torch.Tensor, role: str, state: dict, record: bool
               ) -> torch.Tensor:
        raise NotImplementedError(type(self).__name__)

    def _record(self, state: dict, role: str, amax: torch.Tensor) -> None:
        """Delayed scaling: ``amax`` into this step's history slot."""

    def cast(self, t: torch.Tensor, role: str, dim: int, state: dict, record: bool = False,
             generator: torch.Generator | None = None) -> Quantized:
        """Per-tensor cast. A weight FSDP2 gathered as fp8 (``Fp8Weight``) is cast
        already with this role's scale: its codes are copied (the backward keeps them;
        FSDP frees the gathered bytes), and the shard's amax it carries is recorded,
        which the step's all-reduce MAX makes the whole weight's."""
        if isinstance(t, Fp8Weight):
            if record:
                self._record(state, role, t._amax)
            return Quantized(t._codes.clone(), torch.reciprocal(t._scale))
        amax = t.detach().abs().amax().float()
        scale = self._scale(amax, role, state, record)
        scale = nan_if_not_finite(scale, amax)  # an inf must not saturate to a finite max
        return Quantized(cast_to_fp8(t, scale, self.dtype(role)), torch.reciprocal(scale))


@dataclass(frozen=True)
class DelayedScaling(_PerTensor):
    """Per-tensor scales from an amax history of ``history_len`` steps, reduced by
    ``algo`` (``max`` or ``most_recent``); the history and scales are buffers."""

    history_len: int = 16
    algo: str = "max"
    name: ClassVar[str] = "delayed"
    has_history: ClassVar[bool] = True

    @staticmethod
    def _settings(r: Recipe) -> dict:
        return {**Quantizer._settings(r), "history_len": r.amax_history_len,
                "algo": r.amax_compute_algo}

    def buffers(self, device: torch.device | str, seed: int = 0
                ) -> dict[str, tuple[torch.Tensor, bool]]:
        """The amax history (3 roles × ``history_len``), the scales and the fp8 maxima
        (not saved: they follow from the formats)."""
        maxes = [FP8_MAX[self.dtype(role)] for role in ROLES]
        return {"fp8_amax_history": (torch.zeros(3, self.history_len, device=device), True),
                "fp8_scale": (torch.ones(3, device=device), True),
                "fp8_max": (torch.tensor(maxes, device=device), False)}

    def _record(self, state: dict, role: str, amax: torch.Tensor) -> None:
        slot = state["fp8_amax_history"][ROLES.index(role), 0]
        slot.copy_(torch.maximum(slot, amax))

    def _scale(self, amax: torch.Tensor, role: str, state: dict, record: bool
               ) -> torch.Tensor:
        if record:
            self._record(state, role, amax)
        return state["fp8_scale"][ROLES.index(role)]

    def update(self, state: dict, found_inf: torch.Tensor | None = None) -> None:
        """Delayed scaling's step (``update_delayed_scales``): a new scale from the
        history, which rolls; a skipped step drops its amaxes."""
        with torch.no_grad():
            update_delayed_scales(state["fp8_amax_history"], state["fp8_scale"],
                                  state["fp8_max"], algo=self.algo, margin=self.margin,
                                  found_inf=found_inf)


@dataclass(frozen=True)
class CurrentScaling(_PerTensor):
    """Per-tensor scales from the tensor's own amax at cast time; no state."""

    name: ClassVar[str] = "current"

    def _scale(self, amax: torch.Tensor, role: str, state: dict, record: bool
               ) -> torch.Tensor:
        return amax_to_scale(amax, fp8_max_tensor(self.dtype(role), amax.device),
                             self.margin, torch.ones((), device=amax.device))


@dataclass(frozen=True)
class RowwiseScaling(Quantizer):
    """One scale per row along the contracted dim: per token for activations and
    gradients, per output (forward) or input (dgrad) channel for weights."""

    name: ClassVar[str] = "rowwise"
    memory_route: ClassVar[str] = "rowwise"
    flush_view: ClassVar[str] = "rowwise"

    def cast(self, t: torch.Tensor, role: str, dim: int, state: dict, record: bool = False,
             generator: torch.Generator | None = None) -> Quantized:
        """Rowwise cast along ``dim`` (``cast_rowwise``); the inverse scales broadcast."""
        codes, inv = cast_rowwise(t, dim, self.dtype(role), self.margin)
        return Quantized(codes, inv)

    mm = _PerTensor.mm


@dataclass(frozen=True)
class BlockScaling(Quantizer):
    """1×128 tiles for activations and gradients, 128×128 blocks for weights (which
    serve both of the weight's GEMMs); ``pow2``: scales rounded down to powers of two."""

    pow2: bool = False
    name: ClassVar[str] = "block"
    kernel: ClassVar[str] = "block"
    reused_roles: ClassVar[tuple[str, ...]] = ("weight",)
    exact_fp32: ClassVar[bool] = True
    memory_route: ClassVar[str] = "block"
    flush_view: ClassVar[str] = "per block"

    @staticmethod
    def _settings(r: Recipe) -> dict:
        return {**Quantizer._settings(r), "pow2": r.block_scales == "pow2"}

    def cast(self, t: torch.Tensor, role: str, dim: int, state: dict, record: bool = False,
             generator: torch.Generator | None = None) -> Quantized:
        """A weight in 128×128 blocks (``dim`` does not matter), else 1×128 tiles along
        ``dim``."""
        if role == "weight":
            return cast_blocks(t, _E4M3, margin=self.margin, pow2=self.pow2)
        return cast_tiles(t, dim, self.dtype(role), margin=self.margin, pow2=self.pow2)


@dataclass(frozen=True)
class MXScaling(Quantizer):
    """OCP MXFP8: 1×32 tiles along every GEMM's contracted dim, e8m0 scales whose
    exponent ``rounding`` picks (``mixprec.fp8.blocks.mx_exponents``)."""

    rounding: str = "rceil"
    name: ClassVar[str] = "mx"
    kernel: ClassVar[str] = "mx"
    exact_fp32: ClassVar[bool] = True
    tile: ClassVar[int] = MX_TILE
    memory_route: ClassVar[str] = "block"
    flush_view: ClassVar[str] = "per block"

    @staticmethod
    def _settings(r: Recipe) -> dict:
        return {**Quantizer._settings(r), "rounding": r.mx_rounding}

    def cast(self, t: torch.Tensor, role: str, dim: int, state: dict, record: bool = False,
             generator: torch.Generator | None = None) -> Quantized:
        """1×32 MX tiles along ``dim`` (``cast_mx``)."""
        return cast_mx(t, dim, self.dtype(role), self.rounding)


@dataclass(frozen=True)
class NVFP4Scaling(Quantizer):
    """NVFP4 (NVIDIA's recipe): ``two_d`` 16×16 weight blocks (else 1×16 along each
    GEMM's contracted dim), ``rht`` a random 16×16 Hadamard transform along the tokens
    of both wgrad operands, ``sr`` stochastic rounding of the gradients from the
    module's checkpointed stream (the ``nvfp4_rng`` buffer: seed, backward calls)."""

    two_d: bool = True
    rht: bool = True
    sr: bool = True
    name: ClassVar[str] = "nvfp4"
    kernel: ClassVar[str] = "nvfp4"
    exact_fp32: ClassVar[bool] = True
    memory_route: ClassVar[str] = "nvfp4"
    flush_view: ClassVar[str] = ""

    @staticmethod
    def _settings(r: Recipe) -> dict:
        return {**Quantizer._settings(r), "two_d": r.nvfp4_2d, "rht": r.nvfp4_rht,
                "sr": r.nvfp4_sr}

    @property
    def stochastic_grads(self) -> bool:
        """``sr``: the gradients' elements round stochastically."""
        return self.sr

    def reuses(self, role: str) -> bool:
        """The forward's 16×16 weight blocks serve dgrad; 1×16 casts have an axis."""
        return role == "weight" and self.two_d

    def buffers(self, device: torch.device | str, seed: int = 0
                ) -> dict[str, tuple[torch.Tensor, bool]]:
        """``nvfp4_rng``: the stochastic rounding's (seed, backward calls)."""
        return {"nvfp4_rng": (torch.tensor([seed, 0], device=device), True)}

    def cast(self, t: torch.Tensor, role: str, dim: int, state: dict, record: bool = False,
             generator: torch.Generator | None = None) -> Quantized:
        """NVFP4 cast along ``dim``; the wgrad operands (``dim=0``) Hadamard-transformed
        first under ``rht``, the gradient rounded with ``generator``."""
        if role == "weight":
            return cast_nvfp4(t, dim, square=self.two_d)
        if dim == 0 and self.rht:  # the wgrad operands, contracted over tokens
            t = apply_hadamard(t, hadamard_16(0, t.device))
        return cast_nvfp4(t, dim, generator=generator if role == "grad_output" else None)


#: every scaling by its recipe name (``fp8_scaling``)
QUANTIZERS: dict[str, type[Quantizer]] = {q.name: q for q in (
    DelayedScaling, CurrentScaling, RowwiseScaling, BlockScaling, MXScaling, NVFP4Scaling)}


def quantizer_for(recipe: Recipe | str) -> Quantizer:
    """The quantizer of ``recipe``'s ``fp8_scaling``, with its settings."""
    r = Recipe.coerce(recipe)
    try:
        cls = QUANTIZERS[r.fp8_scaling]
    except KeyError:
        raise ValueError(f"fp8_scaling={r.fp8_scaling!r}; valid: "
                         f"{', '.join(QUANTIZERS)}") from None
    return cls.from_recipe(r)
