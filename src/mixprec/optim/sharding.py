"""FSDP2 / DTensor parameters in ``mixprec.optim``: the update of a local shard, states
sharded like their parameter.

A DTensor parameter (sharded on dim 0) is updated through its local shard: the update
is elementwise, and the block formats cut blocks along rows (``mixprec.optim.states``),
so a shard's states are exactly those rows of the whole tensor's. Which format a state
takes is decided on the whole parameter's shape. Each state is kept as a DTensor
sharded like its parameter, so checkpoints gather or reshard it as they do the
parameter. Stochastic writes key their bits by the element's index in the whole tensor
(``shard_offset``), so a shard draws the bits of its rows. Shards take the per-tensor
path under ``fused=True`` too.
"""

from __future__ import annotations

import math
import sys

import torch

__all__ = ["ShardedUpdate", "is_dtensor", "shard_offset", "shard_like"]


class ShardedUpdate:
    """The ``LowPrecisionOptimizer`` part that steps a DTensor parameter."""

    def _update_shard(self, p, g, group, state, skip) -> None:
        """A DTensor parameter: the update of its local shard, with each new state
        wrapped as a DTensor sharded like ``p`` (rows with its rows)."""
        own = self._own_format(p)
        if own != "fp32" and any(pl.is_shard() and pl.dim != 0 for pl in p.placements):
            raise NotImplementedError(
                f"states={own!r} for a parameter sharded as {p.placements}: block "
                "states are cut along rows, so only dim-0 shards (FSDP2's default) hold "
                "whole blocks. Shard on dim 0, or use states='fp32'.")
        local = {k: v.to_local() if is_dtensor(v) else v for k, v in state.items()}
        offset = shard_offset(p) if self.rule.draws_bits else 0
        self._update_tensor(p.data.to_local(), p.shape, g, group, local, skip,
                            offset=offset, key=id(p))
        for k, v in local.items():
            if k not in state:
                state[k] = v if v.ndim == 0 else shard_like(v, p)


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (without importing DTensor's module: if it was never
    imported, there is none)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def shard_offset(p: torch.Tensor) -> int:
    """Element index, in the whole tensor, of the first element of this rank's shard of
    DTensor ``p`` (dim-0 shards, torch.chunk's split as FSDP2 and DTensor cut them)."""
    (pl,) = p.placements if len(p.placements) == 1 else (None,)
    if pl is None or not pl.is_shard():
        if pl is None:
            raise NotImplementedError(
                f"a parameter on a {p.device_mesh.ndim}-D mesh ({p.placements}): "
                "mixprec.optim's stochastic writes key their bits by the element's index "
                "on a 1-D mesh (FSDP2); use write='kahan' or 'remainder' here")
        return 0
    if pl.dim != 0:
        raise NotImplementedError(f"a parameter sharded as {p.placements}: stochastic "
                                  "writes need dim-0 shards (FSDP2's default)")
    rows, world = p.shape[0], p.device_mesh.size()
    chunk = -(-rows // world) if rows else 0
    first = min(p.device_mesh.get_coordinate()[0] * chunk, rows)
    return first * math.prod(p.shape[1:])


def shard_like(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``local``, this rank's rows of a state of ``p``, as a DTensor placed like ``p``
    whose global dim 0 is ``p``'s (FSDP2's shards may be uneven)."""
    from torch.distributed.tensor import DTensor

    shape = (p.shape[0], *local.shape[1:])
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                              shape=shape, stride=stride)
