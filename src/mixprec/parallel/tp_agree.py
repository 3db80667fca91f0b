"""The agreement a cast on a tensor-parallel shard needs: given an ``Agreement`` (the
operand's tensor-parallel layout, which ``agreement`` builds for one cast and the casts
take as their ``agree`` argument), the amaxes the cast takes become the whole tensor's
(``agreed_amax``: an all-reduce MAX over the group where the operand is sharded) and the
random numbers it draws the whole tensor's slice (``draw_sliced``; ``slice_of`` says
where the slice lies, for draws made by place). Without one both are the identity, so
the casts call them always (through ``mixprec.formats.shard``, whose protocol this
implements). A compiled backward casts on shards in one graph.
``sr_stream`` says which random stream a rank draws from: the ranks that see the same
data (one tensor-parallel group, ``data_group``) alike, data-parallel ranks apart; the
engine fixes every quantized module's stream by it (``share_streams``), sharded or
whole. ``mixprec.parallel.tensor_parallel`` runs the quantized Linears on the shards."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mixprec.formats.shard import agreed_amax, draw_sliced, slice_of
from mixprec.parallel.comm_stats import CommStats
from mixprec.parallel.presharded import fsdp_tp_specs, fsdp_whole_params

__all__ = ["Agreement", "agreement", "agreed_amax", "draw_sliced", "slice_of",
           "sr_stream", "data_group", "share_streams", "STREAM_STRIDE"]


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


def sr_stream(group: dist.ProcessGroup | None = None) -> int:
    """The random stream this rank's stochastic rounding draws from: the global rank of
    the first rank of ``group``, the ranks that see this rank's data (``data_group``;
    None: this rank alone), so that the ranks of one tensor-parallel group, which round
    the same gradients (or slices of one tensor they draw whole), draw alike, and
    data-parallel ranks, which round different gradients, draw apart; 0 in one process
    and on global rank 0."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    if group is None:
        return dist.get_rank()
    return dist.get_global_rank(group, 0)


def _transformers_tp_group(model: nn.Module) -> tuple[bool, dist.ProcessGroup | None]:
    """(whether transformers' ``DistributedConfig`` laid ``model`` out, the group of its
    ``tp`` mesh dim where that has more than one rank)."""
    for m in model.modules():
        manager = getattr(m, "_mesh_manager", None)
        if manager is None or not hasattr(manager, "get_mesh"):
            continue
        if (getattr(m, "_tp_size", None) or 1) <= 1:
            return True, None
        return True, manager.get_mesh("tp").get_group()
    return False, None


def data_group(model: nn.Module) -> dist.ProcessGroup | None:
    """The process group of the ranks that see the same batch as this one: its
    tensor-parallel group, which is transformers' ``tp`` mesh dim under
    ``from_pretrained(..., distributed_config=DistributedConfig(tp_size=...))``, else
    the 1-D mesh of a Linear weight torch's ``parallelize_module`` sharded (FSDP2 over
    it: the mesh of the plan's shard the forward sees; FSDP2's shards of whole weights
    are no such mesh); None where no tensor-parallel plan
    shares this rank's data (one process, DDP, FSDP, expert parallelism alone)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    laid_out, group = _transformers_tp_group(model)
    if laid_out:
        return group
    whole, specs = fsdp_whole_params(model), fsdp_tp_specs(model)
    for m in model.modules():
        w = getattr(m, "weight", None) if isinstance(m, nn.Linear) else None
        if type(w).__name__ != "DTensor" or id(w) in whole:
            continue
        mesh, placements = ((specs[id(w)].mesh, specs[id(w)].placements) if id(w) in specs
                            else (w.device_mesh, w.placements))  # (FSDP2 over the plan)
        if mesh.ndim == 1 and placements[0].is_shard():
            return mesh.get_group(0)
    return None


def share_streams(modules: Iterable[nn.Module], group: dist.ProcessGroup | None) -> None:
    """Each of ``modules`` (quantized Linears, experts formats) draws its stochastic
    rounding from the stream of ``group`` (``data_group``: the ranks that see this
    rank's data), whether its weight is sharded or whole on this rank."""
    shift = sr_stream(group) * STREAM_STRIDE
    for m in modules:
        m._sr_shift = shift
