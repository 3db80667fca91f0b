"""The one place the experts' GEMMs call into the quantizer interface.

A grouped GEMM casts each expert's operands and multiplies them as a converted Linear
does (``mixprec.modules.linear``): ``cast`` a 2-D tensor for a role along the contracted
dim, ``mm`` two casts on the format's route, ``reuses`` (a forward cast serves the
backward), the per-expert scales of a per-tensor format (``segment_scales``, as FSDP2's
gather of the experts' codes takes them). Keeping these calls here means a reshaped
quantizer interface changes this module only.
"""

from __future__ import annotations

import torch

from mixprec.experts.format import ExpertsFormat
from mixprec.formats.mm import _no_autocast
from mixprec.formats.quantized import Quantized
from mixprec.formats.scaling import cast_to_fp8
from mixprec.parallel.gather_casts import CastWeight

__all__ = ["cast", "mm", "reuses", "no_autocast", "segment_scales", "cast_scaled"]

#: autocast off around the GEMMs, which pick their own dtypes (as in a Float8Linear)
no_autocast = _no_autocast


def cast(fmt: ExpertsFormat, t: torch.Tensor, role: str, dim: int, record: bool = False,
         generator: torch.Generator | None = None) -> Quantized:
    """``t`` (2-D) cast for ``role`` along ``dim`` by ``fmt`` (an ``ExpertsFormat``):
    its quantizer with its scaling state; an expert's weight FSDP2 gathered as its
    casts (``CastWeight``, ``mixprec.experts.gather_casts``) hands over its cast."""
    if isinstance(t, CastWeight):
        return t.cast(dim)
    return fmt.quantizer.cast(t, role, dim, fmt.scaling_state(), record, generator)


def mm(fmt: ExpertsFormat, a: Quantized, b: Quantized, out_dtype: torch.dtype
       ) -> torch.Tensor:
    """``a @ b`` on ``fmt``'s GEMM route, fp32 accumulation, in ``out_dtype``."""
    return fmt.quantizer.mm(a, b, out_dtype, fmt.backend(a.data.device))


def reuses(fmt: ExpertsFormat, role: str) -> bool:
    """Whether the forward's cast of ``role`` serves its backward GEMM too."""
    return fmt.quantizer.reuses(role)


def segment_scales(fmt: ExpertsFormat, amax: torch.Tensor, role: str, record: bool = False,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
    """The per-tensor scales of ``fmt``'s quantizer for a vector of per-expert amaxes
    (NaN where an amax is not finite, as a cast makes it); with ``record``, delayed
    scaling records the max of the amaxes (of those ``mask`` keeps)."""
    return fmt.quantizer.expert_scales(amax, role, fmt.scaling_state(), record, mask)


def cast_scaled(fmt: ExpertsFormat, t: torch.Tensor, scale: torch.Tensor, role: str
                ) -> torch.Tensor:
    """``t``'s fp8 codes for ``role`` under ``scale`` (broadcast over ``t``)."""
    return cast_to_fp8(t, scale, fmt.quantizer.dtype(role))
