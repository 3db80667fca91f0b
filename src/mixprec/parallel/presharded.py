"""A model sharded before the engine sees it (transformers'
``from_pretrained(..., distributed_config=DistributedConfig(...))``, or ``fully_shard``
called by hand): what the Linear swap must carry from the module it replaces to the
quantized one, so that the sharding keeps working on it.

- **FSDP2's records.** ``fully_shard`` on a unit (a decoder layer) remembers, for each of
  its parameters, the module that holds it, and in each forward sets the unsharded
  weight there. A Linear swapped for a quantized one after ``fully_shard`` would keep the
  sharded DTensor while FSDP set the whole weight on the module it no longer calls:
  ``rebind_fsdp`` points FSDP's records at the new module.
- **A replaced ``forward``.** transformers' tensor- and expert-parallel plans replace a
  module's ``forward`` on the instance by a wrapper that closes over the module and its
  original ``forward`` (inputs to DTensors before, outputs to local tensors after).
  ``carry_forward`` rebuilds that wrapper around the new module's own ``forward``;
  ``forward_refusal`` says why a wrapper cannot be carried (it does not close over the
  module), and the swap then keeps that Linear in 16 bits with the reason.
"""

from __future__ import annotations

import types

from torch import nn

__all__ = ["fsdp_sharded", "fsdp_whole_params", "fsdp_tp_specs", "rebind_fsdp", "carry_forward",
           "forward_refusal"]


def _fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that ``fully_shard`` made units."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2: nothing can be sharded by it
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def fsdp_sharded(model: nn.Module) -> bool:
    """Whether ``fully_shard`` sharded ``model`` or one of its modules already."""
    return bool(_fsdp_units(model))


def _fsdp_param_records(model: nn.Module) -> list:
    """FSDP2's per-parameter records (``FSDPParam``) of every unit in ``model``."""
    records = []
    for m in _fsdp_units(model):
        state = m._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            groups = [state._fsdp_param_group]
        records += [fp for g in groups if g is not None for fp in g.fsdp_params]
    return records


def fsdp_whole_params(model: nn.Module) -> frozenset[int]:
    """The ids of ``model``'s parameters FSDP2 shards that were plain tensors before
    (no tensor-parallel plan): the forward sees each whole, as one process does, so
    their DTensor shards are no tensor-parallel layout."""
    held = (getattr(fp._module_info.module, fp._module_info.param_name)  # the module's:
            for fp in _fsdp_param_records(model) if not fp.is_dtensor)  # a load may
    return frozenset(id(p) for p in held)  # have replaced FSDP's before its first forward


def fsdp_tp_specs(model: nn.Module) -> dict[int, object]:
    """The ids of ``model``'s parameters FSDP2 shards that a tensor-parallel plan made
    DTensors before -> the ``DTensorSpec`` of the parameter the forward sees: FSDP2
    gathers the FSDP dim only, so the forward holds the plan's DTensor (on its 1-D
    mesh) while the stored shard lies on a 2-D mesh."""
    out = {}
    for fp in _fsdp_param_records(model):
        spec = (getattr(fp, "_unsharded_dtensor_spec", None)  # (older torch names
                or getattr(fp, "_tp_spec", None))  # it _tp_spec)
        if fp.is_dtensor and spec is not None:
            held = getattr(fp._module_info.module, fp._module_info.param_name)
            out[id(held)] = spec
    return out


def rebind_fsdp(model: nn.Module, swaps: dict[nn.Module, nn.Module]) -> int:
    """FSDP2's records of the parameters held by each key of ``swaps`` (a module
    replaced in ``model``) now name its value (the module that replaced it, holding the
    same Parameters); how many records moved."""
    moved = 0
    for fp in _fsdp_param_records(model):
        info = fp._module_info
        if info.module in swaps:
            info.module = swaps[info.module]
            moved += 1
        info.shared_modules = [swaps.get(s, s) for s in info.shared_modules]
    return moved


def _closure(fn) -> dict[str, object] | None:
    """The free variables of a plain function's closure (None: not such a function)."""
    if not isinstance(fn, types.FunctionType) or fn.__closure__ is None:
        return None
    try:
        return {n: c.cell_contents for n, c in zip(fn.__code__.co_freevars, fn.__closure__)}
    except ValueError:  # an empty cell
        return None


def _binds(value: object, module: nn.Module) -> bool:
    """Whether ``value`` is ``module`` or a method bound to it."""
    return value is module or getattr(value, "__self__", None) is module


def forward_refusal(module: nn.Module) -> str | None:
    """Why the ``forward`` that replaces ``module``'s own on the instance cannot be
    carried to a quantized module (None: there is none, or it can be)."""
    fwd = module.__dict__.get("forward")
    if fwd is None:
        return None
    free = _closure(fwd)
    if free is None or not any(_binds(v, module) for v in free.values()):
        return ("its forward is replaced on the instance by a wrapper "
                f"({getattr(fwd, '__qualname__', type(fwd).__name__)}) that mixprec "
                "cannot carry over to the quantized Linear")
    return None


def carry_forward(old: nn.Module, new: nn.Module) -> None:
    """``new`` gets the wrapper that replaced ``old``'s ``forward`` (see the module
    docstring), closing over ``new`` and its own class's methods where it closed over
    ``old``; nothing where ``old`` has none. Raises where ``forward_refusal`` gives a
    reason."""
    fwd = old.__dict__.get("forward")
    if fwd is None:
        return
    why = forward_refusal(old)
    if why is not None:
        raise ValueError(f"{type(old).__name__}: {why}")

    def moved(value):
        if value is old:
            return new
        if getattr(value, "__self__", None) is old:
            return getattr(type(new), value.__name__).__get__(new)
        return value

    cells = tuple(types.CellType(moved(c.cell_contents)) for c in fwd.__closure__)
    new.forward = types.FunctionType(fwd.__code__, fwd.__globals__, fwd.__name__,
                                     fwd.__defaults__, cells)
    new.forward.__kwdefaults__ = fwd.__kwdefaults__
