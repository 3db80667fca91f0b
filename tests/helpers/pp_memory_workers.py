"""Rank function for tests/memory/test_memory_pipeline.py: the four-block model of
``helpers.pp_workers`` cut into stages under torch's schedules, with the micro-batches
each rank holds at once (a forward's start counts one in, the backward reaching the
stage's first weight one out) and the bytes of the receive buffers torch's
``PipelineStage`` allocated."""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.pipelining.schedules as schedules
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage

from helpers.pp_workers import BATCH, N_MICRO, _engine, _stage_ids, make_blocks, make_data
from mixprec.parallel.pipeline import stage_args

warnings.simplefilter("ignore")


def _buffers(stage) -> int:
    """Bytes of the stage's receive buffers (inputs and output gradients)."""
    total = 0
    for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values()):
        for info in infos:
            buf = getattr(info, "buffer", None)
            if isinstance(buf, torch.Tensor):
                total += buf.numel() * buf.element_size()
    return total


class _Count:
    """Micro-batches held: one more at a stage's forward, one fewer when its backward
    reaches the stage's first weight."""

    def __init__(self) -> None:
        self.live = self.most = 0

    def start(self, *_) -> None:
        self.live += 1
        self.most = max(self.most, self.live)

    def end(self, *_) -> None:
        self.live -= 1


def held(rank: int, world: int, tmp: str, names: list[str]) -> None:
    """Per schedule: the most micro-batches (in virtual-stage units) this rank held,
    its receive buffers' bytes and the boundary's dtype."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world)
    out = {}
    for name in names:
        ids, n_stages = _stage_ids(name, rank, world)
        blocks = make_blocks()
        per = 4 // n_stages
        mods = [nn.Sequential(*blocks[i * per:(i + 1) * per]) for i in ids]
        module = mods[0] if len(mods) == 1 else nn.ModuleList(mods)
        engine = _engine(module, "fp32", None, parallel="pp")  # fp32 boundaries all
        count = _Count()
        for m in mods:
            m.register_forward_pre_hook(count.start)
            next(m.parameters()).register_post_accumulate_grad_hook(count.end)
        mb = BATCH // N_MICRO
        samples = [torch.zeros(mb, 16) if i == 0 else torch.zeros(mb, 32) for i in ids]
        args = stage_args(mods, samples, engine, stage_index=ids)
        count.live = count.most = 0  # stage_args ran each stage without grad
        stages = [PipelineStage(m, i, n_stages, torch.device("cpu"), input_args=ins,
                                output_args=outs)
                  for m, i, (ins, outs) in zip(mods, ids, args)]
        loss = engine.pipeline_loss(F.cross_entropy)
        schedule = getattr(schedules, name)(stages if len(stages) > 1 else stages[0],
                                            n_microbatches=N_MICRO, loss_fn=loss)
        x, y = make_data(1)[0]
        first_stage = any(s.is_first for s in stages)
        last_stage = any(s.is_last for s in stages)
        with engine.autocast():
            schedule.step(*((x,) if first_stage else ()),
                          **({"target": y, "losses": []} if last_stage else {}))
        engine.step()
        out[name] = {"held": count.most, "buffers": sum(_buffers(s) for s in stages),
                     "dtype": args[0][1][0].dtype, "stages": n_stages}
        dist.barrier()
    dist.destroy_process_group()
    torch.save(out, os.path.join(tmp, f"held{rank}.pt"))
