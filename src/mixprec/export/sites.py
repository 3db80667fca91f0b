"""Where a trained model's weights were quantized, and their casts as the forward casts
them.

A *site* is one weight a Linear format multiplied in the forward: a converted Linear's
``weight`` (a GPT-2 ``Conv1D``'s, stored in × out, read out × in) or a transformers
experts module's 3-D projection (experts × out × in), whose every expert's slice the
grouped GEMM casts on its own. ``weight_cast`` casts a weight (the fp32 master) with the
site's format and scaling state exactly as the forward's weight cast does (role
``weight``, along the contracted dim, nothing recorded) and returns the codes with each
element's inverse scale spelled out, so that a schema can lay them on its own grid and
check that the grid holds them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mixprec.experts.format import experts_formats
from mixprec.experts.hook import from_transformers
from mixprec.formats.gemm import LinearFormat
from mixprec.formats.quantized import Quantized, expand_blocks
from mixprec.modules.linear import fp8_modules

__all__ = ["Site", "WeightCast", "quantized_sites", "kept_linears", "weight_cast"]

#: the suffix ``convert_experts`` gives each projection's ``ExpertsFormat`` child
_EXPERTS_SUFFIX = "_fp8"


@dataclass(frozen=True)
class Site:
    """One weight a Linear format cast in the forward."""

    #: the parameter's name in the model's ``state_dict``
    param: str
    #: the format that cast it
    quantizer: LinearFormat
    #: the format's buffers (delayed scaling's scales), as the forward reads them
    state: dict
    #: a 3-D experts projection (each expert's slice cast on its own)
    experts: bool = False
    #: the weight is stored in × out (a ``Conv1D``); the cast reads it out × in
    transposed: bool = False


@dataclass(frozen=True)
class WeightCast:
    """A weight's cast, out × in (experts × out × in for a projection): ``codes`` as
    cast (fp8 / int8 bytes, or fp4 values carried as e4m3 bytes), ``scale_inv`` each
    element's inverse scale (fp32, the codes' shape) and ``outer`` the per-tensor factor
    (NVFP4's descale; one per expert for a projection), or None. The value is
    ``codes · scale_inv · outer`` as ``Quantized.dequant`` computes it."""

    codes: torch.Tensor
    scale_inv: torch.Tensor
    outer: torch.Tensor | None

    def values(self) -> torch.Tensor:
        """The fp32 values the forward multiplies (``Quantized.dequant``'s arithmetic:
        the inverse scale times the outer factor, then times the code)."""
        s = self.scale_inv
        if self.outer is not None:
            shape = self.outer.shape + (1,) * (s.dim() - self.outer.dim())
            s = s * self.outer.reshape(shape)
        return self.codes.float() * s


def quantized_sites(module: nn.Module) -> dict[str, Site]:
    """Every weight of ``module`` a Linear format casts, by parameter name."""
    out = {}
    for name, m in fp8_modules(module).items():
        param = f"{name}.weight" if name else "weight"
        out[param] = Site(param, m.quantizer, m.scaling_state(), transposed=m.transposed)
    for name, f in experts_formats(module).items():
        parent, _, child = name.rpartition(".")
        proj = child.removesuffix(_EXPERTS_SUFFIX)
        owner = module.get_submodule(parent)
        if getattr(owner, "is_transposed", False):
            raise NotImplementedError(
                f"experts module {parent!r} holds its weights in x out (is_transposed, as "
                "GPT-OSS does); the export writes out x in projections only. Export this "
                "model with quantized=False, or leave its experts in bf16 "
                "(layer:*.experts=bf16).")
        out[f"{parent}.{proj}"] = Site(f"{parent}.{proj}", f.quantizer, f.scaling_state(),
                                       experts=True)
    return out


def kept_linears(module: nn.Module) -> list[str]:
    """The parameter names of the Linear-like weights the recipe kept in 16 bits: every
    module's own 2-D ``weight`` (Linears, ``Conv1D``s, MoE routers) but embeddings'
    and the quantized ones, and the experts projections left unconverted."""
    sites = quantized_sites(module)
    kept = []
    for n, m in module.named_modules():
        w = m._parameters.get("weight")
        if (w is not None and w.dim() == 2 and not isinstance(m, nn.Embedding)
                and f"{n}.weight" not in sites):
            kept.append(f"{n}.weight" if n else "weight")
        if from_transformers(m) and hasattr(m, "is_transposed"):
            for proj in ("gate_up_proj", "up_proj", "down_proj"):
                w = getattr(m, proj, None)
                if isinstance(w, torch.Tensor) and w.dim() == 3 and f"{n}.{proj}" not in sites:
                    kept.append(f"{n}.{proj}")
    return kept


def _spelled(q: Quantized) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The codes, each element's inverse scale and the outer factor of a 2-D cast."""
    if q.transposed:
        raise ValueError("a transposed cast has no out x in layout of its own")
    s = q.scale_inv.float()
    if q.rows or q.cols:
        s = expand_blocks(s, q.rows, q.cols, q.data.shape)
    return q.data, s.expand(q.data.shape).contiguous(), q.outer


def weight_cast(site: Site, weight: torch.Tensor) -> WeightCast:
    """``weight`` (the site's fp32 master, as stored) cast as the forward casts it: the
    site's format, role ``weight``, along the contracted dim (1 of out × in), with its
    scaling state and no amax recorded; a projection expert by expert."""
    w = weight.detach().float()
    if site.transposed:
        w = w.t()
    if not site.experts:
        codes, s, outer = _spelled(site.quantizer.cast(w, "weight", 1, site.state))
        return WeightCast(codes, s, outer)
    parts = [_spelled(site.quantizer.cast(w[e], "weight", 1, site.state))
             for e in range(w.shape[0])]
    outer = (None if parts[0][2] is None
             else torch.stack([p[2].reshape(()) for p in parts]))
    return WeightCast(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]),
                      outer)
