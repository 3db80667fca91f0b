"""Numeric statistics of a tensor against every format's limits (from mixprec.formats.elements).

One exponent histogram answers every threshold question at once. ``frexp`` gives each
element's binade, and ``bincount`` counts them. The underflow limits (smallest subnormal
and smallest normal) are powers of two, so "how many fall below" is a cumulative sum
over bins. Overflow is counted from ``2^(emax+1)``, the binade above the format's top.
Values between ``max`` and ``2^(emax+1)`` (65504…65536 in fp16) are a sliver that is
left out. ``amax`` reads the whole tensor in one ``aminmax`` pass (so a single inf or NaN
anywhere is always seen). The fractions and
the histogram come from an evenly strided sample of at most ``SAMPLE`` elements, which
is plenty for a fraction and bounds the cost per tensor. There is no host sync.
"""

from __future__ import annotations

import math

import torch

from mixprec.formats import elements as formats

__all__ = ["WATCHED", "tensor_stats", "HIST_EDGES", "EXP_MIN", "EXP_MAX", "SAMPLE"]

#: elements per tensor that the fractions and the histogram are computed from
SAMPLE = 65536

#: formats whose range each statistic is measured against
WATCHED = ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2")
#: binades tracked: |x| in [2^e, 2^(e+1)) for e = EXP_MIN .. EXP_MAX-1 (fp32's whole range)
EXP_MIN = -150
EXP_MAX = 130
HIST_EDGES = torch.arange(EXP_MIN, EXP_MAX + 1, dtype=torch.float32)
_NB = EXP_MAX - EXP_MIN


def tensor_stats(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """Device tensors: amax and the non-finite fraction (whole tensor); smallest non-zero
    magnitude, fraction of exact zeros, and per watched format the fraction that would
    flush to zero (below half the smallest subnormal), fall below min_normal, or
    overflow, plus the histogram of binades (from the sample)."""
    full = t.detach().flatten()
    if full.numel():
        lo, hi = torch.aminmax(full)  # one pass; inf and NaN propagate into it
        amax = torch.maximum(lo.abs(), hi.abs()).float()
    else:
        amax = torch.zeros(())
    stride = max(1, -(-full.numel() // SAMPLE))
    a = full[::stride].float().abs()
    n = max(a.numel(), 1)
    finite = torch.isfinite(a)
    nonzero = (a > 0) & finite
    _, e = torch.frexp(torch.where(nonzero, a, torch.ones_like(a)))  # a = m·2^e, m∈[.5,1)
    binade = (e - 1 - EXP_MIN).clamp_(0, _NB - 1)
    hist = torch.bincount(torch.where(nonzero, binade, torch.full_like(binade, _NB)),
                          minlength=_NB + 1)[:_NB].float()
    cum = torch.cumsum(hist, 0)  # cum[i]: elements with binade <= EXP_MIN + i

    def below(power: float) -> torch.Tensor:  # elements with 0 < |x| < 2^power
        i = int(power) - EXP_MIN - 1
        return cum[i] if i >= 0 else torch.zeros((), device=a.device)

    out = {
        "amax": amax,
        "min_nonzero": torch.where(nonzero, a, torch.full_like(a, math.inf)).min()
        if a.numel() else torch.zeros(()),
        "zeros": (a == 0).sum() / n,
        # sampled; at least one element when the exact amax says something is non-finite
        "nonfinite": torch.where(torch.isfinite(amax), (~finite).sum() / n,
                                 torch.clamp((~finite).sum() / n,
                                             min=1.0 / max(full.numel(), 1))),
        "numel": torch.tensor(float(full.numel())),
        "hist": hist,
    }
    for name in WATCHED:
        f = formats.get(name)
        out[f"{name}_to_zero"] = below(math.log2(f.min_subnormal) - 1) / n
        out[f"{name}_subnormal"] = below(math.log2(f.min_normal)) / n
        out[f"{name}_overflow"] = ((hist.sum() - below(f.emax + 1)) +
                                   (~finite).sum()) / n
    return out
