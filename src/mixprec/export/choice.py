"""Which serving schema holds a Linear format's weight casts, read from what the format
declares (its scale grain, its elements, its kernel's scale dtype), not its name.

| the format's weight cast | schema |
|---|---|
| fp8, one scale per tensor (current, delayed) | compressed-tensors ``float-quantized``, tensor |
| fp8, one per row (rowwise) | compressed-tensors ``float-quantized``, channel |
| int8, one per row (int8) | compressed-tensors ``int-quantized``, channel |
| fp8, square tile × tile weight blocks (block) | transformers ``fp8``, ``weight_block_size`` |
| fp8, 1 × 32 tiles, e8m0 scales (MX) | compressed-tensors ``mxfp8-quantized`` |
| e2m1 in 16-element blocks, fp32 descale (NVFP4) | compressed-tensors ``nvfp4-pack-quantized`` |

Anything else (MXFP6's fp6 elements) raises ``NotImplementedError``.
"""

from __future__ import annotations

import torch

from mixprec.export.compressed import MXFP8, NVFP4, Channel, FloatTensor
from mixprec.export.finegrained import FineGrainedFP8
from mixprec.export.schema import Schema
from mixprec.formats.gemm import LinearFormat

__all__ = ["schema_for"]


def schema_for(fmt: LinearFormat) -> Schema:
    """The schema that holds ``fmt``'s weight casts exactly."""
    g, el = fmt.scales, fmt.elements
    e8m0 = fmt.kernel is not None and fmt.kernel.scale_dtype == torch.float8_e8m0fnu
    if el == "fp8" and g.kind == "tensor":
        return FloatTensor()
    if g.kind == "row" and el in ("fp8", "int8"):
        return Channel(name=f"{'float' if el == 'fp8' else 'int'}-channel",
                       kind="float" if el == "fp8" else "int")
    if el == "fp8" and g.kind == "tile" and g.square_weight:
        return FineGrainedFP8(block=g.tile)
    if el == "fp8" and g.kind == "tile" and e8m0 and g.tile == 32:
        return MXFP8(tile=g.tile)
    if el == "fp4_e2m1" and g.kind == "tile" and g.tile == 16:
        return NVFP4(tile=g.tile)
    raise NotImplementedError(
        f"fp8_scaling={fmt.name!r} ({el} elements, {g.kind} scales) has no serving "
        "schema that holds its casts (compressed-tensors 0.20 and transformers' fp8 "
        "hold fp8 per tensor, per channel and in 128x128 blocks, int8 per channel, "
        "MXFP8 and NVFP4); export it with quantized=False")
