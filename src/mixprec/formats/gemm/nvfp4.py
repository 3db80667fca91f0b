"""NVFP4 (NVIDIA's pretraining recipe, Transformer Engine's ``NVFP4BlockScaling``):
e2m1 elements in 1×16 (weights 16×16) blocks with e4m3 scales and an fp32 scale per
tensor (the casts: ``mixprec.formats.fp4``).

The experts' grouped casts (``segment_cast``): an expert's slice has one fp32 descale
(from its amax) and e4m3 scales per 16 elements along the contracted dim. Along the
hidden dim each row is cast whole, its descale from its expert's amax (a segment
reduction; the rows past the last expert reduce into a slot of their own). wgrad
contracts over the tokens: its 16-token blocks, and the random Hadamard transform over
16 tokens that precedes them, start at each expert's first token, as the per-expert
casts (zero padded to 16 tokens) have them: each expert's rows are copied into a
buffer of ``T + (E + 1)·15`` rows where every expert starts on a multiple of 16
(``Segments.aligned``), which is transformed and cast with each block's descale from
its expert's amax; the experts' padded rows are multiplied as the per-expert casts
stack them (without the transform, the rows are gathered back in place). Stochastic
rounding draws by place in the counter stream of the key it is given, so every element
meets the number the per-expert cast gives it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from mixprec.formats.fp4 import NVFP4_BLOCK, apply_hadamard, cast_nvfp4, hadamard_16
from mixprec.formats.gemm.base import LinearFormat
from mixprec.formats.grain import ScaleGrain
from mixprec.formats.padding import KernelSpec
from mixprec.formats.quantized import Quantized
from mixprec.formats.segments import Segments, segment_amax, spread
from mixprec.formats.shard import Agreement

__all__ = ["NVFP4Scaling"]


@dataclass(frozen=True, kw_only=True)
class NVFP4Scaling(LinearFormat):
    """NVIDIA's NVFP4 format (its preset, ``nvfp4``, keeps the last two Linears in bf16,
    as NVIDIA's recipe does: ``recipe.last_layers``)."""

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
        fp4=True, name="the NVFP4 block-scaled kernel", capability=((10, 0), None))
    #: 1×16 tiles (``reuses`` says when 16×16 weight blocks serve dgrad) under an fp32
    #: per-tensor descale; the wgrad operands' tokens padded to the Hadamard transform's
    #: 16-token blocks
    scales: ClassVar[ScaleGrain] = ScaleGrain(kind="tile", tile=NVFP4_BLOCK, global_bytes=4,
                                              token_multiple=NVFP4_BLOCK)
    elements: ClassVar[str] = "fp4_e2m1"

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

    def segments_apply(self) -> bool:
        """NVFP4 casts an experts operand whole."""
        return True

    def segment_cast(self, t: torch.Tensor, role: str, dim: int, seg: Segments,
                     state: dict, record: bool = False, key: object = None) -> Quantized:
        """Along the hidden dim each row with its expert's descale; along the tokens the
        16-aligned buffer (transformed under ``nvfp4_rht``), each 16-row block with its
        expert's descale (the module doc), rounded with ``key``."""
        groups = seg.experts + 1
        if dim == 1:
            amax = segment_amax(t.detach().float().abs().amax(dim=1), seg.ids, groups)
            return cast_nvfp4(t, 1, generator=key, amax=amax[seg.ids].unsqueeze(1))
        buf = spread(t, *seg.aligned(NVFP4_BLOCK))
        _, blocks = seg.aligned_ends(NVFP4_BLOCK)
        if self.nvfp4_rht:
            buf = apply_hadamard(buf, hadamard_16(0, buf.device))
        buf = buf.float()
        rows = buf.shape[0] + (-buf.shape[0]) % NVFP4_BLOCK
        padded = torch.nn.functional.pad(buf, (0, 0, 0, rows - buf.shape[0]))
        amax = padded.detach().abs().view(-1, NVFP4_BLOCK * buf.shape[1]).amax(dim=1)
        amax = segment_amax(amax, blocks, groups)
        return cast_nvfp4(buf, 0, generator=key, amax=amax[blocks].unsqueeze(1))

    def segment_wgrad(self, g: Quantized, x: Quantized, seg: Segments
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The aligned casts' values: with the transform, every padded row (grouped by
        each expert's padded end); without, the rows gathered back in place."""
        gv, xv = g.dequant(), x.dequant()
        if self.nvfp4_rht:  # the transform's padded rows are multiplied
            return gv, xv, seg.aligned_ends(NVFP4_BLOCK)[0]
        dest, _ = seg.aligned(NVFP4_BLOCK)
        return gv[dest], xv[dest], seg.offs
