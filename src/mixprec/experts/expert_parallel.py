"""Expert parallelism for transformers' experts modules: each rank of an EP group keeps
``E / world`` of every experts module's experts and runs them on the tokens every rank
routes to them (``mixprec.experts.dispatch``: dispatch in the recipe's format, combine
in 16 bits).

``expert_parallel(model, group)`` cuts each experts module's 3-D weights (and
per-expert biases) to the rank's experts (rank ``r`` keeps experts ``r·E/world`` to
``(r+1)·E/world − 1``) and gives the module a forward that sorts its (token, expert)
pairs by expert, dispatches them, runs the local experts (in the module's format where
the engine gave it one, ``grouped_mm``; else per expert in the autocast dtype) and
combines the outputs back, weighted and summed over the top-k in fp32 as transformers'
``grouped_mm`` implementation does. The router, attention and every other module stay
whole on each rank: data parallel over the same ranks, each rank its own tokens.

An expert's gradient sums what every rank's tokens send it; with ``average_grads``
(default) it is divided by the group's size, as data parallel averages the other
parameters' gradients, so that the step is the one process's on the ranks' tokens
together (with each rank's loss a mean). The sharded parameters are listed
(``ExpertShards.params``): a data-parallel wrapper over the same ranks must leave them
out of its gradient reduction; ``ExpertShards.average_grads`` averages the others.

On a 2-D ``DeviceMesh`` (``ep`` and an expert-data-parallel dim, e.g. ``("dp",
"ep")``) the experts are cut over ``ep`` and replicated over the other dim, whose ranks
hold the same experts: ``average_grads`` averages the experts' gradients over it, and
the rest of the model's over the whole mesh (every rank its own tokens). The engine
agrees the skip and sums the clip norm's squares across the mesh (each expert counted
once: summed over ``ep``, not over the replicas; ``mixprec.parallel.ep_layout``).
FSDP2 over the expert-data-parallel dim (sharding the experts' replicas) is not built.
"""

from __future__ import annotations

import types
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from mixprec.experts.dispatch import combine, dispatch, dispatched_mm, exchange, wire_dtype
from mixprec.experts.grouped import grouped_mm
from mixprec.experts.hook import experts_modules
from mixprec.parallel.comm_stats import CommStats

__all__ = ["ExpertShard", "ExpertShards", "expert_parallel", "ep_experts_forward",
           "expert_parallel_modules"]


@dataclass(frozen=True, kw_only=True)
class ExpertShard:
    """One experts module's share on this rank."""

    #: the EP process group
    group: object
    #: the experts of the whole module
    num_experts: int
    #: the first of this rank's experts
    first: int
    #: how many experts this rank holds
    count: int
    #: where the exchanges' bytes are recorded
    stats: CommStats
    #: the module's name (in fallbacks and errors)
    name: str = ""
    #: the expert-data-parallel group (a 2-D mesh's other dim; None: none)
    dp_group: object = None
    #: the group the rest of the model is data-parallel over (the EP group on a 1-D
    #: group; the whole mesh on a 2-D one)
    data_group: object = None


@dataclass(frozen=True, kw_only=True)
class ExpertShards:
    """What ``expert_parallel`` did: the modules' shards and the sharded parameters."""

    #: each experts module's shard by qualified name
    modules: dict[str, ExpertShard] = field(default_factory=dict)
    #: the qualified names of the parameters cut to this rank's experts
    params: tuple[str, ...] = ()
    #: the bytes every dispatch and combine sent
    stats: CommStats = field(default_factory=CommStats)
    #: the EP process group (None: the default group)
    group: object = None
    #: the expert-data-parallel group (a 2-D mesh's other dim; None: none)
    dp_group: object = None
    #: the group the rest of the model is data-parallel over (None: ``group``)
    data_group: object = None

    def average_grads(self, named_grads: Iterable[tuple[str, torch.Tensor | None]]) -> int:
        """In place, the mean of every gradient in ``named_grads`` (``(name, grad)``
        pairs, e.g. ``zip(engine.param_state.names, engine.param_state.grads)``): the
        experts' shards' over the expert-data-parallel group (none on a 1-D group),
        the others' over ``data_group`` (the EP group, or the whole 2-D mesh). Returns
        how many gradients were averaged."""
        data = self.data_group if self.data_group is not None else self.group
        world, n = dist.get_world_size(data), 0
        replicas = None if self.dp_group is None else dist.get_world_size(self.dp_group)
        sharded = set(self.params)
        for name, g in named_grads:
            if g is None or (name in sharded and replicas is None):
                continue
            group, size = (self.dp_group, replicas) if name in sharded else (data, world)
            dist.all_reduce(g, group=group)
            g.div_(size)
            n += 1
        return n


def _groups_of(group, ep_dim: str):
    """``(EP group, expert-data-parallel group or None, data-parallel group)`` from a
    process group, a 1-D or 2-D DeviceMesh, or None (the default group)."""
    if group is None:
        return dist.group.WORLD, None, dist.group.WORLD
    if not hasattr(group, "get_group"):  # a process group
        return group, None, group
    if group.ndim == 1:  # a 1-D mesh, or the EP dim sliced out
        pg = group.get_group()
        return pg, None, pg
    names = group.mesh_dim_names or ()
    if group.ndim != 2 or ep_dim not in names:
        raise ValueError(f"expert_parallel takes a 1-D mesh or a 2-D one with an "
                         f"{ep_dim!r} dim, got {group.ndim} dims {names}; pass "
                         f"mesh[('dp', {ep_dim!r})] (expert-data-parallel x EP) or "
                         f"mesh[{ep_dim!r}]")
    dp_dim = next(n for n in names if n != ep_dim)
    whole = (dist.group.WORLD if group.size() == dist.get_world_size()
             else group._flatten().get_group())
    return group.get_group(ep_dim), group.get_group(dp_dim), whole


def expert_parallel(model: nn.Module,
                    group: dist.ProcessGroup | DeviceMesh | None = None, *,
                    average_grads: bool = True,
                    stats: CommStats | None = None, ep_dim: str = "ep") -> ExpertShards:
    """Each transformers experts module of ``model`` keeps this rank's experts of the
    EP ``group`` (a process group or a 1-D ``DeviceMesh``; default: every rank) and
    exchanges its tokens with the group's ranks. A 2-D ``DeviceMesh``: the experts are
    cut over its ``ep_dim`` and replicated over the other (expert data parallel; the
    module doc). Call it before building the optimizer and the engine (the engine's
    format then serves the local experts). ``stats``: where the exchanges are recorded
    (default: a new ``CommStats``, returned)."""
    if not dist.is_initialized():
        raise RuntimeError("expert_parallel needs an initialized process group; call "
                           "torch.distributed.init_process_group first")
    if any(hasattr(p, "to_local") for p in model.parameters()):
        raise NotImplementedError(
            f"expert_parallel over a model with DTensor parameters ({type(model).__name__}"
            ": FSDP2's fully_shard or a tensor-parallel plan ran first). FSDP2 over the "
            "expert-data-parallel dim is not built: pass the 2-D mesh to "
            "expert_parallel(model, mesh) on the plain model, which replicates each "
            "expert over the mesh's other dim and averages its gradients there "
            "(ExpertShards.average_grads; docs/guides/expert-parallel.md)")
    pg, dp, data = _groups_of(group, ep_dim)
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    stats = stats if stats is not None else CommStats()
    found = experts_modules(model)
    if not found:
        raise ValueError("expert_parallel found no transformers experts module (3-D "
                         "expert weights under use_experts_implementation) in "
                         f"{type(model).__name__}")
    shards, params = {}, []
    for name, m in found.items():
        if "_mixprec_ep" in m.__dict__:
            raise ValueError(f"{name} is expert-parallel already")
        e = m.down_proj.shape[0]
        if e % world:
            raise ValueError(f"{name} has {e} experts, which do not split over {world} "
                             f"ranks; use an EP group size that divides {e}")
        per = e // world
        first = rank * per
        for pname, p in list(m.named_parameters(recurse=False)):
            if p.dim() >= 2 and p.shape[0] == e:
                cut = nn.Parameter(p.detach()[first:first + per].clone(),
                                   requires_grad=p.requires_grad)
                if average_grads and cut.requires_grad:
                    cut.register_hook(lambda g, n=world: g / n)
                cut._mixprec_expert_shard = True  # the engine's norm sums it over EP
                setattr(m, pname, cut)
                params.append(f"{name}.{pname}" if name else pname)
        m._mixprec_ep = ExpertShard(group=pg, num_experts=e, first=first, count=per,
                                    stats=stats, name=name, dp_group=dp, data_group=data)
        m.forward = types.MethodType(ep_experts_forward, m)
        shards[name] = m._mixprec_ep
    return ExpertShards(modules=shards, params=tuple(params), stats=stats, group=pg,
                        dp_group=dp, data_group=data)


def expert_parallel_modules(model: nn.Module) -> list[str]:
    """The names of ``model``'s modules ``expert_parallel`` sharded."""
    return [n for n, m in model.named_modules() if "_mixprec_ep" in m.__dict__]


def _projection(m: nn.Module, proj: str) -> torch.Tensor:
    w = getattr(m, proj)
    return w.transpose(1, 2) if m.is_transposed else w  # (E, out, in)


def _hp(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Each local expert's rows times its weight's transpose, in the autocast dtype."""
    out, start = [], 0
    for j, n in enumerate(counts):
        out.append(F.linear(x[start:start + n], w[j]))
        start += n
    return torch.cat(out) if out else x.new_zeros(0, w.shape[1])


def _bias(m: nn.Module, proj: str, y: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    if not m.has_bias:
        return y
    return (y.float() + getattr(m, f"{proj}_bias")[ids].float()).to(y.dtype)


def ep_experts_forward(self: nn.Module, hidden_states: torch.Tensor,
                       top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                       ) -> torch.Tensor:
    """An expert-parallel experts module's forward (``expert_parallel`` installs it):
    dispatch, the local experts, combine (the module doc)."""
    ep: ExpertShard = self._mixprec_ep
    k = top_k_index.size(-1)
    tokens, hidden = hidden_states.shape
    ids, perm = torch.sort(top_k_index.reshape(-1), stable=True)
    x = hidden_states[perm // k]
    counts = torch.zeros(ep.num_experts, dtype=torch.int64, device=x.device)
    counts = counts.scatter_add(0, ids, torch.ones_like(ids))
    r = exchange(counts, ep.group, ep.stats)
    up, down = ("gate_up_proj" if self.has_gate else "up_proj"), "down_proj"
    fmt_up, fmt_down = getattr(self, f"{up}_fp8", None), getattr(self, f"{down}_fp8", None)
    xr, casts = dispatch(x, ids, r, fmt_up, ep.stats, ep.name or "experts")
    w_up, w_down = _projection(self, up), _projection(self, down)
    h = (dispatched_mm(xr, w_up, r.offsets, fmt_up, casts, wire_dtype(x))
         if fmt_up is not None
         else _hp(xr, w_up, r.local_counts))
    h = _bias(self, up, h, r.expert_ids)
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    h = (grouped_mm(h, w_down, r.offsets, fmt_down) if fmt_down is not None
         else _hp(h, w_down, r.local_counts))
    h = _bias(self, down, h, r.expert_ids)
    if self.has_post_expert_norm:
        h = self.post_expert_norm(h)
    y = combine(h, r, ep.stats)
    y = y * top_k_weights.reshape(-1)[perm].unsqueeze(-1).to(y.dtype)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    out = y[inv].view(tokens, k, hidden).float().sum(dim=1)
    return out.to(hidden_states.dtype)
