"""Atomic checkpoints of the engine's parts: a crash or a full disk never leaves a torn
checkpoint, nor a temp file, behind.

``save_atomic`` writes to a temp file beside ``path``, fsyncs it, renames it over ``path``
(atomic on POSIX) and fsyncs the folder, so ``path`` is always either the previous
complete file or the new complete file; a write that fails removes the temp file.
``load_checkpoint`` reads with ``weights_only=True`` and turns a truncated or corrupt
file into a ``CheckpointError`` that says nothing was changed. The engine's checkpoint
methods live here: ``engine_state`` (``state_dict``), ``save_engine`` (``save``),
``restore_engine`` (``load_state_dict``, after ``check_engine_state`` has checked
everything it can before anything changes), and ``fp32_weights`` (``fp32_state_dict``).
A file that ``save`` writes also holds the random streams (``mixprec.checkpoint.rng``) of the rank
that wrote it, or of every rank where the save is a collective (``full=True`` under DDP
or FSDP); ``load`` restores this rank's. What older versions' checkpoints lack is read by
``mixprec.checkpoint.compat``.

Layouts. A checkpoint of a single process or of DDP holds every tensor whole (layout
``"full"``): DDP's replicas are identical, so it loads at any world size, with or
without ``parallel=``. One of FSDP holds this rank's shards (``"sharded"``) and loads
only into FSDP at the same world size; ``state_dict(full=True)`` gathers the shards
(``gather_full``) into a ``"full"`` checkpoint, and loading a full checkpoint under FSDP
cuts each tensor to this rank's shard (``shard_full_state``). A third form, for FSDP,
neither gathers nor stays tied to its world size: ``save(path, reshardable=True)``
(``mixprec.checkpoint.resharding``).
"""

from __future__ import annotations

import errno
import importlib
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec.checkpoint import rng
from mixprec.checkpoint.compat import saved_layout, stale_model_keys, warn_no_random_streams
from mixprec.engine.param_state import ParamState
from mixprec.engine.switch import enter_saved_phase, phase_entry
from mixprec.experts import experts_formats
from mixprec.modules.linear import fp8_modules, scaling_buffers
from mixprec.parallel.comm import gather_full
from mixprec.parallel.layouts import has_dtensor_params
from mixprec.recipe import Recipe

# the ``engine`` arguments below are a ``mixprec.engine.facade.MixedPrecision``, typed ``Any``:
# this module sits below the engine and imports nothing of it, not even for types

__all__ = ["CheckpointError", "save_atomic", "load_checkpoint", "check_engine_state",
           "engine_state", "save_engine", "load_engine", "restore_engine", "fp32_weights",
           "gather_full", "shard_full_state", "rng_entry"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: unreadable, or from another run's settings."""


def save_atomic(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save`` to a temp file, fsync, rename over ``path``, fsync the folder.
    The temp file's name holds the process id, so ranks that write the same path at
    once each rename a whole file (the last one wins) instead of interleaving bytes.
    On any failure the temp file is removed and ``path`` is left as it was; an
    ``OSError`` (a full disk, a file-size limit, no permission) is raised again with the
    path and the cause in its message."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        if isinstance(e, OSError) and e.errno is not None:
            raise type(e)(e.errno, _write_failure(path, e)) from e
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_failure(path: Path, e: OSError) -> str:
    cause = {errno.ENOSPC: "the disk is full", errno.EFBIG: "the file is larger than this "
             "process may write (a file-size limit or the file system's)",
             errno.EDQUOT: "the disk quota is used up", errno.EACCES: "no permission to "
             "write in its folder", errno.EROFS: "the file system is read-only"}.get(
                 e.errno, e.strerror or "an error of the file system")
    return (f"could not write the checkpoint {str(path)!r}: {cause} ({e.strerror}). "
            "The temp file was removed and the previous checkpoint, if any, is intact")


def load_checkpoint(path: str | os.PathLike[str]) -> dict:
    """``torch.load(path, weights_only=True)``, or a ``CheckpointError`` with the fix.
    FSDP checkpoints hold DTensors, whose module (1.5 s to import) is loaded only for
    a file that needs it."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {str(path)!r}")
    try:
        try:
            return torch.load(path, weights_only=True)
        except Exception as e:
            if "DTensor" not in str(e) or "torch.distributed.tensor" in sys.modules:
                raise
            importlib.import_module("torch.distributed.tensor")  # registers DTensor
            return torch.load(path, weights_only=True)
    except Exception as e:  # truncated zip, bad pickle, ...
        raise CheckpointError(
            f"checkpoint {str(path)!r} is unreadable ({type(e).__name__}: {e}); it may be "
            "truncated or corrupt. Nothing was changed: delete it to start over") from None


def check_engine_state(state: dict, recipe: Recipe, emulating: bool, world_size: int,
                       parallel: str | None, optimizers: list[torch.optim.Optimizer],
                       module: nn.Module) -> None:
    """Raise, naming both sides, unless ``state`` (``MixedPrecision.state_dict()``) can
    resume this engine: same recipe, emulation, optimizers and their param groups' sizes,
    model keys and shapes; and for FSDP shards, FSDP at the same world size. torch's
    ``load_state_dict`` copies tensor by tensor and complains at the end; checking first
    means a refused checkpoint changes nothing."""
    _run_settings(state, recipe, emulating)
    saved_ws = state.get("world_size", 1)
    if saved_layout(state) == "sharded" and (saved_ws != world_size or parallel != "fsdp"):
        here = f"parallel={parallel!r}" + (f" on {world_size} rank(s)" if parallel else "")
        raise ValueError(
            f"checkpoint holds the FSDP shards of {saved_ws} rank(s) but this engine runs "
            f"{here}; resume with parallel='fsdp' and --nproc-per-node {saved_ws}, or save "
            "it whole with engine.save(path, full=True) (every rank calls it; it gathers "
            "the shards), which loads at any world size, with or without FSDP")
    # the model first: another model also has other param groups, and the model is
    # what the user should hear about
    stale = stale_model_keys(module, state["model"])
    _same_model({k: tuple(v.shape) for k, v in module.state_dict().items()},
                {k: tuple(v.shape) for k, v in state["model"].items() if k not in stale})
    if len(state["optimizers"]) != len(optimizers):
        raise ValueError(f"checkpoint has {len(state['optimizers'])} optimizer(s), this "
                         f"engine has {len(optimizers)}")
    for i, (o, s) in enumerate(zip(optimizers, state["optimizers"])):
        have_groups = [len(g["params"]) for g in o.param_groups]
        got_groups = [len(g["params"]) for g in s["param_groups"]]
        if have_groups != got_groups:
            raise ValueError(
                f"optimizer {i} of the checkpoint has param groups of {got_groups} "
                f"parameters, this engine's has {have_groups}; build the optimizer over "
                "the same parameters, in the same groups, as the run that saved it")


def fp32_weights(module: nn.Module, param_state: ParamState) -> dict[str, torch.Tensor]:
    """``module``'s state in fp32 with each working parameter replaced by its fp32
    master (``param_state``: the engine's ``ParamState``), other floating tensors
    upcast exactly, and the fp8 scaling buffers left out."""
    master_of = ({id(w): m for w, m in zip(param_state.working, param_state.masters)}
                 if param_state.has_master else {})
    scaled = {**fp8_modules(module), **experts_formats(module)}
    fp8_keys = {f"{name}.{b}" if name else b
                for name, m in scaled.items() for b in scaling_buffers(m)}
    out = {}
    for k, v in module.state_dict(keep_vars=True).items():
        if k in fp8_keys:
            continue
        v = master_of.get(id(v), v).detach()
        out[k] = (v.float() if v.is_floating_point() and v.dtype != torch.float64
                  else v).clone()
    return out


def load_fp32_weights(engine, weights: dict) -> None:
    """``MixedPrecision.load_fp32_state_dict``: ``fp32_weights``' keys and shapes, whole
    tensors; masters take them exactly, the working copy their rounding (as after an
    update), other entries load as they are. Checked before anything changes."""
    _not_mid_accumulation(engine)
    module, ps = engine.module, engine.param_state
    have = module.state_dict()
    expected = {k: tuple(have[k].shape) for k in fp32_weights(module, ps)}
    _same_model(expected, {k: tuple(v.shape) for k, v in weights.items()})
    new = {k: _like(weights[k], have[k]) for k in expected}
    with torch.no_grad():
        if ps.has_master:
            for name, m in zip(ps.names, ps.masters, strict=True):
                m.copy_(new[name])
        module.load_state_dict(new, strict=False)  # fp8 scaling state stays as it is
        ps.refresh_working()


def _like(full, like, rows: bool = False):
    """``full`` cut to ``like``'s shard when ``like`` is a DTensor of its shape; with
    ``rows``, of its dim 0 (``mixprec.optim``'s block states, sharded with the rows of
    their parameter)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    fits = (full.ndim >= 1 and like.ndim >= 1 and full.shape[0] == like.shape[0]
            if rows else full.shape == like.shape) if isinstance(full, torch.Tensor) else False
    if (isinstance(like, DTensor) and isinstance(full, torch.Tensor)
            and not isinstance(full, DTensor) and fits):
        # every rank read the same file: each keeps its own piece, no communication
        return distribute_tensor(full.to(like.device), like.device_mesh, like.placements,
                                 src_data_rank=None)
    return full


def shard_full_state(state: dict, module: nn.Module, trainable: list,
                     optimizers: list[torch.optim.Optimizer]) -> dict:
    """A ``"full"`` engine state with each tensor cut like its DTensor counterpart (an
    FSDP shard, a tensor-parallel plan's): model entries like ``module``'s, ``masters``
    like the ``trainable`` parameters, optimizer state like the parameter it belongs
    to; whole tensors stay whole. Returns
    new dicts; ``state`` is left as it was."""
    have = module.state_dict()
    out = dict(state)
    out["model"] = {k: _like(v, have[k]) for k, v in state["model"].items()}
    if state.get("masters") is not None:
        out["masters"] = [_like(m, p) for m, p in zip(state["masters"], trainable,
                                                      strict=True)]
    opts = []
    for o, s in zip(optimizers, state["optimizers"]):
        params = [p for g in o.param_groups for p in g["params"]]
        opts.append({**s, "state": {
            i: {k: v if k == "step" else _like(v, params[i], rows=True)
                for k, v in st.items()}
            for i, st in s["state"].items()}})
    out["optimizers"] = opts
    return out


def _not_mid_accumulation(engine) -> None:
    if engine.counters.micro:
        raise RuntimeError("a checkpoint in the middle of gradient accumulation: save "
                           "after step() has updated the weights")


def _restore_counters(engine, state: dict) -> None:
    """The last part of every restore: scaler, schedulers, step count; then the
    engine's own bookkeeping (the writes above were ours; no gradients carried)."""
    engine.scaler.load_state_dict(state["scaler"])
    for sch, s in zip(engine.schedulers, state.get("schedulers", [])):
        sch.load_state_dict(s)
    engine.counters.restore(state["steps"])
    engine.param_state.mark_working()
    engine.zero_grad()
    engine.parallelism.after_restore(engine.fp8_modules)


def engine_state(engine: Any, full: bool) -> dict:
    """``MixedPrecision.state_dict(full)``: recipe, layout, model, masters, optimizers,
    scaler, counters and schedulers."""
    _not_mid_accumulation(engine)
    engine.settle()  # the schedulers count the last step
    fsdp = engine.parallelism.sharded
    state = {
        "recipe": engine.recipe,
        "emulating": engine.emulating,
        "kernels": engine.kernels.as_dict(),  # the choices the run's numerics followed
        "world_size": engine.world_size,
        "parallel": engine.parallel,
        "layout": "sharded" if fsdp and not full else "full",
        "model": engine.module.state_dict(),
        "masters": ([m.detach().clone() for m in engine.param_state.masters]
                    if engine.param_state.has_master else None),
        "optimizers": [o.state_dict() for o in engine.optimizers],
        "scaler": engine.scaler.state_dict(),
        "steps": engine.steps,
        "schedulers": [s.state_dict() for s in engine.schedulers],
        # the precision schedule and its phase (mixprec.engine.switch), where there is one
        "phase": phase_entry(engine),
    }
    return engine.parallelism.gather(state) if full else state


def save_engine(engine: Any, path: str | os.PathLike[str], full: bool,
                extra: dict, rng_state: bool = True) -> None:
    """``MixedPrecision.save``: atomically, from this rank, with this rank's random
    streams. Under DDP or FSDP with ``full`` (every rank calls it): every rank's streams
    (and under FSDP the gathered shards), written by rank 0, the outcome shared so that
    every rank raises if the write failed (none is left waiting)."""
    collective = full and engine.parallel is not None
    streams = rng_entry(engine, gather=collective) if rng_state else None
    state = {"engine": engine_state(engine, full), "extra": extra, "rng": streams}
    if not collective:
        save_atomic(state, path)
        return
    _on_rank0(lambda: save_atomic(state, path), path)


def rng_entry(engine: Any, gather: bool) -> dict:
    """``{"world_size": W, "ranks": {rank: mixprec.checkpoint.rng.capture()}}``: this
    rank's streams, or with ``gather`` every rank's (a collective: every rank calls it)."""
    import torch.distributed as dist

    mine = rng.capture()
    if engine.parallel is None:
        return {"world_size": 1, "ranks": {0: mine}}
    if not gather:
        return {"world_size": engine.world_size, "ranks": {dist.get_rank(): mine}}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {"world_size": engine.world_size, "ranks": dict(enumerate(every))}


def _restore_rng(engine: Any, saved: dict, path) -> None:
    """This rank's streams from a file ``save`` wrote. A file saved with ``rng=False``
    holds None (nothing to do); one written before streams were saved has no entry
    (one warning: dropout will draw other masks than the uninterrupted run)."""
    import torch.distributed as dist

    if "rng" not in saved:
        warn_no_random_streams(path)
        return
    rank = dist.get_rank() if engine.parallel is not None else 0
    mine = rng.for_rank(saved["rng"], rank)
    if mine is not None:
        rng.restore(mine)


def _on_rank0(write, path) -> None:
    """Run ``write`` on rank 0 and tell every rank how it went: a failure raises on
    every rank (none is left waiting for a file that will not come)."""
    import torch.distributed as dist

    error = [None]
    if dist.get_rank() == 0:
        try:
            write()
        except Exception as e:
            error = [f"{type(e).__name__}: {e}"]
    dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise RuntimeError(f"rank 0 could not write the checkpoint {str(path)!r} "
                           f"({error[0]}); the previous one, if any, is intact")


def load_engine(engine: Any, path: str | os.PathLike[str], rng_state: bool = True) -> dict:
    """``MixedPrecision.load`` of a file ``save`` wrote (a ``reshardable`` directory:
    ``mixprec.checkpoint.resharding``); restores this rank's random streams last
    (unless ``rng_state`` is False) and returns the extras."""
    state = load_checkpoint(path)
    if not isinstance(state, dict) or "engine" not in state:
        raise CheckpointError(f"{str(path)!r} was not written by MixedPrecision.save "
                              "(no 'engine' entry); use load_state_dict for other files")
    restore_engine(engine, state["engine"])
    if rng_state:
        _restore_rng(engine, state, path)
    return dict(state.get("extra", {}))


def restore_engine(engine: Any, state: dict) -> None:
    """``MixedPrecision.load_state_dict``: check, then load. Masters cross layouts:
    under FSDP the fp32 shards are the masters; a ``-master`` recipe elsewhere keeps
    them beside its low-precision working copy. A scheduled engine first enters the
    phase the checkpoint was saved in."""
    enter_saved_phase(engine, state)
    check_engine_state(state, engine.recipe, engine.emulating, engine.world_size,
                       engine.parallel, engine.optimizers, engine.module)
    ps = engine.param_state
    masters = state["masters"]
    if ps.has_master and masters is None:
        # saved under FSDP, whose fp32 parameters were the masters
        masters = [state["model"][n] for n in ps.names]
    if saved_layout(state) == "full" and (engine.parallelism.sharded
                                          or has_dtensor_params(engine.module)):
        state = shard_full_state({**state, "masters": masters}, engine.module,
                                 ps.working, engine.optimizers)
        masters = state["masters"]
    engine.module.load_state_dict(state["model"])
    with torch.no_grad():
        if ps.has_master:
            for m, s in zip(ps.masters, masters, strict=True):
                m.copy_(s)
        elif masters is not None:
            # saved with a low-precision working copy: the model entries are its
            # rounding, the masters are the values (here FSDP's fp32 shards)
            for p, s in zip(ps.working, masters, strict=True):
                p.copy_(s)
    for o, s in zip(engine.optimizers, state["optimizers"]):
        o.load_state_dict(s)
    _restore_counters(engine, state)


def _run_settings(state: dict, recipe, emulating: bool) -> None:
    """The recipe and emulation checks of ``check_engine_state``.

    The recipes must agree but for ``emulate``: the weights and states of an emulated
    run are in the same formats as a real one's (fp32 tensors holding the format's
    values), so a run saved where ``emulate=auto`` resolved one way resumes where it
    resolves the other, with one warning (from there on the kernels round as this
    device's do). Only a recipe that pins ``emulate`` to the other value is refused."""
    saved = state.get("recipe")
    if saved is not None and not isinstance(saved, Recipe):
        saved = Recipe.coerce(saved)
    if saved is None or saved.replace(emulate=recipe.precision.emulate) != recipe:
        raise ValueError(
            f"checkpoint was saved with recipe {str(saved)!r} but this engine runs "
            f"{str(recipe)!r}; build the engine with the checkpoint's recipe")
    was = state.get("emulating", emulating)
    if was == emulating:
        return
    on = {True: "on", False: "off"}
    how = "mixprec emulates it" if emulating else "this device's kernels do"
    if recipe.precision.emulate is not None:
        raise ValueError(
            f"checkpoint was trained with emulation {on[was]} but this recipe pins "
            f"emulate={str(recipe.precision.emulate).lower()}; set emulate={str(was).lower()} to "
            "resume with the same numerics, or leave emulate to auto to resume with this "
            "device's kernels")
    warnings.warn(
        f"checkpoint was trained with emulation {on[was]}; on this device emulate=auto "
        f"resolves to {on[emulating]}. The weights and optimizer states are in the same "
        f"formats and resume as saved; from here on {recipe.precision.compute} rounds as "
        f"{how}. Set "
        f"emulate={str(was).lower()} in the recipe to keep the saved numerics.",
        stacklevel=4)


def _same_model(have: dict, got: dict) -> None:
    """Raise unless the model keys and shapes ``have`` and ``got`` agree."""
    if have != got:
        diff = sorted(set(have) ^ set(got)) or sorted(k for k in have if have[k] != got[k])
        raise ValueError(
            f"checkpoint's model does not match this model ({len(diff)} key(s) missing, "
            f"extra or of another shape, e.g. {diff[:3]}); nothing was loaded")
