"""A pipeline stage's place on a 3-D ``DeviceMesh`` (``pp``, ``dp``, ``tp``), as
torchtitan builds it: the groups the ``PP`` mode (``mixprec.parallel.pipeline``) agrees
over and the stage's own split.

- ``pp``: the stages of one pipeline (the stage boundary's sends, the norm's sum, tied
  weights);
- ``tp``: the stage's module split by torch's ``parallelize_module`` over ``mesh["tp"]``
  (DTensor parameters): DTensor runs the forward's and backward's collectives, the
  quantized Linears agree their amaxes over it where an operand is sharded, and the
  norm sums each gradient's squares over the dims it is sharded on (``sum_over_shards_``,
  replicated ones counted once), as ``parallel="tp"`` does;
- ``dp``: replicas of the stage, each on its own share of the batch: at the end of the
  accumulation window the gradients are averaged over ``mesh["dp"]`` in the recipe's
  ``comm`` dtype, pre-divided (``comm.reduce_grads_``, DDP's hook's arithmetic), so the
  replicas hold equal gradients and the norm needs no sum over them.

The skip decision is the MAX over all three dims (every rank of the world skips the
same steps, so the loss scale moves alike everywhere), the fp8 amax histories the MAX
over ``dp`` and ``tp`` (a stage's Linears are its own). A 1-D mesh is the pipeline's
alone. FSDP2 shards inside a stage are not built: a stage with parameters on a ``dp``
dim raises, naming what runs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from mixprec.engine.param_state import ParamState
from mixprec.parallel.comm import agree_amax_, reduce_grads_
from mixprec.parallel.comm_stats import CommStats
from mixprec.parallel.presharded import fsdp_sharded

__all__ = ["StageMesh", "MESH_DIMS"]

#: the mesh dims a pipeline's mesh may name
MESH_DIMS = ("pp", "dp", "tp")


class StageMesh:
    """The pipeline group and, on a 3-D mesh, the stage's ``dp`` and ``tp`` groups
    (None where the mesh has no such dim, or it has one rank)."""

    def __init__(self, group: dist.ProcessGroup | None = None,
                 mesh: DeviceMesh | None = None) -> None:
        if group is not None and mesh is not None:
            raise ValueError("parallel_kwargs gives both group and mesh for parallel='pp': "
                             "give one (mesh['pp'], its get_group(), or a mesh with dims "
                             f"named from {MESH_DIMS})")
        self.dp = self.tp = self.tp_mesh = None
        if mesh is not None and mesh.ndim == 1:
            group = mesh.get_group()
        elif mesh is not None:
            names = tuple(mesh.mesh_dim_names or ())
            bad = [n for n in names if n not in MESH_DIMS]
            if not names or bad or "pp" not in names or len(set(names)) != len(names):
                raise ValueError(
                    f"parallel='pp' with a {mesh.ndim}-D mesh named {names or None}: name "
                    f"its dims from {MESH_DIMS}, 'pp' among them (init_device_mesh(..., "
                    "mesh_dim_names=('pp', 'dp', 'tp'))), or pass mesh['pp'] alone")
            group = mesh["pp"].get_group()
            if "dp" in names and mesh["dp"].size() > 1:
                self.dp = mesh["dp"].get_group()
            if "tp" in names:  # a plan over one rank still makes DTensors
                self.tp_mesh = mesh["tp"]
                self.tp = mesh["tp"].get_group() if mesh["tp"].size() > 1 else None
        #: the pipeline's process group (the world where none is given)
        self.pp = group if group is not None else dist.group.WORLD
        #: a mesh over the whole world: its skip flags agree in one all-reduce
        self.spans_world = mesh is not None and mesh.size() == dist.get_world_size()

    @property
    def inner(self) -> list:
        """The stage's own groups: ``dp`` and ``tp``, those there are."""
        return [g for g in (self.dp, self.tp) if g is not None]

    def check_model(self, model: nn.Module) -> bool:
        """Whether the stage is tensor-parallel; raises where its DTensors are not the
        plan's on ``mesh["tp"]`` (FSDP2 shards, another mesh)."""
        from torch.distributed.tensor import DTensor

        meshes = {id(p.device_mesh): p.device_mesh for p in model.parameters()
                  if isinstance(p, DTensor)}
        if not meshes:
            return False
        works = ("a stage split by a tensor-parallel plan over mesh['tp'] and replicated "
                 "over mesh['dp'], the engine built with parallel='pp', "
                 "parallel_kwargs={'mesh': mesh} on the whole ('pp', 'dp', 'tp') mesh")
        if fsdp_sharded(model):
            raise NotImplementedError(
                "parallel='pp' over a stage FSDP2 sharded (fully_shard): FSDP inside a "
                "pipeline stage is not built. What runs: " + works + ", which averages "
                "the replicas' gradients itself. Drop fully_shard on the stage.")
        if self.tp_mesh is None or any(m != self.tp_mesh for m in meshes.values()):
            found = ", ".join(str(m.mesh_dim_names or m.shape) for m in meshes.values())
            raise NotImplementedError(
                f"parallel='pp' over a stage whose parameters are DTensors on the mesh(es) "
                f"{found}, which is not this engine's mesh['tp']. What runs: {works}.")
        return True

    def start(self, model: nn.Module) -> None:
        """Every replica of the stage starts from the same weights: plain parameters
        and buffers from the ``tp`` group's first rank (DTensor shards are the plan's),
        then everything, shards included, from the ``dp`` group's first rank."""
        from torch.distributed.tensor import DTensor

        tensors = [*model.parameters(), *model.buffers()]
        with torch.no_grad():
            if self.tp is not None:
                src = dist.get_global_rank(self.tp, 0)
                for t in tensors:
                    if not isinstance(t, DTensor):
                        dist.broadcast(t.data, src, group=self.tp)
            if self.dp is not None:
                src = dist.get_global_rank(self.dp, 0)
                for t in tensors:
                    local = t.to_local() if isinstance(t, DTensor) else t.data
                    dist.broadcast(local, src, group=self.dp)

    def average(self, param_state: ParamState, comm_dtype: torch.dtype, stats: CommStats) -> None:
        """The window's gradients averaged over the ``dp`` replicas (nothing without)."""
        if self.dp is not None:
            reduce_grads_(param_state, comm_dtype, stats, group=self.dp)

    def agree_max_(self, t: torch.Tensor) -> torch.Tensor:
        """In place: the MAX over the pipeline and the stage's groups (the world)."""
        for g in ((dist.group.WORLD,) if self.spans_world else (self.pp, *self.inner)):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g)
        return t

    def agree_amax(self, fp8_modules: list) -> None:
        """The stage's fp8 amax histories: the MAX over its ``dp`` and ``tp`` ranks."""
        if self.inner:
            agree_amax_(fp8_modules, max_=self._max_inner_)

    def _max_inner_(self, t: torch.Tensor) -> torch.Tensor:
        for g in self.inner:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g)
        return t
