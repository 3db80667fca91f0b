"""Rank functions for tests/optim/test_optim_dtensor.py: torch's fused, foreach and default
optimizers (and ``mixprec.optim.adamw_for``'s) over DTensor parameters, under torch's
tensor-parallel plans, FSDP and FSDP x TP (gloo ranks, spawned by the tests)."""

from __future__ import annotations

import gc
import math
import warnings
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

import mixprec.engine.checks
from helpers.tp_fp8_workers import PLAN, make_data, make_model
from helpers.tp_workers import _init, _save, full
from mixprec import MixedPrecision
from mixprec.optim import adamw_for

warnings.simplefilter("ignore")

#: Adam's learning rate and epsilon: an epsilon above the clipped gradients' elements
#: (about 3e-3 here) keeps Adam from turning the shards' rounding of near-zero
#: gradients into whole steps of ``LR`` (with torch's 1e-8 the biases of the TP-split block end
#: 10-20% apart under torch's own for-loop AdamW, which steps DTensors unfused)
LR, EPS = 5e-2, 5e-2


def make_opt(how: str, recipe: str, params):
    """The optimizer ``how`` names: ``adamw_for`` (the recipe's: torch's fused AdamW
    for these recipes), torch's AdamW at its ``default``, ``foreach`` or ``fused``
    implementation, ``fused-adam`` / ``fused-sgd`` (torch's Adam, SGD with momentum),
    or ``default-cuda``: torch's default AdamW, which the engine fuses on CUDA (the
    device check stood in for by the caller)."""
    params = list(params)
    if how == "adamw_for":
        return adamw_for(recipe, params, lr=LR, eps=EPS)
    if how == "fused-sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True)
    if how == "fused-adam":
        return torch.optim.Adam(params, lr=LR, eps=EPS, fused=True)
    kw = {"foreach": {"foreach": True}, "fused": {"fused": True}}.get(how, {})
    return torch.optim.AdamW(params, lr=LR, eps=EPS, **kw)


def _cuda_fusing(how: str):
    """``default-cuda``: the engine's check of the parameters' device answers CUDA, so
    it makes torch's default AdamW fused, as it does on a GPU."""
    if how != "default-cuda":
        return mock.patch.object(mixprec.engine.checks, "param_device_types",
                                 mixprec.engine.checks.param_device_types)
    return mock.patch.object(mixprec.engine.checks, "param_device_types", lambda opt: {"cuda"})


def train(model, how, recipe, data, inf_step=-1, inf_rank=0, **engine_kw) -> dict:
    """``model`` trained on ``data`` (each step a list of micro-batches, accumulated):
    the initial and the final masters (whole), each step's norm and skip, whether the
    optimizer's groups ended fused, the engine's warnings that it unfused one, and the
    kinds of the masters. At ``inf_step`` rank ``inf_rank``'s last gradient gets an inf
    after the step's last backward."""
    init = [full(p) for p in model.parameters()]
    opt = make_opt(how, recipe, model.parameters())
    with _cuda_fusing(how), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        engine = MixedPrecision(model, opt, recipe, max_grad_norm=0.5,
                                grad_accum_steps=len(data[0]), **engine_kw)
    out = {"norms": [], "skipped": [], "init": init,
           "fused": all(g.get("fused") for g in opt.param_groups),
           "unfused": [str(m.message) for m in said if "no DTensor rule" in str(m.message)]}
    rank = dist.get_rank() if dist.is_initialized() else inf_rank
    for i, micro in enumerate(data):
        for x, y in micro:
            with engine.autocast():
                loss = F.cross_entropy(engine.model(x), y)
            engine.backward(loss)
        if i == inf_step and rank == inf_rank:
            g = engine.param_state.gradients()[-1]
            (g.to_local() if isinstance(g, DTensor) else g).view(-1)[0] = math.inf
        r = engine.step()
        out["norms"].append(float(r.grad_norm))
        out["skipped"].append(bool(r.skipped))
    out["params"] = [full(p) for p in engine.master_params]
    out["kinds"] = sorted({type(p).__name__ for p in engine.master_params})
    del engine, opt
    return out


def reference(how, recipe, steps, inf_step=-1, dp=1) -> dict:
    """One process: the same model and optimizer on each step's batch, as the ``dp``
    data-parallel ranks' shares accumulated in order (each share's amaxes, and its
    mean's gradient, are then the rank's; the average of the ranks' gradients is the
    accumulation's, to the order of the sums)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        data = [list(zip(x.chunk(dp), y.chunk(dp))) for x, y in make_data(steps)]
        return train(make_model(), how, recipe, data, inf_step, inf_rank=0)
    finally:
        torch.set_num_threads(threads)


def _layout(name: str, world: int):
    """``(model builder, engine kwargs, dp size, dp rank)`` of a layout on ``world``."""
    if name == "tp":
        mesh = init_device_mesh("cpu", (world,))
        return lambda: parallelize_module(make_model(), mesh, PLAN), {}, 1, 0
    if name == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
        return make_model, {"parallel": "fsdp"}, world, mesh.get_local_rank()
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    return (lambda: parallelize_module(make_model(), mesh["tp"], PLAN),
            {"parallel": "fsdp", "parallel_kwargs": {"mesh": mesh["dp"]}},
            world // 2, mesh["dp"].get_local_rank())


def run(rank, world, tmp, layouts, combos, steps, inf_step):
    """For each layout of ``layouts`` ("tp", "fsdp", "fsdp_tp") and each ``(recipe,
    how)`` of ``combos``: the training on this rank's share of each batch, with an inf
    at ``inf_step`` in rank 1's last gradient."""
    _init(rank, world, tmp)
    out = {}
    for name in layouts:
        build, kw, dp, dp_rank = _layout(name, world)
        data = [[(x.chunk(dp)[dp_rank], y.chunk(dp)[dp_rank])] for x, y in make_data(steps)]
        for recipe, how in combos:
            model = build()
            out[name, recipe, how] = train(model, how, recipe, data, inf_step, 1, **kw)
            del model
            gc.collect()
    _save(tmp, "optdt", rank, out)
    dist.destroy_process_group()
