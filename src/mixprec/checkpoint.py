"""Atomic checkpoint files: a crash mid-write never leaves a torn checkpoint behind.

``save_atomic`` writes to ``<path>.tmp``, fsyncs it, renames it over ``path`` (atomic on
POSIX) and fsyncs the folder, so ``path`` is always either the previous complete file or
the new complete file. ``load_checkpoint`` reads with ``weights_only=True`` and turns a
truncated or corrupt file into a ``CheckpointError`` that says nothing was changed.
``MixedPrecision.save`` / ``MixedPrecision.load`` use both; ``check_engine_state`` is
what ``MixedPrecision.load_state_dict`` checks before it changes anything, and
``fp32_weights`` is ``MixedPrecision.fp32_state_dict``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

__all__ = ["CheckpointError", "save_atomic", "load_checkpoint", "check_engine_state",
           "fp32_weights"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: unreadable, or from another run's settings."""


def save_atomic(obj, path: str | Path) -> None:
    """``torch.save`` to a temp file, fsync, rename over ``path``, fsync the folder."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint(path: str | Path) -> dict:
    """``torch.load(path, weights_only=True)``, or a ``CheckpointError`` with the fix."""
    import torch.distributed.tensor  # noqa: F401  (FSDP checkpoints hold DTensors)

    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {str(path)!r}")
    try:
        return torch.load(path, weights_only=True)
    except Exception as e:  # truncated zip, bad pickle, ...
        raise CheckpointError(
            f"checkpoint {str(path)!r} is unreadable ({type(e).__name__}: {e}); it may be "
            "truncated or corrupt. Nothing was changed: delete it to start over") from None


def check_engine_state(state: dict, recipe, emulating: bool, world_size: int,
                       n_optimizers: int, module: nn.Module) -> None:
    """Raise, naming both sides, unless ``state`` (``MixedPrecision.state_dict()``) was
    saved by an engine like this one: recipe, emulation, world size, optimizer count,
    and the model's keys and shapes. torch's ``load_state_dict`` copies tensor by tensor
    and complains at the end; checking first means a refused checkpoint changes nothing."""
    saved = state.get("recipe")
    if saved != recipe:
        raise ValueError(
            f"checkpoint was saved with recipe {str(saved)!r} but this engine runs "
            f"{str(recipe)!r}; build the engine with the checkpoint's recipe")
    if state.get("emulating", emulating) != emulating:
        raise ValueError(
            f"checkpoint was trained with emulation {'on' if state['emulating'] else 'off'}"
            f" but this engine resolved emulate=auto to {'on' if emulating else 'off'}"
            f"; set emulate={'true' if state['emulating'] else 'false'} in the recipe to "
            "resume with the same numerics")
    saved_ws = state.get("world_size", 1)
    if saved_ws != world_size:
        raise ValueError(
            f"checkpoint was saved by {saved_ws} rank(s) but this run has "
            f"{world_size}; resharding is not supported: resume with "
            f"--nproc-per-node {saved_ws}")
    if len(state["optimizers"]) != n_optimizers:
        raise ValueError(f"checkpoint has {len(state['optimizers'])} optimizer(s), this "
                         f"engine has {n_optimizers}")
    have = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in state["model"].items()}
    if have != got:
        diff = sorted(set(have) ^ set(got)) or sorted(k for k in have if have[k] != got[k])
        raise ValueError(
            f"checkpoint's model does not match this model ({len(diff)} key(s) missing, "
            f"extra or of another shape, e.g. {diff[:3]}); nothing was loaded")


def fp32_weights(module: nn.Module, grads) -> dict[str, torch.Tensor]:
    """``module``'s state in fp32 with each working parameter replaced by its fp32
    master (``grads``: the engine's ``GradState``), other floating tensors upcast
    exactly, and the fp8 scaling buffers left out."""
    from mixprec.fp8.linear import Float8Linear

    master_of = ({id(w): m for w, m in zip(grads.working, grads.masters)}
                 if grads.has_master else {})
    fp8_keys = {f"{name}.{b}" if name else b
                for name, m in module.named_modules() if isinstance(m, Float8Linear)
                for b in ("fp8_amax_history", "fp8_scale")}
    out = {}
    for k, v in module.state_dict(keep_vars=True).items():
        if k in fp8_keys:
            continue
        v = master_of.get(id(v), v).detach()
        out[k] = (v.float() if v.is_floating_point() and v.dtype != torch.float64
                  else v).clone()
    return out
