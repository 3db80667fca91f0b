"""Rank functions for tests/parallel/test_tensor_parallel.py (spawned with torch.multiprocessing).

Each rank joins a gloo group through a file store in ``tmp``, builds its model with
torch's ``parallelize_module`` plans on a ``DeviceMesh``, and writes what it saw to
``tmp/<name>_rank<r>.pt``.
"""

from __future__ import annotations

import gc
import math
import os
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from mixprec import MixedPrecision

warnings.simplefilter("ignore")


def _init(rank: int, world: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world)


def _save(tmp: str, name: str, rank: int, obj) -> None:
    torch.save(obj, os.path.join(tmp, f"{name}_rank{rank}.pt"))


class MLP(nn.Module):
    """A colwise-then-rowwise pair between two replicated layers (a norm, a head)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.down(F.gelu(self.up(self.norm(x)))))


class Block(nn.Module):
    """A GPT-style block: attention (q, k, v colwise, o rowwise) and an MLP."""

    def __init__(self, dim: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        # k without a bias: its gradient is zero (softmax ignores a shift per query),
        # rounding noise that Adam would turn into full-size steps
        self.q, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim, bias=False)
        self.o = nn.Linear(dim, dim)
        self.fc, self.proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.head = nn.Linear(dim, 4)

    def forward(self, x):  # x: (batch, seq, dim)
        h = self.hidden(x)
        return h if self.head is None else self.head(h.mean(1))  # a Stack's inner block

    def hidden(self, x):
        """The block's output before the head."""
        h = self.ln1(x)
        b, t, _ = h.shape
        # heads from the local width: under TP each rank holds heads / tp of them
        q, k, v = (m(h).view(b, t, -1, 4).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class Stack(nn.Module):
    """``layers`` GPT blocks and one head (the blocks' own heads removed)."""

    def __init__(self, dim: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = self.layers[-1].head
        for blk in self.layers:
            blk.head = None

    def forward(self, x):
        for blk in self.layers:
            x = blk(x)  # through __call__: FSDP's hooks gather each block's shards
        return self.head(x.mean(1))


PLANS = {
    "mlp": {"up": ColwiseParallel(), "down": RowwiseParallel()},
    # sequence parallel: the norm runs on the batch's shards (dim 0 of a 2-D input)
    # (each rank feeds its rows; ``up`` gathers them)
    "sp": {"norm": SequenceParallel(sequence_dim=0),
           "up": ColwiseParallel(input_layouts=Shard(0)), "down": RowwiseParallel()},
    "block": {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
              "o": RowwiseParallel(), "fc": ColwiseParallel(), "proj": RowwiseParallel()},
}


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return MLP() if kind in ("mlp", "sp") else Block()


def make_data(kind: str, steps: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    shape = (8, 16) if kind in ("mlp", "sp") else (4, 6, 16)
    return [(torch.randn(*shape, generator=g), torch.randint(0, 4, (shape[0],), generator=g))
            for _ in range(steps)]


def make_opt(model: nn.Module, recipe: str, sgd: bool = False):
    """torch's AdamW, or under a write rule mixprec.optim's, with the recipe's states.
    ``sgd``: torch's SGD with momentum (the data-parallel equivalence tests' optimizer:
    Adam turns the bf16 reduction's rounding of near-zero gradients into whole steps)."""
    from mixprec.recipe import Recipe

    r = Recipe.coerce(recipe)
    if sgd:
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if r.write == "nearest":
        return torch.optim.AdamW(model.parameters(), lr=1e-2)
    import mixprec.optim as mo

    return mo.AdamW(model.parameters(), lr=1e-2, states=r.states, write=r.write)


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def tp_train(rank, world, tmp, kind, recipe, steps, max_norm, inf_step):
    """TP over every rank: the same batch on each, the model's Linears split by the
    plan. ``inf_step``: at that step rank 1's gradient of the first parameter gets an inf
    (after backward, before the step: a rank-local fault)."""
    _init(rank, world, tmp)
    mesh = init_device_mesh("cpu", (world,))
    model = parallelize_module(make_model(kind), mesh, PLANS[kind])
    engine = MixedPrecision(model, make_opt(model, recipe), recipe, max_grad_norm=max_norm)
    data = make_data(kind, steps)
    if kind == "sp":  # the sequence-parallel norm takes this rank's rows
        data = [(x.chunk(world)[rank], y) for x, y in data]
    out = run_steps(engine, data, inf_step, rank)
    out["names"] = list(engine.param_state.names)
    out["bytes"] = engine.comm_stats.bytes_sent if engine.comm_stats else None
    _save(tmp, "tp", rank, out)
    dist.destroy_process_group()


def run_steps(engine, data, inf_step=-1, rank=1) -> dict:
    """``engine`` trained on ``data``: each step's skip and norm, and the whole master
    parameters. ``inf_step``: at that step rank ``rank``'s gradient of the first
    parameter gets an inf (after backward, before the step: a rank-local fault)."""
    out = {"skipped": [], "norms": []}
    for i, (x, y) in enumerate(data):
        with engine.autocast():
            loss = F.cross_entropy(engine.model(x), y)
        engine.backward(loss)
        if i == inf_step and rank == 1:
            g = engine.param_state.gradients()[0]
            (g.to_local() if isinstance(g, DTensor) else g).view(-1)[0] = math.inf
        r = engine.step()
        out["skipped"].append(bool(r.skipped))
        out["norms"].append(float(r.grad_norm))
    out["params"] = [full(p) for p in engine.master_params]
    return out


def reference(kind, recipe, steps, max_norm, inf_step=-1, sgd=False):
    """One process, the same model, data and optimizer."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = make_model(kind)
        engine = MixedPrecision(model, make_opt(model, recipe, sgd), recipe,
                                max_grad_norm=max_norm)
        norms = []
        for i, (x, y) in enumerate(make_data(kind, steps)):
            with engine.autocast():
                loss = F.cross_entropy(engine.model(x), y)
            engine.backward(loss)
            if i == inf_step:
                engine.param_state.gradients()[0].view(-1)[0] = math.inf
            norms.append(float(engine.step().grad_norm))
    finally:
        torch.set_num_threads(threads)
    return [p.detach().clone() for p in engine.master_params], norms


def fsdp_tp_train(rank, world, tmp, kind, recipe, steps, ckpt, mode):
    """FSDP on the mesh's ``dp`` dim over torch's TP plan on its ``tp`` dim, world/2 x 2
    (``mode="save"``: a reshardable checkpoint after ``steps`` // 2 steps). With
    ``mode="load"`` on any mesh: load ``ckpt`` and run the last half. Each dp rank trains
    on its half of the batch; every tp rank of it sees the same half."""
    _init(rank, world, tmp)
    tp = 2 if world >= 2 and mode != "load1" else 1
    dp = world // tp
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = make_model(kind)
    if tp > 1:
        model = parallelize_module(model, mesh["tp"], PLANS[kind])
    engine = MixedPrecision(model, make_opt(model, recipe, sgd=True), recipe, parallel="fsdp",
                            parallel_kwargs={"mesh": mesh["dp"]}, max_grad_norm=0.5)
    data = make_data(kind, steps)
    half = steps // 2
    if mode.startswith("load"):
        engine.load(ckpt)
        data = data[half:]
    norms = []
    dp_rank = mesh["dp"].get_local_rank()
    for i, (x, y) in enumerate(data):
        xs, ys = x.chunk(dp)[dp_rank], y.chunk(dp)[dp_rank]
        with engine.autocast():
            loss = F.cross_entropy(engine.model(xs), ys)
        engine.backward(loss)
        norms.append(float(engine.step().grad_norm))
        if mode == "save" and i == half - 1:
            engine.save(ckpt, reshardable=True)
    out = {"params": [full(p) for p in engine.master_params], "norms": norms,
           "bytes": engine.comm_stats.per_call if engine.comm_stats else None}
    _save(tmp, "fsdptp", rank, out)
    del engine, model
    gc.collect()
    dist.destroy_process_group()


def refusals(rank, world, tmp, recipes):
    """What each recipe (and DDP) says over a TP-split model: the error, or "built"."""
    _init(rank, world, tmp)
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for recipe, parallel in recipes:
        model = parallelize_module(make_model("mlp"), mesh, PLANS["mlp"])
        try:
            kwargs = ({"parallel": "tp", "parallel_kwargs": {"mesh": mesh}}
                      if parallel == "tp-kwargs" else {"parallel": parallel})
            MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), recipe,
                           **kwargs)
            out[recipe, parallel] = "built"
        except (NotImplementedError, ValueError) as e:
            out[recipe, parallel] = f"{type(e).__name__}: {e}"
    _save(tmp, "refusals", rank, out)
    gc.collect()
    dist.destroy_process_group()


def tp_memory(rank, world, tmp, recipe):
    """The planner's per-rank items for a TP-split model, against the bytes the engine's
    tensors hold on this rank after a step (each DTensor's local shard)."""
    from mixprec.memory import estimate

    _init(rank, world, tmp)
    mesh = init_device_mesh("cpu", (world,))
    model = parallelize_module(make_model("mlp"), mesh, PLANS["mlp"])
    predicted = estimate(model, recipe, optimizer="adamw").items
    whole = estimate(make_model("mlp"), recipe, optimizer="adamw").items
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = MixedPrecision(model, opt, recipe)
    (x, y), = make_data("mlp", 1)
    with engine.autocast():
        loss = F.cross_entropy(engine.model(x), y)
    engine.backward(loss)

    def nbytes(ts):
        return sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size()
                   for t in ts)

    ps = engine.param_state
    grads = nbytes(ps.gradients())  # before the step frees fp32 training's .grad
    engine.step()
    measured = {"params": nbytes(ps.working), "master": nbytes(ps.masters or []),
                "grads": grads,
                "optimizer": nbytes([v for st in opt.state.values() for v in st.values()
                                     if isinstance(v, torch.Tensor)])}
    _save(tmp, "tpmem", rank, {"predicted": predicted, "whole": whole,
                               "measured": measured})
    del engine, opt, model
    gc.collect()
    dist.destroy_process_group()


def tp_peak(rank, world, tmp, recipes, dim, batch, seq, layers=1, emulate="off"):
    """Each rank's measured peak of one training step (``measure(..., peak=True)``)
    against ``estimate``'s per-rank prediction, for ``layers`` TP-split GPT blocks of
    width ``dim`` (heads of 4), on ``world`` ranks: TP over all of them, or FSDP x TP on
    a (world/2, 2) mesh when ``world`` is 4 (``estimate`` of the sharded model, stage 3
    over dp). The measured items get ``grads``: the gradients' local bytes after a
    backward (``measure`` runs after ``zero_grad``). Real 16-bit kernels on any CPU:
    the planner does not model the emulated path's extra saved tensors under tensor
    parallelism (docs/not-there-yet.md)."""
    from mixprec.engine.devices import EMULATE_ENV
    from mixprec.memory import TransformerSpec, estimate, measure

    os.environ[EMULATE_ENV] = emulate  # this rank's process only
    _init(rank, world, tmp)
    tp = 2
    dp = world // tp
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, seq, dim, generator=g)
    y = torch.randint(0, 4, (batch,), generator=g)
    xs, ys = x.chunk(dp)[mesh["dp"].get_local_rank()], y.chunk(dp)[mesh["dp"].get_local_rank()]
    out = {}
    for recipe in recipes:
        torch.manual_seed(0)
        plan = {f"layers.*.{k}": v for k, v in PLANS["block"].items()}
        model = parallelize_module(Stack(dim, layers), mesh["tp"], plan)
        kwargs = ({"parallel": "fsdp", "parallel_kwargs": {"mesh": mesh["dp"]}} if dp > 1
                  else {})
        engine = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                recipe, **kwargs)
        spec = TransformerSpec(layers=layers, hidden=dim, heads=dim // 4, seq_len=seq,
                               micro_batch=batch // dp, attention="flash", dropout=False,
                               tensor_parallel=tp, qkv_linears=3)
        predicted = estimate(engine.model, recipe, zero_stage=3 if dp > 1 else 0,
                             world_size=dp, activations=spec)
        if dp > 1:  # a sharded module at another stage: refused with the fix
            try:
                estimate(engine.model, recipe, zero_stage=1, world_size=dp)
            except ValueError as e:
                out["refusal"] = str(e)
        loss_fn = lambda o: F.cross_entropy(o, ys)  # noqa: E731
        with engine.autocast():
            loss = loss_fn(engine.model(xs))
        engine.backward(loss)
        grads = sum(g.numel() * g.element_size() for g in
                    (g.to_local() if isinstance(g, DTensor) else g
                     for g in engine.param_state.gradients()))
        engine.step()
        engine.zero_grad()
        got = measure(engine.model, engine, xs, peak=True, loss_fn=loss_fn)
        out[recipe] = (predicted.peak, got.peak, {**got.items, "grads": grads},
                       dict(predicted.items))
        del engine, model
    _save(tmp, "tppeak", rank, out)
    gc.collect()
    dist.destroy_process_group()
