"""What a cast needs to know when its operand is a tensor-parallel shard: the amaxes it
takes must be the whole tensor's and the random numbers it draws the whole tensor's
slice, so that the ranks together cast what one process would. The casts take such an
agreement as their ``agree`` argument (passed, not set aside in a global: a compiled
backward, which may mutate no global, casts on shards in one graph); the parallel
layouts build it (``mixprec.parallel.tp_agree``), and the formats only call it through
this protocol. Without one every function here is the identity."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

__all__ = ["Agreement", "agreed_amax", "draw_sliced", "slice_of"]


class Agreement(Protocol):
    """A cast's operand lies on a tensor-parallel shard (``mixprec.parallel.tp_agree``
    builds one)."""

    #: the operand's sharded dim (None: the operand is whole on every rank)
    dim: int | None

    def whole_amax(self, amax: torch.Tensor, along: int | None) -> torch.Tensor:
        """``amax`` of the shard made the whole tensor's (``along``: the dim it was
        taken over; None: the whole shard's)."""

    def whole_slice(self, shape: tuple[int, ...]
                    ) -> tuple[tuple[int, int], tuple[int, int]] | None:
        """The whole tensor's shape and where this shard starts in it (row, column)."""


def agreed_amax(amax: torch.Tensor, along: int | None = None,
                agree: Agreement | None = None) -> torch.Tensor:
    """``amax`` of the operand being cast, the whole tensor's under ``agree``."""
    return amax if agree is None else agree.whole_amax(amax, along)


def slice_of(shape: tuple[int, ...] | torch.Size, agree: Agreement | None = None
             ) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """Under ``agree`` on a sharded 2-D operand of ``shape``: the whole tensor's shape and
    where this rank's slice starts in it (row, column); else None."""
    if agree is None or agree.dim is None or len(shape) != 2:
        return None
    return agree.whole_slice(tuple(shape))


def draw_sliced(shape: tuple[int, ...] | torch.Size,
                draw: Callable[[tuple[int, ...]], torch.Tensor],
                agree: Agreement | None = None) -> torch.Tensor:
    """``draw(shape)`` (random numbers for a cast), or under ``agree`` on a sharded
    operand: ``draw`` of the whole tensor's shape, narrowed to this rank's slice."""
    where = slice_of(shape, agree)
    if where is None:
        return draw(shape)
    dim = agree.dim
    return draw(where[0]).narrow(dim, where[1][dim], shape[dim])
