"""Rank functions for tests/parallel/test_tensor_parallel_fp8.py: the fp8 / fp4 Linear formats on
torch's tensor-parallel plans (gloo ranks, spawned by the tests; ``tp_workers`` holds
the group setup and the GPT-style model)."""

from __future__ import annotations

import gc
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from helpers.tp_workers import Block, _init, _save, full, run_steps
from mixprec import MixedPrecision

warnings.simplefilter("ignore")

#: the GPT-style block at width 64: every shard cut (32 columns, 128 hidden) lies on the
#: MX (32) and NVFP4 (16) block boundaries
DIM = 64
PLAN = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
        "o": RowwiseParallel(), "fc": ColwiseParallel(), "proj": RowwiseParallel()}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return Block(DIM)


def make_data(steps: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 6, DIM, generator=g), torch.randint(0, 4, (4,), generator=g))
            for _ in range(steps)]


def train(model, recipe, steps, inf_step=-1, rank=0):
    """SGD with momentum under ``recipe``: the parameters, norms, skips and the engine.
    ``inf_step``: rank 1's (or one process's) first gradient gets an inf after that
    backward."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = MixedPrecision(model, opt, recipe, max_grad_norm=0.5)
    return run_steps(engine, make_data(steps), inf_step, rank), engine


def reference(recipe, steps, inf_step=-1):
    """One process, the same model, data and optimizer (``inf_step``: its first
    gradient gets an inf after that backward)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out, _ = train(make_model(), recipe, steps, inf_step, rank=1)
    finally:
        torch.set_num_threads(threads)
    return out


def _tp_runs(mesh, rank, runs, steps):
    """TP for each (recipe, inf_step): what each run trained, its skips and norms, the
    Linears it kept in 16 bits and why, its warnings, and the engine's collectives."""
    out = {}
    for recipe, inf_step in runs:
        model = parallelize_module(make_model(), mesh, PLAN)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            res, engine = train(model, recipe, steps, inf_step, rank)
        res["totals"] = engine.comm_stats.totals()
        res["kept"] = dict(engine.fp8_report.skipped)
        res["warnings"] = [str(m.message) for m in said]
        out[recipe, inf_step] = res
        del engine, model
    return out


def tp_fp8(rank, world, tmp, pairs, bf16_pairs, runs, sp_runs, steps):
    """One group for every two-rank check: ``pair_grads`` for each recipe of
    ``pairs`` and ``pair_bf16`` for each of ``bf16_pairs`` (on the shards and in this
    process), the GPT-style block trained under each of ``runs``, the
    sequence-parallel model under each of ``sp_runs``, and the stochastic-rounding
    draws of an NVFP4 Linear on the shards and of one outside tensor parallelism."""
    _init(rank, world, tmp)
    mesh = init_device_mesh("cpu", (world,))
    out = {"pairs": {r: (pair_grads(r, mesh), pair_grads(r)) for r in pairs},
           "bf16": {r: (pair_bf16(r, mesh), pair_bf16(r)) for r in bf16_pairs},
           "split": (pair_bf16(bf16_pairs[0], mesh, True), pair_bf16(bf16_pairs[0], None,
                                                                       True)),
           "runs": _tp_runs(mesh, rank, runs, steps),
           "sp": _sp_runs(mesh, rank, world, sp_runs, steps),
           "draws": {"tp": sr_draws(_pair(NV, mesh)), "dp": sr_draws(_pair(NV))},
           "whole": {"tp": whole_sr(mesh), "dp": whole_sr(parallel="ddp"),
                     "one": whole_sr()}}
    _save(tmp, "tp8", rank, out)
    gc.collect()
    dist.destroy_process_group()


class Pair(nn.Module):
    """A colwise Linear then a rowwise one (torch's MLP plan), 64 -> 128 -> 64."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


def _pair(recipe, mesh=None, down=None):
    from mixprec import fp8

    torch.manual_seed(0)
    m = Pair()
    with torch.no_grad():  # an outlier in the second half of each weight: one rank's
        m.up.weight[DIM + 3, 5] = 40.0  # colwise shard (its rows)
        m.down.weight[7, DIM + 9] = -40.0  # rowwise shard (its columns)
    if mesh is not None:  # the documented order: the plan first, then the conversion
        m = parallelize_module(m, mesh, {"up": ColwiseParallel(),
                                         "down": down or RowwiseParallel()})
    fp8.convert(m, recipe, filter=lambda mod, name: True)
    return m


def pair_grads(recipe, mesh=None, compiled=False):
    """One forward and backward of ``Pair`` in fp32 (no autocast) under ``recipe``: the
    output, the input's gradient and each parameter's whole gradient. ``compiled``:
    through ``torch.compile`` (``aot_eager``)."""
    m = _pair(recipe, mesh)
    f = torch.compile(m, backend="aot_eager") if compiled else m
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, DIM, generator=g)
    x[3, 11] = 25.0  # an outlier token
    x.requires_grad_(True)
    gy = torch.randn(16, DIM, generator=g)
    y = f(x)
    y.backward(gy)
    return {"y": full(y), "dx": x.grad.clone(),
            **{n: full(p.grad) for n, p in m.named_parameters()}}


def pair_bf16(recipe, mesh=None, split=False):
    """One forward and backward of ``Pair`` on a bf16 input under bf16 autocast: the
    output (this rank's tokens where ``split``: the rowwise Linear's output then
    reduce-scattered along the tokens), the input's gradient (both bf16), the rowwise
    Linear's bias gradient and the collectives the Linears recorded."""
    from mixprec.modules.linear import fp8_modules
    from mixprec.parallel.comm_stats import CommStats
    from mixprec.parallel.tensor_parallel import attach_comm_stats

    down = RowwiseParallel(output_layouts=Shard(0)) if split and mesh is not None else None
    m, stats = _pair(recipe, mesh, down), CommStats()
    attach_comm_stats(fp8_modules(m), stats)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, DIM, generator=g).bfloat16().requires_grad_(True)
    gy = torch.randn(64, DIM, generator=g).bfloat16()
    with torch.autocast("cpu", torch.bfloat16):
        y = m(x)
    if split and mesh is not None:  # y holds this rank's tokens
        y.backward(gy.chunk(dist.get_world_size())[dist.get_rank()])
    else:
        y.backward(gy)
        if split:
            y = y.chunk(dist.get_world_size())[dist.get_rank()]
    return {"y": full(y), "dx": x.grad.clone(), "bias": full(m.down.bias.grad),
            "totals": stats.totals()}


#: NVFP4 on every Linear of a ``Pair``, with stochastic rounding (the default)
NV = "nvfp4,bf16_last_layers=0"


def sr_draws(pair):
    """What the stochastic rounding of ``pair``'s second Linear draws next (16
    numbers), after one forward and backward."""
    x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(3))
    pair(x).float().sum().backward()
    return torch.rand(16, generator=pair.down._sr_generator("cpu"))


def whole_sr(mesh=None, parallel=None):
    """``Pair`` in NVFP4 under an engine, its first Linear colwise on ``mesh`` with the
    output gathered and its second left whole by the plan (None: no plan; the engine's
    ``parallel``), one backward of the same batch on every rank: the whole Linear's
    weight gradient and what its stochastic rounding draws next."""
    torch.manual_seed(0)
    m = Pair()
    if mesh is not None:
        m = parallelize_module(m, mesh, {"up": ColwiseParallel(output_layouts=Replicate())})
    engine = MixedPrecision(m, torch.optim.SGD(m.parameters(), lr=0.1), NV,
                            parallel=parallel, fp8_filter=lambda mod, name: True)
    x = torch.randn(8, DIM, generator=torch.Generator().manual_seed(3))
    with engine.autocast():
        loss = engine.model(x).float().square().mean()
    engine.backward(loss)
    out = {"grad": m.down.weight.grad.clone(),
           "draws": torch.rand(16, generator=m.down._sr_generator("cpu"))}
    engine.close()
    return out


class SeqMLP(nn.Module):
    """A sequence-parallel norm, then a colwise and a rowwise Linear, and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up, self.down = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)
        self.head = nn.Linear(DIM, 4)

    def forward(self, x):  # (batch, seq, dim), sequence-sharded under the plan
        return self.head(self.down(F.gelu(self.up(self.norm(x)))).mean(1))


def sp_plan(quantized: bool):
    from mixprec.parallel.tp_plans import QuantizedColwiseParallel

    colwise = QuantizedColwiseParallel if quantized else ColwiseParallel
    return {"norm": SequenceParallel(), "up": colwise(input_layouts=Shard(1)),
            "down": RowwiseParallel()}


def _sp_runs(mesh, rank, world, runs, steps):
    """Sequence parallel before a colwise Linear, for each (recipe, quantized plan): the
    parameters, norms, the engine's collectives and fallbacks, and the warnings (each
    rank feeds its half of every sequence)."""
    out = {}
    for recipe, quantized in runs:
        torch.manual_seed(0)
        model = parallelize_module(SeqMLP(), mesh, sp_plan(quantized))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            engine = MixedPrecision(model, opt, recipe, max_grad_norm=0.5)
            norms = []
            for x, y in make_data(steps):
                with engine.autocast():
                    loss = F.cross_entropy(engine.model(x.chunk(world, 1)[rank]), y)
                engine.backward(loss)
                norms.append(float(engine.step().grad_norm))
        out[recipe, quantized] = {
            "params": [full(p) for p in engine.master_params], "norms": norms,
            "totals": engine.comm_stats.totals(), "fallbacks": engine.comm_stats.fallbacks,
            "warnings": [str(m.message) for m in said]}
        del engine, model
    return out


def sp_reference(recipe, steps):
    """One process of ``SeqMLP``, the same data and optimizer."""
    torch.manual_seed(0)
    model = SeqMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = MixedPrecision(model, opt, recipe, max_grad_norm=0.5)
    norms = []
    for x, y in make_data(steps):
        with engine.autocast():
            loss = F.cross_entropy(engine.model(x), y)
        engine.backward(loss)
        norms.append(float(engine.step().grad_norm))
    return [p.detach().clone() for p in engine.master_params], norms


def _fsdp_tp_run(recipe, steps, path, mesh, mode):
    """FSDP on ``mesh["dp"]`` over the TP plan on ``mesh["tp"]`` (when it has 2 or more
    ranks): ``mode="save"`` trains ``steps`` steps and saves a reshardable checkpoint
    after half of them; ``"load"`` resumes it for the last half. Each dp rank trains on
    its part of every batch."""
    dp, tp = mesh["dp"].size(), mesh["tp"].size()
    model = make_model()
    if tp > 1:
        model = parallelize_module(model, mesh["tp"], PLAN)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = MixedPrecision(model, opt, recipe, parallel="fsdp", max_grad_norm=0.5,
                            parallel_kwargs={"mesh": mesh["dp"]})
    data, half = make_data(steps), steps // 2
    if mode == "load":
        engine.load(path)
        data = data[half:]
    norms, dp_rank = [], mesh["dp"].get_local_rank()
    for i, (x, y) in enumerate(data):
        with engine.autocast():
            loss = F.cross_entropy(engine.model(x.chunk(dp)[dp_rank]), y.chunk(dp)[dp_rank])
        engine.backward(loss)
        norms.append(float(engine.step().grad_norm))
        if mode == "save" and i == half - 1:
            engine.save(path, reshardable=True)
    from mixprec.modules.linear import fp8_modules

    q = fp8_modules(engine.model).get("q")
    out = {"params": [full(p) for p in engine.master_params], "norms": norms,
           "totals": engine.comm_stats.totals() if engine.comm_stats else {},
           "draws": (torch.rand(16, generator=q._sr_generator("cpu"))
                     if q is not None and q.quantizer.stochastic_grads else None)}
    del engine, model, opt
    gc.collect()
    return out


def fsdp_tp(rank, world, tmp, recipes, steps):
    """Four ranks, for each recipe: FSDP (dp=2) over TP (tp=2) trains and saves a
    reshardable checkpoint halfway; a fresh 2 x 2 engine and a dp=4 x tp=1 one (FSDP
    alone) each resume it for the last half."""
    _init(rank, world, tmp)
    square = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    flat = init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "tp"))
    out = {}
    for recipe in recipes:
        path = f"{tmp}/ck-{recipe}"
        out[recipe] = {"save": _fsdp_tp_run(recipe, steps, path, square, "save"),
                       "same": _fsdp_tp_run(recipe, steps, path, square, "load"),
                       "tp1": _fsdp_tp_run(recipe, steps, path, flat, "load")}
    _save(tmp, "fsdptp8", rank, out)
    dist.destroy_process_group()


def reference_halves(recipe, steps, parts=2):
    """One process accumulating each batch's ``parts`` halves (what FSDP's dp ranks
    see), the same model, data and optimizer."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = MixedPrecision(model, opt, recipe, max_grad_norm=0.5, grad_accum_steps=parts)
    norms = []
    for x, y in make_data(steps):
        for xs, ys in zip(x.chunk(parts), y.chunk(parts)):
            with engine.autocast():
                loss = F.cross_entropy(engine.model(xs), ys)
            engine.backward(loss)
        norms.append(float(engine.step().grad_norm))
    return [p.detach().clone() for p in engine.master_params], norms
