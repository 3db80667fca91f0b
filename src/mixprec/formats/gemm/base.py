"""LinearFormat: the interface every fp8 / fp4 Linear format implements, and the fields
all of them share.

A format is frozen, keyword-only configuration validated at construction. It casts a
2-D tensor for a *role* (``input``, ``weight``, ``grad_output``) along the GEMM's
contracted dim and multiplies two of its casts on a GEMM route; what it keeps between
steps it declares as ``buffers``, which the owning module registers and checkpoints.
Everything else in mixprec asks a format object (route, bytes, gather, flush view)
instead of branching on its name. How the Linears cross the ranks and which of them
stay in bf16 are the recipe's (``LayoutOptions``, ``LastLayers``), not a format's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from mixprec.formats.blocks import TILE
from mixprec.formats.fp32_precision import ieee_fp32_matmul
from mixprec.formats.grain import ScaleGrain
from mixprec.formats.padding import (
    TENSOR_KERNEL,
    KernelSpec,
    backward_padding_bytes,
    run_or_fall_back,
)
from mixprec.formats.quantized import Quantized
from mixprec.formats.route import GEMM_CHOICES, gemm_route
from mixprec.formats.scaled_mm import block_scaled_mm
from mixprec.formats.segments import Segments, spread
from mixprec.formats.shard import Agreement

__all__ = ["LinearFormat", "Fp8Elements", "Margined", "check_fields", "TileScaled", "derived"]

E4M3 = torch.float8_e4m3fn

#: the valid values of each choice field, for validation and error messages
CHOICES: dict[str, tuple] = {
    "fp8_gemm": GEMM_CHOICES,
    "fp8_format": ("hybrid", "e4m3"),
    "amax_compute_algo": ("max", "most_recent"),
    "block_scales": ("fp32", "pow2"),
    "mx_rounding": ("rceil", "floor", "ceil", "even"),
}
_INTS = {"margin": 0, "amax_history_len": 1}


class derived:
    """A fact a format derives from its declared capabilities, read alike on the class
    (``FORMATS[name].block_scaled``) and on an instance; not a dataclass field. Each
    subclass of ``LinearFormat`` holds its facts as plain class attributes, computed
    when the class is made (``torch.compile`` reads them as constants)."""

    def __init__(self, fn: Callable[[type], Any]) -> None:
        self.fn = fn
        self.__doc__ = fn.__doc__

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self.fn(owner if owner is not None else type(obj))


def check_fields(obj: Any) -> None:
    """Each field of a format in range, raising ``ValueError`` naming field, value and
    the valid values (the messages a recipe string's users see)."""
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if f.name in CHOICES and v not in CHOICES[f.name]:
            raise ValueError(f"recipe field {f.name!r}: unknown value {v!r}; "
                             f"valid: {', '.join(CHOICES[f.name])}")
        if f.name in _INTS and not (isinstance(v, int) and not isinstance(v, bool)
                                    and v >= _INTS[f.name]):
            raise ValueError(f"recipe field {f.name!r}: {v!r} is invalid; it must be an "
                             f"integer >= {_INTS[f.name]}")
        if f.type in (bool, "bool") and not isinstance(v, bool):
            raise ValueError(f"recipe field {f.name!r}: {v!r} is invalid; it must be "
                             "true or false")


@dataclass(frozen=True, kw_only=True)
class LinearFormat:
    """A Linear's fp8 / fp4 format: the fields every format has."""

    #: the GEMM route: ``auto`` (torch's scaled kernel where this device has it, else
    #: the dequantizing GEMM with a warning; measured on a CPU), ``scaled_mm`` (the
    #: kernel, refused where missing), ``dequant`` (exact upcast, bf16 GEMM) or
    #: ``dequant_fp32`` (exact upcast, fp32 GEMM): ``mixprec.formats.route``
    fp8_gemm: Literal["auto", "scaled_mm", "dequant", "dequant_fp32"] = "auto"

    #: the name a recipe string gives it (``fp8_scaling=NAME``)
    name: ClassVar[str]
    # -- the capabilities a format declares; the rest derive from them (``derived``) --
    #: where the casts' scales sit (``mixprec.formats.grain.ScaleGrain``): per tensor,
    #: row or tile, from which ``per_tensor``, ``block_scaled``, ``flush_view``,
    #: ``segment_kind`` and the casts' bytes (``cast_bytes``) follow
    scales: ClassVar[ScaleGrain] = ScaleGrain(kind="row")
    #: what the codes hold: ``fp8`` (e4m3 / e5m2 by the fields), ``int8``, or an element
    #: format of ``mixprec.formats.elements`` kept in a wider carrier (``fp4_e2m1``,
    #: ``fp6_e3m2``); the diagnostics judge the flushes of fp8 elements only
    elements: ClassVar[str] = "fp8"
    #: torch's scaled-matmul kernel that multiplies its casts (``mixprec.formats.padding``:
    #: the GEMM's (M, K, N) multiples, the scales' layout, its name and the GPUs it runs
    #: on; ``mixprec.formats.scaled_mm.block_scaled_mm`` takes it); None: no such kernel
    #: (``fp8_gemm=scaled_mm`` is refused, the GEMMs run the exact dequantizing route)
    kernel: ClassVar[KernelSpec | None] = TENSOR_KERNEL
    #: the GEMMs this format quantizes (``forward``, ``dgrad``, ``wgrad``); one left out
    #: runs in the gradient's 16-bit dtype on the saved high-precision input
    quantized_gemms: ClassVar[tuple[str, ...]] = ("forward", "dgrad", "wgrad")
    #: an amax history in ``fp8_amax_history`` that the ranks agree on every step
    has_history: ClassVar[bool] = False
    #: FSDP2 may gather the weight as its casts (``fp8_all_gather``)
    gathers_casts: ClassVar[bool] = True
    #: why this format cannot run on tensor-parallel shards (None: it can; a
    #: block-scaled one where every shard cut lies on a block boundary)
    tp_unsupported: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name, fact in vars(LinearFormat).items():
            if isinstance(fact, derived) and name not in vars(cls):
                setattr(cls, name, fact.fn(cls))

    @derived
    def per_tensor(cls) -> bool:
        """One scale per tensor: FSDP2's all-gather sends the weight's e4m3 codes with a
        scale every rank holds (``mixprec.formats.precast.Fp8Weight``)."""
        return cls.scales.per_tensor

    @derived
    def block_scaled(cls) -> bool:
        """A scale per block: the GEMMs take the block-scaled routes."""
        return cls.scales.block_scaled

    @derived
    def exact_fp32(cls) -> bool:
        """The GEMMs multiply dequantized fp32 operands (full fp32 precision pinned):
        the block-scaled formats."""
        return cls.scales.block_scaled

    @derived
    def takes_tensor_route(cls) -> bool:
        """``auto`` takes the per-tensor GEMM routes (``_scaled_mm`` or a measured
        dequant): a kernel whose scales factor out of the GEMM."""
        return cls.kernel is not None and cls.kernel.scales == "tensor"

    @derived
    def flush_view(cls) -> str:
        """Which of the diagnostics' flush shares applies (``per-tensor``, ``rowwise``,
        ``per block``; "" for none: they judge fp8 elements only)."""
        views = {"tensor": "per-tensor", "row": "rowwise", "tile": "per block"}
        return views[cls.scales.kind] if cls.elements == "fp8" else ""

    @derived
    def tile(cls) -> int:
        """Elements per scale along the contracted dim, as the diagnostics judge
        underflow: the tile of a format judged per block, else ``TILE``."""
        judged = cls.scales.kind == "tile" and cls.elements == "fp8"
        return cls.scales.tile if judged else TILE

    @derived
    def segment_kind(cls) -> str:
        """What the experts' whole-operand casts (``segment_cast``) keep and hold, as the
        memory planner prices them (``mixprec.memory.expert_casts``): ``tensor``,
        ``rows`` (``int8-rows`` for int8 codes), ``tiles`` (``fp4`` for NVFP4's fp4
        codes under a per-tensor descale)."""
        kind = cls.scales.kind
        if kind == "tensor":
            return "tensor"
        if kind == "row":
            return "int8-rows" if cls.elements == "int8" else "rows"
        return "fp4" if cls.elements == "fp4_e2m1" else "tiles"

    def __post_init__(self) -> None:
        check_fields(self)

    @property
    def grad_dtype(self) -> torch.dtype:
        """The output gradient's fp8 dtype."""
        return torch.float8_e5m2

    @property
    def stochastic_grads(self) -> bool:
        """The backward rounds gradients stochastically (from the module's generator)."""
        return False

    def replace(self, **changes: Any) -> LinearFormat:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def dtype(self, role: str) -> torch.dtype:
        """The fp8 dtype of ``role``'s codes."""
        return self.grad_dtype if role == "grad_output" else E4M3

    def buffers(self, device: torch.device | str, seed: int = 0
                ) -> dict[str, tuple[torch.Tensor, bool]]:
        """What this format keeps between steps: name -> (initial tensor, persistent)."""
        return {}

    def reuses(self, role: str) -> bool:
        """Whether the forward's cast of ``role`` serves its backward GEMM too: every
        role's under one scale per tensor (it has no axis), the weight's where it is
        cast in square blocks."""
        return self.per_tensor or (role == "weight" and self.scales.square_weight)

    def cast(self, t: torch.Tensor, role: str, dim: int, state: dict, record: bool = False,
             generator: torch.Generator | None = None, agree: Agreement | None = None
             ) -> Quantized:
        """``t`` (2-D) cast for ``role`` with scales along ``dim``, the GEMM's contracted
        dim. ``state``: the module's buffers of ``buffers``; ``record``: this cast is
        part of a training step (delayed scaling records its amax); ``agree``: the
        operand lies on a tensor-parallel shard (``mixprec.parallel.tp_agree``): its amaxes
        and random draws are the whole tensor's."""
        raise NotImplementedError(type(self).__name__)

    def weight_cast_dims(self) -> tuple[int, ...]:
        """The contracted dims of the weight casts a training step takes: the forward's
        (1) and, unless that cast serves dgrad too, dgrad's (0)."""
        return (1,) if self.reuses("weight") else (1, 0)

    def shard_rows(self, dim: int) -> int:
        """The rows one scale of the weight's cast along ``dim`` spans: a row shard's
        cast is its rows of the whole weight's where the shard starts on a multiple."""
        return 1

    def gather_amax(self, shard: torch.Tensor) -> torch.Tensor | None:
        """What the ranks agree on (all-reduce MAX) before each casts its rows of the
        weight (``cast_shard``); None: the casts of a shard need nothing of the others."""
        return None

    def cast_shard(self, shard: torch.Tensor, dim: int, amax: torch.Tensor | None
                   ) -> Quantized:
        """Rows ``shard`` of a weight cast along ``dim`` as the whole weight's cast
        casts them, given ``amax``, the ranks' agreed ``gather_amax``."""
        return self.cast(shard, "weight", dim, {})

    def gemm_context(self) -> contextlib.AbstractContextManager:
        """Around a Linear's casts and GEMMs: full-precision fp32 matmul for the
        dequantizing formats (``mixprec.formats.fp32_precision.ieee_fp32_matmul``)."""
        return ieee_fp32_matmul() if self.exact_fp32 else contextlib.nullcontext()

    def kernel_refusal(self) -> str | None:
        """Why torch's kernel cannot take this format's operands (None: it can)."""
        return None

    def route(self, device: torch.device | str, choice: str | None = None) -> str:
        """The GEMM route ``mm`` takes on ``device`` for ``choice`` (default: this
        format's ``fp8_gemm``): ``mixprec.formats.route.gemm_route``, the one decision."""
        return gemm_route(device, self, self.fp8_gemm if choice is None else choice)

    def mm(self, a: Quantized, b: Quantized, out_dtype: torch.dtype, backend: str
           ) -> torch.Tensor:
        """``a @ b`` (``a`` (M, K), ``b`` (K, N), each scaled along K) in ``out_dtype``,
        fp32 accumulation: torch's block-scaled kernel where ``backend`` is
        ``scaled_mm``, else the exact dequantizing GEMM."""
        exact = lambda: (a.dequant() @ b.dequant()).to(out_dtype)  # noqa: E731
        if backend == "scaled_mm":  # a shape the kernel refuses: this GEMM runs exact
            return run_or_fall_back(lambda: block_scaled_mm(a, b, out_dtype, self.kernel),
                                    exact, self.kernel.name,
                                    (a.codes.shape[0], a.codes.shape[1], b.codes.shape[1]),
                                    a.data.device)
        return exact()

    # -- the experts' grouped GEMM without a host read (``mixprec.experts.segmented``) --

    def segments_apply(self) -> bool:
        """Whether this format casts an experts operand whole (``segment_cast``), every
        expert's rows as the cast of that expert's slice gives them."""
        return False

    def segment_cast(self, t: torch.Tensor, role: str, dim: int, seg: Segments,
                     state: dict, record: bool = False, key: Any = None) -> Any:
        """``t`` (the tokens sorted by expert × cols) cast for ``role`` along ``dim``
        (1: the hidden dim; 0: the tokens, wgrad's) with each expert's rows (``seg``)
        scaled, clamped and rounded as a cast of that expert's slice does; ``key``: the
        gradient's stochastic rounding (a counter key, or None). A ``Quantized`` or a
        tuple of them and tensors (what the backward saves)."""
        raise NotImplementedError(f"{type(self).__name__} has no grouped casts")

    def segment_weights(self, w: torch.Tensor, dim: int, seg: Segments, state: dict,
                        record: bool = False) -> Any:
        """The experts' weights ``w`` (E × N × K) cast per expert along ``dim`` of each
        (1: K, the forward's; 0: N, dgrad's): a list of per-expert casts by default."""
        return [self.cast(w[i], "weight", dim, state) for i in range(w.shape[0])]

    def segment_values(self, c: Any, seg: Segments) -> torch.Tensor:
        """The fp32 values of a ``segment_cast`` along the hidden dim (rows × cols)."""
        return c.dequant()

    def segment_weight_values(self, c: Any, seg: Segments, transposed: bool
                              ) -> torch.Tensor:
        """The fp32 values of ``segment_weights``' cast, E × N × K (``transposed``:
        E × K × N, contiguous)."""
        return torch.stack([q.dequant().t() if transposed else q.dequant() for q in c])

    def segment_wgrad(self, g: Any, x: Any, seg: Segments
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """wgrad's operands from the gradient's and the input's casts along the tokens:
        their fp32 rows and the cumulative counts that group them."""
        raise NotImplementedError(f"{type(self).__name__} has no grouped casts")

    def segment_codes(self, c: Any) -> tuple[torch.Tensor, torch.Tensor | None,
                                             torch.Tensor | None]:
        """A ``segment_cast`` as the grouped GEMM on codes takes it (formats whose
        scales factor out of the GEMM, ``kernel.scales == "tensor"``): the codes, each
        row's inverse scale (None: per group only) and each group's (None: per row)."""
        raise NotImplementedError(f"{type(self).__name__} has no grouped codes")

    def update(self, state: dict, found_inf: torch.Tensor | None = None) -> None:
        """Once per optimizer step (delayed scaling's history); nothing by default."""

    def code_bytes(self, role: str) -> int:
        """Bytes one code of ``role``'s cast is held in (its carrier dtype's: fp4 and
        fp6 codes are kept as e4m3 bytes)."""
        return self.dtype(role).itemsize

    def cast_bytes(self, rows: float, cols: float, role: str, dim: int) -> float:
        """Bytes one cast of a (rows, cols) ``role`` operand along ``dim`` holds: its
        codes (``code_bytes`` each) and an fp32 scale per tensor, per slice along
        ``dim`` or per tile of one (a square-block weight: per block), plus
        ``scales.global_bytes``; an activation's or gradient's tokens (``dim=0``)
        padded to ``scales.token_multiple``. The memory planner prices casts by it
        (``mixprec.memory.expert_casts``)."""
        if rows == 0:
            return 0.0
        g, code = self.scales, self.code_bytes(role)
        if g.kind == "tensor":
            return float(rows * cols * code + 4)
        if g.kind == "row":
            return float(rows * cols * code + 4 * (rows if dim == 1 else cols))
        tile = g.tile
        if dim == 0 and role != "weight":
            rows += (-rows) % g.token_multiple
        if role == "weight" and self.reuses("weight"):  # square tiles serve both GEMMs
            n = math.ceil(rows / tile) * math.ceil(cols / tile)
        elif dim == 1:
            n = rows * math.ceil(cols / tile)
        else:
            n = math.ceil(rows / tile) * cols
        return float(rows * cols * code + 4 * n + g.global_bytes)

    def saved_weight_bytes(self, i: int, o: int) -> float:
        """Bytes of the weight cast a Linear of ``i`` inputs and ``o`` outputs saves
        for backward: one byte per element (fp4 codes are kept as e4m3 bytes)."""
        return float(i * o)

    def backward_bytes(self, t: int, i: int, o: int, act_bytes: float, route: str
                       ) -> float:
        """What the backward of a Linear of ``t`` tokens holds beyond its gradients
        (``mixprec.memory.transient``), on GEMM ``route``: per tensor and rowwise, the
        gradient's codes and, where it arrives in 16 bits, its fp32 upcast; the
        operands' bf16 copies on ``dequant``, fp32 on ``dequant_fp32``, none on
        ``scaled_mm`` but the padding of a dim ``torch._scaled_mm`` needs a multiple of
        16 (``mixprec.formats.padding.backward_padding_bytes``)."""
        copies = {"dequant": 2, "dequant_fp32": 4}.get(route, 0)
        need = (5 if act_bytes < 4 else 1) * t * o + copies * (t * o + i * o)
        if route == "scaled_mm":
            need += backward_padding_bytes(t, i, o, 2 if act_bytes < 4 else 4)
        return need

    @classmethod
    def flushed(cls, per_tensor: float, rowwise: float, blockwise: float) -> float:
        """The share of a tensor's non-zero elements this format's casts flush to zero,
        of the three shares the diagnostics measure (``mixprec.diagnostics.fp8range``):
        one scale per tensor, per row, per ``tile`` of a row."""
        return per_tensor


class TileScaled:
    """Mixin of the formats with a scale per tile of the contracted dim (block, MX; their
    ``scales`` a tile grain): their backward's bytes and grouped casts."""

    def backward_bytes(self, t: int, i: int, o: int, act_bytes: float, route: str
                       ) -> float:
        """The gradient's block cast (``5·T·O``), its fp32 dequantized copy and the
        other operand's (``4·(T·O + I·O)`` for dgrad, ``4·(T·O + T·I)`` for wgrad), and
        the dgrad cast's codes, still alive (``T·O``)."""
        to = t * o
        return 5 * to + 4 * max(to + i * o, to + t * i) + to

    @classmethod
    def flushed(cls, per_tensor: float, rowwise: float, blockwise: float) -> float:
        """A scale per tile: the blockwise share."""
        return blockwise

    def segments_apply(self) -> bool:
        """Grouped casts where every GEMM is quantized (wgrad's tiles start at each
        expert's first token)."""
        return "wgrad" in self.quantized_gemms

    def segment_cast(self, t: torch.Tensor, role: str, dim: int, seg: Segments,
                     state: dict, record: bool = False, key: Any = None) -> Quantized:
        """Along the hidden dim the tiles lie in one row: the whole operand is cast.
        Along the tokens (wgrad) each expert's rows are copied into a buffer where
        every expert starts on a whole tile (``Segments.aligned``, its tail padded with
        zeros as a cast of its slice pads it), which is cast."""
        if dim == 0:
            t = spread(t, *seg.aligned(self.scales.tile))
        return self.cast(t, role, dim, state, record, key)

    def segment_wgrad(self, g: Quantized, x: Quantized, seg: Segments
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The aligned casts dequantized and their rows gathered back in place."""
        dest, _ = seg.aligned(self.scales.tile)
        return g.dequant()[dest], x.dequant()[dest], seg.offs


@dataclass(frozen=True, kw_only=True)
class Fp8Elements(LinearFormat):
    """A format whose elements are fp8: e4m3 forward, and gradients by ``fp8_format``."""

    #: ``hybrid``: e5m2 gradients (more range); ``e4m3``: e4m3 everywhere
    fp8_format: Literal["hybrid", "e4m3"] = "hybrid"

    @property
    def grad_dtype(self) -> torch.dtype:
        """The output gradient's fp8 dtype (e5m2 under ``fp8_format=hybrid``)."""
        return torch.float8_e5m2 if self.fp8_format == "hybrid" else E4M3


@dataclass(frozen=True, kw_only=True)
class Margined(Fp8Elements):
    """An fp8 format whose scales are ``fp8 max / amax / 2^margin``."""

    #: headroom in powers of two below the fp8 maximum (scale = max / amax / 2^margin)
    margin: int = 0
