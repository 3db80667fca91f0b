"""The engine's checkpoint and export methods (``MixedPrecision`` inherits them): the
fp32 weights, the whole state to resume, atomic saves and reshardable directories, and
the trained model in the format it trained in. The layouts are ``mixprec.checkpoint``'s;
this class only routes to them."""

from __future__ import annotations

import os
from typing import Any

import torch

from mixprec.checkpoint import core as checkpoint
from mixprec.checkpoint import resharding as checkpoint_resharding
from mixprec.export import pretrained as export_pretrained

__all__ = ["Checkpoints"]


class Checkpoints:
    """Checkpoints and export of a ``MixedPrecision`` engine (a mixin: it reads the
    engine's ``module``, ``param_state`` and ``parallelism``)."""

    def fp32_state_dict(self, full: bool = False) -> dict[str, torch.Tensor]:
        """The trained weights in fp32, keyed like the original model's ``state_dict``:
        masters where there are some, other tensors upcast exactly, no fp8 scaling
        state. Loads strictly into a fresh fp32 model. Under FSDP: local shards, or with
        ``full=True`` whole tensors (a collective: every rank calls it)."""
        weights = checkpoint.fp32_weights(self.module, self.param_state)
        return self.parallelism.gather(weights) if full else weights

    def export_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The trained model to hand on: what every framework's export writes (its
        ``save_model``, ``save_pretrained``, ``get_state_dict``, checkpoint files).

        Whole tensors keyed by the model's own ``state_dict`` names, with the fp32
        masters in place of the 16-bit working copy and no fp8 scaling state, so it
        loads with ``load_state_dict(strict=True)`` into the plain fp32 model; with
        ``dtype``, floating tensors are cast to it (one rounding of the masters). Under
        FSDP it gathers the shards: every rank calls it."""
        weights = self.fp32_state_dict(full=True)
        if dtype is not None:
            weights = {k: v.to(dtype) if v.is_floating_point() else v
                       for k, v in weights.items()}
        return weights

    def save_pretrained(self, directory: str | os.PathLike[str], quantized: bool = True,
                        dtype: torch.dtype = torch.bfloat16) -> Any:
        """Write the trained transformers model to ``directory`` as a Hugging Face model
        (``mixprec.export.save_pretrained``): with ``quantized`` (the default) in the
        format it trained in (each quantized weight the codes and scales of its fp32
        master's cast, exactly as the forward casts it; ``config.json`` with the
        ``quantization_config`` transformers and vLLM read; the rest in ``dtype``), else
        the fp32 masters. Under FSDP every rank calls it. Returns what was written
        (``mixprec.export.Exported``; None for ``quantized=False`` and on ranks that do
        not write). Any other module: ``mixprec.export.save``."""
        return export_pretrained.save_pretrained(self, directory, quantized=quantized,
                                                 dtype=dtype)

    def load_fp32_state_dict(self, weights: dict[str, torch.Tensor]) -> None:
        """Load trained weights, as ``export_state_dict`` (or ``fp32_state_dict(full=True)``)
        wrote them: whole fp32 tensors keyed like the model's ``state_dict``, no fp8
        scaling state. Masters take the values exactly, and the working copy their
        rounding to nearest, as after an update; the optimizer, loss scale and counters
        stay as they are (``load_state_dict`` restores those). Under FSDP every rank
        calls it with the same whole tensors and keeps its shards. Keys or shapes that
        do not match raise before anything changes."""
        checkpoint.load_fp32_weights(self, weights)

    def state_dict(self, full: bool = False) -> dict:
        """Everything to resume bit-identically but the random streams (``save`` adds
        them; ``mixprec.checkpoint.rng.capture`` for a loop of your own); loads with
        ``weights_only=True``.
        Whole tensors (any world size), except under FSDP: this rank's shards, or with
        ``full=True`` gathered (a collective). Layouts: ``mixprec.checkpoint.core``."""
        return checkpoint.engine_state(self, full)

    def save(self, path: str | os.PathLike[str], full: bool = False,
             reshardable: bool = False, rng_state: bool = True, **extra: Any) -> None:
        """Write ``state_dict(full)`` (and ``extra``: a step count, a data position...) to
        ``path`` atomically: a crash or a failed write leaves the previous file whole
        and no temp file behind.

        The file also holds the random streams (torch's CPU and CUDA generators,
        Python's ``random``, numpy's global generator) that dropout and augmentation draw
        from, so that ``load`` resumes them exactly; ``rng_state=False`` leaves them out
        (for loops that save and restore their own).

        Without FSDP any rank may call it, and the file holds that rank's streams;
        ``full=True`` under DDP or FSDP is a collective (every rank calls it): the file,
        written by rank 0, holds every rank's streams. Under FSDP each rank otherwise
        writes its shards (one path per rank); ``full=True`` gathers them;
        ``reshardable=True`` writes a ``torch.distributed.checkpoint`` directory that
        FSDP resumes at any world size (a tensor-parallel engine's: at any degree, or
        in one process; pipeline stages' (every rank calls it) or one process's: by
        stages at any pipeline degree, or one process, ``mixprec.checkpoint.pipeline``).

        >>> import torch, tempfile, os
        >>> from mixprec import MixedPrecision
        >>> model = torch.nn.Linear(4, 2)
        >>> engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
        >>> engine.save(path, step=100)
        >>> engine.load(path)
        {'step': 100}
        """
        if reshardable:
            checkpoint_resharding.save_resharding(self, path, extra, rng_state)
        else:
            checkpoint.save_engine(self, path, full, extra, rng_state)

    def load(self, path: str | os.PathLike[str], rng_state: bool = True) -> dict:
        """Restore what ``save`` wrote, this rank's random streams included (unless
        ``rng_state=False``), and return its ``extra``. An unreadable file, or one this
        engine cannot resume (another recipe; FSDP shards of another world size), raises
        before anything changes. A directory is a ``reshardable`` save, for FSDP at any
        world size, or (saved under tensor parallelism) any degree or one process, or
        (saved by pipeline stages or one process) stages at any pipeline degree or one
        process."""
        if checkpoint_resharding.is_resharding(path):
            return checkpoint_resharding.restore_resharding(self, path, rng_state)
        return checkpoint.load_engine(self, path, rng_state)

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``'s output. Another recipe, emulation setting,
        optimizer layout or FSDP world size is refused, naming both sides, before
        anything changes. A whole state loads at any world size and layout."""
        checkpoint.restore_engine(self, state)
