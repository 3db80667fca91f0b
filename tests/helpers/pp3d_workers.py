"""Rank functions for a pipeline whose stages are themselves tensor-parallel and
data-parallel: a 3-D ``DeviceMesh`` (``pp``, ``dp``, ``tp``) as torchtitan builds it, four
MLP blocks and a head cut into two stages, each split by torch's ``parallelize_module``
over ``tp`` and replicated over ``dp``; and the same model trained whole in one
process for reference."""

from __future__ import annotations

import math
import os
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from mixprec import MixedPrecision
from mixprec.parallel.pipeline import stage_args

warnings.simplefilter("ignore")

WIDTH, N_MICRO, BATCH, CLIP = 32, 2, 16, 0.1
#: the rank whose gradient turns non-finite at ``inject``: stage 1's last (on the
#: 2 x 2 x 2 mesh: dp 1, tp 1)
INJECT_RANK = -1


class Block(nn.Module):
    """A pre-norm MLP block: the norm stays whole on every ``tp`` rank, ``up`` is cut
    by columns and ``down`` by rows."""

    def __init__(self, d: int = WIDTH) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(4)], nn.Linear(WIDTH, 4))


def make_data(steps: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, WIDTH, generator=g),
             torch.randint(0, 4, (BATCH,), generator=g)) for _ in range(steps)]


def fp8_filter(module: nn.Module, fqn: str) -> bool:
    """The blocks' Linears in fp8, the 4-wide head not."""
    return module.out_features % 16 == 0


def _engine(module, recipe, accum, **kw):
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    return MixedPrecision(module, opt, recipe, grad_accum_steps=accum, max_grad_norm=CLIP,
                          fp8_filter=fp8_filter if "fp8" in recipe else None, **kw)


def _state(engine) -> list[torch.Tensor]:
    """Every tensor a skipped step must leave as it was (local shards)."""
    ts = [*engine.param_state.working, *engine.master_params]
    ts += [v for o in engine.optimizers for s in o.state.values() for v in s.values()
           if isinstance(v, torch.Tensor)]
    return [(t.to_local() if isinstance(t, DTensor) else t).detach().clone() for t in ts]


def reference(recipe: str, steps: int, inject: int, n_dp: int = 2) -> dict:
    """One process holding the whole model: the pipeline's micro-batches (every dp
    rank's, in order) through ``engine.backward``; at ``inject`` a non-finite gradient."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = make_model()
        engine = _engine(model, recipe, n_dp * N_MICRO)
        losses, norms, skipped = [], [], []
        for k, (x, y) in enumerate(make_data(steps)):
            hook = (engine.param_state.working[0].register_hook(lambda g: g * math.inf)
                    if k == inject else None)
            mine = []
            for xm, ym in zip(x.chunk(n_dp * N_MICRO), y.chunk(n_dp * N_MICRO)):
                with engine.autocast():
                    loss = F.cross_entropy(model(xm), ym)
                mine.append(loss.detach().float())
                engine.backward(loss)
                r = engine.step()
            if hook is not None:
                hook.remove()
            losses.append(torch.stack(mine).mean().item())
            norms.append(float(r.grad_norm))
            skipped.append(bool(r.skipped))
        weights = engine.fp32_state_dict()
    finally:
        torch.set_num_threads(threads)
    return {"losses": losses, "norms": norms, "skipped": skipped, "weights": weights}


def train_3d(rank: int, mesh, recipe: str, steps: int, inject: int) -> dict:
    """This rank's share: stage ``mesh["pp"]``'s rank, cut by ``tp``, fed dp rank's
    half of each batch in ``N_MICRO`` micro-batches by ``Schedule1F1B``."""
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    n_dp = mesh["dp"].size()
    whole = make_model()
    first, last = 2 * pp, 2 * pp + 2
    module = nn.Sequential(*whole[first:last], *([whole[4]] if pp == 1 else []))
    plan = {f"{i}.{n}": (ColwiseParallel() if n == "up" else RowwiseParallel())
            for i in range(2) for n in ("up", "down")}
    module = parallelize_module(module, mesh["tp"], plan)
    engine = _engine(module, recipe, N_MICRO, parallel="pp",
                     parallel_kwargs={"mesh": mesh})
    mb = BATCH // n_dp // N_MICRO
    ins, outs = stage_args(module, torch.zeros(mb, WIDTH), engine, stage_index=pp)
    stage = PipelineStage(module, pp, 2, torch.device("cpu"), input_args=ins,
                          output_args=outs, group=mesh["pp"].get_group())
    loss_fn = engine.pipeline_loss(F.cross_entropy)
    schedule = Schedule1F1B(stage, n_microbatches=N_MICRO, loss_fn=loss_fn)
    losses, norms, skipped, scales, intact = [], [], [], [], None
    for k, (x, y) in enumerate(make_data(steps)):
        x, y = x.chunk(n_dp)[dp], y.chunk(n_dp)[dp]
        hook = before = None
        if k == inject:
            before = _state(engine)
            if rank == dist.get_world_size() + INJECT_RANK:  # its first norm: whole
                hook = engine.param_state.working[0].register_hook(lambda g: g * math.inf)
        with engine.autocast():
            schedule.step(*((x,) if stage.is_first else ()),
                          **({"target": y, "losses": []} if stage.is_last else {}))
        r = engine.step()
        if hook is not None:
            hook.remove()
        if before is not None:
            intact = all(torch.equal(a, b) for a, b in zip(before, _state(engine)))
        if stage.is_last:
            losses.append(torch.stack(loss_fn.take()).float().mean().item())
        norms.append(float(r.grad_norm))
        skipped.append(bool(r.skipped))
        scales.append(float(r.scale))
    weights = engine.fp32_state_dict(full=True)  # the tp shards gathered whole
    names = {n: f"{int(n.split('.')[0]) + first}.{n.split('.', 1)[1]}" for n in weights}
    return {"losses": losses, "norms": norms, "skipped": skipped, "scales": scales,
            "intact": intact, "weights": {names[n]: v for n, v in weights.items()},
            "names": list(engine.param_state.names), "pp": pp, "dp": dp,
            "tp": mesh["tp"].get_local_rank()}


def pp3d_runs(rank: int, world: int, tmp: str, recipes: list[str], steps: int,
              inject: int, shape: tuple[int, int, int] = (2, 2, 2)) -> None:
    """Each recipe on a ``shape`` (pp = 2, dp, tp) mesh; rank 0 adds the one-process
    references."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("pp", "dp", "tp"))
    out = {}
    for recipe in recipes:
        out[recipe] = train_3d(rank, mesh, recipe, steps, inject)
        dist.barrier()
    refs = ({r: reference(r, steps, inject, shape[1]) for r in recipes} if rank == 0
            else {})
    torch.save({"runs": out, "refs": refs}, os.path.join(tmp, f"pp3d_rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
