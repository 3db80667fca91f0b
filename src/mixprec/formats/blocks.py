"""Block-scaled fp8 casts: one scale per few consecutive elements along the GEMM's
contracted dim, so an outlier costs precision in its own block only. DeepSeek-V3's 1×128
tiles and 128×128 weight blocks (``cast_tiles``, ``cast_blocks``; a block serves the
weight and its transpose), and OCP MX's 1×32 tiles with e8m0 scales (``cast_mx``, which
also casts to the narrower MX element formats of ``mixprec.formats.elements``: the MX emulation
of ``mixprec.engine.emulate`` is this cast). ``dim=1`` cuts each row every ``tile`` columns
(scales ``(M, ⌈K/tile⌉)``), ``dim=0`` each column. A last partial tile is scaled by its
own amax; a tile holding an inf or NaN gets a NaN scale, so the step is skipped. Every
cast returns a ``Quantized`` (codes and inverse scales per block).
"""

from __future__ import annotations

import torch

from mixprec.formats import elements as formats
from mixprec.formats.elements import _CONTAINERS, Format
from mixprec.formats.quantized import Quantized, block_amax, expand_blocks
from mixprec.formats.scaling import FP8_MAX, amax_to_scale, nan_if_not_finite

__all__ = ["TILE", "MX_TILE", "MX_ROUNDINGS", "cast_tiles", "cast_blocks", "cast_mx",
           "mx_exponents"]

#: DeepSeek-V3's tile and block edge
TILE = 128
#: OCP MX's block size
MX_TILE = 32
#: the e8m0 exponent rules, as torchao names them (``mx_exponents``). ``floor`` (the
#: OCP spec's) puts a block's amax in [256, 512) × X for e4m3, so its largest elements
#: saturate at 448: a Gaussian Linear's output reads 24.8 dB against 29.0 for ``rceil``
#: (``tests/formats/test_fp8_blocks.py``), hence ``rceil``, NVIDIA's rule, is the default
MX_ROUNDINGS = ("rceil", "floor", "ceil", "even")


def _cast(t: torch.Tensor, scale: torch.Tensor, rows: int, cols: int,
          dtype: torch.dtype) -> Quantized:
    """Saturating cast of ``t`` at per-block ``scale`` (NaN where it is NaN)."""
    m = FP8_MAX[dtype]
    codes = (t.float() * expand_blocks(scale, rows, cols, t.shape)).clamp_(-m, m).to(dtype)
    return Quantized(codes, torch.reciprocal(scale), rows, cols)


def _scales(amax: torch.Tensor, dtype: torch.dtype, margin: int, pow2: bool
            ) -> torch.Tensor:
    # fp8 max / amax / 2^margin in fp32, as torch computes a float over a tensor:
    # fp8 max × fp32(1 / amax); pow2 (Transformer Engine's option) rounds it down to a
    # power of two, so the dequantization is exact
    scale = amax_to_scale(amax, FP8_MAX[dtype], margin, torch.ones_like(amax))
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return nan_if_not_finite(scale, amax)


def cast_tiles(t: torch.Tensor, dim: int, dtype: torch.dtype, tile: int = TILE,
               margin: int = 0, pow2: bool = False) -> Quantized:
    """``t`` (2-D) in fp8 with one scale per ``tile`` consecutive elements along
    ``dim``, the GEMM's contracted dim (DeepSeek-V3's 1×128 tiles)."""
    rows, cols = (1, tile) if dim == 1 else (tile, 1)
    return _cast(t, _scales(block_amax(t, rows, cols), dtype, margin, pow2), rows, cols,
                 dtype)


def cast_blocks(t: torch.Tensor, dtype: torch.dtype, block: int = TILE, margin: int = 0,
                pow2: bool = False) -> Quantized:
    """``t`` (2-D) in fp8 with one scale per ``block × block`` block (DeepSeek-V3's
    weights): the same codes serve ``t`` and its transpose."""
    return _cast(t, _scales(block_amax(t, block, block), dtype, margin, pow2), block,
                 block, dtype)


def _log2_floor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``floor(log2 x)`` (as ``x``'s float dtype) and the significand ``x / 2^floor`` in
    [1, 2), read from the bits: exact for every finite ``x > 0``, subnormals included
    (lifted by 2^64 first). Integer shifts and masks only, so compilers vectorize it."""
    idt, mbits, bias, emask = _CONTAINERS[x.dtype]
    sub = x < 2.0 ** (1 - bias)
    bits = torch.where(sub, x * 2.0**64, x).view(idt)
    e = ((bits >> mbits) & emask) - bias
    mant = ((bits & ((1 << mbits) - 1)) | (bias << mbits)).view(x.dtype)
    return e.to(x.dtype) - torch.where(sub, 64.0, 0.0).to(x.dtype), mant


def mx_exponents(amax: torch.Tensor, fmt: torch.dtype | str | Format,
                 rounding: str = "rceil") -> torch.Tensor:
    """The e8m0 exponent of each block's scale for element format ``fmt`` under
    ``rounding``, as float32 integers clamped to [-127, 127]; -127 for an all-zero
    block, NaN for a block that holds an inf or NaN. float64 ``amax`` is read in
    float64, anything else in float32. With ``emax`` the element format's (8 for e4m3,
    15 for e5m2):

    - ``floor``: ``floor(log2(amax)) - emax`` (the OCP spec);
    - ``ceil``: ``ceil(log2(amax)) - emax``: never saturates, coarser;
    - ``even``: ``floor``, but a block whose amax would round up to the next power of
      two at the element's mantissa takes the next scale;
    - ``rceil``: ``ceil(log2(amax / max_elem))``, the quotient in fp32 (NVIDIA cuBLAS's
      rule: the largest element lands at or below the max).
    """
    if rounding not in MX_ROUNDINGS:
        raise ValueError(f"mx_rounding={rounding!r}; valid: {', '.join(MX_ROUNDINGS)}")
    f = formats.get(fmt)
    a = amax if amax.dtype == torch.float64 else amax.float()
    ok = torch.isfinite(a) & (a > 0)
    if rounding == "rceil":
        descale = torch.where(ok, a.float() / f.max, 1.0)  # the fp32 quotient
        floor, mant = _log2_floor(descale)
        exp = torch.where(mant == 1.0, floor, floor + 1)  # ceil(log2(descale))
    else:
        floor, mant = _log2_floor(torch.where(ok, a, 1.0))
        if rounding == "ceil":
            floor = torch.where(mant == 1.0, floor, floor + 1)
        elif rounding == "even":  # amax rounded to the element's mantissa may reach
            # the next binade
            floor = torch.where(mant >= 2 - 2.0 ** -(f.mantissa_bits + 1), floor + 1, floor)
        exp = floor - f.emax
    exp = torch.where(a > 0, exp.float(), -127.0).clamp(-127, 127)
    return torch.where(torch.isfinite(a), exp, float("nan"))


def cast_mx(t: torch.Tensor, dim: int, dtype: torch.dtype | str | Format =
            torch.float8_e4m3fn, rounding: str = "rceil", tile: int = MX_TILE
            ) -> Quantized:
    """``t`` (2-D) as MX: one e8m0 scale per ``tile`` elements along ``dim``, elements
    ``t / X`` saturated and rounded to nearest-even in ``dtype`` (an fp8 dtype, whose
    codes are bytes, or any element format of ``mixprec.formats.elements``, whose codes are its
    values in fp32)."""
    rows, cols = (1, tile) if dim == 1 else (tile, 1)
    exp = mx_exponents(block_amax(t, rows, cols), dtype, rounding)
    scale = torch.exp2(-exp).float()  # 1 / X: exact, a power of two (NaN stays NaN)
    if isinstance(dtype, torch.dtype) and dtype in FP8_MAX:
        return _cast(t, scale, rows, cols, dtype)
    v = t.float() * expand_blocks(scale, rows, cols, t.shape)
    return Quantized(formats.quantize(v, dtype, saturate=True), torch.reciprocal(scale),
                     rows, cols)
