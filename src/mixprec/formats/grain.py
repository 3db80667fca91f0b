"""A format's scale granularity: one descriptor of where its scales sit along the GEMM's
contracted dim, from which the rest of mixprec reads what it needs (per tensor or per
block, the tile, the memory planner's cast shapes) instead of one flag per question."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["ScaleGrain", "GRAIN_KINDS"]

#: the kinds of scale granularity: one scale per tensor, per row (slice along the
#: contracted dim) or per tile of a row
GRAIN_KINDS = ("tensor", "row", "tile")


@dataclass(frozen=True, kw_only=True)
class ScaleGrain:
    """Where a format's casts put their scales."""

    #: ``tensor`` (one scale per tensor), ``row`` (one per slice along the contracted
    #: dim) or ``tile`` (one per ``tile`` elements of such a slice)
    kind: Literal["tensor", "row", "tile"]
    #: elements per scale along the contracted dim (``tile`` only; 0 otherwise)
    tile: int = 0
    #: a weight is cast in ``tile × tile`` blocks, whose one cast serves both of the
    #: weight's GEMMs
    square_weight: bool = False
    #: bytes of a per-tensor scale a cast carries beside its block scales (NVFP4's fp32)
    global_bytes: int = 0
    #: a cast of an activation or gradient along the tokens pads them to a multiple of
    #: this (NVFP4's 16-token Hadamard blocks)
    token_multiple: int = 1

    def __post_init__(self) -> None:
        if self.kind not in GRAIN_KINDS:
            raise ValueError(f"ScaleGrain kind={self.kind!r}; valid: "
                             f"{', '.join(GRAIN_KINDS)}")
        if (self.kind == "tile") != (isinstance(self.tile, int) and self.tile > 0):
            raise ValueError(f"ScaleGrain kind={self.kind!r} with tile={self.tile!r}: a "
                             "tile grain needs a positive tile, the others tile=0")
        if not (isinstance(self.token_multiple, int) and self.token_multiple >= 1):
            raise ValueError(f"ScaleGrain token_multiple={self.token_multiple!r}: give a "
                             "positive integer (1: no padding)")

    @property
    def per_tensor(self) -> bool:
        """One scale per tensor."""
        return self.kind == "tensor"

    @property
    def block_scaled(self) -> bool:
        """A scale per tile: the GEMMs take the block-scaled routes."""
        return self.kind == "tile"
