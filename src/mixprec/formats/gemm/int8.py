"""INT8 rowwise training: the forward and dgrad GEMMs on int8 codes, wgrad in bf16.

The recipe of SwitchBack and torchao's int8 mixed-precision training: each operand of
the forward (``x @ wᵀ``) and dgrad (``g @ w``) GEMMs is cast symmetrically to int8 with
one fp32 scale per row along the GEMM's contracted dim (per token for ``x`` and ``g``,
per output channel of ``w`` for the forward and per input channel for dgrad); the
weight gradient ``gᵀ @ x`` stays in the gradient's own 16-bit dtype (``quantized_gemms``
leaves it out), since its contraction over tokens is where outliers and rounding bias
add up.

The cast: ``scale = amax / 127`` per row, ``code = round_half_even(x / scale)`` clamped
to ``[-127, 127]`` (the quotient is an fp32 division, rounded once, then rounded to an
integer). A row of zeros keeps ``scale = 1`` (codes 0; as does an amax so small that
``amax / 127`` underflows to zero); a row holding an inf or NaN gets a NaN scale and
codes 0 (int8 has no NaN), so the GEMM's output row is NaN and the step is skipped like
any overflow, as the fp8 casts do (``mixprec.formats.scaling.nan_if_not_finite``).

The GEMM multiplies the codes into an exact int32 sum, then applies the scales in fp32,
rows first: ``(float(acc) · s_row) · s_col``. Two routes give that sum bit for bit:

- ``scaled_mm``: ``torch._int_mm`` (int8 products, int32 accumulation): AVX512-VNNI /
  AMX-INT8 CPUs, int8 tensor cores (sm75+; CUDA takes ``M > 16`` and ``K``, ``N``
  multiples of 8: a GEMM of a shape it refuses runs the exact route instead);
- ``dequant_fp32`` (``dequant`` names it too): the codes in fp32, full-precision fp32
  GEMMs over chunks of ``EXACT_CHUNK`` of the contracted dim, each exact (every partial
  sum is an integer below ``1024 · 127² < 2^24``), summed in int32.

``fp8_gemm=auto`` takes ``_int_mm`` on a GPU with int8 tensor cores, the exact route on
other devices, and on a CPU decides per GEMM shape class (each dim rounded up to a power
of two), from a reading of ``_int_mm`` against the exact route's fp32 GEMM on that class
(``measured_int8``, which ``mixprec.engine.devices`` sets: ``int8_reading``). The routes agree
bit for bit, so the choice changes speed only, never numerics.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from mixprec.formats.fp32_precision import ieee_fp32_matmul
from mixprec.formats.gemm.base import LinearFormat
from mixprec.formats.quantized import Quantized
from mixprec.formats.route import GEMM_CHOICES
from mixprec.formats.scaling import nan_if_not_finite
from mixprec.formats.segments import Segments
from mixprec.formats.shard import Agreement, agreed_amax

__all__ = ["Int8Rowwise", "cast_int8_rowwise", "int8_gemm", "int_mm_refusal",
           "shape_class", "register_measured_int8", "INT8_MAX", "EXACT_CHUNK",
           "INT8_CAPABILITY"]

#: the largest code: symmetric, so -128 is never used
INT8_MAX = 127
#: contracted-dim chunk of the exact route: ``1024 · 127² < 2^24``, so fp32 sums of
#: integer products stay exact in any order
EXACT_CHUNK = 1024
#: the NVIDIA compute capability from which ``torch._int_mm`` runs on int8 tensor cores
INT8_CAPABILITY = (7, 5)


def cast_int8_rowwise(t: torch.Tensor, dim: int, agree: Agreement | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` (2-D) as int8 codes with one fp32 scale per slice along ``dim`` (the GEMM's
    contracted dim), shaped to broadcast (``dim=1``: (rows, 1); ``dim=0``: (1, cols)):
    ``t ≈ codes · scale`` (the module doc gives the rounding, zeros and non-finite
    slices; ``agree``: ``t`` is a tensor-parallel shard, ``tp_agree``)."""
    amax = agreed_amax(t.detach().abs().amax(dim=dim, keepdim=True).float(), dim, agree)
    scale = amax / INT8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    scale = nan_if_not_finite(scale, amax)
    q = (t.detach().float() / scale).round_().clamp_(-INT8_MAX, INT8_MAX)
    # a NaN scale made its slice NaN: codes 0 there (int8 has no NaN; the scale keeps it)
    return q.nan_to_num_(0.0).to(torch.int8), scale


_CPU_EXACT: list[bool] = []


def cpu_int_mm_exact() -> bool:
    """Whether this CPU's ``torch._int_mm`` sums int8 products exactly (measured once).
    Without VNNI or AMX, oneDNN's int8 GEMM adds pairs of products in int16 with
    saturation (``vpmaddubsw`` on codes shifted to unsigned), so 127·127 pairs come out
    wrong; the exact route runs there instead."""
    if not _CPU_EXACT:
        k = 64
        a = torch.full((17, k), 127, dtype=torch.int8)
        a[1::2] = -127
        b = torch.full((k, 8), 127, dtype=torch.int8)
        b[:, 1::2] = -127
        g = torch.Generator().manual_seed(0)
        r = torch.randint(-127, 128, (17, k), generator=g, dtype=torch.int8)
        ok = all(torch.equal(torch._int_mm(x, b), (x.long() @ b.long()).int())
                 for x in (a, r))
        _CPU_EXACT.append(ok)
    return _CPU_EXACT[0]


_CPU_INEXACT = ("this CPU's torch._int_mm saturates int8 product sums (no VNNI/AMX: "
                "oneDNN adds pairs in int16)")


def int_mm_refusal(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """Why ``torch._int_mm`` does not take ``a`` (M, K) @ ``b`` (K, N) on their device
    (a sentence), or None where it does: a CPU whose kernel sums exactly takes any
    shape, CUDA needs ``M > 16`` and ``K``, ``N`` multiples of 8; other devices have no
    kernel wired here."""
    dev = a.device.type
    if dev == "meta":
        return None
    if dev == "cpu":
        return None if cpu_int_mm_exact() else _CPU_INEXACT
    if dev != "cuda":
        return f"torch._int_mm is wired for CPU and CUDA only, not {dev}"
    (m, k), n = a.shape, b.shape[1]
    if m <= 16 or k % 8 or n % 8:
        return f"CUDA's torch._int_mm needs M > 16 and K, N multiples of 8, got {m}x{k}x{n}"
    return None


def _exact_int32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of int8 codes as an exact int32 sum from fp32 GEMMs over K-chunks."""
    k = a.shape[1]
    acc = torch.zeros(a.shape[0], b.shape[1], dtype=torch.int32, device=a.device)
    with ieee_fp32_matmul():
        for k0 in range(0, k, EXACT_CHUNK):
            part = torch.mm(a[:, k0:k0 + EXACT_CHUNK].float(), b[k0:k0 + EXACT_CHUNK].float())
            acc += part.to(torch.int32)
    return acc


def int8_gemm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
              scale_b: torch.Tensor, out_dtype: torch.dtype, use_int_mm: bool
              ) -> torch.Tensor:
    """``(a · scale_a) @ (b · scale_b)`` for int8 ``a`` (M, K) with (M, 1) scales and
    ``b`` (K, N) with (1, N) scales: the int32 sum (``torch._int_mm`` where
    ``use_int_mm`` and it takes the shape, else the exact fp32 chunks), then
    ``(float(sum) · scale_a) · scale_b`` in fp32, cast to ``out_dtype``."""
    if use_int_mm and int_mm_refusal(a, b) is None:
        acc = torch._int_mm(a, b)
    else:
        acc = _exact_int32(a, b)
    return (acc.float() * scale_a * scale_b).to(out_dtype)


def shape_class(m: int, k: int, n: int) -> tuple[int, int, int]:
    """A GEMM's shape class: each dim rounded up to a power of two (at least 16)."""
    return tuple(max(16, 1 << math.ceil(math.log2(max(d, 1)))) for d in (m, k, n))


#: ``auto`` on a CPU, ``(device, shape class) -> bool``: whether ``torch._int_mm`` is
#: faster there than the exact route. ``mixprec.engine.devices`` (above this module)
#: registers it when imported, from its readings (``int8_reading``).
measured_int8: Callable[[torch.device, tuple[int, int, int]], bool] | None = None


def register_measured_int8(fn: Callable[[torch.device, tuple[int, int, int]], bool]) -> None:
    """Make ``fn`` (``(device, shape class) -> bool``) the measured ``auto`` of the int8
    GEMM on a CPU (``measured_int8``)."""
    global measured_int8
    measured_int8 = fn


def _faster(dev: torch.device, m: int, k: int, n: int) -> bool:
    if measured_int8 is None:  # importing mixprec imports mixprec.engine.devices: it registers
        raise RuntimeError("mixprec.formats.gemm.int8.measured_int8 is unset: "
                           "import mixprec")
    return measured_int8(dev, shape_class(m, k, n))


# a compiled graph takes the reading as a constant, read while tracing (the mark
# ``torch.compiler.assume_constant_result`` sets, without importing torch._dynamo)
_faster._dynamo_marked_constant = True


_SAID: set[tuple[str, str]] = set()


@dataclass(frozen=True, kw_only=True)
class Int8Rowwise(LinearFormat):
    """INT8 rowwise (the module doc): int8 forward and dgrad GEMMs, wgrad in the
    gradient's 16-bit dtype. ``grad_dtype`` and ``margin`` do not apply (int8 has one
    element format, and its scale maps amax exactly onto 127)."""

    name: ClassVar[str] = "int8"
    quantized_gemms: ClassVar[tuple[str, ...]] = ("forward", "dgrad")
    #: not judged by the doctor's fp8 flush shares: 127 uniform levels flush whatever is
    #: below amax / 254 of its row by design (the planner's SQNR judges int8)
    elements: ClassVar[str] = "int8"
    #: its own GEMM (``int8_gemm``: ``torch._int_mm``), not a scaled-matmul kernel
    kernel: ClassVar[None] = None
    #: ``fp8_all_gather`` is refused: FSDP2 gathers its weights in 16 bits
    gathers_casts: ClassVar[bool] = False

    def dtype(self, role: str) -> torch.dtype:
        """int8, every role."""
        return torch.int8

    def cast(self, t: torch.Tensor, role: str, dim: int, state: dict, record: bool = False,
             generator: torch.Generator | None = None, agree: Agreement | None = None
             ) -> Quantized:
        """Symmetric int8 codes with a scale per slice along ``dim``."""
        codes, scale = cast_int8_rowwise(t, dim, agree)
        return Quantized(codes, scale)

    def route(self, device: torch.device | str, choice: str | None = None) -> str:
        """``scaled_mm`` (``torch._int_mm``, refused where the device has none),
        ``dequant_fp32`` (the exact route; also for ``dequant``) or, for ``auto`` on a
        CPU, ``auto`` (per GEMM shape class, measured)."""
        choice = self.fp8_gemm if choice is None else choice
        if choice not in GEMM_CHOICES:
            raise ValueError(f"fp8_gemm={choice!r}; valid: {', '.join(GEMM_CHOICES)}")
        dev = torch.device(device)
        if choice in ("dequant", "dequant_fp32"):
            return "dequant_fp32"
        missing = self._missing(dev)
        if choice == "scaled_mm":
            if missing is not None:
                raise ValueError(f"fp8_gemm=scaled_mm with fp8_scaling=int8 on {dev}: "
                                 f"{missing}. Use fp8_gemm=auto or fp8_gemm=dequant_fp32 "
                                 "(the exact dequantizing GEMM, bit-identical).")
            return "scaled_mm"
        if dev.type == "cpu" and missing is None:
            return "auto"
        if missing is not None:
            key = (str(dev), missing)
            if key not in _SAID:
                _SAID.add(key)
                warnings.warn(f"fp8_gemm=auto, fp8_scaling=int8 on {dev}: {missing}; the "
                              "exact dequantizing GEMM (dequant_fp32) runs instead",
                              stacklevel=3)
            return "dequant_fp32"
        return "scaled_mm"

    @staticmethod
    def _missing(dev: torch.device) -> str | None:
        """Why ``dev`` has no ``torch._int_mm`` (None where it has)."""
        if dev.type == "meta":
            return None
        if dev.type == "cpu":
            return None if cpu_int_mm_exact() else _CPU_INEXACT
        if dev.type != "cuda" or torch.version.hip is not None:
            return f"torch._int_mm is wired for CPU and NVIDIA GPUs only, not {dev}"
        cap = tuple(torch.cuda.get_device_capability(dev))
        if cap < INT8_CAPABILITY:
            return f"int8 tensor cores need sm75 or newer, this GPU is sm{cap[0]}{cap[1]}"
        return None

    def backward_bytes(self, t: int, i: int, o: int, act_bytes: float, route: str
                       ) -> float:
        """The larger of the gradient's cast (an fp32 copy and the fp32 quotient:
        ``8·T·O``) and the dgrad GEMM: the gradient's codes ``T·O`` and ``int8_gemm``'s
        12 bytes per output element (the int32 sum, its fp32 copy and the scaled
        product; on the exact route the fp32 partial sum and its int32 copy instead, at
        the same height), less the input's gradient the caller counts (``act_bytes``
        per element). wgrad runs in 16 bits on the saved input."""
        return max(8 * t * o, t * o + (12 - act_bytes) * t * i)

    def mm(self, a: Quantized, b: Quantized, out_dtype: torch.dtype, backend: str
           ) -> torch.Tensor:
        """``a @ b`` (``a`` (M, K) with row scales, ``b`` (K, N) with column scales) on
        ``backend``'s route (``int8_gemm``)."""
        if backend not in ("scaled_mm", "dequant_fp32", "auto"):
            raise ValueError(f"int8 GEMM backend {backend!r}; valid: scaled_mm, "
                             "dequant_fp32, auto")
        ca, cb = a.codes, b.codes
        use = backend == "scaled_mm" or backend == "auto" and _faster(
            ca.device, ca.shape[0], ca.shape[1], cb.shape[1])
        return int8_gemm(ca, cb, a.inv, b.inv, out_dtype, use)


    def segments_apply(self) -> bool:
        """Every int8 cast scales one slice along its contracted dim, and none crosses
        an expert's rows: each operand is cast whole (wgrad runs in 16 bits)."""
        return True

    def segment_cast(self, t: torch.Tensor, role: str, dim: int, seg: Segments,
                     state: dict, record: bool = False, key: object = None) -> Quantized:
        """The tokens cast as they come (a scale per token along the hidden dim)."""
        return self.cast(t, role, dim, state, record, key)

    def segment_weights(self, w: torch.Tensor, dim: int, seg: Segments, state: dict,
                        record: bool = False) -> Quantized:
        """The E × N × K weights cast per expert along ``dim`` of each (1: K, per output
        channel, as one (E·N) × K tensor; 0: N, per input channel, as one N × (E·K))."""
        e, n, k = w.shape
        if dim == 1:
            return self.cast(w.reshape(e * n, k), "weight", 1, state)
        return self.cast(w.transpose(0, 1).reshape(n, e * k), "weight", 0, state)

    def segment_weight_values(self, c: Quantized, seg: Segments, transposed: bool
                              ) -> torch.Tensor:
        """``segment_weights``' forward cast (``transposed``: E × K × N) or dgrad's
        (E × N × K) dequantized, contiguous."""
        v, e = c.dequant(), seg.experts
        if transposed:
            return v.view(e, v.shape[0] // e, v.shape[1]).transpose(1, 2).contiguous()
        return v.view(v.shape[0], e, v.shape[1] // e).transpose(0, 1).contiguous()
