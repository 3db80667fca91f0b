"""The compressed-tensors schemas (``quant_method: compressed-tensors``), as transformers
and vLLM read them with compressed-tensors 0.20: per-tensor and per-channel fp8
(``float-quantized``), per-channel int8 (``int-quantized``), MXFP8
(``mxfp8-quantized``: e4m3 codes, e8m0 scales as biased exponent bytes) and NVFP4
(``nvfp4-pack-quantized``: two e2m1 codes a byte, e4m3 scales per 16, an fp32 global
scale). The config is written as plain JSON: compressed-tensors is needed to load it,
not to write it.

Each loader dequantizes ``code × scale`` in fp32 (MXFP8's e8m0 scales in bf16, every
product exact there); NVFP4's divides the e4m3 scale by the global scale, where the
trained cast multiplies it by its descale ``G``: the global scale written is the fp32
value among ``1/G``'s neighbours that reads back the most scales exactly, and
``loader_values`` gives what the loader reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixprec.export.schema import Schema, on_grid

__all__ = ["FloatTensor", "Channel", "MXFP8", "NVFP4", "FP4_GRID"]

_E4M3 = torch.float8_e4m3fn
#: transformers' reading of compressed-tensors experts: plain (fp8 weight, scale) pairs
#: multiplied, or packed weights decompressed without their global scale
_EXPERTS = ("transformers (5.25) dequantizes compressed-tensors {} MoE experts wrongly "
            "(it {}); vLLM and compressed-tensors' own decompressor read them as trained")

#: the e2m1 magnitudes by their 3-bit code (bit 3 is the sign)
FP4_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _args(num_bits: int, kind: str, strategy: str, dynamic: bool, **extra) -> dict:
    """A ``QuantizationArgs`` as compressed-tensors dumps it (symmetric)."""
    return {"num_bits": num_bits, "type": kind, "symmetric": True, "group_size": None,
            "strategy": strategy, "block_structure": None, "dynamic": dynamic,
            "actorder": None, "observer": None, "observer_kwargs": {}, **extra}


def _config(fmt: str, weights: dict, inputs: dict | None, ignore: list[str]) -> dict:
    group = {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
             "output_activations": None, "format": fmt}
    return {"quant_method": "compressed-tensors", "format": fmt,
            "quantization_status": "compressed", "config_groups": {"group_0": group},
            "ignore": list(ignore), "kv_cache_scheme": None,
            "global_compression_ratio": None}


@dataclass(frozen=True)
class FloatTensor(Schema):
    """fp8 e4m3 weights with one fp32 scale per tensor; activations cast per tensor
    at run time (``dynamic``), as current scaling casts them."""

    name: str = "float-tensor"
    quant_method: str = "compressed-tensors"

    def encode(self, module: str, codes: torch.Tensor, scale_inv: torch.Tensor,
               outer: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The codes and this schema's scales of the weight, on its grid (the trained scales,
        checked to fit)."""
        s = on_grid(scale_inv, 0, 0, module).reshape(1)
        return {f"{module}.weight": codes.contiguous(), f"{module}.weight_scale": s}

    def loader_values(self, tensors: dict[str, torch.Tensor], module: str) -> torch.Tensor:
        """The loader's fp32 arithmetic on the written tensors."""
        return tensors[f"{module}.weight"].float() * tensors[f"{module}.weight_scale"]

    def quantization_config(self, ignore: list[str]) -> dict:
        """The ``quantization_config`` this schema's loader reads, ``ignore`` its skip list."""
        return _config("float-quantized", _args(8, "float", "tensor", False),
                       _args(8, "float", "tensor", True), ignore)


@dataclass(frozen=True)
class Channel(Schema):
    """fp8 (``float``) or int8 (``int``) weights with one fp32 scale per output
    channel; activations per token at run time (compressed-tensors' FP8_DYNAMIC,
    INT8_W8A8), as the rowwise formats cast them."""

    name: str = "float-channel"
    quant_method: str = "compressed-tensors"
    #: ``float`` (e4m3 codes) or ``int`` (int8 codes)
    kind: str = "float"

    def encode(self, module: str, codes: torch.Tensor, scale_inv: torch.Tensor,
               outer: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The codes and this schema's scales of the weight, on its grid (the trained scales,
        checked to fit)."""
        s = on_grid(scale_inv, 1, 0, module)
        return {f"{module}.weight": codes.contiguous(), f"{module}.weight_scale": s}

    def loader_values(self, tensors: dict[str, torch.Tensor], module: str) -> torch.Tensor:
        """The loader's fp32 arithmetic on the written tensors."""
        return tensors[f"{module}.weight"].float() * tensors[f"{module}.weight_scale"]

    def quantization_config(self, ignore: list[str]) -> dict:
        """The ``quantization_config`` this schema's loader reads, ``ignore`` its skip list."""
        fmt = "float-quantized" if self.kind == "float" else "int-quantized"
        return _config(fmt, _args(8, self.kind, "channel", False),
                       _args(8, self.kind, "token", True), ignore)


@dataclass(frozen=True)
class MXFP8(Schema):
    """e4m3 weights with an e8m0 scale per 32 inputs (biased exponent bytes);
    activations in 1×32 MX tiles at run time (compressed-tensors' MXFP8)."""

    name: str = "mxfp8"
    quant_method: str = "compressed-tensors"
    tile: int = 32

    def encode(self, module: str, codes: torch.Tensor, scale_inv: torch.Tensor,
               outer: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The codes and this schema's scales of the weight, on its grid (the trained scales,
        checked to fit)."""
        s = on_grid(scale_inv, 1, self.tile, module)
        exp = torch.log2(s)
        if not torch.equal(exp, exp.round()) or codes.shape[1] % self.tile:
            raise ValueError(f"{module}: MXFP8 needs power-of-two scales per {self.tile} "
                             f"inputs and in_features a multiple of {self.tile}; got "
                             f"{tuple(codes.shape)}")
        return {f"{module}.weight": codes.contiguous(),
                f"{module}.weight_scale": (exp + 127).to(torch.uint8)}

    def loader_values(self, tensors: dict[str, torch.Tensor], module: str) -> torch.Tensor:
        """The loader's fp32 arithmetic on the written tensors."""
        s = torch.exp2(tensors[f"{module}.weight_scale"].float() - 127)
        return tensors[f"{module}.weight"].float() * s.repeat_interleave(self.tile, 1)

    def experts_warning(self) -> str:
        """How transformers misreads experts written in this schema."""
        return _EXPERTS.format("MXFP8", "multiplies the e8m0 exponent bytes as numbers")

    def quantization_config(self, ignore: list[str]) -> dict:
        """The ``quantization_config`` this schema's loader reads, ``ignore`` its skip list."""
        mx = {"group_size": self.tile, "strategy": "group", "scale_dtype": "torch.uint8",
              "zp_dtype": "torch.uint8"}
        return _config("mxfp8-quantized", {**_args(8, "float", "group", False), **mx},
                       {**_args(8, "float", "group", True), **mx}, ignore)


def _pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 values (out × in, in even) as bytes: each element's 4-bit code (sign in bit
    3), the first of each pair in the low nibble."""
    v = codes.float()
    idx = torch.searchsorted(FP4_GRID, v.abs().contiguous())
    if not torch.equal(FP4_GRID[idx.clamp(max=7)], v.abs()):
        raise ValueError("NVFP4 codes off the e2m1 grid")
    nib = (idx | (torch.signbit(v).to(torch.int64) << 3)).to(torch.uint8)
    return nib[:, 0::2] | (nib[:, 1::2] << 4)


def _unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    nib = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
    v = FP4_GRID[(nib & 7).long()]
    return torch.where((nib & 8) != 0, -v, v)


@dataclass(frozen=True)
class NVFP4(Schema):
    """e2m1 weights packed two a byte, an e4m3 scale per 16 inputs and an fp32 global
    scale (compressed-tensors' NVFP4A16: weights only; the trained forward's per-tensor
    activation descale has no calibrated ``input_global_scale`` to write)."""

    name: str = "nvfp4"
    quant_method: str = "compressed-tensors"
    tile: int = 16

    def encode(self, module: str, codes: torch.Tensor, scale_inv: torch.Tensor,
               outer: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The codes and this schema's scales of the weight, on its grid (the trained scales,
        checked to fit)."""
        s = on_grid(scale_inv, 1, self.tile, module)
        if codes.shape[1] % self.tile:
            raise ValueError(f"{module}: NVFP4 needs in_features a multiple of "
                             f"{self.tile}; got {tuple(codes.shape)}")
        outer = on_grid(outer, 0, 0, module).reshape(())
        trained = (s * outer).repeat_interleave(self.tile, 1)  # Quantized.dequant's
        best, fewest = None, None
        inv = torch.reciprocal(outer).reshape(1)
        for cand in (inv, torch.nextafter(inv, inv * 2), torch.nextafter(inv, inv * 0)):
            read = (s / cand).repeat_interleave(self.tile, 1)
            miss = int((read != trained).sum())
            if fewest is None or miss < fewest:
                best, fewest = cand, miss
        return {f"{module}.weight_packed": _pack_fp4(codes),
                f"{module}.weight_scale": s.to(_E4M3),
                f"{module}.weight_global_scale": best.float()}

    def loader_values(self, tensors: dict[str, torch.Tensor], module: str) -> torch.Tensor:
        """The loader's fp32 arithmetic on the written tensors."""
        codes = _unpack_fp4(tensors[f"{module}.weight_packed"])
        s = (tensors[f"{module}.weight_scale"].float()
             / tensors[f"{module}.weight_global_scale"])
        return codes * s.repeat_interleave(self.tile, 1)

    def experts_warning(self) -> str:
        """How transformers misreads experts written in this schema."""
        return _EXPERTS.format("NVFP4", "leaves out their global scale")

    def quantization_config(self, ignore: list[str]) -> dict:
        """The ``quantization_config`` this schema's loader reads, ``ignore`` its skip list."""
        w = {**_args(4, "float", "tensor_group", False), "group_size": self.tile,
             "scale_dtype": "torch.float8_e4m3fn", "zp_dtype": "torch.float8_e4m3fn"}
        return _config("nvfp4-pack-quantized", w, None, ignore)
