"""Checkpoints of pipeline stages that reload at another pipeline degree: each stage
writes its part of the model, its fp32 masters and its optimizers' states, keyed by
their names in the WHOLE model, into one ``torch.distributed.checkpoint`` directory;
a stage at any degree (or one process holding the whole model) reads exactly the
entries its parameters are named by.

The names are the stage module's own: a stage made the way torchtitan makes them, a
copy of the whole model with the other stages' layers deleted (``stage_module``),
keeps every parameter's name in the whole model. A rank holding several stages (the
interleaved schedules) gives the engine an ``nn.ModuleList`` of them: its entries are
its stages' own names, past the list's index. A stage built as a fresh
``nn.Sequential`` of some blocks renumbers them ("2.0.weight" becomes "0.0.weight"):
the save refuses names that two stages both hold, and the load names the entries a
stage needs that the directory lacks, or that no stage claimed.

``checkpoint_resharding`` writes and reads the directory (the atomic swap, settings,
counters, random streams); this module makes the state it holds: ``pp_state`` and
``pp_layout`` for the save, ``load_pp_state`` for the load. The optimizers' states
are keyed by parameter name, not by index, and each parameter keeps its param
group's settings, so they survive a re-split.
"""

from __future__ import annotations

import copy as copy_module
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["stage_module", "check_pp_savable", "pp_state", "pp_layout", "load_pp_state"]

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def stage_module(model: nn.Module, drop: Iterable[str], copy: bool = True) -> nn.Module:
    """``model`` (a copy of it, unless ``copy=False``) without the submodules at the
    dotted paths in ``drop`` (the other stages' layers: ``"layers.5"``, ``"head"``),
    every kept parameter under its name in the whole model. An entry of an
    ``nn.Sequential``, ``nn.ModuleList`` or ``nn.ModuleDict`` is removed (the container
    runs what is left; ``del seq[i]`` would renumber the rest); any other submodule
    becomes ``None``, for a forward that skips it (``if self.head is not None``).
    Build the whole model on the meta device where it is large, then ``to_empty``
    and initialise the stage."""
    out = copy_module.deepcopy(model) if copy else model
    for path in drop:
        parent_name, _, leaf = path.rpartition(".")
        try:
            parent = out.get_submodule(parent_name) if parent_name else out
        except AttributeError:
            parent = None
        if parent is None or leaf not in parent._modules:
            raise ValueError(f"stage_module: {path!r} is not a submodule of the model "
                             f"(its children: {', '.join(list(out._modules)[:8])}, ...)")
        if isinstance(parent, _CONTAINERS):
            del parent._modules[leaf]
        else:
            parent._modules[leaf] = None
    return out


def _stages(module: nn.Module) -> list[nn.Module]:
    """The stage modules of a rank: the ``nn.ModuleList`` of its stages (interleaved
    schedules; a ModuleList has no forward, so it is nothing else), or its one stage."""
    return list(module) if isinstance(module, nn.ModuleList) else [module]


def _entries(engine: Any) -> dict[str, torch.Tensor]:
    """The model entries of this rank's stage(s), by their names in the whole model."""
    out: dict[str, torch.Tensor] = {}
    for m in _stages(engine.module):
        out.update(m.state_dict())
    return out


def _whole(engine: Any, name: str) -> str:
    """A trained parameter's name in the whole model (past a ModuleList's index)."""
    return name.split(".", 1)[1] if isinstance(engine.module, nn.ModuleList) else name


def _group(engine: Any) -> Any:
    return getattr(engine.parallelism, "group", None) if engine.parallel else None


def _gather(engine: Any, obj: Any) -> list:
    """``obj`` of every rank of the pipeline group (this rank's alone in one process)."""
    if engine.parallel is None:
        return [obj]
    group = _group(engine)
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def check_pp_savable(engine: Any) -> None:
    """Refuse ``mixprec.optim``'s optimizers (their stream counter is the optimizer's,
    not a parameter's) and names that two stages both hold (stages that renumber the
    whole model's layers); a collective over the pipeline group."""
    if any(hasattr(o, "extra_state") for o in engine.optimizers):
        raise NotImplementedError(
            "save(path, reshardable=True) of pipeline stages takes torch's optimizers; "
            "mixprec.optim's states are not split by parameter name yet. Use save(path), "
            "one path per rank, which resumes at the same pipeline degree")
    tied = {_whole(engine, n) for n in getattr(engine.parallelism, "tied", ())}
    every = _gather(engine, [k for m in _stages(engine.module) for k in m.state_dict()
                             if k not in tied])
    seen: dict[str, int] = {}
    twice = []
    for stage, names in enumerate(every):
        for n in names:
            if n in seen:
                twice.append((n, seen[n], stage))
            seen[n] = stage
    if twice:
        n, a, b = twice[0]
        raise ValueError(
            f"save(path, reshardable=True): {len(twice)} name(s) are held by two pipeline "
            f"ranks (e.g. {n!r} by ranks {a} and {b}): the checkpoint keys each entry by "
            "its name in the whole model. Make each stage a copy of the whole model with "
            "the other stages' layers deleted (mixprec.checkpoint.pipeline.stage_module), "
            "not a fresh nn.Sequential that renumbers them; a weight tied across stages "
            "under one name goes in parallel_kwargs={'tied': [...]}")


def _named(engine: Any) -> tuple[dict[str, torch.Tensor], dict[int, str]]:
    """The optimized tensor of each trained parameter by name, and the names by id."""
    ps = engine.param_state
    opt_params = {_whole(engine, n): q for n, q in zip(ps.names, ps.opt_params)}
    return opt_params, {id(q): n for n, q in opt_params.items()}


def _masters(engine: Any) -> dict[str, torch.Tensor]:
    ps = engine.param_state
    return ({_whole(engine, n): m for n, m in zip(ps.names, ps.masters)}
            if ps.has_master else {})


def _tensors(st: dict) -> dict:
    return {k: v for k, v in st.items() if isinstance(v, torch.Tensor)}


def pp_state(engine: Any) -> dict:
    """What ``dcp.save`` writes for this stage: its model entries, its masters and its
    optimizers' tensor states, all keyed by name."""
    _, name_of = _named(engine)
    return {"model": _entries(engine), "masters": _masters(engine),
            "optim": {str(k): {name_of[id(p)]: _tensors(st) for p, st in o.state.items()}
                      for k, o in enumerate(engine.optimizers)}}


def _settings(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def pp_layout(engine: Any) -> dict:
    """The directory's map, gathered over the pipeline group (a collective): the
    pipeline degree, and per stage its model entries, each optimizer's states (a
    tensor's shape and dtype, other values as they are) and each trained parameter's
    param-group settings."""
    _, name_of = _named(engine)
    states, groups = [], []
    for o in engine.optimizers:
        states.append({name_of[id(p)]: {k: ((tuple(v.shape), v.dtype)
                                            if isinstance(v, torch.Tensor) else ("value", v))
                                        for k, v in st.items()}
                       for p, st in o.state.items()})
        groups.append({name_of[id(p)]: _settings(g) for g in o.param_groups
                       for p in g["params"] if id(p) in name_of})
    mine = {"names": list(_entries(engine)), "states": states, "groups": groups}
    stages = _gather(engine, mine)
    return {"degree": len(stages), "stages": stages}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu())))
    return a == b


def _check(engine: Any, md: dict, layout: dict) -> str | None:
    """What keeps this stage from loading the directory (None: nothing)."""
    have = _entries(engine)
    missing = [k for k in have if f"model.{k}" not in md]
    if missing:
        return (f"{len(missing)} model entries of this stage are in none of the "
                f"{layout['degree']} saved stage(s): {missing[:6]}")
    shaped = [k for k, v in have.items() if tuple(md[f"model.{k}"].size) != tuple(v.shape)]
    if shaped:
        k = shaped[0]
        return (f"{len(shaped)} entries of another shape, e.g. {k!r}: saved "
                f"{tuple(md[f'model.{k}'].size)}, here {tuple(have[k].shape)}")
    if len(layout["stages"][0]["states"]) != len(engine.optimizers):
        return (f"the checkpoint holds {len(layout['stages'][0]['states'])} optimizer(s) "
                f"per stage, this engine has {len(engine.optimizers)}")
    opt_params, name_of = _named(engine)
    for k, o in enumerate(engine.optimizers):
        saved = {n for s in layout["stages"] for n in s["states"][k]}
        trained = [name_of[id(p)] for g in o.param_groups for p in g["params"]
                   if id(p) in name_of]
        lacking = [n for n in trained if saved and n not in saved]
        if lacking:
            return f"optimizer {k} has no saved state for {lacking[:6]}"
        groups = {}
        for s in layout["stages"]:
            groups.update(s["groups"][k])
        for g in o.param_groups:
            names = [name_of[id(p)] for p in g["params"] if id(p) in name_of]
            got = [groups[n] for n in names if n in groups]
            if len(got) != len(names):
                return (f"optimizer {k} has no saved param-group settings for "
                        f"{[n for n in names if n not in groups][:6]}")
            if any(set(s) != set(got[0]) or not all(_same(s[x], got[0][x]) for x in s)
                   for s in got[1:]):
                return (f"a param group of optimizer {k} holds {names[:4]}..., which the "
                        "saved run trained with other settings (other param groups)")
    return None


def load_pp_state(engine: Any, path: str, layout: dict) -> None:
    """Read this stage's entries of the directory at ``path`` into ``engine``: model
    and masters in place, each optimizer's states by name (made like its parameters
    from ``layout``) with the saved param-group settings. Everything is checked first,
    over the whole pipeline group (a collective), so a refused load changes nothing on
    any stage: a stage's entries the directory lacks, or the directory's entries no
    stage claims, are named."""
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    error = _check(engine, md, layout)
    every = _gather(engine, {"names": list(_entries(engine)), "error": error})
    errors = [f"stage on rank {r}: {e['error']}" for r, e in enumerate(every) if e["error"]]
    claimed = {n for e in every for n in e["names"]}
    unclaimed = sorted({n for s in layout["stages"] for n in s["names"]} - claimed)
    if unclaimed and not errors:
        errors.append(f"{len(unclaimed)} saved model entries belong to no stage here: "
                      f"{unclaimed[:6]}")
    if errors:
        raise ValueError(
            f"{path!r} (saved by {layout['degree']} pipeline stage(s)) does not cover this "
            f"model: {'; '.join(errors)}. The stages find their entries by their names in "
            "the whole model: build each stage as a copy of the whole model with the other "
            "stages' layers deleted (mixprec.checkpoint.pipeline.stage_module), the same "
            "model and optimizer as the run that saved it. Nothing was loaded")
    opt_params, name_of = _named(engine)
    made, values = [], []
    for k, o in enumerate(engine.optimizers):
        saved = {}
        for s in layout["stages"]:
            saved.update(s["states"][k])
        mine = [name_of[id(p)] for g in o.param_groups for p in g["params"]
                if id(p) in name_of and name_of[id(p)] in saved]
        made.append({n: {x: _like(opt_params[n], *sd) for x, sd in saved[n].items()
                         if sd[0] != "value"} for n in mine})
        values.append({n: {x: sd[1] for x, sd in saved[n].items() if sd[0] == "value"}
                       for n in mine})
    state = {"model": _entries(engine), "masters": _masters(engine),
             "optim": {str(k): s for k, s in enumerate(made)}}
    dcp.load(state, checkpoint_id=path, no_dist=engine.parallel is None)
    for m in _stages(engine.module):
        m.load_state_dict({k: state["model"][k] for k in m.state_dict()})
    for k, o in enumerate(engine.optimizers):
        groups = {}
        for s in layout["stages"]:
            groups.update(s["groups"][k])
        order = [p for g in o.param_groups for p in g["params"]]
        index = {id(p): i for i, p in enumerate(order)}
        o.load_state_dict({
            "state": {index[id(opt_params[n])]: {**made[k][n], **values[k][n]}
                      for n in made[k]},
            "param_groups": [{**groups[name_of[id(g["params"][0])]],
                              "params": [index[id(p)] for p in g["params"]]}
                             if g["params"] and id(g["params"][0]) in name_of
                             else {**_settings(g), "params": [index[id(p)]
                                                              for p in g["params"]]}
                             for g in o.param_groups]})


def _like(param: torch.Tensor, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """An empty state tensor for ``param``: on its device, of the saved shape."""
    return torch.zeros(shape, dtype=dtype, device=param.device)
