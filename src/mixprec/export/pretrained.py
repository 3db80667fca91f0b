"""``save_pretrained``: a transformers model (``PreTrainedModel``) trained under a Linear
format written as a Hugging Face directory (``model.safetensors`` + ``config.json``) in
the format it trained in, which ``AutoModelForCausalLM.from_pretrained`` and vLLM load
quantized; or, with ``quantized=False``, its fp32 masters.

The tensors are named as transformers saves the model (its reverse weight conversion:
fused experts projections split into per-expert modules), the quantized weights laid
out by their schema (``mixprec.export.choice``), everything else in ``dtype``, and
``config.json`` carries the schema's ``quantization_config`` with the Linears kept in
16 bits in its ignore list. Under FSDP every rank calls it (the masters are gathered)
and rank 0 writes.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch
from torch import nn

from mixprec.export.sites import quantized_sites
from mixprec.export.tensors import Exported, export_tensors, trained_weights

__all__ = ["save_pretrained", "WEIGHTS_NAME"]

#: the one weights file the directory holds
WEIGHTS_NAME = "model.safetensors"


def _writes() -> bool:
    """This rank writes (rank 0, or no process group)."""
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _tied(model: nn.Module) -> set[str]:
    """The parameters transformers ties to another (and does not save)."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    return set(tied)


def save_pretrained(model_or_engine: nn.Module | object, directory: str | os.PathLike[str],
                    *, quantized: bool = True, dtype: torch.dtype = torch.bfloat16
                    ) -> Exported | None:
    """Write ``model_or_engine`` (a transformers ``PreTrainedModel``, or the
    ``MixedPrecision`` engine training one) to ``directory`` as a Hugging Face model.

    ``quantized=True``: every weight a Linear format cast (Linears and MoE experts
    projections) as the codes and scales of its fp32 master's cast, exactly as the
    training forward casts it; the other tensors in ``dtype``. Returns what was written
    (``mixprec.export.tensors.Exported``: schema, ignore list, the loader's read-back
    error), or None on a rank that does not write. ``quantized=False``: the fp32
    masters (transformers' own ``save_pretrained``)."""
    model, weights = trained_weights(model_or_engine)
    try:
        import transformers  # optional: only a transformers model gets here
    except ImportError as e:  # pragma: no cover - transformers is there for its models
        raise TypeError("save_pretrained needs transformers; for any nn.Module use "
                        "mixprec.export.save(model, path)") from e
    if not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(f"save_pretrained takes a transformers PreTrainedModel, got "
                        f"{type(model).__name__}; for any nn.Module use "
                        "mixprec.export.save(model, path)")
    if not quantized:
        if _writes():
            model.save_pretrained(directory, state_dict=weights)
        return None
    from transformers.core_model_loading import revert_weight_conversion

    conv = sorted(p for p, site in quantized_sites(model).items() if site.transposed)
    if conv:
        raise NotImplementedError(
            f"{conv[0]} is a Conv1D weight (stored in x out, as GPT-2's): the serving "
            "schemas hold out x in Linear weights. Use save_pretrained(quantized=False), "
            "or mixprec.export.save(model, path), which writes it out x in")
    exported = export_tensors(model, weights, dtype,
                              lambda d: revert_weight_conversion(model, dict(d)),
                              drop=_tied(model))
    if not _writes():
        return None
    from safetensors.torch import save_file

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    save_file(exported.tensors, str(path / WEIGHTS_NAME), metadata={"format": "pt"})
    config = copy.deepcopy(model.config)
    config.quantization_config = exported.quantization_config()
    config.dtype = dtype
    config.save_pretrained(path)
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(path)
    return exported
