"""Per-tensor fp8 scaling: amax histories, delayed and current scales.

Each fp8 tensor ``t`` is stored as ``cast(t * scale)`` with ``scale = fp8_max / amax /
2^margin``, so its largest magnitude lands just under the format's max (448 for e4m3,
57344 for e5m2), and the GEMM multiplies the result back by ``1 / scale``.

- **current** scaling takes ``amax`` from the tensor itself at cast time;
- **rowwise** scaling is current scaling with one scale per row of a GEMM operand
  (``cast_rowwise``): per token for activations and gradients, per output or input
  channel for weights. One outlier token then costs precision in its own row only.
- **delayed** scaling (Transformer Engine's recipe) uses a scale computed
  from a history of the amaxes of previous steps, so the cast needs no reduction before
  it. ``history[:, 0]`` collects this step's amax (the max over micro-batches); at the
  optimizer step the new scale comes from ``max`` over the history (or the most recent
  entry), then the history rolls by one. A margin ``m`` keeps casts from saturating
  while amax grows by less than 2^m per step.

A scale is kept, not replaced, when the amax is 0 or not finite. A skipped optimizer
step discards this step's amaxes, so one overflow does not poison the history. All of it
is tensor ops on the device.

Casts saturate (``clamp`` to ±max), which would also turn an inf into ±max and hide it
from the engine's non-finite check: an inf in an input batch would train as a large
finite value. So the cast of a tensor whose amax is not finite uses a NaN scale
(``nan_if_not_finite``): the cast is all NaN, so is the GEMM's output, and the step is
skipped like any other overflow.
"""

from __future__ import annotations

import torch

from mixprec import formats

__all__ = ["ROLES", "amax_to_scale", "cast_to_fp8", "cast_rowwise", "nan_if_not_finite",
           "update_delayed_scales", "FP8_MAX", "fp8_max_tensor"]

ROLES = ("input", "weight", "grad_output")
FP8_MAX = {
    torch.float8_e4m3fn: formats.get("fp8_e4m3").max,
    torch.float8_e5m2: formats.get("fp8_e5m2").max,
}


def fp8_max_tensor(dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``dtype``'s largest value as a 0-d fp32 tensor: ``max / amax`` then divides
    tensors (``448.0 / a`` would be ``reciprocal(a) * 448``, one ulp off)."""
    return torch.full((), FP8_MAX[dtype], device=device)


def amax_to_scale(amax: torch.Tensor, fp8_max: torch.Tensor | float, margin: int,
                  old: torch.Tensor) -> torch.Tensor:
    """fp8_max / amax / 2^margin where that is finite and amax > 0; else ``old``."""
    scale = fp8_max / amax / (2.0**margin)
    ok = (amax > 0) & torch.isfinite(amax) & torch.isfinite(scale)
    return torch.where(ok, scale, old)


def nan_if_not_finite(scale: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """``scale`` where ``amax`` is finite, NaN where it is not (elementwise, so a row's
    scale for rowwise casts): a saturating cast must not turn an inf into a finite max."""
    return torch.where(torch.isfinite(amax), scale, torch.full_like(scale, float("nan")))


def cast_to_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Saturating cast: ``clamp(x * scale, ±max)`` rounded to nearest into ``dtype``."""
    m = FP8_MAX[dtype]
    return (x.float() * scale).clamp_(-m, m).to(dtype)


def cast_rowwise(t: torch.Tensor, dim: int, dtype: torch.dtype, margin: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` (2-D) in fp8 with one scale per slice along ``dim``, the GEMM's contraction
    dim, and the inverse scales, shaped to broadcast (``dim=1``: (rows, 1); ``dim=0``:
    (1, cols)). A slice of zeros keeps the scale 1; a slice holding an inf or NaN gets a
    NaN scale (see the module doc)."""
    amax = t.detach().abs().amax(dim=dim, keepdim=True).float()
    scale = amax_to_scale(amax, FP8_MAX[dtype], margin, torch.ones_like(amax))
    scale = nan_if_not_finite(scale, amax)
    return cast_to_fp8(t, scale, dtype), torch.reciprocal(scale)


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
