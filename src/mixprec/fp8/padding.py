"""Alignment of the fp8 / fp4 GEMM routes: what each kernel needs, the padding's bytes,
and the per-GEMM fallback where a kernel still refuses a shape.

A Linear of any dims runs on every scaling. The casts need no alignment: a last
partial tile or block is scaled by its own elements (``mixprec.fp8.quantized.block_amax``
pads with zeros, which never raise an amax). The OCP MX v1.0 spec defines a block of
``k = 32`` whole elements and says nothing of a partial one; its reference emulation
(microsoft/microxcaling, ``_reshape_to_blocks``) pads the axis with zeros to whole
blocks before taking the shared exponent, which gives the same scale. NVFP4 and the
1×128 / 128×128 tiles are cast the same way.

The kernels do need alignment, and the route pads (``MULTIPLES``: the GEMM's ``M``,
``K``, ``N``), with zero codes under unit scales, so no sum changes, and keeps the
output's first ``M × N``:

===========  =======================================================================
``tensor``   ``torch._scaled_mm`` (per tensor, rowwise): K and N to 16
``block``    the 1×128 / 128×128 kernel: K and N to 128, M to 4 (the tile scales'
             16-byte leading dimension)
``mx``       MXFP8: K to 32, N to 16; the 1×32 scales padded with unit scales to
             the swizzled layout's 128 × 4 tiles
``nvfp4``    NVFP4: K to 32 (two e2m1 codes per byte), N to 16; the 1×16 scales
             padded as MX's
===========  =======================================================================

A shape a kernel still refuses (a build or device with a narrower kernel) falls back
for that GEMM only (``run_or_fall_back``): the exact dequantizing route runs it, with one
warning per shape and route; every other GEMM keeps the kernel. ``padding_bytes`` and
``backward_padding_bytes`` are the padded copies' bytes, which the memory planner adds
to the ``scaled_mm`` route's backward (``mixprec.memory.transient``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

__all__ = ["MULTIPLES", "padded", "padding_bytes",
           "backward_padding_bytes", "run_or_fall_back"]

#: the multiples each kernel's GEMM needs of (M, K, N)
MULTIPLES = {"tensor": (1, 16, 16), "block": (4, 128, 128), "mx": (1, 32, 16),
             "nvfp4": (1, 32, 16)}


def _up(x: int, mult: int) -> int:
    return -(-x // mult) * mult


def padded(m: int, k: int, n: int, kernel: str = "tensor") -> tuple[int, int, int]:
    """``(M, K, N)`` of an ``(M, K) @ (K, N)`` GEMM as ``kernel`` runs it, padded."""
    if kernel not in MULTIPLES:
        raise ValueError(f"kernel={kernel!r}; valid: {', '.join(MULTIPLES)}")
    mm, mk, mn = MULTIPLES[kernel]
    return _up(m, mm), _up(k, mk), _up(n, mn)


def padding_bytes(m: int, k: int, n: int, *, a_copied: bool, b_copied: bool,
                  out_bytes: int, code_bytes: float = 1.0, kernel: str = "tensor"
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
                           kernel: str = "tensor") -> float:
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
