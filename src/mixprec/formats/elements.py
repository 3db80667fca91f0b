"""Floating-point formats: one table, and exact rounding into any of them.

This module is the single source of truth about bits in mixprec. Every other room asks
it for a format's limits (``get("fp16").max``) instead of hard-coding 65504.

``quantize(x, fmt)`` returns the value each element of ``x`` takes after conversion
into ``fmt``, still stored in ``x``'s dtype (fp32 or fp64). It is exact: the result is
what an IEEE-754 style conversion with round-to-nearest-even produces, including
gradual underflow through subnormals and each format's own overflow behaviour.

How the rounding is done, without a loop over elements: for ``|x|`` with binary
exponent ``E`` (read from the bits), the spacing of ``fmt`` there is
``2^(max(E, emin) - m)``. Scaling ``|x|`` by the inverse spacing is exact (a power of
two), rounding that to an integer with ``torch.round`` (ties to even) is the
conversion, and scaling back is exact again. Powers of two are built from integer
bit patterns, never from ``pow``, so nothing here is approximate.

Example::

    >>> import torch
    >>> from mixprec import formats
    >>> formats.quantize(torch.tensor([2048.0 + 1e-4, 70000.0]), "fp16")
    tensor([2048.,   inf])
    >>> formats.get("fp8_e4m3").max
    448.0
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

__all__ = [
    "Format",
    "FORMATS",
    "get",
    "names",
    "quantize",
    "ulp",
    "survival_bound",
    "bits",
]

NanEncoding = Literal["ieee", "single", "none"]


@dataclass(frozen=True)
class Format:
    """A binary floating-point format.

    ``nan``: ``"ieee"`` (all-ones exponent with non-zero mantissa, next to ±inf),
    ``"single"`` (one pattern per sign, all ones, as in e4m3fn and e8m0; the rest of the
    top binade holds finite values) or ``"none"`` (fp6/fp4: every pattern is a number).
    ``signed=False`` and ``subnormals=False`` describe e8m0, the MX scale type: an
    unsigned power of two with no zero.
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    has_inf: bool
    nan: NanEncoding
    torch_dtype: torch.dtype | None = None
    signed: bool = True
    subnormals: bool = True
    aliases: tuple[str, ...] = field(default=(), compare=False, repr=False)
    description: str = field(default="", compare=False, repr=False)

    @property
    def total_bits(self) -> int:
        """Storage width: sign + exponent + mantissa bits."""
        return int(self.signed) + self.exponent_bits + self.mantissa_bits

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal number."""
        return 1 - self.bias if self.subnormals else -self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest finite number."""
        top = 2**self.exponent_bits - 1 - self.bias  # exponent of the all-ones field
        if self.has_inf or self.nan == "ieee":
            return top - 1
        if self.nan == "single" and self.mantissa_bits == 0:
            return top - 1  # e8m0: the all-ones exponent is the NaN
        return top

    @property
    def max(self) -> float:
        """Largest finite value."""
        m = self.mantissa_bits
        if self.nan == "single" and m > 0 and not self.has_inf:
            # e4m3fn: mantissa all-ones in the top binade is NaN, so one step below it.
            frac = 2.0 - 2.0 ** (1 - m)
        else:
            frac = 2.0 - 2.0**-m
        return math.ldexp(frac, self.emax)

    @property
    def min_normal(self) -> float:
        """Smallest positive normal number, 2^emin."""
        return math.ldexp(1.0, self.emin)

    @property
    def min_subnormal(self) -> float:
        """Smallest positive value (equals min_normal for formats without subnormals)."""
        if not self.subnormals:
            return self.min_normal
        return math.ldexp(1.0, self.emin - self.mantissa_bits)

    @property
    def eps(self) -> float:
        """Spacing of values just above 1.0: 2^-mantissa_bits."""
        return math.ldexp(1.0, -self.mantissa_bits)

    @property
    def decimal_digits(self) -> float:
        """Decimal digits of precision, (mantissa_bits + 1) * log10(2)."""
        return (self.mantissa_bits + 1) * math.log10(2.0)

    def __str__(self) -> str:
        return self.name


def _fmt(name, e, m, bias, has_inf, nan, dtype, aliases, description, **kw) -> Format:
    return Format(name, e, m, bias, has_inf, nan, dtype, aliases=aliases,
                  description=description, **kw)


FORMATS: dict[str, Format] = {
    f.name: f
    for f in [
        _fmt("fp32", 8, 23, 127, True, "ieee", torch.float32,
             ("float32", "f32", "float", "single"), "IEEE binary32"),
        _fmt("tf32", 8, 10, 127, True, "ieee", None, ("tensorfloat32",),
             "NVIDIA TensorFloat-32: fp32 range, fp16 precision (matmul inputs only)"),
        _fmt("bf16", 8, 7, 127, True, "ieee", torch.bfloat16,
             ("bfloat16",), "Brain float: fp32 range, 8 bits of precision"),
        _fmt("fp16", 5, 10, 15, True, "ieee", torch.float16,
             ("float16", "half", "f16"), "IEEE binary16"),
        _fmt("fp8_e4m3", 4, 3, 7, False, "single", torch.float8_e4m3fn,
             ("e4m3", "e4m3fn", "fp8_e4m3fn", "float8_e4m3fn"),
             "OCP FP8 E4M3 (fn): no inf, max 448; forward tensors"),
        _fmt("fp8_e5m2", 5, 2, 15, True, "ieee", torch.float8_e5m2,
             ("e5m2", "float8_e5m2"), "OCP FP8 E5M2: IEEE-like, max 57344; gradients"),
        _fmt("fp6_e3m2", 3, 2, 3, False, "none", None,
             ("e3m2", "float6_e3m2fn"), "OCP MX FP6 E3M2: no inf or NaN, max 28"),
        _fmt("fp6_e2m3", 2, 3, 1, False, "none", None,
             ("e2m3", "float6_e2m3fn"), "OCP MX FP6 E2M3: no inf or NaN, max 7.5"),
        _fmt("fp4_e2m1", 2, 1, 1, False, "none", None,
             ("e2m1", "fp4", "float4_e2m1fn"), "OCP MX FP4 E2M1: no inf or NaN, max 6"),
        _fmt("e8m0", 8, 0, 127, False, "single", getattr(torch, "float8_e8m0fnu", None),
             ("fp8_e8m0", "e8m0fnu", "float8_e8m0fnu"),
             "OCP MX scale: unsigned power of two 2^-127..2^127, no zero",
             signed=False, subnormals=False),
    ]
}

_LOOKUP: dict[object, Format] = {}
for _f in FORMATS.values():
    for _key in (_f.name, *_f.aliases):
        _LOOKUP[_key.lower()] = _f
    if _f.torch_dtype is not None:
        _LOOKUP[_f.torch_dtype] = _f


def names() -> list[str]:
    """Canonical names of every known format, widest first."""
    return list(FORMATS)


def get(fmt: str | torch.dtype | Format) -> Format:
    """Look a format up by name, alias or torch dtype.

    >>> get("bfloat16") is get(torch.bfloat16) is get("bf16")
    True
    """
    if isinstance(fmt, Format):
        return fmt
    key = fmt.lower().strip() if isinstance(fmt, str) else fmt
    try:
        return _LOOKUP[key]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown format {fmt!r}; known formats: {', '.join(names())} "
            "(aliases such as 'bfloat16', 'e4m3', 'half' and torch dtypes work too)"
        ) from None


# --- exact rounding -------------------------------------------------------------------

# Per container dtype: (int view dtype, mantissa bits, exponent bias, exponent mask).
_CONTAINERS = {
    torch.float32: (torch.int32, 23, 127, 0xFF),
    torch.float64: (torch.int64, 52, 1023, 0x7FF),
}


def _pow2(k: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Exact 2**k for integer tensor k within the container's normal exponent range."""
    idt, mbits, bias, _ = _CONTAINERS[dtype]
    return ((k.to(idt) + bias) << mbits).view(dtype)


def _binade(a: torch.Tensor, fmt: Format) -> torch.Tensor:
    """max(floor(log2 a), emin), read from the bits; a >= 0 (inf/nan give emax+1)."""
    idt, mbits, bias, emask = _CONTAINERS[a.dtype]
    e = ((a.view(idt) >> mbits) & emask) - bias
    # Container subnormals have a zero exponent field; their binade is the container's
    # emin, which is below every target emin we clamp to, so clamping handles them.
    # inf/nan have e = bias + 1; clamp to the top binade so the scalings stay finite
    # (inf then scales to inf and takes the overflow path, nan stays nan).
    return e.clamp_(e_lo(fmt, a.dtype), bias)


def e_lo(f: Format, dtype: torch.dtype) -> int:
    """Smallest binade _binade returns for format f in container dtype."""
    return max(f.emin, 1 - _CONTAINERS[dtype][2])


def _check_input(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _CONTAINERS:
        raise TypeError(
            f"quantize takes float32 or float64 tensors, got {x.dtype}; "
            "convert with x.float() first (every narrower format is exact in float32)"
        )


def _round_integer_(y: torch.Tensor, rounding: str,
                    generator: torch.Generator | None,
                    noise: torch.Tensor | None = None) -> torch.Tensor:
    """``y`` (non-negative, in units of the target's spacing) rounded to an integer in
    place: to nearest with ties to even, or stochastically, up with probability equal
    to the fractional part (so the expectation is ``y``), against uniform ``noise``
    in [0, 1) if given, else draws from ``generator``."""
    if rounding == "nearest":
        return y.round_()
    lo = torch.floor(y)
    u = (noise.to(y.dtype) if noise is not None else
         torch.rand(y.shape, dtype=y.dtype, device=y.device, generator=generator))
    return lo.add_((u < y.sub_(lo)).to(y.dtype))


def _overflow_(v: torch.Tensor, f: Format, saturate: bool) -> None:
    """In place: magnitudes above ``f.max`` (+inf included; NaN compares False and
    passes through) become max (saturating, or a format without NaN), NaN (a format
    without inf) or inf."""
    over = v > f.max
    if saturate or f.nan == "none":
        v.masked_fill_(over, f.max)
    elif not f.has_inf:
        v.masked_fill_(over, math.nan)
    else:
        v.masked_fill_(over, math.inf)


def quantize(
    x: torch.Tensor,
    fmt: str | torch.dtype | Format,
    rounding: Literal["nearest", "stochastic"] = "nearest",
    saturate: bool = False,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """Value of each element of ``x`` after conversion into ``fmt``, in ``x``'s dtype.

    - ``rounding="nearest"``: round to nearest, ties to even (IEEE default).
      ``"stochastic"``: round to one of the two neighbours with probability proportional
      to proximity, so ``E[quantize(x)] == x`` (unbiased); draws from ``generator``, or
      compares against ``noise`` (uniform in [0, 1), shaped like ``x``) when given.
    - Underflow is gradual, through the format's subnormals; signed zeros are kept.
    - Overflow (a value that rounds above ``max``) follows the standard conversion:
      ±inf for fp32/tf32/bf16/fp16/e5m2, NaN for e4m3fn and e8m0, ±max for the fp6/fp4
      types (they have neither inf nor NaN). ``saturate=True`` clamps every value beyond
      ±max, infinities included, to ±max for every format (torch's own conversion to
      ``float8_e4m3fn`` does this).
    - NaN inputs stay NaN for every format. fp6/fp4 have no NaN encoding (the MX spec
      leaves the conversion implementation-defined; ml_dtypes gives ±0): mixprec keeps
      the NaN so that a bad value stays visible instead of silently becoming zero.
    - e8m0 is unsigned with no zero: zero, negative values and NaN give NaN, positive
      values below 2^-127 give 2^-127, and ties between powers of two round up (as the
      IEEE tie-to-even rule does on a zero-bit mantissa).
    """
    _check_input(x)
    f = get(fmt)
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    if f.name == "fp32" and x.dtype == torch.float32 and rounding == "nearest" and not saturate:
        return x.clone()
    if x.dtype == torch.float32 and f.emin < e_lo(f, x.dtype):
        # e8m0 reaches 2^-127, below fp32's normal range: fp32 subnormal inputs need a
        # finer binade than the container gives them (all of them sit in 2^-126's). float64
        # holds every fp32 value, and every e8m0 value is an fp32 value: exact both ways
        out = quantize(x.double(), f, rounding, saturate=saturate,
                       generator=generator, noise=noise).float()
        # +inf: max when saturating, else NaN (no inf in e8m0), as from fp32 directly
        return out.masked_fill_(x == math.inf, f.max if saturate else math.nan)

    m = f.mantissa_bits
    a = x.abs()
    e = _binade(a, f)
    cbias = _CONTAINERS[x.dtype][2]
    # y = |x| / spacing, in [0, 2^(m+1)). Every factor is an exact power of two inside
    # the container's normal range: one factor 2^(m-e) when that fits (the narrow
    # formats), else 2^(1-e) * 2^(m-1) (bf16/tf32 subnormals, and inf inputs whose e
    # is clamped to the container's top binade).
    one_factor = (m - e_lo(f, x.dtype)) <= cbias and (f.emin - m) >= 1 - cbias
    if one_factor:
        y = a.mul_(_pow2(m - e, x.dtype)) if a is not x else a * _pow2(m - e, x.dtype)
    else:
        y = a.mul_(_pow2(1 - e, x.dtype)).mul_(2.0 ** (m - 1))
    r = _round_integer_(y, rounding, generator, noise)
    if one_factor:
        v = r.mul_(_pow2(e - m, x.dtype))
    else:
        v = r.mul_(2.0**-m).mul_(_pow2(e, x.dtype))
    _overflow_(v, f, saturate)
    if not f.signed:  # e8m0
        v.clamp_(min=f.min_normal)  # NaN propagates through clamp
        return v.masked_fill_(~(x > 0), math.nan)
    return v.copysign_(x)


def ulp(x: torch.Tensor, fmt: str | torch.dtype | Format) -> torch.Tensor:
    """Spacing of ``fmt``'s representable values in the binade of each ``|x|``.

    Below ``min_normal`` this is the subnormal spacing ``min_subnormal``; above ``max``
    it is the spacing at ``max``. ``ulp(2048, "fp16") == 2``: 2048 + 1e-4 is lost in
    fp16 because 1e-4 is less than half of 2. (It is lost in fp32 too: fp32's spacing at
    2048 is 2^-12 ~ 2.44e-4, so an update must exceed ~1.22e-4 to register there.)
    """
    if not isinstance(x, torch.Tensor):
        x = torch.tensor(x, dtype=torch.float64)
    _check_input(x)
    f = get(fmt)
    e = _binade(x.abs(), f).clamp_(max=f.emax)
    return _pow2(e, x.dtype) * 2.0 ** -f.mantissa_bits  # exact; may be a subnormal


def survival_bound(update: float, fmt: str | torch.dtype | Format) -> float:
    """Bound on ``|w|`` below which adding ``update`` to a stored ``w`` changes it.

    ``w + update`` rounds to a value other than ``w`` when ``|update|`` is more than half
    the spacing at ``w``; at exactly half, the tie goes to the even neighbour, so it moves
    only an odd ``w``. Spacing grows with ``|w|`` and bottoms out at ``min_subnormal``.
    The returned bound ``b`` is exact: the update changes every stored ``w`` with
    ``|w| < b``, whatever the signs (``w = 0`` too, except when ``|update|`` is exactly
    half ``min_subnormal``: that tie rounds back to 0), and leaves ``w = ±b`` as it is
    when it moves ``w`` away from zero. ``b = 0.0``: it changes no ``w`` (``|update|`` is
    below half the smallest subnormal). ``b = inf``: it changes every finite ``w`` (at
    ``max`` an increase overflows to inf or NaN); fp6/fp4 saturate instead, so there
    ``b = max``. Above ``b`` a step away from zero is lost, except on odd values of a
    binade whose half spacing equals ``|update|``; a step toward zero from a power of
    two sees the finer spacing below it.

    >>> survival_bound(1e-4, "fp32"), survival_bound(1e-4, "bf16")
    (2048.0, 0.03125)
    >>> survival_bound(1e-4, "e4m3")  # below half of e4m3's smallest subnormal 2^-9
    0.0
    """
    f = get(fmt)
    u = abs(float(update))
    if not math.isfinite(u):
        raise ValueError(f"update must be a finite number, got {update!r}")
    m = f.mantissa_bits
    if 2 * u < f.min_subnormal:
        return 0.0  # even the finest step is too coarse, and 0 + update rounds to 0
    for e in range(f.emin, f.emax + 1):
        step = math.ldexp(1.0, e - m)
        if 2 * u > step:
            continue  # every value of this binade moves
        # first value of the binade in units of step: subnormals start at 1 (odd)
        r = 1 if e == f.emin and f.subnormals else 1 << m
        if 2 * u == step and r % 2:
            r += 1  # a tie moves odd values only; the first even one stays
            if r >= 2 << m:
                continue  # no even value in this binade (e8m0: m = 0)
        return math.ldexp(r, e - m)
    return f.max if f.nan == "none" else math.inf  # fp6/fp4 saturate: max + update = max


def bits(x: torch.Tensor | float, fmt: str | torch.dtype | Format) -> list[tuple[int, int, int]]:
    """(sign, exponent field, mantissa field) of each element after conversion to fmt.

    For display and teaching (``mixprec formats --value``); flattens ``x``. NaN is shown
    with its format's pattern (all-ones exponent; mantissa all ones for e4m3fn/e8m0).
    """
    f = get(fmt)
    t = x if isinstance(x, torch.Tensor) else torch.tensor([x], dtype=torch.float64)
    q = quantize(t.double().flatten(), f).tolist()
    m = f.mantissa_bits
    out = []
    for v in q:
        sign = int(math.copysign(1.0, v) < 0) if f.signed else 0
        a = abs(v)
        top = 2**f.exponent_bits - 1
        if math.isnan(v):
            out.append((sign, top, 2**m - 1 if f.nan == "single" else 1 << max(m - 1, 0)))
        elif math.isinf(v):
            out.append((sign, top, 0))
        elif a == 0.0:
            out.append((sign, 0, 0))
        else:
            e = max(math.frexp(a)[1] - 1, f.emin)
            frac = int(round(math.ldexp(a, m - e)))
            if frac < 2**m and f.subnormals:
                out.append((sign, 0, frac))  # subnormal
            else:
                out.append((sign, e + f.bias, frac - 2**m))
    return out
