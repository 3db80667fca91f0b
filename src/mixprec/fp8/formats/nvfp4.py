"""NVFP4 (NVIDIA's pretraining recipe, Transformer Engine's ``NVFP4BlockScaling``):
e2m1 elements in 1×16 (weights 16×16) blocks with e4m3 scales and an fp32 scale per
tensor (the casts: ``mixprec.fp8.nvfp4``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from mixprec.fp8.formats.base import LinearFormat
from mixprec.fp8.nvfp4 import NVFP4_BLOCK, apply_hadamard, cast_nvfp4, hadamard_16
from mixprec.fp8.padding import KernelSpec
from mixprec.fp8.quantized import Quantized
from mixprec.fp8.tp_agree import Agreement

__all__ = ["NVFP4Scaling"]


@dataclass(frozen=True, kw_only=True)
class NVFP4Scaling(LinearFormat):
    """The last two Linears stay in bf16 by default, as NVIDIA's recipe keeps them."""

    bf16_last_layers: int = 2
    #: 16×16 weight blocks (which serve dgrad too); else 1×16 along each contracted dim
    nvfp4_2d: bool = True
    #: a random 16×16 Hadamard transform along the tokens of both wgrad operands
    nvfp4_rht: bool = True
    #: stochastic rounding of the gradients, from the module's checkpointed stream
    nvfp4_sr: bool = True

    name: ClassVar[str] = "nvfp4"
    #: K to 32 (two e2m1 codes per byte), N to 16; 1×16 e4m3 scales swizzled as MX's
    kernel: ClassVar[KernelSpec] = KernelSpec(
        multiples=(1, 32, 16), tile=16, scales="swizzled", scale_dtype=torch.float8_e4m3fn,
        fp4=True)
    kernel_name: ClassVar[str] = "the NVFP4 block-scaled kernel"
    kernel_capability: ClassVar[tuple[tuple[int, int], int | None]] = ((10, 0), None)
    exact_fp32: ClassVar[bool] = True
    block_scaled: ClassVar[bool] = True
    global_scale_bytes: ClassVar[int] = 4
    token_multiple: ClassVar[int] = NVFP4_BLOCK  # the Hadamard transform's blocks
    takes_tensor_route: ClassVar[bool] = False
    flush_view: ClassVar[str] = ""

    def backward_bytes(self, t: int, i: int, o: int, act_bytes: float, route: str
                       ) -> float:
        """The gradient's cast keeps about seven fp32 copies of it alive at once (its
        fp32 view, the expanded scales, the scaled values, their magnitudes, the grid
        steps, the random draws, the rounded values: ``28·T·O``), plus the dgrad cast's
        codes (``T·O``) and the Hadamard-transformed wgrad operands (``4·(T·O + T·I)``)."""
        return 29 * t * o + 4 * (t * o + t * i)

    @property
    def stochastic_grads(self) -> bool:
        """``nvfp4_sr``: the gradients' elements round stochastically."""
        return self.nvfp4_sr

    def reuses(self, role: str) -> bool:
        """The forward's 16×16 weight blocks serve dgrad; 1×16 casts have an axis."""
        return role == "weight" and self.nvfp4_2d

    def shard_rows(self, dim: int) -> int:
        """16×16 blocks, and dgrad's 16×1, span 16 rows; the forward's 1×16, one."""
        return NVFP4_BLOCK if self.nvfp4_2d or dim == 0 else 1

    def gather_amax(self, shard: torch.Tensor) -> torch.Tensor | None:
        """The shard's amax: the ranks' max is the weight's, which sets the per-tensor
        descale."""
        if shard.numel() == 0:
            return torch.zeros((), device=shard.device)
        return shard.detach().abs().amax().float()

    def cast_shard(self, shard: torch.Tensor, dim: int, amax: torch.Tensor | None
                   ) -> Quantized:
        """The weight's cast of these rows, with the whole weight's amax."""
        return cast_nvfp4(shard, dim, square=self.nvfp4_2d, amax=amax)

    def buffers(self, device: torch.device | str, seed: int = 0
                ) -> dict[str, tuple[torch.Tensor, bool]]:
        """``nvfp4_rng``: the stochastic rounding's (seed, backward calls)."""
        return {"nvfp4_rng": (torch.tensor([seed, 0], device=device), True)}

    def cast(self, t: torch.Tensor, role: str, dim: int, state: dict, record: bool = False,
             generator: torch.Generator | None = None, agree: Agreement | None = None
             ) -> Quantized:
        """NVFP4 cast along ``dim``; the wgrad operands (``dim=0``) Hadamard-transformed
        first under ``nvfp4_rht``, the gradient rounded with ``generator``."""
        if role == "weight":
            return cast_nvfp4(t, dim, square=self.nvfp4_2d, agree=agree)
        if dim == 0 and self.nvfp4_rht:  # the wgrad operands, contracted over tokens
            t = apply_hadamard(t, hadamard_16(0, t.device))
        return cast_nvfp4(t, dim, generator=generator if role == "grad_output" else None,
                          agree=agree)
