"""The per-tensor and rowwise fp8 GEMM routes (``fp8_gemm=...``).

- ``scaled_mm``: ``torch._scaled_mm``, the hardware fp8 GEMM (CUDA sm89+). A CPU build
  has it too, as a reference kernel (~0.1 GFLOP/s on one chip, as fast as fp32 on
  another), so ``auto`` measures it there (``mixprec.formats.route`` decides). The
  contraction dim and the output's columns are padded with zero codes to multiples of
  16, as the kernel requires: the weight gradient contracts over tokens, any number.
- ``dequant``: the fp8 operands upcast exactly to bf16 (e4m3/e5m2 values are bf16
  values) and multiplied with fp32 accumulation; an fp32 output uses an fp32 GEMM;
- ``dequant_fp32``: the same upcast, to fp32, and an fp32 GEMM for every output, with
  full-precision fp32 matmul pinned (``mixprec.formats.fp32_precision.ieee_fp32_matmul``).

The block-scaled quantizers (block, MX, NVFP4) multiply their dequantized operands in
fp32 (``mixprec.recipe.linear_format``).
"""

from __future__ import annotations

import torch

from mixprec.formats.fp32_precision import ieee_fp32_matmul
from mixprec.formats.padding import TENSOR_KERNEL, run_or_fall_back
from mixprec.formats.quantized import pad_to

__all__ = ["fp8_gemm", "SCALED_MM_MULTIPLE", "upcast"]


#: torch._scaled_mm needs the contraction dim and the output's columns divisible by 16
SCALED_MM_MULTIPLE = TENSOR_KERNEL.multiples[1]


def _scaled_mm_operands(a: torch.Tensor, b: torch.Tensor):
    """``a`` (M, K) row-major and ``b`` (K, N) column-major, with K and N padded with
    zeros to multiples of 16, as ``torch._scaled_mm`` takes them. The weight gradient
    contracts over tokens (``gᵀ @ x``), whose count is any number; fp8's zero byte is
    +0, so the padding changes no sum. Returns ``(a, b, N)``; the output's first N
    columns are the product."""
    m16 = SCALED_MM_MULTIPLE
    a = pad_to(a.contiguous().view(torch.uint8), 1, m16).view(a.dtype)
    bt = pad_to(b.t().contiguous().view(torch.uint8), m16, m16).view(b.dtype)  # (N, K)
    return a, bt.t(), b.shape[1]


def fp8_gemm(a: torch.Tensor, b: torch.Tensor, inv_a: torch.Tensor, inv_b: torch.Tensor,
             out_dtype: torch.dtype, backend: str) -> torch.Tensor:
    """(a · inv_a) @ (b · inv_b) for fp8 ``a`` (M, K) and ``b`` (K, N), fp32 accumulation.

    ``inv_a`` and ``inv_b`` are scalars (per-tensor) or one per row of ``a`` (M, 1) and
    per column of ``b`` (1, N) (rowwise). torch's rowwise ``_scaled_mm`` kernels write
    bf16 only, so for other outputs ``scaled_mm`` runs at unit scales into fp32 and
    applies them after: the same sum, one more pass over the output."""
    if backend == "scaled_mm":
        return run_or_fall_back(
            lambda: _scaled(a, b, inv_a, inv_b, out_dtype),
            lambda: fp8_gemm(a, b, inv_a, inv_b, out_dtype, "dequant"),
            "torch._scaled_mm", (a.shape[0], a.shape[1], b.shape[1]), a.device)
    if backend not in ("dequant", "dequant_fp32"):
        raise ValueError(f"fp8 GEMM backend {backend!r}; valid: scaled_mm, dequant, "
                         "dequant_fp32, auto")
    fp32 = out_dtype == torch.float32 or backend == "dequant_fp32"
    if not fp32:
        y = torch.mm(upcast(a, torch.bfloat16), upcast(b, torch.bfloat16))
    else:
        with ieee_fp32_matmul():
            y = torch.mm(upcast(a, torch.float32), upcast(b, torch.float32))
    return (y.float() * (inv_a * inv_b)).to(out_dtype)


_TABLES: dict[torch.dtype, torch.Tensor] = {}


def upcast(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``codes.to(dtype)`` for fp8 ``codes``, bit for bit and in the same memory layout.
    On a CPU, e4m3 codes going to bf16 (the ``dequant`` route's operands) are looked up
    in a 256-entry table of torch's own conversion: torch converts them element by
    element, 5-6x slower than the lookup (``benchmarks/fp8_upcast.py``), and that was
    a third of an fp8 step. Other pairs, layouts other than row-major or its transpose,
    and other devices convert with ``to`` (a lookup gained nothing there); so does a
    compiled graph (inductor fuses the conversion into its neighbours) and a call under
    a dispatch mode (the coverage counters read an upcast of fp8 as ``to``'s copy)."""
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
            or codes.device.type != "cpu" or codes.dim() != 2 or not codes.numel()
            or codes.dtype != torch.float8_e4m3fn or dtype != torch.bfloat16):
        return codes.to(dtype)
    if not codes.is_contiguous():
        return upcast(codes.t(), dtype).t() if codes.t().is_contiguous() else codes.to(dtype)
    table = _TABLES.get(dtype)
    if table is None:
        table = _TABLES[dtype] = torch.arange(256, dtype=torch.uint8).view(
            torch.float8_e4m3fn).to(dtype)
    return table.index_select(0, codes.view(torch.uint8).reshape(-1).int()).view(codes.shape)


def _scaled(a: torch.Tensor, b: torch.Tensor, inv_a: torch.Tensor, inv_b: torch.Tensor,
            out_dtype: torch.dtype) -> torch.Tensor:
    """``fp8_gemm`` on ``torch._scaled_mm``, K and N padded, the output sliced back."""
    a, b, n = _scaled_mm_operands(a, b)
    if inv_b.numel() > 1 and inv_b.shape[-1] != b.shape[1]:  # rowwise: pad N's scales
        inv_b = torch.cat([inv_b, inv_b.new_ones(1, b.shape[1] - inv_b.shape[-1])], 1)
    if inv_a.numel() == 1 and inv_b.numel() == 1 or out_dtype == torch.bfloat16:
        y = torch._scaled_mm(a, b, scale_a=inv_a, scale_b=inv_b, out_dtype=out_dtype)
        return y if y.shape[1] == n else y[:, :n]
    one = torch.ones((), device=a.device)
    y = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32)
    return (y * (inv_a * inv_b)).to(out_dtype)[:, :n]
