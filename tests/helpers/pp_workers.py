"""Pipeline-parallel rank functions: a four-block model cut into stages for torch's
``PipelineStage`` and schedules, trained by one engine per rank, and the same model
trained whole in one process for reference."""

from __future__ import annotations

import math
import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.pipelining.schedules as schedules
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage

from mixprec import MixedPrecision
from mixprec.parallel.pipeline import stage_args

warnings.simplefilter("ignore")

N_MICRO, BATCH, LR = 4, 16, 1e-2
#: the schedules that hold two stages per rank (stages r and r + world; V: r, 2w-1-r)
MULTI = ("ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble",
         "ScheduleZBVZeroBubble", "ScheduleDualPipeV")


def make_blocks(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU()),
            nn.Sequential(nn.Linear(32, 32), nn.GELU()),
            nn.Sequential(nn.Linear(32, 32), nn.GELU()),
            nn.Sequential(nn.Linear(32, 4))]


def make_data(steps: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, 16, generator=g), torch.randint(0, 4, (BATCH,), generator=g))
            for _ in range(steps)]


def fp8_filter(module: nn.Module, fqn: str) -> bool:
    """The same Linears in fp8 however the model is cut: all but the 4-wide head."""
    return module.out_features % 16 == 0


def _engine(module, recipe, clip, windows=1, **kw):
    opt = torch.optim.AdamW(module.parameters(), lr=LR, fused=True)
    return MixedPrecision(module, opt, recipe, grad_accum_steps=N_MICRO * windows,
                          max_grad_norm=clip,
                          fp8_filter=fp8_filter if "fp8" in recipe else None, **kw)


def reference(recipe: str, steps: int, clip: float | None, tie: bool = False,
              windows: int = 1) -> dict:
    """One process holding the whole model: the same micro-batches through
    ``engine.backward``, on one thread as each rank runs. ``tie``: blocks 1 and 2 share
    their Linear's weight."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        blocks = make_blocks()
        if tie:
            blocks[2][0].weight = blocks[1][0].weight
        model = nn.Sequential(*blocks)
        engine = _engine(model, recipe, clip, windows)
        losses, norms = [], []
        for x, y in make_data(steps):
            mine = []
            for xm, ym in zip(x.chunk(N_MICRO * windows), y.chunk(N_MICRO * windows)):
                with engine.autocast():
                    loss = F.cross_entropy(model(xm), ym)
                mine.append(loss.detach().float())
                engine.backward(loss)
                r = engine.step()
            losses.append(torch.stack(mine).mean().item())
            norms.append(float(r.grad_norm))
        weights = engine.fp32_state_dict()
    finally:
        torch.set_num_threads(threads)
    return {"losses": losses, "norms": norms, "weights": weights}


def _stage_ids(name: str, rank: int, world: int) -> tuple[list[int], int]:
    if name not in MULTI:
        return [rank], world
    if name in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV"):
        return [rank, 2 * world - 1 - rank], 2 * world
    return [rank, rank + world], 2 * world


def _whole_names(module: nn.Module, ids: list[int], n_stages: int) -> dict[str, str]:
    """Each stage parameter's name in the whole ``nn.Sequential`` of the four blocks."""
    per = 4 // n_stages
    out = {}
    for name, _ in module.named_parameters():
        parts = name.split(".")
        if len(ids) > 1:  # a ModuleList of the rank's stages
            k, parts = int(parts[0]), parts[1:]
        else:
            k = 0
        out[name] = ".".join([str(ids[k] * per + int(parts[0])), *parts[1:]])
    return out


def _state(engine) -> list[torch.Tensor]:
    """Every tensor a skipped step must leave as it was."""
    out = [p.detach().clone() for p in engine.param_state.working]
    out += [p.detach().clone() for p in engine.master_params]
    for opt in engine.optimizers:
        for s in opt.state.values():
            out += [v.clone() for v in s.values() if isinstance(v, torch.Tensor)]
    return out


def train_stages(rank: int, world: int, recipe: str, name: str, steps: int,
                 clip: float | None, scale_grads: bool = True,
                 inject: int | None = None, tie: bool = False,
                 ckpt: str | None = None, windows: int = 1) -> dict:
    """Train this rank's stage(s) under ``name``; ``inject``: at that step a non-finite
    gradient on rank 0's first parameter; ``tie``: blocks 1 and 2 (stages 0 and 1 of
    two) share their Linear's weight, each stage holding a copy (``tied=``)."""
    ids, n_stages = _stage_ids(name, rank, world)
    blocks = make_blocks(seed=rank if tie else 0)  # tied copies start from rank 0's
    per = 4 // n_stages
    mods = [nn.Sequential(*blocks[i * per:(i + 1) * per]) for i in ids]
    module = mods[0] if len(mods) == 1 else nn.ModuleList(mods)
    kw = {"parallel_kwargs": {"tied": ["1.0.weight" if rank == 0 else "0.0.weight"]}} \
        if tie else {}
    if tie:  # the untied weights as the reference's: only the tied copy differs
        ref = make_blocks()
        with torch.no_grad():
            for m, i in zip(mods, ids):
                for p, q in zip(m.parameters(), nn.Sequential(
                        *ref[i * per:(i + 1) * per]).parameters()):
                    p.copy_(q)
            if rank == 1:
                mods[0][0][0].weight.mul_(2.0)  # differs: the broadcast must undo it
    engine = _engine(module, recipe, clip, windows, parallel="pp", **kw)
    mb = BATCH // N_MICRO // windows
    samples = [torch.zeros(mb, 16) if i == 0 else torch.zeros(mb, 32) for i in ids]
    args = stage_args(mods, samples, engine, stage_index=ids)
    stages = [PipelineStage(m, i, n_stages, torch.device("cpu"), input_args=ins,
                            output_args=outs) for m, i, (ins, outs) in zip(mods, ids, args)]
    boundary = [str(outs[0].dtype) for _, outs in args]
    pipeline_loss = engine.pipeline_loss(F.cross_entropy)
    cls = getattr(schedules, name)
    schedule = cls(stages if len(stages) > 1 else stages[0], n_microbatches=N_MICRO,
                   loss_fn=pipeline_loss, scale_grads=scale_grads)
    first = any(s.is_first for s in stages)
    last = any(s.is_last for s in stages)
    losses, norms, skipped, scales, intact = [], [], [], [], None
    error = None
    for k, (x, y) in enumerate(make_data(steps)):
        hook = before = None
        if inject == k:
            before = _state(engine)
            if rank == 0:
                hook = engine.param_state.working[0].register_hook(lambda g: g * math.inf)
        try:
            for xw, yw in zip(x.chunk(windows), y.chunk(windows)):
                with engine.autocast():
                    schedule.step(*((xw,) if first else ()),
                                  **({"target": yw, "losses": []} if last else {}))
                r = engine.step()
        except NotImplementedError as e:
            error = str(e)
            break
        if hook is not None:
            hook.remove()
        if before is not None:
            intact = all(torch.equal(a, b) for a, b in zip(before, _state(engine)))
        if last:
            losses.append(torch.stack(pipeline_loss.take()).float().mean().item())
        norms.append(float(r.grad_norm))
        skipped.append(bool(r.skipped))
        scales.append(float(r.scale))
    resumed = None
    if ckpt is not None:  # each stage saves its own state and resumes it in a new engine
        path = f"{ckpt}.rank{rank}"
        engine.save(path)
        again = nn.Sequential(*make_blocks(seed=5)[ids[0] * per:(ids[0] + 1) * per])
        fresh = _engine(again, recipe, clip, parallel="pp")
        fresh.load(path)
        resumed = (all(torch.equal(a, b) for a, b in zip(_state(engine), _state(fresh)))
                   and torch.equal(engine.scale, fresh.scale) and fresh.steps == engine.steps)
        try:  # these stages renumber the blocks: no names in the whole model
            engine.save(path + ".dcp", reshardable=True)
        except ValueError as e:
            resumed = resumed and "held by two pipeline ranks" in str(e)
    names = _whole_names(module, ids, n_stages)
    weights = {names[k]: v for k, v in engine.fp32_state_dict().items()} if error is None \
        else {}
    return {"losses": losses, "norms": norms, "skipped": skipped, "scales": scales,
            "intact": intact, "weights": weights, "error": error, "resumed": resumed,
            "boundary": boundary}


def pp_runs(rank: int, world: int, tmp: str, runs: list[dict]) -> None:
    """Each of ``runs`` (``train_stages``' keyword arguments) on this rank; rank 0 adds
    the one-process reference of each recipe and clip."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world)
    out = []
    for run in runs:
        out.append(train_stages(rank, world, **run))
        dist.barrier()
    refs = {}
    if rank == 0:
        for run in runs:
            key = (run["recipe"], run["clip"], run["steps"], run.get("tie", False),
                   run.get("windows", 1))
            if key not in refs and run.get("inject") is None:
                refs[key] = reference(run["recipe"], run["steps"], run["clip"], key[3],
                                      key[4])
    torch.save({"runs": out, "refs": refs}, os.path.join(tmp, f"pp_rank{rank}.pt"))
    dist.destroy_process_group()
