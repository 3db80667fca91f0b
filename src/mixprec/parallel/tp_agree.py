"""The agreement a cast on a tensor-parallel shard needs: given an ``Agreement`` (the
operand's tensor-parallel layout, which ``agreement`` builds for one cast and the casts
take as their ``agree`` argument), the amaxes the cast takes become the whole tensor's
(``agreed_amax``: an all-reduce MAX over the group where the operand is sharded) and the
random numbers it draws the whole tensor's slice (``draw_sliced``; ``slice_of`` says
where the slice lies, for draws made by place). Without one both are the identity, so
the casts call them always (through ``mixprec.formats.shard``, whose protocol this
implements). A compiled backward casts on shards in one graph.
``sr_stream`` says which random stream a rank draws from: the ranks of one
tensor-parallel group alike, data-parallel ranks apart. ``mixprec.parallel.tensor_parallel``
runs the quantized Linears on the shards."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mixprec.formats.shard import agreed_amax, draw_sliced, slice_of
from mixprec.parallel.comm_stats import CommStats

__all__ = ["Agreement", "agreement", "agreed_amax", "draw_sliced", "slice_of",
           "sr_stream", "STREAM_STRIDE"]


@dataclass(frozen=True)
class Agreement:
    """One cast of an operand on a tensor-parallel shard (``mixprec.formats.shard``'s
    protocol, which the casts call)."""

    #: the weight's ``mixprec.parallel.tensor_parallel.TPLayout``
    layout: Any
    #: the operand's sharded dim (None: the operand is whole on every rank)
    dim: int | None
    #: where the amax all-reduces are recorded (None: nowhere)
    stats: CommStats | None = None

    def whole_amax(self, amax: torch.Tensor, along: int | None) -> torch.Tensor:
        """``amax`` all-reduced (MAX) over the tensor-parallel group where the operand
        is sharded, when ``along`` (the dim the amax was taken over; None: the whole
        tensor's amax) spans the sharded dim. A NaN becomes an inf first, so every rank
        sees it."""
        if self.dim is None or (along is not None and along % 2 != self.dim):
            return amax
        out = torch.where(torch.isnan(amax), torch.full_like(amax, math.inf), amax)
        out = out.float().contiguous()
        if self.stats is not None:
            self.stats.record(out, op="all_reduce", what="amax")
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.layout.group)
        return out.to(amax.dtype)

    def whole_slice(self, shape: tuple[int, ...]
                    ) -> tuple[tuple[int, int], tuple[int, int]] | None:
        """The whole tensor's shape and where this rank's slice starts in it."""
        if self.dim is None:
            return None
        whole, at = list(shape), [0, 0]
        whole[self.dim], at[self.dim] = self.layout.full, self.layout.offset
        return tuple(whole), tuple(at)


def agreement(layout: Any, role: str, stats: CommStats | None = None,
              dim: int | None = -1) -> Agreement | None:
    """The ``agree`` argument of one cast of ``role``'s operand on a tensor-parallel
    shard (``layout``: the weight's ``TPLayout``; None off a shard, which gives None;
    ``dim``: the operand's sharded dim, if not the role's; ``stats``: where its amax
    all-reduces are recorded)."""
    if layout is None:
        return None
    return Agreement(layout, layout.dim_of(role) if dim == -1 else dim, stats)


#: an odd 32-bit multiplier: a module's stochastic-rounding key moves by
#: ``stream * STREAM_STRIDE``, distinct in the key's low 32 bits for every stream
STREAM_STRIDE = 0x9E3779B1


def sr_stream(layout: Any = None) -> int:
    """The random stream this rank's stochastic rounding draws from: the global rank of
    the first rank of its tensor-parallel group (``layout``: the Linear's ``TPLayout``,
    None off a tensor-parallel shard: this rank), so that the ranks of one group, which
    draw one tensor and keep their slices, draw alike, and data-parallel ranks, which
    round different gradients, draw apart; 0 in one process and on global rank 0."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    if layout is None:
        return dist.get_rank()
    return dist.get_global_rank(layout.group, 0)
