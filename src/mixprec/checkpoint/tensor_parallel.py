"""Reshardable checkpoints of a tensor-parallel engine without FSDP: the model, the
fp32 masters and the optimizer's states keyed by parameter name in a
``torch.distributed.checkpoint`` directory, which resumes at any tensor-parallel degree
or in one process (each rank reads the pieces of its shards).

``checkpoint_resharding`` writes and reads the directory (its atomic swap, the
engine's settings, counters and random streams); this module makes the state it holds
when the engine has no FSDP: ``tp_state`` for the save, ``load_tp_state`` for the load.
torch's own ``get_state_dict`` cannot: it keys an optimizer's states by the model's
parameters, and a ``-master`` recipe's optimizer holds the fp32 masters instead.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_tp_savable", "tp_state", "tp_layout", "load_tp_state"]


def check_tp_savable(engine: Any) -> None:
    """Refuse ``mixprec.optim``'s optimizers: their block states are cut by the local
    shard's rows, which another degree cuts elsewhere."""
    if any(hasattr(o, "extra_state") for o in engine.optimizers):
        raise NotImplementedError(
            "save(path, reshardable=True) of a tensor-parallel engine without FSDP takes "
            "torch's optimizers; mixprec.optim's states are not resharded across "
            "tensor-parallel degrees yet. Use save(path, full=True) (whole: it resumes at "
            "any degree) or FSDP on a dp dimension (of size 1 is enough)")


def _named_states(engine: Any) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """The optimized tensor of each trained parameter by name, and each optimizer's
    ``{name: state}``."""
    ps = engine.param_state
    opt_params = dict(zip(ps.names, ps.opt_params))
    name_of = {id(q): n for n, q in opt_params.items()}
    states = [{name_of[id(p)]: st for p, st in o.state.items()} for o in engine.optimizers]
    return opt_params, states


def tp_state(engine: Any) -> dict:
    """What ``dcp.save`` writes for ``engine``: model, masters by name, and each
    optimizer's states by parameter name (tensors as they are: DTensor shards or
    whole)."""
    ps = engine.param_state
    _, states = _named_states(engine)
    return {"model": engine.module.state_dict(),
            "masters": dict(zip(ps.names, ps.masters)) if ps.has_master else {},
            "optim": {str(k): s for k, s in enumerate(states)}}


def tp_layout(engine: Any) -> dict:
    """What the load needs to rebuild the optimizers' states before ``dcp.load``: per
    optimizer, per parameter name, each state's shape and dtype (scalars and tensors
    shaped like the parameter), and the param groups' settings."""
    _, states = _named_states(engine)
    return {"states": [{n: {k: (tuple(v.shape), v.dtype) for k, v in st.items()
                            if isinstance(v, torch.Tensor)} for n, st in s.items()}
                       for s in states],
            "groups": [o.state_dict()["param_groups"] for o in engine.optimizers]}


def load_tp_state(engine: Any, path: str, layout: dict) -> None:
    """Read the directory at ``path`` into ``engine``: its model and masters in place,
    each optimizer's states made like its parameters (``layout``, from ``tp_layout``)
    and loaded through ``load_state_dict`` with the saved param groups."""
    import torch.distributed.checkpoint as dcp

    ps = engine.param_state
    opt_params, _ = _named_states(engine)
    if len(layout["states"]) != len(engine.optimizers):
        raise ValueError(f"checkpoint holds {len(layout['states'])} optimizer(s), this "
                         f"engine has {len(engine.optimizers)}; build it as the run that "
                         "saved it did")
    made = []
    for saved in layout["states"]:
        missing = sorted(set(saved) - set(opt_params))
        if missing:
            raise ValueError(f"checkpoint has optimizer state for {missing[:3]}, which "
                             "this engine does not train; build the optimizer over the "
                             "same parameters as the run that saved it")
        made.append({n: {k: _like(opt_params[n], shape, dtype)
                         for k, (shape, dtype) in st.items()} for n, st in saved.items()})
    state = {"model": engine.module.state_dict(),
             "masters": dict(zip(ps.names, ps.masters)) if ps.has_master else {},
             "optim": {str(k): s for k, s in enumerate(made)}}
    dcp.load(state, checkpoint_id=path, no_dist=not torch.distributed.is_initialized())
    engine.module.load_state_dict(state["model"])
    name_of = {id(q): n for n, q in opt_params.items()}
    for o, st, groups in zip(engine.optimizers, made, layout["groups"]):
        order = [p for g in o.param_groups for p in g["params"]]
        o.load_state_dict({"state": {i: st[name_of[id(p)]] for i, p in enumerate(order)
                                     if name_of.get(id(p)) in st},
                           "param_groups": groups})


def _like(param: torch.Tensor, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """An empty state tensor for ``param``: shaped (and placed) like it where the
    saved state was, else a plain tensor of the saved shape (a step count)."""
    if tuple(shape) == tuple(param.shape):
        return torch.zeros_like(param, dtype=dtype)
    return torch.zeros(shape, dtype=dtype, device=getattr(param, "device", None))
