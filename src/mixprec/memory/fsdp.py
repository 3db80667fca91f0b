"""What a module already sharded by FSDP2 (``fully_shard``, mixprec's ``parallel="fsdp"``)
holds per rank, alone or over a tensor-parallel plan (``estimate`` prices it from here).

Its parameters are DTensors whose local shards are this rank's (``1/dp`` of each
tensor-parallel shard), so the counts are per rank already and are not divided by
``world_size`` again. The shards are what the engine trains (``ParamState(sharded=)``):
fp32, serving as the masters (no separate master copy), with fp32 gradients on the
shards and the optimizer's states on the shards, in fp32; under a write rule
(``stochastic``, ``kahan``, ``remainder``) the shards are the 16-bit weights, with fp32
gradient buffers.

FSDP gathers each unit's shards whole (in the recipe's 16-bit ``params`` under
``master=fp32``, else as stored) while the unit runs, and holds two units' worth at once
(measured, torch's profiler, a 2 x 2 mesh): in the forward the running unit's weights
and the all-gather's output they were copied out of (freed at the next unit's gather),
in the backward the running unit's and the next one's, prefetched. The root unit's
gathered weights stay from the forward to the backward. These add to the peak.
"""

from __future__ import annotations

from torch import nn

from mixprec.recipe import Recipe

__all__ = ["fsdp_units", "fsdp_sharded", "fsdp_held_recipe", "fsdp_gathered_bytes",
           "FSDP_NOTE"]

FSDP_NOTE = ("FSDP2: the fp32 shards are the masters; two units' gathered weights and the "
             "root's add to the peak (mixprec.memory.fsdp)")


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that ``fully_shard`` made units (none: not sharded)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def fsdp_sharded(model: nn.Module, zero_stage: int) -> bool:
    """Whether ``fully_shard`` sharded ``model``; raises unless ``zero_stage`` is 3 (the
    gathered weights' size needs ``world_size``, the data-parallel size)."""
    if not fsdp_units(model):
        return False
    if zero_stage != 3:
        raise ValueError(f"zero_stage={zero_stage} for a module FSDP2 sharded: FSDP2 "
                         "shards parameters, gradients and optimizer states (stage 3); "
                         "pass zero_stage=3 and world_size = its data-parallel size")
    return True


def fsdp_held_recipe(r: Recipe) -> Recipe:
    """The recipe the engine's sharded parameter state holds (``ParamState``): fp32
    shards that are the masters, fp32 gradients; under a write rule 16-bit shards and
    fp32 gradient buffers."""
    if r.optim.write == "nearest":
        return r.replace(params="fp32", master="none", grads="fp32")
    return r.replace(grads="fp32")


def fsdp_gathered_bytes(model: nn.Module, r: Recipe, emulated: bool, dp: int) -> float:
    """Bytes of gathered (whole over the ``dp`` ranks) weights held at a step's peak:
    the root unit's own, and twice the largest other unit's (see the module docstring),
    each element in the gathered dtype."""
    units = fsdp_units(model)
    if not units:
        return 0.0
    gathered = 2 if r.precision.master == "fp32" and not emulated else None
    sizes = []
    for u in units:
        inner = {id(p) for v in units if v is not u and _within(v, u)
                 for p in v.parameters()}
        own = [p for p in u.parameters() if id(p) not in inner and p.requires_grad]
        sizes.append(sum(_local(p).numel() * dp * (gathered or p.element_size())
                         for p in own))
    return float(sizes[0] + 2 * max(sizes[1:], default=0))


def _within(inner: nn.Module, outer: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def _local(p):
    return p.to_local() if hasattr(p, "to_local") else p
