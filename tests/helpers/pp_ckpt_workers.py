"""Pipeline checkpoints across pipeline degrees: the four-block model of
``pp_workers`` cut into stages that keep their names in the whole model
(``stage_module``), saved through ``torch.distributed.checkpoint`` by two stages and
resumed by two stages or by one process holding the whole model, and the other way
round; each resumed run beside the run that never stopped."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, ScheduleInterleaved1F1B

from helpers.pp_workers import BATCH, N_MICRO, _engine, make_blocks, make_data
from mixprec.checkpoint.pipeline import stage_module
from mixprec.parallel.pipeline import stage_args

STEPS, CUT, CLIP = 6, 3, 0.1


def _whole(seed: int = 0) -> nn.Sequential:
    return nn.Sequential(*make_blocks(seed))


def _name(engine, name: str) -> str:
    """A name in the whole model (past the index of a rank's ModuleList of stages)."""
    return name.split(".", 1)[1] if isinstance(engine.module, nn.ModuleList) else name


def _snapshot(engine) -> dict:
    """Every tensor a resume must carry, by name in the whole model: the model's
    entries, the masters and the optimizer's states."""
    ps = engine.param_state
    out = {f"model.{_name(engine, k)}": v.detach().clone()
           for k, v in engine.module.state_dict().items()}
    if ps.has_master:
        out.update({f"master.{_name(engine, n)}": m.detach().clone()
                    for n, m in zip(ps.names, ps.masters)})
    name_of = {id(q): _name(engine, n) for n, q in zip(ps.names, ps.opt_params)}
    for p, st in engine.optimizers[0].state.items():
        out.update({f"optim.{name_of[id(p)]}.{k}": v.detach().clone().float()
                    for k, v in st.items() if isinstance(v, torch.Tensor)})
    out["scale"] = engine.scale.detach().clone()
    return out


class Stages:
    """This rank's stage of ``n``, its engine and schedule (fresh weights from ``seed``)."""

    def __init__(self, rank: int, recipe: str, seed: int = 0, renumbered: bool = False,
                 n: int = 2):
        per = 4 // n
        mine = range(per * rank, per * (rank + 1))
        if renumbered:  # a fresh nn.Sequential of the blocks: names from 0 on each stage
            self.module = nn.Sequential(*make_blocks(seed)[mine.start:mine.stop])
        else:
            self.module = stage_module(_whole(seed), [str(i) for i in range(4) if i not in mine],
                                       copy=False)
        self.engine = _engine(self.module, recipe, CLIP, parallel="pp")
        mb = BATCH // N_MICRO
        ins, outs = stage_args(self.module, torch.zeros(mb, 16 if rank == 0 else 32),
                               self.engine, stage_index=rank)
        self.stage = PipelineStage(self.module, rank, n, torch.device("cpu"),
                                   input_args=ins, output_args=outs)
        self.loss = self.engine.pipeline_loss(F.cross_entropy)
        self.schedule = ScheduleGPipe(self.stage, n_microbatches=N_MICRO, loss_fn=self.loss)
        self.first, self.last = self.stage.is_first, self.stage.is_last

    def train(self, data: list) -> list[float]:
        losses = []
        for x, y in data:
            with self.engine.autocast():
                self.schedule.step(*((x,) if self.first else ()),
                                   **({"target": y, "losses": []} if self.last else {}))
            self.engine.step()
            if self.last:
                losses.append(torch.stack(self.loss.take()).float().mean().item())
        return losses


class Interleaved(Stages):
    """This rank's two stages of four (blocks ``rank`` and ``rank + 2``) in one
    ``nn.ModuleList``, under ``ScheduleInterleaved1F1B``."""

    def __init__(self, rank: int, recipe: str, seed: int = 0):
        ids = [rank, rank + 2]
        mods = [stage_module(_whole(seed), [str(j) for j in range(4) if j != i]) for i in ids]
        self.module = nn.ModuleList(mods)
        self.engine = _engine(self.module, recipe, CLIP, parallel="pp")
        mb = BATCH // N_MICRO
        args = stage_args(mods, [torch.zeros(mb, 16 if i == 0 else 32) for i in ids],
                          self.engine, stage_index=ids)
        stages = [PipelineStage(m, i, 4, torch.device("cpu"), input_args=a, output_args=o)
                  for m, i, (a, o) in zip(mods, ids, args)]
        self.loss = self.engine.pipeline_loss(F.cross_entropy)
        self.schedule = ScheduleInterleaved1F1B(stages, n_microbatches=N_MICRO,
                                                loss_fn=self.loss)
        self.first = any(s.is_first for s in stages)
        self.last = any(s.is_last for s in stages)


def _one_process(recipe: str, seed: int = 0):
    model = _whole(seed)
    return model, _engine(model, recipe, CLIP)


def _train_one(model, engine, data: list) -> list[float]:
    """The same micro-batches through ``engine.backward``, as ``pp_workers.reference``."""
    losses = []
    for x, y in data:
        mine = []
        for xm, ym in zip(x.chunk(N_MICRO), y.chunk(N_MICRO)):
            with engine.autocast():
                loss = F.cross_entropy(model(xm), ym)
            mine.append(loss.detach().float())
            engine.backward(loss)
            engine.step()
        losses.append(torch.stack(mine).mean().item())
    return losses


def _fp32(engine) -> dict:
    return {_name(engine, k): v.clone() for k, v in engine.fp32_state_dict().items()}


def pp_ckpt_runs(rank: int, world: int, tmp: str, recipe: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world)
    data = make_data(STEPS)
    out: dict = {}
    # the run that never stops, at two stages
    s = Stages(rank, recipe)
    out["pp2_losses"] = s.train(data)
    out["pp2_weights"] = _fp32(s.engine)
    # two stages: three steps, saved (twice: the second replaces the first) ...
    s = Stages(rank, recipe)
    s.train(data[:CUT])
    pp2_dir = os.path.join(tmp, "pp2")
    s.engine.save(pp2_dir, reshardable=True, step=CUT)
    s.engine.save(pp2_dir, reshardable=True, step=CUT)
    out["pp2_saved"] = _snapshot(s.engine)
    out["listing"] = sorted(os.listdir(tmp))
    # ... resumed by two fresh stages of other weights
    s = Stages(rank, recipe, seed=5)
    out["pp2_extra"] = s.engine.load(pp2_dir)
    out["pp2_loaded"] = _snapshot(s.engine)
    out["pp2_steps"] = s.engine.steps
    out["pp2_resumed"] = s.train(data[CUT:])
    out["pp2_resumed_weights"] = _fp32(s.engine)
    # ... and by one process holding the whole model
    if rank == 0:
        model, e = _one_process(recipe, seed=5)
        out["pp1_extra"] = e.load(pp2_dir)
        out["pp1_loaded"] = _snapshot(e)
        out["pp1_resumed"] = _train_one(model, e, data[CUT:])
        out["pp1_resumed_weights"] = _fp32(e)
        # one process, straight and saved at the cut, for two stages to resume
        model, e = _one_process(recipe)
        out["one_losses"] = _train_one(model, e, data)
        out["one_weights"] = _fp32(e)
        model, e = _one_process(recipe)
        _train_one(model, e, data[:CUT])
        e.save(os.path.join(tmp, "pp1"), reshardable=True)
        out["pp1_saved"] = _snapshot(e)
    dist.barrier()
    s = Stages(rank, recipe, seed=5)
    s.engine.load(os.path.join(tmp, "pp1"))
    out["from_pp1_loaded"] = _snapshot(s.engine)
    out["from_pp1_resumed"] = s.train(data[CUT:])
    out["from_pp1_weights"] = _fp32(s.engine)
    # stages that renumber the blocks: the save refuses, the load names the entries
    bad = Stages(rank, recipe, seed=5, renumbered=True)
    before = _snapshot(bad.engine)
    for what, call in (("save", lambda: bad.engine.save(os.path.join(tmp, "bad"),
                                                        reshardable=True)),
                       ("load", lambda: bad.engine.load(pp2_dir))):
        try:
            call()
            out[f"bad_{what}"] = None
        except ValueError as e:
            out[f"bad_{what}"] = str(e)
    after = _snapshot(bad.engine)
    out["bad_unchanged"] = before.keys() == after.keys() and all(
        torch.equal(before[k], after[k]) for k in before)
    out["no_bad_dir"] = not os.path.exists(os.path.join(tmp, "bad"))
    torch.save(out, os.path.join(tmp, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def pp4_runs(rank: int, world: int, tmp: str, recipe: str) -> None:
    """On four ranks: four stages straight, and three steps saved to ``tmp/pp4``; on
    two (a second spawn): two stages resume it, and so do the four stages two per rank
    (interleaved), whose save one process resumes."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store{world}", rank=rank,
                            world_size=world)
    data = make_data(STEPS)
    out: dict = {}
    if world == 4:
        s = Stages(rank, recipe, n=4)
        out["losses"] = s.train(data)
        out["weights"] = _fp32(s.engine)
        s = Stages(rank, recipe, n=4)
        s.train(data[:CUT])
        s.engine.save(os.path.join(tmp, "pp4"), reshardable=True)
        out["saved"] = _snapshot(s.engine)
    else:
        s = Stages(rank, recipe, seed=5, n=2)
        s.engine.load(os.path.join(tmp, "pp4"))
        out["loaded"] = _snapshot(s.engine)
        out["losses"] = s.train(data[CUT:])
        out["weights"] = _fp32(s.engine)
        # the four stages two per rank (interleaved): read back, trained on, saved ...
        s = Interleaved(rank, recipe, seed=5)
        s.engine.load(os.path.join(tmp, "pp4"))
        out["iv_loaded"] = _snapshot(s.engine)
        out["iv_losses"] = s.train(data[CUT:])
        out["iv_weights"] = _fp32(s.engine)
        s.engine.save(os.path.join(tmp, "iv"), reshardable=True)
        out["iv_saved"] = _snapshot(s.engine)
        if rank == 0:  # ... and resumed by one process holding the whole model
            _, e = _one_process(recipe, seed=5)
            e.load(os.path.join(tmp, "iv"))
            out["iv_one_loaded"] = _snapshot(e)
    torch.save(out, os.path.join(tmp, f"pp{world}_rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
