"""The random streams a training step draws from, captured and restored for exact resume.

Dropout, stochastic depth and random data augmentation draw from torch's CPU generator,
each CUDA device's generator, Python's ``random`` and numpy's global generator. A
checkpoint that leaves them out resumes with other masks than the uninterrupted run.
``capture`` returns them as plain tensors and numbers (loadable with
``torch.load(weights_only=True)``); ``restore`` puts them back. ``MixedPrecision.save``
stores one capture per rank and ``load`` restores this rank's.

Generators that a user created (``torch.Generator()``, ``numpy.random.default_rng``)
are the user's to save: they are objects of the user's loop, not global streams.
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import numpy as np
import torch

__all__ = ["capture", "restore", "for_rank"]


def capture() -> dict[str, Any]:
    """The global random streams of this process: ``torch`` (CPU), ``cuda`` (one state
    per visible device, only where CUDA has been initialised: capturing would
    otherwise start it), ``python`` and ``numpy``."""
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    out: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)),
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def restore(state: dict[str, Any]) -> None:
    """Put back what ``capture`` returned. CUDA states are restored where this process
    sees as many devices as the capture held; elsewhere (a run resumed on fewer GPUs,
    or on a CPU) they are left alone with one warning."""
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached"]))
    cuda = state.get("cuda")
    if cuda:
        if torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
            torch.cuda.set_rng_state_all(cuda)
        else:
            here = torch.cuda.device_count() if torch.cuda.is_available() else 0
            warnings.warn(
                f"the checkpoint holds the random streams of {len(cuda)} CUDA device(s), "
                f"this process sees {here}: the CUDA streams keep their current state "
                "(dropout on the GPU draws other masks than the saved run)", stacklevel=3)


def for_rank(saved: dict[str, Any] | None, rank: int) -> dict[str, Any] | None:
    """This rank's capture from a checkpoint's ``{"ranks": {rank: capture}}`` entry, or
    None (with one warning) where the checkpoint holds other ranks' streams only."""
    if not saved:
        return None
    ranks = saved["ranks"]
    if rank in ranks:
        return ranks[rank]
    warnings.warn(
        f"the checkpoint holds the random streams of rank(s) {sorted(ranks)}, not of rank "
        f"{rank}: this rank keeps its current streams, so its dropout masks differ from "
        "the saved run's. Under DDP call engine.save(path, full=True) on every rank, "
        "which stores every rank's streams", stacklevel=3)
    return None
