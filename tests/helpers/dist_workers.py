"""Rank functions for tests/parallel/test_distributed.py (spawned with torch.multiprocessing).

Each worker joins a gloo group through a file store in ``tmp`` and writes what it saw to
``tmp/<name>_rank<r>.pt`` for the test process to compare.
"""

from __future__ import annotations

import contextlib
import gc
import io
import math
import os
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mixprec import MixedPrecision

warnings.simplefilter("ignore")


def _init(rank: int, world: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world)


def _teardown() -> None:
    """Free what still holds the process group (engines, FSDP modules, reference cycles)
    before destroying it, so the group is destroyed here, in order, and not at
    interpreter exit (see ``mixprec.parallel.distributed``'s Teardown)."""
    gc.collect()
    dist.destroy_process_group()


def _save(tmp: str, name: str, rank: int, obj) -> None:
    torch.save(obj, os.path.join(tmp, f"{name}_rank{rank}.pt"))


def make_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 32),
                         nn.GELU(), nn.Linear(32, 4))


def make_data(steps: int, batch: int = 16, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 16, generator=g), torch.randint(0, 4, (batch,), generator=g))
            for _ in range(steps)]


def train_reference(recipe: str, steps: int, accum: int = 1,
                    world: int = 1) -> list[torch.Tensor]:
    """One process, the whole batch of 16 each step.

    ``world > 1``: the same micro-batches, magnitudes and sums as ``world`` ranks of
    ``equivalence``: ``accum * world`` micro-batches of 16 / world / accum samples, each
    loss times ``world`` (a rank's mean over its own samples) and the learning rate over
    ``world`` (the ranks' average of their sums). On one thread, as the ranks run: the
    GEMMs then sum in the ranks' order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = make_mlp(seed=0)
        engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1 / world),
                                recipe, grad_accum_steps=accum * world)
        for x, y in make_data(steps):
            for xs, ys in zip(x.chunk(accum * world), y.chunk(accum * world)):
                with engine.autocast():
                    loss = F.cross_entropy(model(xs), ys) * world
                engine.backward(loss)
                engine.step()
    finally:
        torch.set_num_threads(threads)
    return [p.detach().clone() for p in engine.master_params]


def equivalence(rank, world, tmp, recipe, parallel, steps, accum):
    """2 ranks x 8 samples per step (in `accum` micro-batches)."""
    _init(rank, world, tmp)
    model = make_mlp(seed=rank)  # different on purpose: rank 0's weights are broadcast
    engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), recipe,
                            parallel=parallel, grad_accum_steps=accum)
    for x, y in make_data(steps):
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
        for xm, ym in zip(xs.chunk(accum), ys.chunk(accum)):
            with engine.autocast():
                loss = F.cross_entropy(engine.model(xm), ym)
            engine.backward(loss)
            engine.step()
    params = [p.detach() for p in engine.master_params]
    if parallel == "fsdp":
        params = [p.full_tensor() for p in params]
    stats = engine.comm_stats
    _save(tmp, "equivalence", rank, {"params": [p.clone() for p in params],
                                     "bytes": stats.bytes_sent if stats else None,
                                     "kernels": engine.kernels.as_dict()})
    dist.destroy_process_group()


def rank_local_inf(rank, world, tmp, recipe, parallel):
    """Step 1: inf in rank 1's gradient before the reduction. Step 2: inf only in rank
    1's local buffer after it (a rank-local fault): both ranks must skip both."""
    _init(rank, world, tmp)
    model = make_mlp(seed=0)
    engine = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True),
                            recipe, parallel=parallel)
    skipped = []
    data = make_data(4)
    for i, (x, y) in enumerate(data):
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
        if i == 1 and rank == 1:
            xs = xs.clone()
            xs[0, 0] = math.inf
        with engine.autocast():
            loss = F.cross_entropy(engine.model(xs), ys)
        engine.backward(loss)
        if i == 2 and rank == 1:
            g = engine.param_state.gradients()[0]
            (g.to_local() if hasattr(g, "to_local") else g).view(-1)[0] = math.inf
        skipped.append(bool(engine.step().skipped))
    params = [p.detach() for p in engine.master_params]
    if parallel == "fsdp":
        params = [p.full_tensor() for p in params]
    _save(tmp, "inf", rank, {"skipped": skipped, "params": [p.clone() for p in params]})
    dist.destroy_process_group()


def fp8_outlier(rank, world, tmp):
    _init(rank, world, tmp)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.Linear(32, 16))
    engine = MixedPrecision(model, torch.optim.AdamW(model.parameters(), fused=True), "fp8",
                            parallel="ddp")
    g = torch.Generator().manual_seed(rank)
    for step in range(3):
        x = torch.randn(8, 32, generator=g)
        if rank == 1 and step == 1:
            x[0, 0] = 1000.0  # an activation outlier on one rank only
        with engine.autocast():
            loss = engine.model(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    _save(tmp, "fp8", rank, {
        "scales": [m.fp8_scale.clone() for m in engine.fp8_modules],
        "hist": [m.fp8_amax_history.clone() for m in engine.fp8_modules]})
    dist.destroy_process_group()


def fp16_comm(rank, world, tmp):
    """Gradients of 40000 on every rank: the fp16 sum (80000) overflows, the mean does not."""
    _init(rank, world, tmp)
    lin = nn.Linear(16, 16, bias=False)
    engine = MixedPrecision(lin, torch.optim.SGD(lin.parameters(), lr=0.0),
                            "fp32,comm=fp16", parallel="ddp")
    engine.backward((engine.model(torch.full((1, 16), 16.0)) * 2500.0).sum())  # d/dw = 40000
    pre_divided = engine.param_state.gradients()[0].clone()
    naive = torch.full((16, 16), 40000.0).half()
    dist.all_reduce(naive)  # sum first, then divide: what pre-division avoids
    _save(tmp, "fp16", rank, {"pre": pre_divided, "naive": (naive.float() / world)})
    dist.destroy_process_group()


def _run_shards(engine, batches, rank: int, world: int) -> list[float]:
    """One step per batch, this rank on its slice; the losses."""
    out = []
    for x, y in batches:
        with engine.autocast():
            loss = F.cross_entropy(engine.model(x.chunk(world)[rank]), y.chunk(world)[rank])
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


def resume(rank, world, tmp, recipe):
    """Train 3 steps, checkpoint, train 3; a fresh engine from the checkpoint must
    repeat the last 3 steps bit for bit."""
    _init(rank, world, tmp)

    def fresh(seed):
        m = make_mlp(seed)
        return MixedPrecision(m, torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True),
                              recipe, parallel="ddp")

    def run(engine, batches):
        return _run_shards(engine, batches, rank, world)

    data = make_data(6)
    a = fresh(0)
    run(a, data[:3])
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    tail_a = run(a, data[3:])
    b = fresh(7)
    buf.seek(0)
    b.load_state_dict(torch.load(buf, weights_only=True))
    tail_b = run(b, data[3:])
    same = all(torch.equal(p, q) for p, q in zip(a.master_params, b.master_params))
    _save(tmp, "resume", rank, {"a": tail_a, "b": tail_b, "same": same})
    dist.destroy_process_group()


def resume_dropout(rank, world, tmp, recipe):
    """A model with dropout, each rank seeded apart: 3 steps, ``save(full=True)`` on
    every rank, 3 more; then every stream scrambled, a fresh engine loads the file and
    must repeat the last 3 steps bit for bit (each rank its own dropout masks)."""
    _init(rank, world, tmp)

    def fresh(seed):
        torch.manual_seed(seed)
        m = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 4))
        return MixedPrecision(m, torch.optim.AdamW(m.parameters(), lr=1e-2), recipe,
                              parallel="ddp")

    def run(engine, batches):
        return _run_shards(engine, batches, rank, world)

    data = make_data(6)
    a = fresh(0)
    torch.manual_seed(100 + rank)  # each rank its own stream
    run(a, data[:3])
    path = os.path.join(tmp, "dropout.pt")
    a.save(path, full=True, step=3)
    tail_a = run(a, data[3:])
    torch.manual_seed(555)  # the same scrambled stream on every rank
    b = fresh(7)
    b.load(path)
    tail_b = run(b, data[3:])
    same = all(torch.equal(p, q) for p, q in zip(a.master_params, b.master_params))
    torch.manual_seed(555)
    c = fresh(7)
    c.load(path, rng_state=False)  # the streams left as they are: other masks
    tail_c = run(c, data[3:])
    _save(tmp, "dropout", rank, {"a": tail_a, "b": tail_b, "c": tail_c, "same": same})
    _teardown()


def make_frozen_adagrad(seed: int = 0):
    """A model whose first Linear is frozen, with Adagrad (state built in __init__)
    over all its parameters, as torch allows."""
    model = make_mlp(seed)
    model[0].requires_grad_(False)
    return model, torch.optim.Adagrad(model.parameters(), lr=0.05)


def frozen_stateful(rank, world, tmp, parallel, steps, recipe="fp32"):
    """make_frozen_adagrad on 2 ranks x 8 samples per step."""
    _init(rank, world, tmp)
    model, opt = make_frozen_adagrad(seed=rank)
    engine = MixedPrecision(model, opt, recipe, parallel=parallel)
    for x, y in make_data(steps):
        with engine.autocast():
            loss = F.cross_entropy(engine.model(x.chunk(world)[rank]), y.chunk(world)[rank])
        engine.backward(loss)
        engine.step()
    params = [p.detach() for p in engine.module.parameters()]
    if parallel == "fsdp":
        params = [p.full_tensor() for p in params]
    _save(tmp, "frozen", rank, {"params": [p.clone() for p in params]})
    dist.destroy_process_group()


class TwoHeads(nn.Module):
    """A shared trunk and two heads; each step uses one head, so the other's parameters
    get no gradient (DDP needs find_unused_parameters=True)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = nn.Sequential(nn.Linear(16, 32), nn.GELU())
        self.heads = nn.ModuleList([nn.Linear(32, 4), nn.Linear(32, 4)])

    def forward(self, x, head: int):
        return self.heads[head](self.trunk(x))


def unused_head(rank, world, tmp, recipe, steps):
    """TwoHeads on 2 ranks x 8 samples, head = step % 2, find_unused_parameters=True."""
    _init(rank, world, tmp)
    model = TwoHeads(seed=rank)
    engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), recipe,
                            parallel="ddp",
                            parallel_kwargs={"find_unused_parameters": True})
    for i, (x, y) in enumerate(make_data(steps)):
        with engine.autocast():
            loss = F.cross_entropy(engine.model(x.chunk(world)[rank], i % 2),
                                   y.chunk(world)[rank])
        engine.backward(loss)
        engine.step()
    _save(tmp, "unused", rank, {"params": [p.detach().clone() for p in engine.master_params]})
    dist.destroy_process_group()


def make_gpt(seed: int = 0):
    from mixprec.workbench import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab=64, seq_len=16, n_layers=2, d_model=32, n_heads=2))


def gpt_tokens(steps: int, batch: int = 8):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 64, (batch, 17), generator=g) for _ in range(steps)]


def gpt_fsdp(rank, world, tmp, recipe, steps):
    """The workbench GPT (blocks in a ModuleList) on 2 ranks x 4 sequences, FSDP."""
    _init(rank, world, tmp)
    model = make_gpt(seed=rank)
    engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.5), recipe,
                            parallel="fsdp")
    for idx in gpt_tokens(steps):
        idx = idx.chunk(world)[rank]
        with engine.autocast():
            loss = engine.model(idx[:, :-1], idx[:, 1:])
        engine.backward(loss)
        engine.step()
    units = [type(m).__name__ for m in (*model.blocks, model)]
    params = [p.detach().full_tensor().clone() for p in engine.master_params]
    _save(tmp, "gpt", rank, {"params": params, "units": units})
    dist.destroy_process_group()


#: (recipe, parallel) pairs whose engines ``freed`` builds, trains and drops
FREED_CASES = [("bf16", "ddp"), ("fp16-master", "ddp"), ("bf16-master,wgrad=fp32", "ddp"),
               ("fp8", "ddp"), ("bf16", "fsdp"), ("bf16-master", "fsdp")]


def freed(rank, world, tmp):
    """Whether an engine, its model and its masters outlive the last user reference
    (after two steps and a garbage collection), for each of FREED_CASES."""
    import weakref

    _init(rank, world, tmp)
    alive = []
    for recipe, parallel in FREED_CASES:
        model = make_mlp(rank)
        engine = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                recipe, parallel=parallel)
        for x, y in make_data(2):
            with engine.autocast():
                loss = F.cross_entropy(engine.model(x.chunk(world)[rank]),
                                       y.chunk(world)[rank])
            engine.backward(loss)
            engine.step()
        refs = [weakref.ref(o) for o in (engine, model, engine.master_params[0])]
        del engine, model, loss
        gc.collect()
        alive.append([r() is not None for r in refs])
    _save(tmp, "freed", rank, {"alive": alive})
    dist.destroy_process_group()


def reshard(rank, world, tmp, recipe):
    """Checkpoints across world sizes and layouts, each against the run it came from:
    ``down``: 2 ranks (DDP, or FSDP saving full=True) -> one process; ``up``: one process
    -> 2 ranks (DDP, FSDP); ``refused``: FSDP shards -> one process raises."""
    _init(rank, world, tmp)

    def engine(seed, parallel):
        m = make_mlp(seed)
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        return MixedPrecision(m, opt, recipe, parallel=parallel)

    def run(e, batches, split):
        for x, y in batches:
            if split:
                x, y = x.chunk(world)[rank], y.chunk(world)[rank]
            with e.autocast():
                loss = F.cross_entropy(e.model(x), y)
            e.backward(loss)
            e.step()
        return e.fp32_state_dict(full=True)

    data = make_data(6)
    out = {"down": {}, "up": {}}
    for parallel in ("ddp", "fsdp"):
        a = engine(0, parallel)
        run(a, data[:3], split=True)
        # DDP: both ranks write the same file; FSDP: both gather, rank 0 writes
        path = os.path.join(tmp, f"{parallel}.pt")
        a.save(path, full=True, step=3)
        if parallel == "fsdp":  # rank 0 cannot write: every rank raises, none waits
            try:
                a.save(os.path.join(tmp, "missing", "x.pt"), full=True)
                out["failed_write"] = None
            except RuntimeError as e:
                out["failed_write"] = str(e)
        want = run(a, data[3:], split=True)
        b = engine(7, None)
        out[f"extra_{parallel}"] = b.load(path)
        out["down"][parallel] = (want, run(b, data[3:], split=False))

        c = engine(0, None)
        run(c, data[:3], split=False)
        buf = io.BytesIO()
        torch.save(c.state_dict(), buf)  # (state_dict() holds live tensors)
        want = run(c, data[3:], split=False)
        d = engine(7, parallel)
        buf.seek(0)
        d.load_state_dict(torch.load(buf, weights_only=True))
        out["up"][parallel] = (want, run(d, data[3:], split=True))
    # FSDP's own shards, one file per rank, resumed by FSDP on as many ranks
    f = engine(0, "fsdp")
    run(f, data[:3], split=True)
    path = os.path.join(tmp, f"shards{rank}.pt")
    f.save(path)
    want = run(f, data[3:], split=True)
    g = engine(7, "fsdp")
    g.load(path)
    out["sharded"] = (want, run(g, data[3:], split=True))
    try:
        engine(0, None).load_state_dict(f.state_dict())
        out["refused"] = None
    except ValueError as e:
        out["refused"] = str(e)
    _save(tmp, "reshard", rank, out)
    del a, b, c, d, f, g
    _teardown()


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x):
        return x + self.fc(self.ln(x))


def make_sequential(seed: int = 0) -> nn.Module:
    """Blocks in an nn.Sequential, no ModuleList: the default FSDP units miss them."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), Block(32), Block(32), nn.Linear(32, 4))


def fsdp_units(rank, world, tmp, units, steps):
    """make_sequential under FSDP with ``fsdp_units=units`` ("default", "class" or
    "callable"): which modules became FSDP units, and the weights after ``steps``."""
    from torch.distributed.fsdp import FSDPModule

    _init(rank, world, tmp)
    model = make_sequential(seed=rank)
    chosen = {"default": None, "class": Block,
              "callable": lambda m: isinstance(m, nn.Linear)}[units]
    engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32",
                            parallel="fsdp", fsdp_units=chosen)
    for x, y in make_data(steps):
        with engine.autocast():
            loss = F.cross_entropy(engine.model(x.chunk(world)[rank]), y.chunk(world)[rank])
        engine.backward(loss)
        engine.step()
    _save(tmp, "units", rank, {
        "units": [i for i, m in enumerate(model) if isinstance(m, FSDPModule)],
        "root": isinstance(model, FSDPModule),
        "params": [p.detach().full_tensor().clone() for p in model.parameters()]})
    dist.destroy_process_group()


def _fsdp_adamw(seed, recipe):
    m = make_mlp(seed)
    return MixedPrecision(m, torch.optim.AdamW(m.parameters(), lr=1e-2), recipe,
                          parallel="fsdp")


def _train_split(engine, batches, rank, world):
    for x, y in batches:
        with engine.autocast():
            loss = F.cross_entropy(engine.model(x.chunk(world)[rank]), y.chunk(world)[rank])
        engine.backward(loss)
        engine.step()
    return engine.fp32_state_dict(full=True)


def reshardable_save(rank, world, tmp, recipe, ckpt):
    """FSDP on ``world`` ranks: 3 steps, save(ckpt, reshardable=True) twice (the second
    replaces the first), 3 more steps; the weights after them are what loading must
    reproduce."""
    _init(rank, world, tmp)
    e = _fsdp_adamw(0, recipe)
    data = make_data(6)
    _train_split(e, data[:2], rank, world)
    e.save(ckpt, reshardable=True, step=2)
    _train_split(e, data[2:3], rank, world)
    e.save(ckpt, reshardable=True, step=3)
    _save(tmp, "reshardable", rank, {"want": _train_split(e, data[3:], rank, world)})
    del e
    _teardown()


def reshardable_load(rank, world, tmp, recipe, ckpt):
    """FSDP on ``world`` ranks from another seed: load(ckpt), the same 3 steps."""
    _init(rank, world, tmp)
    e = _fsdp_adamw(7, recipe)
    extra = e.load(ckpt)
    got = _train_split(e, make_data(6)[3:], rank, world)
    other = nn.Sequential(nn.Linear(16, 4))
    o = MixedPrecision(other, torch.optim.AdamW(other.parameters()), recipe, parallel="fsdp")
    before = o.fp32_state_dict(full=True)
    try:
        o.load(ckpt)
        refused = None
    except ValueError as err:
        refused = str(err)
    after = o.fp32_state_dict(full=True)
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    _save(tmp, "reshardable", rank, {"got": got, "extra": extra, "steps": e.steps,
                                     "refused": refused, "unchanged": unchanged,
                                     "opt_state": len(o.optimizers[0].state)})
    del e, o
    _teardown()


def make_wide_mlp(seed: int = 0) -> nn.Module:
    """4096- and 1024-element weights: mixprec.optim quantizes the first one's states."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 256), nn.GELU(), nn.Linear(256, 4))


def _lean_engine(recipe, seed=0, parallel="ddp"):
    from mixprec.optim import adamw_for

    m = make_wide_mlp(seed)
    return MixedPrecision(m, adamw_for(recipe, m.parameters(), lr=1e-2), recipe,
                          parallel=parallel)


def _lean_steps(engine, batches, rank, world):
    for x, y in batches:
        with engine.autocast():
            loss = F.cross_entropy(engine.model(x.chunk(world)[rank]).float(),
                                   y.chunk(world)[rank])
        engine.backward(loss)
        engine.step()


def lean_ddp(rank, world, tmp, recipe, ckpt, resume):
    """mixprec.optim under DDP: 20 steps with a checkpoint after 10 (``resume=False``),
    or the last 10 from that checkpoint in a fresh engine (``resume=True``)."""
    _init(rank, world, tmp)
    data = make_data(20)
    engine = _lean_engine(recipe, seed=3 if resume else 0)
    if resume:
        engine.load(ckpt)
    else:
        _lean_steps(engine, data[:10], rank, world)
        if rank == 0:
            engine.save(ckpt)
        dist.barrier()
    _lean_steps(engine, data[10:], rank, world)
    opt = engine.optimizers[0]
    _save(tmp, "lean", rank, {
        "params": [p.detach().clone() for p in engine.param_state.working],
        "states": [{k: v.clone() for k, v in st.items()} for st in opt.state.values()]})
    del engine, opt
    _teardown()


def make_uneven_mlp(seed: int = 0) -> nn.Module:
    """A 257 x 16 weight (4112 elements: quantized states) that 2 ranks shard unevenly
    (129 + 128 rows), beside small fp32-state tensors."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 257), nn.GELU(), nn.Linear(257, 4))


def lean_engine(recipe, seed=0, parallel="fsdp", opt="sgd"):
    """An uneven MLP under a mixprec.optim optimizer with ``recipe``'s states: SGD with
    momentum (the equivalence tests' optimizer) or AdamW."""
    import mixprec.optim as mo
    from mixprec.recipe import Recipe

    m = make_uneven_mlp(seed)
    r = Recipe.coerce(recipe)
    kw = {"states": r.states, "write": r.write}
    o = (mo.SGD(m.parameters(), lr=0.1, momentum=0.9, **kw) if opt == "sgd"
         else mo.AdamW(m.parameters(), lr=1e-2, **kw))
    return MixedPrecision(m, o, recipe, parallel=parallel)


def _full_states(engine):
    """Every optimizer state gathered whole (a collective under FSDP)."""
    return engine.parallelism.gather(
        [{k: v for k, v in st.items() if k != "step"}
         for st in engine.optimizers[0].state.values()])


def lean_fsdp(rank, world, tmp, recipe, ckpt, mode):
    """FSDP with quantized states. ``mode="save"``: 10 steps, a reshardable save (the
    directory ``ckpt``) and a whole-file one (``ckpt.pt``), 10 more steps. ``"dir"`` or
    ``"file"``: a fresh engine (another seed) loads that checkpoint and runs the last 10."""
    _init(rank, world, tmp)
    data = make_data(20)
    engine = lean_engine(recipe, seed=0 if mode == "save" else 4)
    if mode == "save":
        _lean_steps(engine, data[:10], rank, world)
        engine.save(ckpt, reshardable=True, step=10)
        engine.save(ckpt + ".pt", full=True, step=10)
    else:
        extra = engine.load(ckpt if mode == "dir" else ckpt + ".pt")
        assert extra == {"step": 10}, extra
    _lean_steps(engine, data[10:], rank, world)
    opt = engine.optimizers[0]
    placed = sorted({str(v.placements) for st in opt.state.values() for k, v in st.items()
                     if k != "step"})
    shards = [p.to_local() for p in engine.param_state.working]
    _save(tmp, "leanfsdp", rank, {
        "params": engine.fp32_state_dict(full=True), "states": _full_states(engine),
        "placements": placed, "emulating": engine.emulating,
        "shard_dtypes": sorted({str(t.dtype) for t in shards}),
        "shard_bytes": sum(t.untyped_storage().nbytes() for t in shards),
        "shard_numel": sum(t.numel() for t in shards),
        # the share of shard elements that hold a bf16 value (the rule's writes)
        "bf16_share": (sum(int((t.float() == t.bfloat16().float()).sum()) for t in shards)
                       / sum(t.numel() for t in shards))})
    del engine, opt
    _teardown()


SHARDED_SHAPES = ((257, 16), (40, 700), (300,))  # uneven rows, rows of 2 blocks, 1-D


def sharded_steps(full_params, states, steps=5, world=None, write="nearest"):
    """mixprec.optim AdamW and SGD (momentum) for ``steps`` steps on the same seeded
    gradients: on ``full_params`` (one process), or with ``world`` on dim-0 DTensor
    shards of them. A write rule other than nearest steps bf16 weights. Returns the
    whole weights and states after."""
    import mixprec.optim as mo
    from mixprec.parallel.comm import gather_full

    out = []
    half = write != "nearest"
    for make in (lambda ps: mo.AdamW(ps, lr=1e-2, states=states, write=write),
                 lambda ps: mo.SGD(ps, lr=0.1, momentum=0.9, states=states, write=write)):
        params = [nn.Parameter(p.clone().to(torch.bfloat16) if half else p.clone())
                  for p in full_params]
        if world is not None:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import Shard, distribute_tensor

            mesh = init_device_mesh("cpu", (world,))
            params = [nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)]))
                      for p in params]
        opt = make(params)
        g = torch.Generator().manual_seed(11)
        for _ in range(steps):
            for p in params:
                grad = torch.randn(p.shape, generator=g).to(p.dtype)
                p.grad = (grad if world is None
                          else distribute_tensor(grad, p.device_mesh, p.placements))
            opt.step()
        states_of = [{k: v for k, v in opt.state[p].items() if k != "step"} for p in params]
        out.append(gather_full({"params": [p.detach() for p in params],
                                "states": states_of}))
    return out


def sharded_optimizer(rank, world, tmp, states, write="nearest", chunk=None):
    """``sharded_steps`` on ``world`` ranks (``chunk``: the step's piece size,
    ``mixprec.optim.pieces.CHUNK``)."""
    if chunk is not None:
        import mixprec.optim.pieces as pieces

        pieces.CHUNK = chunk
    _init(rank, world, tmp)
    torch.manual_seed(0)
    full = [torch.randn(s) for s in SHARDED_SHAPES]
    _save(tmp, "shardopt", rank, sharded_steps(full, states, world=world, write=write))
    _teardown()


def _classify_steps(engine, rank, world, steps, g, width, classes, batch=16):
    """``steps`` cross-entropy steps on random batches drawn from ``g``, each rank
    taking its chunk."""
    for _ in range(steps):
        x = torch.randn(batch, width, generator=g)
        y = torch.randint(0, classes, (batch,), generator=g)
        with engine.autocast():
            loss = F.cross_entropy(engine.model(x.chunk(world)[rank]),
                                   y.chunk(world)[rank])
        engine.backward(loss)
        engine.step()


def fp8_gather(rank, world, tmp, recipe, steps=6):
    """FSDP2 on a stack of bias-free 64x64 Linears (every parameter a Float8Linear
    weight), 2 ranks x 8 samples: the bytes each step all-gathers and the all-reduces
    it makes, counted at torch.distributed's entry points, and the final weights."""
    _init(rank, world, tmp)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.GELU(),
                          nn.Linear(64, 64, bias=False), nn.GELU(),
                          nn.Linear(64, 64, bias=False))
    engine = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), recipe,
                            parallel="fsdp", fp8_filter=lambda m, fqn: True)  # head too
    counts = {"gathered": 0, "all_reduces": 0}
    real_gather, real_reduce = dist.all_gather_single, dist.all_reduce  # FSDP2 uses these

    def gather(out, inp, *a, **k):
        counts["gathered"] += inp.numel() * inp.element_size()
        return real_gather(out, inp, *a, **k)

    def reduce(t, *a, **k):
        counts["all_reduces"] += 1
        return real_reduce(t, *a, **k)

    dist.all_gather_single, dist.all_reduce = gather, reduce
    g = torch.Generator().manual_seed(3)
    try:
        _classify_steps(engine, rank, world, steps, g, 64, 64)
    finally:
        dist.all_gather_single, dist.all_reduce = real_gather, real_reduce
    from mixprec.modules.linear import fp8_modules
    from mixprec.parallel.gather import gathers_fp8

    mods = list(fp8_modules(engine.module).values())
    state = engine.state_dict(full=True)
    _save(tmp, "fp8gather", rank, {
        "params": [p.full_tensor().clone() for p in engine.master_params],
        "per_step": {k: v / steps for k, v in counts.items()},
        "fp8_modules": len(mods), "hooked": sum(gathers_fp8(m) for m in mods),
        # delayed scaling's state (current scaling keeps none)
        "scales": [m.fp8_scale.clone() for m in mods if m.quantizer.has_history],
        "hist": [m.fp8_amax_history.clone() for m in mods if m.quantizer.has_history],
        "state_keys": sorted(state["model"])})
    del engine, model
    _teardown()


def gpt_fp8_gather(rank, world, tmp, recipe, steps=4):
    """The workbench GPT under FSDP2 (each block its own unit, resharded after the
    forward and gathered again for the backward) with ``recipe``: the losses and the
    final fp32 weights."""
    from mixprec.workbench import GPT, GPTConfig

    _init(rank, world, tmp)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=64, seq_len=32, n_layers=2, d_model=64, n_heads=4))
    engine = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=3e-3), recipe,
                            parallel="fsdp", max_grad_norm=1.0)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        b = torch.randint(0, 64, (2 * world, 33), generator=g).chunk(world)[rank]
        with engine.autocast():
            loss = engine.model(b[:, :-1], b[:, 1:])
        losses.append(loss.item())
        engine.backward(loss)
        engine.step()
    from mixprec.parallel.gather import gathers_fp8

    _save(tmp, "gptfp8", rank, {"losses": losses, "params": engine.fp32_state_dict(full=True),
                                "fp8": len(engine.fp8_modules),
                                "hooked": sum(map(gathers_fp8, engine.fp8_modules))})
    del engine, model
    _teardown()


def disagreeing_choices(rank, world, tmp, recipe, parallel, fast_rank):
    """Each rank's measured speeds say the opposite (rank ``fast_rank`` has fast bf16
    units, the other none): every rank must still take rank 0's choices."""
    from mixprec.engine import devices as kernels

    os.environ.pop(kernels.EMULATE_ENV, None)  # measured, not pinned
    fast = rank == fast_rank
    kernels.speed_reading = lambda device, dtype: kernels.SpeedReading(
        name={torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype], base="fp32",
        rounds=(1.0 if fast else 0.01,))
    kernels.route_reading = lambda device, route: kernels.SpeedReading(
        name="scaled_mm", base=route, rounds=(0.0,))
    _init(rank, world, tmp)
    model = make_mlp(seed=0)
    engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), recipe,
                            parallel=parallel)
    seen = []
    for x, y in make_data(3):
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
        with engine.autocast():
            seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu")
                        else None)
            loss = F.cross_entropy(engine.model(xs), ys)
        engine.backward(loss)
        engine.step()
    params = [p.detach() for p in engine.master_params]
    if parallel == "fsdp":
        params = [p.full_tensor() for p in params]
    _save(tmp, "choices", rank, {
        "kernels": engine.kernels, "autocast": seen,
        "routes": sorted({m.backend for m in engine.fp8_modules}),
        "checkpoint": engine.state_dict()["kernels"],
        "params": [p.clone() for p in params]})
    _teardown()


def _versions(state, idx) -> int:
    """Sum of the version counters (bumped by every in-place write) of the buffers and
    Kahan compensations of parameters ``idx`` (a DTensor's: of its local tensor)."""
    ts = [state.buffers[i] for i in idx] + [state.compensations[i] for i in idx
                                            if state.compensations]
    return sum(getattr(t, "_local_tensor", t)._version for t in ts)


class DoorSpy:
    """Wraps ``ParamState.receive``: counts its calls by the function that made them,
    and the writes to the buffers made inside them (version counters of the buffers
    each call names), to compare with all writes to the buffers (``writes``)."""

    def __init__(self) -> None:
        from collections import Counter

        self.calls: Counter = Counter()
        self.inside = 0

    def __enter__(self):
        import sys

        from mixprec.engine.param_state import ParamState

        self._cls, self._orig = ParamState, ParamState.receive
        spy = self

        def receive(state, where, grads, *, replace=False):
            caller = sys._getframe(1).f_code.co_name
            idx = [i if isinstance(i, int) else state.index[id(i)] for i in where]
            before = _versions(state, idx)
            spy._orig(state, where, grads, replace=replace)
            spy.inside += _versions(state, idx) - before
            spy.calls[caller] += 1

        ParamState.receive = receive
        return self

    def __exit__(self, *exc) -> None:
        self._cls.receive = self._orig

    @staticmethod
    def writes(state) -> int:
        """All writes so far to ``state``'s buffers (compare before and after)."""
        return _versions(state, range(len(state.buffers)))


class ValueSpy:
    """Compares the buffers' values at each ``ParamState.receive`` call's entry and exit
    with the values the previous call left: writes inside the door and outside it, seen
    without version counters."""

    def __init__(self, state) -> None:
        self.state, self.inside, self.outside = state, 0, 0

    def _snap(self):
        return [getattr(b, "_local_tensor", b).detach().clone()
                for b in self.state.buffers + list(self.state.compensations or [])]

    def _changed(self) -> int:
        now = self._snap()
        n = sum(not torch.equal(a, b) for a, b in zip(self.last, now))
        self.last = now
        return n

    def __enter__(self):
        from mixprec.engine.param_state import ParamState

        self.last, self._orig, spy = self._snap(), ParamState.receive, self

        def receive(state, *args, **kwargs):
            spy.outside += spy._changed()
            spy._orig(state, *args, **kwargs)
            spy.inside += spy._changed()

        ParamState.receive = receive
        return self

    def __exit__(self, *exc) -> None:
        from mixprec.engine.param_state import ParamState

        ParamState.receive = self._orig
        self.outside += self._changed()


def door_writers(rank, world, tmp):
    """One accumulation window per case, under DDP and FSDP: who called the parameter
    state's door, the buffer writes made in it, and all buffer writes of the window."""
    _init(rank, world, tmp)
    out = {}
    cases = [("ddp", "bf16-master", 2), ("ddp", "bf16-master,wgrad=fp32", 1),
             ("fsdp", "fp32,grad_accum=kahan", 2)]
    for parallel, recipe, accum in cases:
        model = make_mlp(seed=0)
        engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), recipe,
                                parallel=parallel, grad_accum_steps=accum)
        state = engine.param_state
        start = DoorSpy.writes(state)
        with ValueSpy(state) as values, DoorSpy() as spy:
            x, y = make_data(1)[0]
            xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
            for xm, ym in zip(xs.chunk(accum), ys.chunk(accum)):
                with engine.autocast():
                    loss = F.cross_entropy(engine.model(xm), ym)
                engine.backward(loss)
        out[(parallel, recipe)] = {"calls": dict(spy.calls), "inside": spy.inside,
                                   "writes": DoorSpy.writes(state) - start,
                                   "direct": state.direct, "emulating": engine.emulating,
                                   "values_inside": values.inside,
                                   "values_outside": values.outside}
        engine.step()
        del engine, model, state
    _save(tmp, "door", rank, out)
    _teardown()


def accum_windows(rank, world, tmp, recipe, parallel, ends, old=False):
    """2 ranks x 8 samples per window in 4 micro-batches of 2; window ``i`` ends after
    ``ends[i]`` of them (``backward(last=True)`` when early). The gradient collectives
    seen after each micro-batch (DDP: the comm stats; FSDP: reduce-scatters and
    all-reduces counted at torch.distributed's entry points during the backwards) and the
    final weights. ``old``: every forward outside ``no_sync()``, as the engine once
    ran them (each micro-batch reduced)."""
    _init(rank, world, tmp)
    model = make_mlp(seed=0)
    engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), recipe,
                            parallel=parallel, grad_accum_steps=4)
    if old:
        engine.parallelism.forward = lambda m, last: contextlib.nullcontext()
        engine.parallelism.reduce = lambda state: None
    seen = {"n": 0}
    real = {n: getattr(dist, n)  # FSDP2 reduce-scatters through reduce_scatter_single
            for n in ("reduce_scatter_single", "reduce_scatter_tensor", "all_reduce")}

    def counted(name):
        def call(*a, **k):
            seen["n"] += 1
            return real[name](*a, **k)
        return call

    calls = []
    for (x, y), end in zip(make_data(len(ends)), ends):
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
        for i, (xm, ym) in enumerate(zip(xs.chunk(4)[:end], ys.chunk(4)[:end])):
            with engine.autocast():
                loss = F.cross_entropy(engine.model(xm), ym)
            if parallel == "fsdp":
                for n in real:
                    setattr(dist, n, counted(n))
            try:
                engine.backward(loss, last=True if i == end - 1 < 3 else None)
            finally:
                for n, f in real.items():
                    setattr(dist, n, f)
            calls.append(engine.comm_stats.calls if parallel == "ddp" else seen["n"])
            engine.step()
    params = [p.detach() for p in engine.master_params]
    if parallel == "fsdp":
        params = [p.full_tensor() for p in params]
    stats = engine.comm_stats
    _save(tmp, "windows", rank, {"params": [p.clone() for p in params], "calls": calls,
                                 "bytes": stats.bytes_sent if stats else None,
                                 "dtype": stats.dtype if stats else None,
                                 "numel": sum(p.numel() for p in params)})
    del engine, model
    _teardown()


#: (in, out) of the Linears gathered as casts: 128 + 128 rows, 128 + 127 (a padded
#: shard), 32 + 31 and 15 + 15 rows on 2 ranks; 33 and 63 inputs are odd
CAST_SHAPES = ((33, 256), (256, 255), (255, 63), (63, 30))


def _cast_model(seed=0):
    torch.manual_seed(seed)
    layers = []
    for i, o in CAST_SHAPES:
        layers += [nn.Linear(i, o, bias=False), nn.GELU()]
    return nn.Sequential(*layers[:-1])


def _gather_by_hand(m, world):
    """``m``'s weight gathered through its hooks, as FSDP2 would: (the gathered tensor,
    the bytes this rank's inputs hold)."""
    local, mesh = m.weight._local_tensor, m.weight.device_mesh
    if m.quantizer.per_tensor:
        inputs, meta = local.fsdp_pre_all_gather(mesh, m.weight.shape, m.weight.stride(),
                                                 m, None)
    else:
        inputs, meta = local.fsdp_pre_all_gather(mesh)
    outs = []
    for t in inputs:
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous())
        outs.append(torch.cat(parts))
    w, _ = local.fsdp_post_all_gather(tuple(outs), meta, torch.float32)
    return w, sum(t.numel() * t.element_size() for t in inputs)


def _casts_equal(a, b) -> bool:
    """Codes (as bytes), inverse scales (NaN where NaN) and outer factors equal."""
    same = torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and (
        torch.equal(a.scale_inv, b.scale_inv)) and (a.rows, a.cols) == (b.rows, b.cols)
    return same and ((a.outer is None and b.outer is None) or torch.equal(a.outer, b.outer))


def cast_gather(rank, world, tmp, recipes, steps=3):
    """For each recipe: FSDP2 over ``_cast_model`` with and without ``fp8_all_gather``.
    Per Linear: whether it is hooked, whether each weight cast gathered by hand equals
    the format's cast of the whole fp32 weight bit for bit, and the bytes sent; the
    engine's comm_stats (records, fallbacks) and the fallback warnings; the bytes
    all-gathered per step at torch.distributed's entry point; the trained weights of
    both runs."""
    from mixprec.modules.linear import fp8_modules
    from mixprec.parallel.gather import gathers_fp8
    from mixprec.parallel.gather_casts import CastWeight

    _init(rank, world, tmp)
    out = {}
    real_gather = dist.all_gather_single
    for recipe in recipes:
        res = {}
        for gather in (False, True):
            model = _cast_model()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                engine = MixedPrecision(
                    model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                    recipe + (",fp8_all_gather=true" if gather else ""), parallel="fsdp",
                    fp8_filter=lambda m, fqn: True)
            mods = list(fp8_modules(engine.module).values())
            layers = []
            if gather:
                for m in mods:
                    full = m.weight.full_tensor().detach()
                    row = {"hooked": gathers_fp8(m), "shape": tuple(full.shape)}
                    if row["hooked"]:
                        w, nbytes = _gather_by_hand(m, world)
                        row["bytes"] = nbytes
                        dims = (1,) if m.quantizer.per_tensor else \
                            m.quantizer.weight_cast_dims()
                        row["dims"] = dims
                        if isinstance(w, CastWeight):
                            row["equal"] = [_casts_equal(
                                w.cast(d), m.quantizer.cast(full, "weight", d, {}))
                                for d in dims]
                            row["value"] = torch.equal(w + 0, w.cast(1).dequant())
                        else:
                            want = m.quantizer.cast(full, "weight", 1, m.scaling_state())
                            row["equal"] = [torch.equal(
                                w._codes[:full.shape[0]].view(torch.uint8),
                                want.data.view(torch.uint8))]
                    layers.append(row)
            counts = {"gathered": 0}

            def counting(o, i, *a, counts=counts, **k):
                counts["gathered"] += i.numel() * i.element_size()
                return real_gather(o, i, *a, **k)

            dist.all_gather_single = counting
            before = len(engine.comm_stats.records)
            g = torch.Generator().manual_seed(3)
            try:
                _classify_steps(engine, rank, world, steps, g, 33, 30, batch=8 * world)
            finally:
                dist.all_gather_single = real_gather
            recs = engine.comm_stats.records[before:]
            res[gather] = {
                "layers": layers, "params": [p.full_tensor().clone()
                                             for p in engine.master_params],
                "gathered": counts["gathered"] / steps,
                "recorded": sum(r.nbytes for r in recs if r.op == "all_gather") / steps,
                # the fallbacks' gathers: the only fp32 all-gathers of weights
                "fallback_bytes": sum(r.nbytes for r in recs if r.op == "all_gather"
                                      and r.dtype == torch.float32) / steps,
                "fallbacks": list(engine.comm_stats.fallbacks),
                "warnings": [str(w.message) for w in caught
                             if "low-precision communication" in str(w.message)]}
            if gather and rank == 0 and recipe == recipes[-1]:
                from mixprec.diagnostics import audit_comm

                res["findings"] = audit_comm(engine)
            del engine, model
        out[recipe] = res
    _save(tmp, "castgather", rank, out)
    _teardown()
