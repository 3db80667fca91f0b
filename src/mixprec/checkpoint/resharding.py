"""Reshardable checkpoints for FSDP: a ``torch.distributed.checkpoint`` directory that
FSDP resumes on any number of ranks, each rank writing and reading only its pieces.
A tensor-parallel engine's directory resumes at any degree
(``mixprec.checkpoint.tensor_parallel``), pipeline stages' at any pipeline degree or in
one process (``mixprec.checkpoint.pipeline``).

``save_resharding`` (``MixedPrecision.save(path, reshardable=True)``) assembles the
directory in ``PATH.partial`` and renames it over ``PATH``, keeping a previous one at
``PATH.old`` during the swap; ``restore_resharding`` (``MixedPrecision.load`` of a
directory) falls back to ``PATH.old`` after a crash between the renames. The engine's
settings, counters, every rank's random streams and the extras travel in
``engine.pt`` inside the directory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mixprec.checkpoint.compat import stale_model_keys
from mixprec.checkpoint.core import (
    _not_mid_accumulation,
    _on_rank0,
    _restore_counters,
    _restore_rng,
    _run_settings,
    _same_model,
    load_checkpoint,
    rng_entry,
    save_atomic,
)
from mixprec.checkpoint.pipeline import check_pp_savable, load_pp_state, pp_layout, pp_state
from mixprec.checkpoint.tensor_parallel import check_tp_savable, load_tp_state, tp_layout, tp_state

__all__ = ["save_resharding", "restore_resharding", "is_resharding"]


def _require_fsdp(engine, what: str, pipeline: bool = True) -> None:
    if not (engine.parallelism.sharded or _tensor_parallel(engine)
            or (pipeline and _pipeline(engine))):
        raise ValueError(
            f"{what} is for parallel='fsdp', a tensor-parallel model, pipeline stages "
            f"(parallel='pp') or one process (parallel=None); this engine runs "
            f"parallel={engine.parallel!r}. Use save(path) / load(path): without "
            "sharding a checkpoint is whole and loads at any world size already")


def _pipeline(engine) -> bool:
    """Pipeline stages, or one process holding the whole model (``mixprec.checkpoint.
    pipeline`` makes their state)."""
    return engine.parallel in ("pp", None)


def _tensor_parallel(engine) -> bool:
    """A tensor-parallel engine without FSDP (``checkpoint_tp`` makes its state)."""
    return engine.parallel == "tp"


def is_resharding(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a reshardable directory (or one whose swap a crash cut
    short, leaving ``PATH.old``)."""
    return os.path.isdir(path) or os.path.isdir(f"{path}.old")


def save_resharding(engine: Any, path: str | os.PathLike[str], extra: dict,
                    rng_state: bool = True) -> None:
    """``MixedPrecision.save(path, reshardable=True)``: a directory written with
    ``torch.distributed.checkpoint`` (every rank its own shards) and ``engine.pt``
    (recipe, scaler, counters, schedulers, every rank's random streams unless
    ``rng_state`` is False, extras), assembled in ``PATH.partial`` and
    renamed over ``path``; a previous checkpoint is kept at ``PATH.old`` during the swap,
    and ``restore_resharding`` falls back to it if a crash came between the renames."""
    import shutil

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    _require_fsdp(engine, "save(path, reshardable=True)")
    pp = _pipeline(engine)
    if _tensor_parallel(engine):
        check_tp_savable(engine)
    if pp:
        check_pp_savable(engine)
    _not_mid_accumulation(engine)
    engine.settle()  # the schedulers count the last step
    if not pp and any(not o.state for o in engine.optimizers):
        raise ValueError("save(path, reshardable=True) before the first step: the "
                         "optimizer has no state yet (torch's get_state_dict would create "
                         "it with a zero-learning-rate step); save after a step, or use "
                         "save(path, full=True)")
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    old = path.with_name(path.name + ".old")
    single = engine.parallel is None
    if single or dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
    if not single:
        dist.barrier()
    streams = rng_entry(engine, gather=not single) if rng_state else None
    tp = _tensor_parallel(engine)
    if pp:
        dcp.save(pp_state(engine), checkpoint_id=str(partial), no_dist=single)
    elif tp:
        dcp.save(tp_state(engine), checkpoint_id=str(partial))
    else:
        model_sd, optim_sd = get_state_dict(engine.module, engine.optimizers)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(partial))
    meta = {"recipe": engine.recipe, "emulating": engine.emulating,
            "kernels": engine.kernels.as_dict(),
            "world_size": engine.world_size, "parallel": engine.parallel,
            "layout": "reshardable", "scaler": engine.scaler.state_dict(),
            "steps": engine.steps, "schedulers": [s.state_dict() for s in engine.schedulers],
            # what dcp's optimizer state dict drops (mixprec.optim's stream counter)
            "optim_extra": [o.extra_state() if hasattr(o, "extra_state") else None
                            for o in engine.optimizers],
            "tp_layout": tp_layout(engine) if tp else None,
            "pp_layout": pp_layout(engine) if pp else None}

    def finish():
        save_atomic({"engine": meta, "extra": extra, "rng": streams},
                    partial / "engine.pt")
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            os.replace(path, old)
        os.replace(partial, path)
        shutil.rmtree(old, ignore_errors=True)

    if single:
        finish()
    else:
        _on_rank0(finish, path)


def restore_resharding(engine: Any, path: str | os.PathLike[str],
                       rng_state: bool = True) -> dict:
    """``MixedPrecision.load`` of a ``reshardable`` directory, under FSDP at any world
    size. Recipe, emulation, the model's keys and shapes and the optimizer's entries are
    checked against the directory's metadata before anything is read into the engine.
    Returns the extras."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    if not (path / "engine.pt").exists() and (path.with_name(path.name + ".old")
                                              / "engine.pt").exists():
        path = path.with_name(path.name + ".old")  # a crash came between the renames
    saved = load_checkpoint(path / "engine.pt")
    meta = saved["engine"]
    _run_settings(meta, engine.recipe, engine.emulating)
    if meta.get("pp_layout") is not None or engine.parallel == "pp":
        return _restore_pp(engine, path, saved, rng_state)
    layout = meta.get("tp_layout")
    if layout is not None and not engine.parallelism.sharded:
        return _restore_tp(engine, path, saved, rng_state)
    if layout is not None or _tensor_parallel(engine):
        by, where = (("a tensor-parallel engine without FSDP",
                      "under tensor parallelism or in one process") if layout is not None
                     else ("an FSDP engine", "under parallel='fsdp'"))
        raise ValueError(f"{str(path)!r} was saved by {by}: load it {where} (at any "
                         f"degree); this engine runs parallel={engine.parallel!r}")
    _require_fsdp(engine, "a reshardable checkpoint", pipeline=False)
    md = _same_model_as(engine, path)
    trained = [n for n, p in engine.module.named_parameters() if p.requires_grad]
    missing = [n for n in trained if not any(k.startswith(f"optim.state.{n}.") for k in md)]
    if missing:
        raise ValueError(
            f"checkpoint has no optimizer state for {missing[:3]} ({len(missing)} "
            "parameter(s)); build the optimizer over the same parameters as the run that "
            "saved it")
    for o, e in zip(engine.optimizers, meta.get("optim_extra", [])):
        if e is not None and hasattr(o, "check_extra_state"):
            o.check_extra_state(e, reshardable=True)
    for o in engine.optimizers:  # dcp fills the entries that exist: make them all
        if hasattr(o, "materialize_states"):
            o.materialize_states()
    model_sd, optim_sd = get_state_dict(engine.module, engine.optimizers)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(engine.module, engine.optimizers, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    for o, e in zip(engine.optimizers, meta.get("optim_extra", [])):
        if e is not None and hasattr(o, "load_extra_state"):
            o.load_extra_state(e)
    _restore_counters(engine, meta)
    if rng_state:
        _restore_rng(engine, saved, path)
    return dict(saved.get("extra", {}))


def _restore_tp(engine: Any, path: Path, saved: dict, rng_state: bool) -> dict:
    """The load of a directory a tensor-parallel engine without FSDP wrote
    (``checkpoint_tp``), at any tensor-parallel degree or in one process."""
    meta = saved["engine"]
    _same_model_as(engine, path)
    load_tp_state(engine, str(path), meta["tp_layout"])
    _restore_counters(engine, meta)
    if rng_state:
        _restore_rng(engine, saved, path)
    return dict(saved.get("extra", {}))


def _restore_pp(engine: Any, path: Path, saved: dict, rng_state: bool) -> dict:
    """The load of a directory pipeline stages (or one process) wrote, by stages at
    any pipeline degree or by one process holding the whole model."""
    meta = saved["engine"]
    layout = meta.get("pp_layout")
    if layout is None or not _pipeline(engine):
        by = ("pipeline stages or one process" if layout is not None
              else f"an engine under parallel={meta.get('parallel')!r}")
        where = ("under parallel='pp' (any degree) or in one process" if layout is not None
                 else "under the layout that saved it (FSDP or tensor parallelism)")
        raise ValueError(f"{str(path)!r} was saved by {by}: load it {where}; this engine "
                         f"runs parallel={engine.parallel!r}")
    load_pp_state(engine, str(path), layout)
    _restore_counters(engine, meta)
    if rng_state:
        _restore_pp_rng(engine, saved, path)
    return dict(saved.get("extra", {}))


def _restore_pp_rng(engine: Any, saved: dict, path: Path) -> None:
    """This rank's streams, where the saving run had this rank; else (a deeper
    pipeline than the one that saved) one warning, and the streams stay."""
    import warnings

    import torch.distributed as dist

    streams = saved.get("rng")
    if streams is None:
        return
    rank = dist.get_rank() if engine.parallel is not None else 0
    if rank in streams["ranks"]:
        _restore_rng(engine, saved, path)
        return
    warnings.warn(
        f"{str(path)!r} holds the random streams of {len(streams['ranks'])} rank(s), "
        f"not of rank {rank}: this rank keeps its current streams (dropout draws other "
        "masks than a run at the saved pipeline degree would)", stacklevel=4)


def _same_model_as(engine: Any, path: Path) -> dict:
    """Raise unless the directory's model entries match ``engine``'s keys and shapes
    (entries a newer layout dropped aside); returns the directory's metadata."""
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    have = {f"model.{k}": tuple(v.shape) for k, v in engine.module.state_dict().items()}
    got = {k: tuple(m.size) for k, m in md.items()
           if k.startswith("model.") and hasattr(m, "size")}
    stale = stale_model_keys(engine.module, (k[len("model."):] for k in got))
    _same_model(have, {k: v for k, v in got.items() if k[len("model."):] not in stale})
    return md
