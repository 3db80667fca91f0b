"""Data-parallel mixed precision on torch.distributed: DDP and FSDP2, the user's entry
(tensor parallelism: ``parallelize_module`` first, then ``parallel="tp"`` or ``"fsdp"``).

``MixedPrecision(model, opt, recipe, parallel="ddp" | "fsdp")`` inside an initialised
process group (``torchrun`` + ``init_process_group("gloo" | "nccl")``). Then call the
wrapped module, ``engine.model``, for the forward pass. ``prepare()`` returns both.

How each mode reduces, shards and agrees is in ``mixprec.parallel.comm`` (the collectives) and
``mixprec.parallel.layouts`` (one interface over single process, DDP and FSDP2). This module
sits above the engine, so that the engine never imports it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mixprec.engine.facade import MixedPrecision
from mixprec.parallel.comm import (
    CommStats,
    agree_amax_,
    all_reduce_max_,
    broadcast_module_,
    ddp_comm_hook,
    fsdp_policy,
    require_process_group,
    shard_fsdp,
    wrap_ddp,
)

if TYPE_CHECKING:
    from mixprec.recipe import Recipe

__all__ = ["CommStats", "require_process_group", "ddp_comm_hook", "fsdp_policy", "prepare",
           "all_reduce_max_", "broadcast_module_", "wrap_ddp", "shard_fsdp", "agree_amax_"]


def prepare(model: nn.Module,
            optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
            recipe: Recipe | str = "bf16", parallel: str = "ddp",
            **kwargs: Any) -> tuple[nn.Module, MixedPrecision]:
    """``(module to call, engine)`` for data-parallel training.

    Example (``torchrun --nproc-per-node 2 train.py``)::

        dist.init_process_group("gloo")
        model = MyModel()
        opt = torch.optim.AdamW(model.parameters(), fused=True)
        ddp_model, engine = mixprec.parallel.distributed.prepare(model, opt, "bf16", "ddp")
        # extra MixedPrecision arguments pass through, e.g.
        # parallel_kwargs={"find_unused_parameters": True}
        with engine.autocast():
            loss = loss_fn(ddp_model(x), y)
        engine.backward(loss)
        engine.step()
    """
    engine = MixedPrecision(model, optimizer, recipe, parallel=parallel, **kwargs)
    return engine.model, engine
