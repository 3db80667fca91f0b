"""Per-tensor and rowwise fp8 scaling: ``scale = fp8_max / amax / 2^margin`` (the
largest magnitude lands at the format's max), saturating casts, and delayed scaling's
per-step update of its amax history (Transformer Engine's recipe). A scale is kept where
amax is 0 or not finite; a cast whose amax is not finite takes a NaN scale
(``nan_if_not_finite``) so that the step is skipped.
"""

from __future__ import annotations

import torch

from mixprec.formats import elements as formats
from mixprec.formats.shard import Agreement, agreed_amax

__all__ = ["ROLES", "amax_to_scale", "cast_to_fp8", "cast_rowwise", "rowwise_scale",
           "nan_if_not_finite", "update_delayed_scales", "FP8_MAX", "fp8_max_tensor",
           "abs_max"]

ROLES = ("input", "weight", "grad_output")
FP8_MAX = {
    torch.float8_e4m3fn: formats.get("fp8_e4m3").max,
    torch.float8_e5m2: formats.get("fp8_e5m2").max,
}


def fp8_max_tensor(dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``dtype``'s largest value as a 0-d fp32 tensor: ``max / amax`` then divides
    tensors (``448.0 / a`` would be ``reciprocal(a) * 448``, one ulp off)."""
    return torch.full((), FP8_MAX[dtype], device=device)


def abs_max(t: torch.Tensor) -> torch.Tensor:
    """``t.abs().amax()`` in ``t``'s dtype, in one pass without the ``|t|`` copy: the
    larger of ``-min`` and ``max`` from ``torch.aminmax`` (1.9x faster on a bf16
    activation here: ``benchmarks/fp8_upcast.py``; along a dim, aminmax was 10x slower,
    so rowwise amaxes stay ``abs().amax(dim)``). Bit for bit the same for finite and
    infinite values (the final ``abs`` makes a zero +0, as ``|t|``'s is); a NaN anywhere
    gives a NaN, as amax does (its payload may differ: every cast turns a NaN amax into
    a fresh NaN scale)."""
    lo, hi = torch.aminmax(t.detach())
    return torch.maximum(lo.neg_(), hi).abs_()


def amax_to_scale(amax: torch.Tensor, fp8_max: torch.Tensor | float, margin: int,
                  old: torch.Tensor) -> torch.Tensor:
    """fp8_max / amax / 2^margin where that is finite and amax > 0; else ``old``. A
    margin ``m`` keeps delayed casts from saturating while amax grows by less than
    2^m per step."""
    scale = fp8_max / amax / (2.0**margin)
    ok = (amax > 0) & torch.isfinite(amax) & torch.isfinite(scale)
    return torch.where(ok, scale, old)


def nan_if_not_finite(scale: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """``scale`` where ``amax`` is finite, NaN where it is not (elementwise, so a row's
    scale for rowwise casts): a saturating cast must not turn an inf into a finite max,
    which would train an inf input as a large finite value; a NaN cast makes the GEMM's
    output NaN, and the step is skipped like any overflow."""
    return torch.where(torch.isfinite(amax), scale, torch.full_like(scale, float("nan")))


def cast_to_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Saturating cast: ``clamp(x * scale, ±max)`` rounded to nearest into ``dtype``."""
    m = FP8_MAX[dtype]
    return (x.float() * scale).clamp_(-m, m).to(dtype)


def cast_rowwise(t: torch.Tensor, dim: int, dtype: torch.dtype, margin: int = 0,
                 amax: torch.Tensor | None = None, agree: Agreement | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` (2-D) in fp8 with one scale per slice along ``dim``, the GEMM's contraction
    dim, and the inverse scales, shaped to broadcast (``dim=1``: (rows, 1); ``dim=0``:
    (1, cols)). A slice of zeros keeps the scale 1; a slice holding an inf or NaN gets a
    NaN scale (``nan_if_not_finite``). ``amax``: the slices' amaxes, shaped as the
    scales, where they are known already (a row shard's columns, agreed over ranks);
    ``agree``: else ``t`` is a tensor-parallel shard whose amaxes are agreed now."""
    if amax is None:
        amax = agreed_amax(t.detach().abs().amax(dim=dim, keepdim=True).float(), dim, agree)
    scale = rowwise_scale(amax, dtype, margin)
    return cast_to_fp8(t, scale, dtype), torch.reciprocal(scale)


def rowwise_scale(amax: torch.Tensor, dtype: torch.dtype, margin: int = 0) -> torch.Tensor:
    """The scale of each slice of a rowwise cast from its ``amax`` (elementwise): 1 for
    a slice of zeros, NaN for one holding an inf or NaN."""
    scale = amax_to_scale(amax, FP8_MAX[dtype], margin, torch.ones_like(amax))
    return nan_if_not_finite(scale, amax)


def update_delayed_scales(
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    fp8_max: torch.Tensor,
    *,
    algo: str = "max",
    margin: int = 0,
    found_inf: torch.Tensor | None = None,
) -> None:
    """One optimizer step of delayed scaling, in place, for a (roles, L) history.

    New scale from the history (``max`` over it, or ``most_recent``: column 0), then roll
    so column 0 is free for the next step. With ``found_inf`` > 0 (a skipped step) the
    scales stay and column 0 is cleared instead: that step's amaxes are dropped.
    """
    amax = amax_history.amax(dim=1) if algo == "max" else amax_history[:, 0]
    new_scale = amax_to_scale(amax, fp8_max, margin, scale)
    rolled = amax_history.roll(1, dims=1)
    rolled[:, 0] = 0.0
    if found_inf is None:
        amax_history.copy_(rolled)
        scale.copy_(new_scale)
        return
    ok = found_inf.reshape(()) == 0
    dropped = amax_history.clone()
    dropped[:, 0] = 0.0
    amax_history.copy_(torch.where(ok, rolled, dropped))
    scale.copy_(torch.where(ok, new_scale, scale))
