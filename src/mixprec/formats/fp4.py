"""NVFP4: e2m1 elements, an e4m3 scale per 16 elements, an fp32 scale per tensor.

The cast of a tensor ``t`` (NVIDIA's recipe, as torchao's ``nvfp4_quantize`` computes it):

1. a per-tensor descale ``G = amax(t) / (448 · 6)`` in fp32 (1 for an all-zero tensor),
   so a block whose amax is the tensor's gets the largest e4m3 scale;
2. per block of 16 elements, ``s = e4m3(clamp(fp32(amax_b / 6) / G, 2^-6, 448))``,
   rounded to nearest-even;
3. elements ``e2m1(clamp(x · fp32(fp32(1 / G) / s), ±6))``, to nearest-even, or
   stochastically (``stochastic=True``: unbiased, for gradients);
4. the value is ``code · (s · G)``.

Blocks are 1×16 along a GEMM's contracted dim (``dim``), or, for weights with
``square=True``, 16×16 (the same codes serve ``w`` and ``wᵀ``). A block holding an inf
or NaN casts to NaN, so the step is skipped.

``hadamard_16`` gives the 16×16 orthonormal random Hadamard transform that the wgrad
GEMM applies to both operands along the token dim (``H`` = Sylvester Hadamard / 4 with
fixed random column signs): ``(Hg)ᵀ(Hx) = gᵀx`` exactly in real arithmetic, while the
transform spreads an outlier over 16 tokens before the 16-element blocks are cast.
"""

from __future__ import annotations

import functools
import math

import torch

from mixprec.formats import elements as formats
from mixprec.formats.quantized import Quantized, block_amax, expand_blocks
from mixprec.formats.shard import Agreement, agreed_amax, draw_sliced, slice_of

__all__ = ["NVFP4_BLOCK", "cast_nvfp4", "nvfp4_descale", "hadamard_16", "apply_hadamard",
           "counter_uniform", "counter_key"]

NVFP4_BLOCK = 16
_E4M3 = formats.get("fp8_e4m3")
_E2M1_MAX = formats.get("fp4_e2m1").max  # 6
_DESCALE = _E4M3.max * _E2M1_MAX


def _e2m1_step(a: torch.Tensor) -> torch.Tensor:
    """The e2m1 grid's spacing at each ``a`` (non-negative fp32, at most 6): 0.5 below 2
    (the subnormal 0.5 and the binade [1, 2)), then 1 in [2, 4) and 2 in [4, 6]; i.e.
    ``2^(max(e, 0) - 1)`` for ``a``'s binary exponent ``e``, built from its exponent
    bits (a power of two, so dividing by it is exact)."""
    biased = a.view(torch.int32) >> 23  # a >= 0: the sign bit is clear
    return ((biased.clamp_(min=127) - 1) << 23).view(torch.float32)


_M32 = 0xFFFFFFFF


def counter_uniform(key: torch.Tensor, shape: tuple[int, ...] | torch.Size,
                    within: tuple[tuple[int, int], tuple[int, int]] | None = None
                    ) -> torch.Tensor:
    """Uniform floats in [0, 1) (24 random bits each) for every element of ``shape``,
    hashed from (``key``, the element's index) on ``key``'s device: no generator state,
    so compiled graphs draw them too, and the same key gives the same numbers on every
    device. ``within`` (a 2-D ``shape`` only): (the whole shape, the slice's start), as
    ``tp_agree.slice_of`` gives; the index is then the element's place in the whole
    tensor, so the slice gets the whole draw's numbers, drawing only its own. The hash
    is a 32-bit integer mixer (xor-shift, multiply) in int64 whose products stay below
    2^63."""
    if within is None:
        i = torch.arange(math.prod(shape), device=key.device, dtype=torch.int64)
    else:
        (_, cols), (r0, c0) = within
        r = torch.arange(r0, r0 + shape[0], device=key.device, dtype=torch.int64)
        c = torch.arange(c0, c0 + shape[1], device=key.device, dtype=torch.int64)
        i = (r[:, None] * cols + c).reshape(-1)
    x = (i + ((key.to(torch.int64) & _M32) * 0x61C88647 & _M32)) & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M32
    x = x ^ (x >> 16)
    return ((x >> 8).to(torch.float32) * 2.0**-24).reshape(shape)


#: the inverse of ``counter_uniform``'s key multiplier 0x61C88647, modulo 2^32
_KEY_STEP = 0xEBB34377


def counter_key(key: torch.Tensor, offset: int) -> torch.Tensor:
    """The key whose ``counter_uniform`` stream is ``key``'s from its ``offset``-th
    number on: ``counter_uniform(counter_key(k, o), (n,))`` equals
    ``counter_uniform(k, (o + n,))[o:]``. The hash adds ``key · 0x61C88647`` to each
    index modulo 2^32, so the key moves by ``offset`` times that multiplier's inverse."""
    return (key.to(torch.int64) + (offset * _KEY_STEP & _M32)) & _M32


def _round_e2m1(v: torch.Tensor, generator: torch.Generator | torch.Tensor | None,
                a: torch.Tensor | None = None, agree: Agreement | None = None
                ) -> torch.Tensor:
    """``v`` (already within ±6) on the e2m1 grid: nearest-even, or stochastically
    between the two neighbours with the probability that keeps the mean, drawn from
    ``generator`` (a ``torch.Generator``, or a key tensor for ``counter_uniform``).
    ``a``: ``|v|`` if the caller has it (it is consumed).

    ``a / step`` is exact, so ``torch.round`` (half to even) picks the neighbour with
    the even mantissa bit on a tie, and ``a / step - floor(a / step)`` is exactly the
    distance to the lower neighbour in steps (the stochastic rounding's probability of
    going up). A NaN stays NaN (its exponent bits make a finite step)."""
    a = v.abs() if a is None else a
    step = _e2m1_step(a)
    k = a.div_(step)
    if generator is None:
        q = k.round_().mul_(step)
    else:
        down = k.floor()
        if isinstance(generator, torch.Tensor):  # by place: this slice's numbers only
            u = counter_uniform(generator, k.shape, slice_of(k.shape, agree))
        else:
            u = draw_sliced(k.shape, lambda s: torch.rand(s, generator=generator,
                                                          device=v.device), agree)
        q = torch.where(u < k.sub_(down), down.add(1), down).mul_(step)
    return q.copysign_(v)


def nvfp4_descale(amax: torch.Tensor) -> torch.Tensor:
    """The per-tensor descale ``G = amax / (448 · 6)`` of tensors with amax ``amax``
    (elementwise, fp32; 1 where an amax is 0), as ``cast_nvfp4`` computes it."""
    amax = amax.float()
    return torch.where(amax > 0, amax / _DESCALE, torch.ones_like(amax))


def cast_nvfp4(t: torch.Tensor, dim: int = 1, square: bool = False,
               generator: torch.Generator | torch.Tensor | None = None,
               amax: torch.Tensor | None = None, agree: Agreement | None = None
               ) -> Quantized:
    """``t`` (2-D) in NVFP4 along ``dim`` (1×16 blocks), or in 16×16 blocks with
    ``square``; ``generator``: stochastic rounding of the elements; ``amax``: the
    tensor's amax where it is known already (a row shard's, agreed over ranks: the
    shard then casts as its rows of the whole tensor do); ``agree``: else ``t`` is a
    tensor-parallel shard whose amax and random draws are agreed now (``tp_agree``).

    The result's codes are the e2m1 values as e4m3 bytes (every e2m1 value is one), its
    inverse scales the e4m3 block scales ``s`` (in fp32) and its ``outer`` the descale
    ``G``: the value is ``code · (s · G)``."""
    rows, cols = ((NVFP4_BLOCK, NVFP4_BLOCK) if square else
                  (1, NVFP4_BLOCK) if dim == 1 else (NVFP4_BLOCK, 1))
    x = t.detach().float()
    amax_b = block_amax(x, rows, cols)
    amax_t = (agreed_amax(amax_b.amax(), agree=agree)  # the largest block's
              if amax is None else amax.float())
    descale = nvfp4_descale(amax_t)
    s = ((amax_b / _E2M1_MAX) / descale).clamp_(_E4M3.min_normal, _E4M3.max)
    s = s.to(torch.float8_e4m3fn).float()
    bad = ~torch.isfinite(amax_b)
    s = torch.where(bad, torch.full_like(s, float("nan")), s)
    mult = torch.reciprocal(descale) / s
    v = x * expand_blocks(mult, rows, cols, x.shape)
    a = v.abs().clamp_(max=_E2M1_MAX)  # |v| within ±6 (a NaN stays NaN)
    codes = _round_e2m1(v, generator, a, agree).to(torch.float8_e4m3fn)
    return Quantized(codes, s, rows, cols, outer=descale)


def _hadamard_16(seed: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    for _ in range(4):
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    g = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (16,), generator=g).float() * 2 - 1
    return h * signs / 4.0


#: seed 0's matrix, built at import so that compiled graphs read it as a constant
#: instead of tracing a generator
_H16 = _hadamard_16(0)


@functools.cache
def _hadamard_on(seed: int, device) -> torch.Tensor:
    return (_H16 if seed == 0 else _hadamard_16(seed)).to(device)


def hadamard_16(seed: int = 0, device: torch.device | str | None = None) -> torch.Tensor:
    """The 16×16 orthonormal Hadamard matrix with random column signs (fixed by
    ``seed``), built once per device (read-only: callers must not modify it)."""
    if seed == 0 and torch.compiler.is_compiling():
        return _H16.to(device)
    return _hadamard_on(seed, device)


def apply_hadamard(t: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``H`` applied to each group of 16 rows of ``t`` (rows zero-padded to 16)."""
    m = t.shape[0]
    p = torch.nn.functional.pad(t.float(), (0, 0, 0, (-m) % 16))
    out = torch.einsum("ij,gjn->gin", h, p.view(-1, 16, p.shape[1]))
    return out.reshape(-1, p.shape[1])
