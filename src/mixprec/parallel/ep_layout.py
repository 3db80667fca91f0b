"""The engine's moments over an expert-parallel model (``mixprec.experts.expert_parallel``):
the mode built when no ``parallel=`` is given and the model's experts are cut over an EP
group, on a 1-D group or a 2-D mesh of expert data parallel × EP.

The experts' shards differ across the EP ranks and are replicas across the
expert-data-parallel ones; the rest of the model is replicated over the data-parallel
group (the EP group, or the whole mesh). ``ExpertShards.average_grads`` averages the
gradients in the loop; the engine makes every rank take the same step:

==================  ===========================================================
moment              expert parallel
==================  ===========================================================
``choose``          the data group's first rank measures, every rank takes it
``start``           the rest from the data group's first rank, each expert from
                    its first replica (the expert-data-parallel group's)
``agree_max_``      all-reduce MAX over the data group: every rank skips together
``agree_amax``      fp8 amax histories' all-reduce MAX over the data group (an
                    experts module's then spans every expert's tokens, as in one
                    process)
``norm_of``         the experts' squares summed over the EP group (each expert
                    once, not once per replica), the rest's counted once
==================  ===========================================================
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from mixprec.engine.devices import KernelChoices
from mixprec.engine.gradnorm import fp32_norms
from mixprec.engine.param_state import ParamState
from mixprec.experts.expert_parallel import ExpertShard
from mixprec.parallel.layouts import Parallel
from mixprec.recipe import Recipe

__all__ = ["EP", "expert_shard_of", "is_expert_shard"]


def is_expert_shard(p: torch.Tensor) -> bool:
    """Whether ``p`` is an experts module's parameter cut to this rank's experts."""
    return bool(getattr(p, "_mixprec_expert_shard", False))


def expert_shard_of(model: nn.Module) -> ExpertShard | None:
    """The groups of ``model``'s expert-parallel modules (None: none is); every module
    must share them."""
    shards = [m._mixprec_ep for m in model.modules() if "_mixprec_ep" in m.__dict__]
    if not shards:
        return None
    first = shards[0]
    for s in shards[1:]:
        if (s.group, s.dp_group, s.data_group) != (first.group, first.dp_group,
                                                    first.data_group):
            raise ValueError(f"experts modules {first.name} and {s.name} are expert-"
                             "parallel over different groups; call expert_parallel once "
                             "on the whole model")
    return first


def _first(group) -> int:
    """The global rank of ``group``'s rank 0."""
    return dist.get_global_rank(group, 0)


class EP(Parallel):
    """Expert parallelism, alone or beside expert data parallelism (module doc)."""

    def __init__(self, recipe: Recipe, shard: ExpertShard) -> None:
        super().__init__(recipe)
        self.group, self.dp_group = shard.group, shard.dp_group
        self.data_group = shard.data_group if shard.data_group is not None else shard.group
        self._state: ParamState | None = None
        #: which gradients ``local`` returned last are expert shards
        self._flags: list[bool] = []

    def choose(self, measure: Callable[[], KernelChoices]) -> KernelChoices:
        """The data group's first rank measures, every rank takes its choices (as
        data parallel does: ranks must not resolve ``auto`` differently)."""
        src = _first(self.data_group)
        box = [measure() if dist.get_rank() == src else None]
        dist.broadcast_object_list(box, src, group=self.data_group)
        agreed = box[0]
        return agreed if dist.get_rank() == src else dataclasses.replace(
            agreed, source=f"rank {src} ({agreed.source})")

    def start(self, model: nn.Module) -> None:
        """The rest of the model from the data group's first rank; each expert shard
        from its first replica."""
        src = _first(self.data_group)
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                if not is_expert_shard(t):
                    dist.broadcast(t.data, src, group=self.data_group)
                elif self.dp_group is not None:
                    dist.broadcast(t.data, _first(self.dp_group), group=self.dp_group)

    def wrap(self, model: nn.Module, param_state: ParamState) -> nn.Module:
        """Nothing wraps the model; the parameter state is kept for the norm."""
        self._state = param_state
        return model

    def local(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The gradients as they are; which are expert shards is noted for ``norm_of``."""
        st = self._state
        flags = [is_expert_shard(p) for p, g in zip(st.working, st.grads) if g is not None]
        if len(flags) != len(grads):
            raise RuntimeError(f"{len(grads)} gradients for {len(flags)} parameters with a "
                               "gradient: the norm must read the parameter state's")
        self._flags = flags
        return grads

    def norm_of(self, grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """The whole model's norm, the same on every rank: the experts' squares summed
        over the EP group, the rest's (replicated) counted once."""
        squares = (torch.stack(fp32_norms(grads)).square() if grads
                   else torch.zeros(0, device=device))
        flags = torch.tensor(self._flags, dtype=torch.bool, device=squares.device)
        experts = torch.where(flags, squares, 0).sum().reshape(1)
        dist.all_reduce(experts, group=self.group)
        return (torch.where(flags, 0, squares).sum() + experts[0]).sqrt()

    def agree_max_(self, t: torch.Tensor) -> torch.Tensor:
        """In place: the elementwise max of ``t`` over the data-parallel ranks."""
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.data_group)
        return t

    def agree_amax(self, fp8_modules: list) -> None:
        """This step's amaxes become the max over the data group."""
        mods = [m for m in fp8_modules if m.quantizer.has_history]
        if not mods:
            return
        cur = torch.stack([m.fp8_amax_history[:, 0] for m in mods])
        dist.all_reduce(cur, op=dist.ReduceOp.MAX, group=self.data_group)
        for m, row in zip(mods, cur):
            m.fp8_amax_history[:, 0] = row
