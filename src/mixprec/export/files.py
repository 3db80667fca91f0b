"""``save``: any module trained under a Linear format (or the engine training it) as one
safetensors file of its quantized weights' codes and scales, plus a JSON description
beside it (``<path>.json``): the schema, its ``quantization_config``, which module each
quantized weight came from and its format, the 16-bit ones, and the loader's read-back
error.

The tensors are named by the model's ``state_dict`` names, a 3-D experts projection
``P`` as one weight per expert (``P.<e>.weight``, ``P.<e>.weight_scale``, ...); the
rest is in ``dtype``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from mixprec.export.tensors import Exported, export_tensors, trained_weights, unbind_experts

__all__ = ["save", "DESCRIPTION_FORMAT"]

#: the ``format`` field of the JSON description
DESCRIPTION_FORMAT = "mixprec.export/1"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def save(model_or_engine: nn.Module | object, path: str | os.PathLike[str], *,
         dtype: torch.dtype = torch.bfloat16) -> Exported:
    """Write ``model_or_engine``'s quantized weights (the casts of its fp32 masters,
    exactly as the forward casts them) and its other tensors in ``dtype`` to ``path``
    (a safetensors file) and the description to ``<path>.json``. Returns what was
    written. Under FSDP every rank calls it and rank 0 writes."""
    model, weights = trained_weights(model_or_engine)
    exported = export_tensors(model, weights, dtype, unbind_experts)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return exported
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(exported.tensors, str(path), metadata={"format": "pt"})
    description = {
        "format": DESCRIPTION_FORMAT, "schema": exported.schema.name,
        "dtype": _name(dtype), "quantization_config": exported.quantization_config(),
        "quantized": exported.quantized, "kept_16bit": exported.ignore,
        "loader_error": exported.loader_error, "notes": exported.notes,
        "tensors": {k: {"dtype": _name(v.dtype), "shape": list(v.shape)}
                    for k, v in exported.tensors.items()}}
    Path(f"{path}.json").write_text(json.dumps(description, indent=1))
    return exported
