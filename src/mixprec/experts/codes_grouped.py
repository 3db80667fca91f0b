"""The ``grouped`` route where ``torch._grouped_mm`` takes bf16 only (CUDA).

torch's CUDA grouped GEMM (and its meta kernel, which mirrors it) takes bf16 operands
with 16-byte strides and writes bf16. The per-tensor and rowwise formats (``fp8``,
``fp8-current``, ``fp8-rowwise``) scale whole rows and columns of each GEMM, so their
scales factor out of the sum: the fp8 codes, widened to bf16 (exact: every e4m3 and
e5m2 value is a bf16 value), go to the kernel, which accumulates in fp32 and rounds
once to bf16, and each output element is then multiplied in fp32 by its row's and
column's inverse scales, as the ``dequant`` GEMM route does
(``mixprec.fp8.gemm.fp8_gemm``). The block formats' dequantized operands are not bf16
values in general, and their scales do not factor out: on such a device they take the
``loop`` route (``mixprec.experts.grouped``).

Each GEMM here takes per-expert casts (None: an expert with no token); a cast's inverse
scales are a scalar or one per row or column of its codes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mixprec.experts.format import ExpertsFormat
    from mixprec.fp8.quantized import Quantized

__all__ = ["bf16_only", "codes_apply", "rows_mm", "wgrad_mm"]

_BF16 = torch.bfloat16


def bf16_only(device: torch.device) -> bool:
    """Whether ``torch._grouped_mm`` on ``device`` takes bf16 operands only (every
    device but the CPU, whose kernel takes fp32 too)."""
    return torch.device(device).type != "cpu"


def codes_apply(fmt: ExpertsFormat) -> bool:
    """Whether ``fmt``'s scales factor out of each GEMM (per-tensor and rowwise fp8)."""
    kernel = fmt.quantizer.kernel  # a KernelSpec (mixprec.fp8.padding); int8: None
    return kernel is not None and kernel.scales == "tensor"


def _vec(inv: torch.Tensor, count: int) -> torch.Tensor:
    """Inverse scales as one fp32 value per index: a scalar repeated, or a vector."""
    inv = inv.float().reshape(-1)
    return inv.expand(count) if inv.numel() == 1 else inv


def rows_mm(a_casts: list[Quantized], b_casts: list[Quantized], bounds: list[tuple[int, int]],
            t: int, k: int, n: int, device: torch.device) -> torch.Tensor:
    """``a[e] @ b[e]`` into expert e's rows of a (t, n) fp32 output: ``a[e]`` (rows, k)
    with one scale per row (or per tensor), ``b[e]`` (k, n) with one per column (or per
    tensor). Rows past the last expert's are left for the caller to zero."""
    a = torch.zeros(t, k, dtype=_BF16, device=device)
    row = torch.ones(t, device=device)
    b = torch.zeros(len(b_casts), k, n, dtype=_BF16, device=device)
    col = torch.ones(t, n, device=device)
    for ac, (s, end) in zip(a_casts, bounds):
        if ac is None:
            continue
        a[s:end] = ac.codes
        row[s:end] = _vec(ac.inv, end - s)
    for e, (bc, (s, end)) in enumerate(zip(b_casts, bounds)):
        if bc is not None and s != end:
            b[e] = bc.codes
            col[s:end] = _vec(bc.inv, n)
    offs = torch.tensor([end for _, end in bounds], dtype=torch.int32, device=device)
    y = torch._grouped_mm(a, b, offs=offs)
    return y.float() * (row.unsqueeze(1) * col)


def wgrad_mm(g_casts: list[Quantized], x_casts: list[Quantized], bounds: list[tuple[int, int]],
             t: int, k: int, n: int, device: torch.device) -> torch.Tensor:
    """``g[e]ᵀ @ x[e]`` for every expert, (E, n, k) fp32: ``g[e]`` (rows, n) and
    ``x[e]`` (rows, k) cast along the tokens (one scale per column, or per tensor).
    The token dim is padded to a multiple of 8 (16-byte strides of ``gᵀ``)."""
    tp = t + (-t) % 8
    g = torch.zeros(n, tp, dtype=_BF16, device=device)
    x = torch.zeros(tp, k, dtype=_BF16, device=device)
    sg = torch.ones(len(bounds), n, 1, device=device)
    sx = torch.ones(len(bounds), 1, k, device=device)
    for e, (gc, xc, (s, end)) in enumerate(zip(g_casts, x_casts, bounds)):
        if gc is None:
            continue
        g[:, s:end] = gc.codes.t()
        x[s:end] = xc.codes
        sg[e, :, 0] = _vec(gc.inv, n)
        sx[e, 0] = _vec(xc.inv, k)
    offs = torch.tensor([end for _, end in bounds], dtype=torch.int32, device=device)
    return torch._grouped_mm(g, x, offs=offs).float() * (sg * sx)
