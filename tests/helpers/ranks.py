"""Spawning gloo ranks from the forkserver the suite preloads (conftest.py), and the
relative difference the distributed tests compare ranks by."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.multiprocessing as mp

__all__ = ["spawn", "spawn_tp", "max_rel"]


def spawn(fn, *args, world=2):
    """Run ``fn(rank, world, tmp, *args)`` of ``helpers.dist_workers`` on ``world`` gloo
    ranks; returns what each rank saved (its file is named after ``fn``)."""
    tmp = tempfile.mkdtemp(prefix="mixprec-dist-")
    mp.start_processes(fn, args=(world, tmp, *args), nprocs=world, join=True,
                       start_method="forkserver")  # preloaded: see conftest.py
    name = {"equivalence": "equivalence", "rank_local_inf": "inf", "fp8_outlier": "fp8",
            "fp16_comm": "fp16", "resume": "resume", "frozen_stateful": "frozen",
            "unused_head": "unused", "gpt_fsdp": "gpt", "freed": "freed",
            "reshard": "reshard", "fsdp_units": "units",
            "reshardable_save": "reshardable", "reshardable_load": "reshardable",
            "lean_ddp": "lean", "lean_fsdp": "leanfsdp",
            "sharded_optimizer": "shardopt", "fp8_gather": "fp8gather",
            "gpt_fp8_gather": "gptfp8", "disagreeing_choices": "choices",
            "cast_gather": "castgather",
            "resume_dropout": "dropout", "door_writers": "door",
            "accum_windows": "windows"}[fn.__name__]
    return [torch.load(os.path.join(tmp, f"{name}_rank{r}.pt"), weights_only=False)
            for r in range(world)]


def spawn_tp(fn, *args, world=2, name="tp"):
    """Run a tensor-parallel rank function ``fn(rank, world, tmp, *args)`` on ``world``
    gloo ranks; returns what each rank saved as ``<name>_rank<r>.pt``."""
    tmp = tempfile.mkdtemp(prefix="mixprec-tp-")
    mp.start_processes(fn, args=(world, tmp, *args), nprocs=world, join=True,
                       start_method="forkserver")  # preloaded: see conftest.py
    return [torch.load(os.path.join(tmp, f"{name}_rank{r}.pt"), weights_only=False)
            for r in range(world)]


def max_rel(a, b):
    """The largest relative difference (in fp32) of ``a``'s tensors from ``b``'s."""
    return max(((x.float() - y.float()).abs().max() / y.float().abs().max()).item()
               for x, y in zip(a, b))
