"""Writing an fp32 update into a bf16/fp16 weight that has no fp32 master.

The optimizer computes the new value of each weight in fp32 (``new``); the write rule
decides what the 16-bit weight keeps of it. With ``w = 1.0`` in bf16 (spacing 2^-7)
and 1000 updates of ``+1e-4``:

- ``nearest``: round to nearest even. An update below half the spacing is lost every
  time: the weight stays 1.0 (seed 000 §2's vanishing update).
- ``stochastic``: round up with probability equal to the remainder's share of the
  spacing, so ``E[w_new] = new`` (unbiased): the weight reaches 1.1 in expectation. The
  random bits come from the optimizer's seeded generator (checkpointed, and the same
  stream on every data-parallel replica, whose weights therefore stay equal).
- ``kahan``: a compensation buffer ``c`` in the weight's dtype holds what the last
  rounding dropped (``c = w - true``); the next update starts from ``w - c``. The
  stored weight then follows the exact sum: 1000 updates give the bf16 nearest to 1.1.
  Costs 2 bytes per parameter.
- ``remainder`` (bf16 only): an int16 remainder holds the low 16 bits of the fp32
  value, so bf16 weight + remainder *is* the fp32 master, exactly, for 2 bytes instead
  of 4. The weight is the fp32 value rounded to nearest, ties away from zero: with 16
  bits there is no room to record which way a tie went under ties-to-even (a bf16
  value has 65,537 fp32 values that round to it when it is even), so at the 1-in-2^17
  fp32 values that are ties towards an even bf16 the weight is the other neighbour.
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["WriteRule", "WRITE_RULES", "stochastic_round", "split_remainder",
           "join_remainder", "write_bytes"]

WriteRule = Literal["nearest", "stochastic", "kahan", "remainder"]
WRITE_RULES = ("nearest", "stochastic", "kahan", "remainder")

_LOW = 0xFFFF


def stochastic_round(x: torch.Tensor, dtype: torch.dtype,
                     generator: torch.Generator | None) -> torch.Tensor:
    """``x`` (fp32) rounded stochastically to ``dtype`` (bf16 or fp16), unbiased.

    bf16: a uniform 16-bit integer is added to the fp32 bit pattern and the low 16 bits
    are dropped, which rounds the magnitude up with probability (dropped bits) / 2^16.
    Non-finite values pass through. fp16: ``mixprec.formats.quantize`` with
    ``rounding="stochastic"`` (its subnormals and overflow included)."""
    if dtype == torch.float16:
        from mixprec.formats import quantize

        return quantize(x, "fp16", rounding="stochastic", generator=generator).to(dtype)
    if dtype != torch.bfloat16:
        raise ValueError(f"stochastic rounding writes bf16 or fp16 weights, not {dtype}")
    r = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device,
                      generator=generator)
    bits = (x.view(torch.int32) + r) & ~_LOW
    out = bits.view(torch.float32)
    return torch.where(torch.isfinite(x), out, x).to(dtype)


def split_remainder(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``x`` as (bf16 weight, int16 remainder) with ``join_remainder`` exact.

    The weight's bits are the top 16 of ``x``'s, plus one where the low 16 are 0x8000
    or more (round half away from zero); the remainder is ``x``'s bits minus the
    weight's shifted up, which then lies in [-2^15, 2^15). A NaN whose rounding would
    carry out of the exponent (top 16 bits 0x7FFF or 0xFFFF, low 16 >= 0x8000) keeps
    its top 16 bits as a NaN weight and a zero remainder: the low bits of its payload
    are the one thing not kept (the alternative, a zero weight, would hide it)."""
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    hi = (bits >> 16) + ((bits & _LOW) >= 0x8000).to(torch.int64)
    carry_out = torch.isnan(x) & ((hi & 0x7FFF) == 0)  # 0x7FFF + 1 would read as -0
    hi = torch.where(carry_out, bits >> 16, hi)
    rem = torch.where(carry_out, 0, bits - (hi << 16))
    w = _int_to(hi & _LOW, torch.int16).view(torch.bfloat16)
    return w, rem.to(torch.int16)


def join_remainder(w: torch.Tensor, rem: torch.Tensor) -> torch.Tensor:
    """The fp32 value a bf16 weight and its int16 remainder hold."""
    hi = w.view(torch.int16).to(torch.int64) & _LOW
    bits = ((hi << 16) + rem.to(torch.int64)) & 0xFFFFFFFF
    return _int_to(bits, torch.int32).view(torch.float32)


def _int_to(u: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Unsigned values in int64 as the two's-complement ``dtype`` of the same width."""
    width = torch.iinfo(dtype).bits
    return torch.where(u >= (1 << (width - 1)), u - (1 << width), u).to(dtype)


def write_bytes(rule: str, numel: int) -> int:
    """Bytes the rule keeps beside a 16-bit weight (kahan's compensation, remainder's
    int16)."""
    if rule not in WRITE_RULES:
        raise ValueError(f"write rule {rule!r}; valid: {', '.join(WRITE_RULES)}")
    return 2 * numel if rule in ("kahan", "remainder") else 0
