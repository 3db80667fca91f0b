"""Alignment of the fp8 / fp4 GEMM routes: what each kernel needs, the padding's bytes,
and the per-GEMM fallback where a kernel still refuses a shape.

A Linear of any dims runs on every scaling. The casts need no alignment: a last
partial tile or block is scaled by its own elements (``mixprec.formats.quantized.block_amax``
pads with zeros, which never raise an amax). The OCP MX v1.0 spec defines a block of
``k = 32`` whole elements and says nothing of a partial one; its reference emulation
(microsoft/microxcaling, ``_reshape_to_blocks``) pads the axis with zeros to whole
blocks before taking the shared exponent, which gives the same scale. NVFP4 and the
1×128 / 128×128 tiles are cast the same way.

The kernels do need alignment: each format's ``kernel`` (a ``KernelSpec``) declares
the multiples of the GEMM's ``M``, ``K``, ``N`` its kernel takes (and the kernel's name and
the GPUs it runs on), and the route pads to
them with zero codes under unit scales, so no sum changes, and keeps the output's first
``M × N``. ``torch._scaled_mm`` (per tensor, rowwise; ``TENSOR_KERNEL``) takes K and N
in multiples of 16; the block formats' specs sit in their own files.

A shape a kernel still refuses (a build or device with a narrower kernel) falls back
for that GEMM only (``run_or_fall_back``): the exact dequantizing route runs it, with one
warning per shape and route; every other GEMM keeps the kernel. ``padding_bytes`` and
``backward_padding_bytes`` are the padded copies' bytes, which the memory planner adds
to the ``scaled_mm`` route's backward (``mixprec.memory.transient``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["KernelSpec", "TENSOR_KERNEL", "padded", "padding_bytes",
           "backward_padding_bytes", "run_or_fall_back"]


@dataclass(frozen=True, kw_only=True)
class KernelSpec:
    """What one of torch's scaled-matmul kernels needs of a format's casts: the GEMM's
    alignment and how its scales are laid out (``mixprec.formats.scaled_mm``)."""

    #: the multiples of the GEMM's (M, K, N) the kernel takes (the route pads to them)
    multiples: tuple[int, int, int]
    #: elements per scale along K (0: a scale per tensor or per row)
    tile: int = 0
    #: how the scales reach the kernel: ``tensor`` (a scale per tensor or row, as
    #: ``torch._scaled_mm`` takes them), ``outer_major`` (fp32, strides ``(1, rows)``,
    #: a 128×128 weight block's as ``(K blocks rounded up to 4, N / 128)``) or
    #: ``swizzled`` (cuBLAS's ``SWIZZLE_32_4_4``, in ``scale_dtype``)
    scales: Literal["tensor", "outer_major", "swizzled"] = "tensor"
    #: the scales' dtype as the kernel reads them
    scale_dtype: torch.dtype = torch.float32
    #: e2m1 codes packed two per byte, and a per-tensor descale applied to the fp32 output
    fp4: bool = False
    #: the kernel, as an error message names it
    name: str = "torch._scaled_mm"
    #: the NVIDIA compute capabilities it runs on: (lowest, highest major or None)
    capability: tuple[tuple[int, int], int | None] = ((8, 9), None)

    def __post_init__(self) -> None:
        if len(self.multiples) != 3 or not all(isinstance(m, int) and m >= 1
                                               for m in self.multiples):
            raise ValueError(f"KernelSpec multiples={self.multiples!r}: give three "
                             "positive integers, the multiples of (M, K, N)")
        if self.scales not in ("tensor", "outer_major", "swizzled"):
            raise ValueError(f"KernelSpec scales={self.scales!r}; valid: tensor, "
                             "outer_major, swizzled")


#: ``torch._scaled_mm`` with a scale per tensor or per row: K and N to 16
TENSOR_KERNEL = KernelSpec(multiples=(1, 16, 16))


def _up(x: int, mult: int) -> int:
    return -(-x // mult) * mult


def padded(m: int, k: int, n: int, kernel: KernelSpec = TENSOR_KERNEL
           ) -> tuple[int, int, int]:
    """``(M, K, N)`` of an ``(M, K) @ (K, N)`` GEMM as ``kernel`` runs it, padded."""
    mm, mk, mn = kernel.multiples
    return _up(m, mm), _up(k, mk), _up(n, mn)


def padding_bytes(m: int, k: int, n: int, *, a_copied: bool, b_copied: bool,
                  out_bytes: int, code_bytes: float = 1.0,
                  kernel: KernelSpec = TENSOR_KERNEL
                  ) -> float:
    """Bytes one GEMM holds because of its padding, beyond the unpadded call: an
    operand the route would pass as it is (``a_copied`` / ``b_copied`` False) is copied
    whole to pad it; one it copies anyway (a transpose made contiguous) grows by its
    padding; the output's padded columns (``out_bytes`` each) stay allocated under the
    sliced view. Zero for an aligned shape."""
    pm, pk, pn = padded(m, k, n, kernel)
    total = 0.0
    for rows, cols, prows, pcols, copied in ((m, k, pm, pk, a_copied),
                                             (k, n, pk, pn, b_copied)):
        if (rows, cols) != (prows, pcols):
            total += code_bytes * (prows * pcols - (rows * cols if copied else 0))
    return total + out_bytes * (pm * pn - m * n)


def backward_padding_bytes(tokens: int, d_in: int, d_out: int, dx_bytes: int,
                           kernel: KernelSpec = TENSOR_KERNEL) -> float:
    """The padding's bytes at a Linear's backward on the ``scaled_mm`` route: the larger
    of the dgrad GEMM's ``(T, O) @ (O, I)`` (the gradient's codes passed as they are,
    the weight's transposed) and the wgrad GEMM's ``(O, T) @ (T, I)`` (both operands
    transposed, an fp32 output)."""
    dgrad = padding_bytes(tokens, d_out, d_in, a_copied=False, b_copied=True,
                          out_bytes=dx_bytes, kernel=kernel)
    wgrad = padding_bytes(d_out, tokens, d_in, a_copied=True, b_copied=True,
                          out_bytes=4, kernel=kernel)
    return max(dgrad, wgrad)


_REFUSED: dict[tuple[str, tuple[int, ...]], str] = {}


def run_or_fall_back(kernel: Callable[[], torch.Tensor],
                     exact: Callable[[], torch.Tensor], route: str,
                     shape: tuple[int, int, int], device: torch.device) -> torch.Tensor:
    """``kernel()``, or ``exact()`` for this GEMM where the kernel refuses its ``shape``
    (``(M, K, N)``; it raises): one warning per route and shape names both, and later
    GEMMs of that shape go straight to ``exact``. A kernel's out-of-memory error is
    raised, not hidden; meta tensors and compiled graphs call the kernel alone (they
    check what the kernel takes)."""
    key = (route, tuple(shape))
    if key in _REFUSED:
        return exact()
    if device.type == "meta" or torch.compiler.is_compiling():
        return kernel()
    try:
        return kernel()
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, NotImplementedError) as e:
        m, k, n = shape
        _REFUSED[key] = f"{type(e).__name__}: {e}"
        warnings.warn(f"fp8 GEMM ({m}, {k}) @ ({k}, {n}) on {route}: the kernel refused "
                      f"it ({_REFUSED[key][:200]}); this GEMM shape runs on the exact "
                      "dequantizing route instead, every other on the kernel",
                      stacklevel=3)
        return exact()
