"""transformers' fine-grained fp8 schema (``quant_method: fp8``, DeepSeek-V3's layout,
which vLLM reads too): e4m3 weights with one fp32 inverse scale per 128 × 128 block
(``weight_scale_inv``, ``weight_block_size``), activations cast in 1 × 128 tiles at run
time, as block scaling casts them. The loader dequantizes ``code × scale_inv`` in fp32,
the trained cast's arithmetic. transformers derives the block edge from the scale grid
(``rows // grid rows``): a dim longer than a block and not a multiple of it would be
read with the wrong edge, which ``loader_warning`` says.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixprec.export.schema import Schema, on_grid

__all__ = ["FineGrainedFP8"]


@dataclass(frozen=True)
class FineGrainedFP8(Schema):
    """e4m3 codes and an fp32 ``weight_scale_inv`` per ``block × block`` block."""

    name: str = "fp8-block"
    quant_method: str = "fp8"
    #: the block edge (the format's tile)
    block: int = 128

    def encode(self, module: str, codes: torch.Tensor, scale_inv: torch.Tensor,
               outer: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The codes and this schema's scales of the weight, on its grid (the trained scales,
        checked to fit)."""
        s = on_grid(scale_inv, self.block, self.block, module)
        return {f"{module}.weight": codes.contiguous(),
                f"{module}.weight_scale_inv": s.contiguous()}

    def loader_values(self, tensors: dict[str, torch.Tensor], module: str) -> torch.Tensor:
        """The loader's fp32 arithmetic on the written tensors."""
        s = tensors[f"{module}.weight_scale_inv"]
        s = s.repeat_interleave(self.block, 0).repeat_interleave(self.block, 1)
        w = tensors[f"{module}.weight"]
        return w.float() * s[:w.shape[0], :w.shape[1]]

    def quantization_config(self, ignore: list[str]) -> dict:
        """The ``quantization_config`` this schema's loader reads, ``ignore`` its skip list."""
        return {"quant_method": "fp8", "activation_scheme": "dynamic",
                "weight_block_size": [self.block, self.block],
                "modules_to_not_convert": list(ignore) or None}

    def loader_warning(self, shape: tuple[int, ...]) -> str | None:
        """Why transformers would read a weight of ``shape`` with the wrong block edge."""
        bad = [n for n in shape[-2:] if n > self.block and n % self.block]
        if not bad:
            return None
        return (f"a weight of shape {tuple(shape)} has a dim longer than {self.block} and "
                f"not a multiple of it: transformers reads its blocks with the wrong edge "
                f"(it divides the dim by the scale grid's); vLLM pads it")
