"""torch's optimizers over parameters of several kinds: plain tensors and DTensors.

A model split by torch's ``parallelize_module`` holds DTensor shards (the planned
Linears) beside plain tensors (the norms, the head), and FSDP over such a model holds
DTensors on two meshes (``(dp, tp)`` for the planned weights, ``dp`` for the rest).
torch's fused and foreach optimizers hand each param group to one multi-tensor kernel,
and DTensor refuses a kernel that mixes DTensors with plain tensors (``aten._fused_adamw_
got mixed torch.Tensor and DTensor``) or meshes. ``step_by_kind`` steps such an
optimizer once per kind of parameter (plain, or a DTensor on one mesh), each time with
``found_inf`` and ``grad_scale`` of that kind (a DTensor replicated on the parameters'
mesh), so the fused kernels still skip on the device and no step reads the host.

torch registers DTensor rules for its fused Adam and AdamW kernels, not for fused SGD
or Adagrad: ``unfuse_over_dtensors`` switches such an optimizer over DTensors to its
unfused implementation, with one warning (the engine then reads ``found_inf`` on the
host once per step, as for any optimizer that cannot skip on the device).

Only torch's own optimizers are split (``torch.optim``: each ``step`` reads its param
groups afresh and keeps its state per parameter); ``mixprec.optim`` steps each DTensor
through its local shard and needs no split. Hooks registered on a split optimizer's
``step`` run once per kind.
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable

import torch

from mixprec.optim.sharding import is_dtensor

__all__ = ["kind_of", "kinds_of", "as_kind", "splits_by_kind", "step_by_kind",
           "fuses_over_dtensors", "unfuse_over_dtensors"]

#: the fused kernel each of torch's optimizers runs (``torch.optim.<name>``)
_FUSED_KERNELS = {"Adam": "_fused_adam_", "AdamW": "_fused_adamw_", "SGD": "_fused_sgd_",
                  "Adagrad": "_fused_adagrad_"}


def kind_of(p: torch.Tensor) -> Hashable:
    """A parameter's kind: ``None`` for a plain tensor, its ``DeviceMesh`` for a DTensor."""
    return p.device_mesh if is_dtensor(p) else None


def kinds_of(opt: torch.optim.Optimizer) -> list[Hashable]:
    """The kinds of ``opt``'s parameters, in the order they first appear."""
    seen: dict[Hashable, None] = {}
    for g in opt.param_groups:
        for p in g["params"]:
            seen.setdefault(kind_of(p), None)
    return list(seen)


def as_kind(t: torch.Tensor | None, kind: Hashable) -> torch.Tensor | None:
    """``t`` (``found_inf`` or ``grad_scale``, a plain tensor on the engine's device)
    as the parameters of ``kind`` take it: itself for plain tensors, a DTensor
    replicated on the mesh for DTensors (the same value on every rank: the skip was
    agreed across ranks)."""
    if t is None or kind is None or is_dtensor(t):
        return t
    from torch.distributed.tensor import DTensor, Replicate  # DTensors exist: loaded

    return DTensor.from_local(t, kind, [Replicate()] * kind.ndim, run_check=False)


def _torch_own(opt: torch.optim.Optimizer) -> bool:
    return type(opt).__module__.startswith("torch.optim")


def splits_by_kind(opt: torch.optim.Optimizer) -> bool:
    """Whether ``step_by_kind`` steps ``opt`` once per kind: one of torch's own
    optimizers whose parameters are of more than one kind."""
    return _torch_own(opt) and len(kinds_of(opt)) > 1


def step_by_kind(opt: torch.optim.Optimizer, found_inf: torch.Tensor | None = None,
                 grad_scale: torch.Tensor | None = None) -> None:
    """``opt.step()`` with ``found_inf`` / ``grad_scale`` set (None: a step that takes
    neither). One of torch's own optimizers steps once per kind of parameter, each
    call seeing only the param groups' parameters of that kind (the groups restored
    afterwards, whatever happens) and the two tensors of that kind; any other
    optimizer steps once with the tensors as they are."""
    kinds = kinds_of(opt) if _torch_own(opt) else []
    groups = opt.param_groups
    try:
        for kind in kinds or [None]:
            if len(kinds) > 1:
                opt.param_groups = [{**g, "params": [p for p in g["params"]
                                                     if _same(kind_of(p), kind)]}
                                    for g in groups]
            if found_inf is not None:
                opt.found_inf = as_kind(found_inf, kind)
                opt.grad_scale = as_kind(grad_scale, kind)
            opt.step()
    finally:
        opt.param_groups = groups
        if found_inf is not None:
            del opt.found_inf, opt.grad_scale


def _same(a: Hashable, b: Hashable) -> bool:
    return a is b or (a is not None and b is not None and a == b)


def _has_dtensor_rule(kernel: str) -> bool:
    """Whether DTensor has a sharding rule for ``aten.<kernel>.default`` (its
    propagator's registry; where that cannot be read, torch's documented pair)."""
    from torch.distributed.tensor import DTensor

    op = getattr(torch.ops.aten, kernel).default
    try:
        prop = DTensor._op_dispatcher.sharding_propagator
        return op in prop.op_single_dim_strategy_funcs or op in prop.op_strategy_funcs
    except AttributeError:
        return kernel in ("_fused_adam_", "_fused_adamw_")


def fuses_over_dtensors(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt``'s fused kernel runs over its parameters: True where none is a
    DTensor, or where DTensor has a rule for the kernel (torch's Adam and AdamW); False
    for another optimizer (its kernel unknown) over DTensors."""
    if not any(is_dtensor(p) for g in opt.param_groups for p in g["params"]):
        return True
    kernel = _FUSED_KERNELS.get(type(opt).__name__) if _torch_own(opt) else None
    return kernel is not None and _has_dtensor_rule(kernel)


def unfuse_over_dtensors(optimizers: list) -> list[int]:
    """Switch each of torch's optimizers built ``fused=True`` whose kernel has no
    DTensor rule for its DTensor parameters to its default unfused implementation, with
    one warning; returns their indices."""
    switched = []
    for i, o in enumerate(optimizers):
        if not (_torch_own(o) and any(g.get("fused") for g in o.param_groups)):
            continue
        if fuses_over_dtensors(o):
            continue
        for g in o.param_groups:
            g["fused"] = False
        o.defaults["fused"] = False
        o._step_supports_amp_scaling = False
        kernel = _FUSED_KERNELS.get(type(o).__name__, "its fused kernel")
        warnings.warn(
            f"optimizer {i} (torch.optim.{type(o).__name__}, fused=True) updates DTensor "
            f"parameters, and torch has no DTensor rule for aten.{kernel}: mixprec steps "
            "it unfused, reading the skip decision on the host once per step. Use "
            "torch.optim.AdamW or Adam with fused=True (DTensor runs their kernels), or "
            f"mixprec.optim.{type(o).__name__ if type(o).__name__ == 'SGD' else 'AdamW'} "
            "(it skips on the device), to keep the step free of host syncs.",
            stacklevel=4)
        switched.append(i)
    return switched
