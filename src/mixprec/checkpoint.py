"""Atomic checkpoint files: a crash mid-write never leaves a torn checkpoint behind.

``save_atomic`` writes to ``<path>.tmp``, fsyncs it, renames it over ``path`` (atomic on
POSIX) and fsyncs the folder, so ``path`` is always either the previous complete file or
the new complete file. ``load_checkpoint`` reads with ``weights_only=True`` and turns a
truncated or corrupt file into a ``CheckpointError`` that says nothing was changed.
``MixedPrecision.save`` / ``MixedPrecision.load`` use both.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

__all__ = ["CheckpointError", "save_atomic", "load_checkpoint"]


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
