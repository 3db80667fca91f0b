"""Rank functions for tests/parallel/test_tensor_parallel.py that run the engine's loop on
torch's tensor-parallel plans: accumulation windows, ``torch.compile``, and the
collectives ``comm_stats`` records (``tp_workers`` holds the group setup, models and
data)."""

from __future__ import annotations

import gc
import math
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from helpers.tp_workers import PLANS, _init, _save, full, make_data, make_model, make_opt
from mixprec import MixedPrecision

warnings.simplefilter("ignore")


#: accumulation runs: micro-batches per window, and each window's length (the last one
#: ended early with ``backward(last=True)``, as at a data loader's end)
ACCUM, WINDOWS = 3, (3, 3, 3, 2)


def accum_steps(engine, kind, inf_at=-1, rank=1, world=1) -> dict:
    """``engine`` (``grad_accum_steps=ACCUM``) through ``WINDOWS``' micro-batches of
    ``kind``'s data: each update's skip, its norm, ``clip_grad_norm_``'s norm read just
    before it, and the whole masters. ``inf_at``: after that micro-batch's backward,
    rank ``rank``'s first gradient gets an inf (a rank-local fault). Under sequence
    parallelism each of ``world`` ranks feeds its rows."""
    out = {"skipped": [], "norms": [], "clip": []}
    data, i = make_data(kind, sum(WINDOWS)), 0
    for n in WINDOWS:
        for j in range(n):
            x, y = data[i]
            if kind == "sp" and world > 1:
                x = x.chunk(world)[rank]
            with engine.autocast():
                loss = F.cross_entropy(engine.model(x), y)
            engine.backward(loss, last=True if j == n - 1 and n < ACCUM else None)
            if i == inf_at and rank == 1:
                g = engine.param_state.gradients()[0]
                (g.to_local() if isinstance(g, DTensor) else g).view(-1)[0] = math.inf
            i += 1
            if j < n - 1:
                assert engine.step().accumulating
        out["clip"].append(float(engine.clip_grad_norm_()))
        r = engine.step()
        out["skipped"].append(bool(r.skipped))
        out["norms"].append(float(r.grad_norm))
    out["params"] = [full(p) for p in engine.master_params]
    return out


def tp_accum(rank, world, tmp, runs, inf_at):
    """TP over every rank for each (kind, recipe) of ``runs``, accumulating
    ``ACCUM`` micro-batches a step (``accum_steps``; SGD with momentum), and the
    engine's collectives."""
    _init(rank, world, tmp)
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for kind, recipe in runs:
        model = parallelize_module(make_model(kind), mesh, PLANS[kind])
        engine = MixedPrecision(model, make_opt(model, recipe, sgd=True), recipe,
                                max_grad_norm=0.5, grad_accum_steps=ACCUM)
        out[kind, recipe] = accum_steps(engine, kind, inf_at, rank, world)
        out[kind, recipe]["totals"] = engine.comm_stats.totals()
        out[kind, recipe]["emulating"] = engine.emulating
        del engine, model
    _save(tmp, "tpaccum", rank, out)
    gc.collect()
    dist.destroy_process_group()


def accum_reference(kind, recipe, inf_at=-1):
    """One process accumulating the same micro-batches (``accum_steps``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = make_model(kind)
        engine = MixedPrecision(model, make_opt(model, recipe, sgd=True), recipe,
                                max_grad_norm=0.5, grad_accum_steps=ACCUM)
        return accum_steps(engine, kind, inf_at)
    finally:
        torch.set_num_threads(threads)


def tp_compiled(rank, world, tmp, kind, recipes, steps):
    """TP over every rank for each recipe, the engine's model called eagerly and then
    through ``torch.compile`` (``aot_eager``: dynamo and AOTAutograd, as
    tests/engine/test_compile.py): each run's losses, masters, the collectives its
    ``comm_stats`` recorded and the frames dynamo had compiled after each step."""
    from torch._dynamo.testing import CompileCounterWithBackend

    _init(rank, world, tmp)
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for recipe in recipes:
        for compiled in (False, True):
            out[recipe, compiled] = _sgd_run(kind, recipe, steps, mesh, compiled,
                                             CompileCounterWithBackend("aot_eager"))
    torch._dynamo.reset()
    _save(tmp, "tpcompile", rank, out)
    gc.collect()
    dist.destroy_process_group()


def tp_plan_bytes(rank, world, tmp, recipe, steps):
    """A sequence-parallel norm, then ``QuantizedColwiseParallel`` on a Linear that
    ``recipe`` keeps in 16 bits (torch's behaviour: its input gathered): the engine's
    collectives, and the norm output's local shape and dtype (what that gather sends)."""
    from helpers.tp_fp8_workers import SeqMLP, make_data, sp_plan

    _init(rank, world, tmp)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = parallelize_module(SeqMLP(), mesh, sp_plan(quantized=True))
    seen = []
    model.norm.register_forward_hook(
        lambda m, i, o: seen.append((tuple(o.to_local().shape), o.dtype)))
    engine = MixedPrecision(model, make_opt(model, recipe, sgd=True), recipe)
    for x, y in make_data(steps):
        with engine.autocast():
            loss = F.cross_entropy(engine.model(x.chunk(world, 1)[rank]), y)
        engine.backward(loss)
        engine.step()
    _save(tmp, "tpplan", rank, {"totals": engine.comm_stats.totals(), "seen": seen})
    del engine, model
    gc.collect()
    dist.destroy_process_group()



def tp_full_resume(rank, world, tmp, kind, recipes, steps, ckpt, mode, how="full"):
    """TP over ``world`` ranks (``world`` 1: one process, no plan), for each recipe.
    ``mode="save"``: ``steps`` AdamW steps, a checkpoint (``ckpt`` + the recipe) after
    half of them, whole (``how="full"``: ``save(path, full=True)``) or a reshardable
    directory (``how="reshardable"``); ``mode="load"``: load it and run the last half.
    Each recipe's whole masters, or the error the load raised."""
    _init(rank, world, tmp)
    out = {}
    for recipe in recipes:
        model = make_model(kind)
        if world > 1:
            model = parallelize_module(model, init_device_mesh("cpu", (world,)),
                                       PLANS[kind])
        engine = MixedPrecision(model, make_opt(model, recipe), recipe, max_grad_norm=0.5)
        data, half, path = make_data(kind, steps), steps // 2, f"{ckpt}-{recipe}"
        if mode == "load":
            try:
                engine.load(path)
            except Exception as e:  # noqa: BLE001 - reported to the test
                out[recipe] = f"{type(e).__name__}: {e}"
                continue
            data = data[half:]
        for i, (x, y) in enumerate(data):
            with engine.autocast():
                loss = F.cross_entropy(engine.model(x), y)
            engine.backward(loss)
            engine.step()
            if mode == "save" and i == half - 1:
                try:
                    engine.save(path, **{how: True})
                except NotImplementedError as e:  # reported to the test
                    out[recipe] = f"{type(e).__name__}: {e}"
                    break
        else:
            out[recipe] = [full(p) for p in engine.master_params]
        del engine, model
        gc.collect()
    _save(tmp, "tpfull", rank, out)
    dist.destroy_process_group()


def _sgd_run(kind, recipe, steps, mesh, compiled, backend="aot_eager"):
    """``steps`` SGD steps of ``kind``'s model under ``recipe``, split by its plan on
    ``mesh`` (None: whole, as one process), its model called eagerly or through
    ``torch.compile`` (``backend``, or a ``CompileCounterWithBackend``): the losses,
    the frames dynamo had compiled after each step (with a counter), the collectives
    ``comm_stats`` recorded and the whole masters."""
    torch._dynamo.reset()
    model = make_model(kind)
    if mesh is not None:
        model = parallelize_module(model, mesh, PLANS[kind])
    engine = MixedPrecision(model, make_opt(model, recipe, sgd=True), recipe,
                            max_grad_norm=0.5)
    f = torch.compile(engine.model, backend=backend) if compiled else engine.model
    losses, frames = [], []
    for x, y in make_data(kind, steps):
        with engine.autocast():
            loss = F.cross_entropy(f(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        frames.append(getattr(backend, "frame_count", None))
    records = list(engine.comm_stats.records) if engine.comm_stats else []
    return {"losses": losses, "frames": frames, "records": records,
            "emulating": engine.emulating,
            "params": [full(p) for p in engine.master_params]}


def tp_compiled_sr(rank, world, tmp, kind, recipes, steps):
    """For each recipe: ``kind``'s model trained split over every rank and whole in this
    rank (rank 0's whole run draws as one process does), each eagerly and compiled
    (``_sgd_run``); and one forward and backward of ``tp_fp8_workers.Pair`` under
    NVFP4 with stochastic rounding, compiled, on the shards and whole
    (``pair_grads``)."""
    from helpers.tp_fp8_workers import NV, pair_grads

    _init(rank, world, tmp)
    mesh = init_device_mesh("cpu", (world,))
    out = {(recipe, split, compiled): _sgd_run(kind, recipe, steps,
                                               mesh if split else None, compiled)
           for recipe in recipes for split in (True, False) for compiled in (False, True)}
    torch._dynamo.reset()
    out["pair"] = (pair_grads(NV, mesh, compiled=True), pair_grads(NV, compiled=True))
    torch._dynamo.reset()
    _save(tmp, "tpcsr", rank, out)
    gc.collect()
    dist.destroy_process_group()
