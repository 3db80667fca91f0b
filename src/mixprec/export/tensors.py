"""A trained model's weights as a serving schema's tensors: every quantized weight's
cast (``mixprec.export.sites``) laid out by its schema (``mixprec.export.choice``),
every other floating tensor in the 16-bit ``dtype``, and the Linears kept in 16 bits
named for the config's ignore list.

``rename`` maps tensors keyed by the model's ``state_dict`` names to the names (and
pieces) they have on disk: transformers' reverse weight conversion splits a fused
experts projection into its per-expert ``gate_proj`` / ``up_proj``; the codes, each
element's inverse scale and the outer factor go through it alike, so every piece keeps
its own elements' scales, which its schema then lays on its grid (checking they fit).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from mixprec.experts.format import experts_formats
from mixprec.export.choice import schema_for
from mixprec.export.schema import Schema, relative_error
from mixprec.export.sites import Site, kept_linears, quantized_sites, weight_cast
from mixprec.modules.linear import fp8_modules, scaling_buffers

__all__ = ["Exported", "export_tensors", "trained_weights", "unbind_experts"]

Rename = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


@dataclass
class Exported:
    """What an export writes and what it found."""

    #: every tensor by its on-disk name
    tensors: dict[str, torch.Tensor]
    #: the schema of the quantized weights
    schema: Schema
    #: the on-disk module names of the Linears kept in 16 bits (the config's ignore list)
    ignore: list[str]
    #: on-disk module name -> the Linear format (``fp8_scaling``) that cast it
    quantized: dict[str, str] = field(default_factory=dict)
    #: the largest relative difference between what the loader reads back and the
    #: trained values, over every quantized weight (0.0: all exact)
    loader_error: float = 0.0
    #: the loader limitations found (one line each)
    notes: list[str] = field(default_factory=list)

    def quantization_config(self) -> dict:
        """The ``quantization_config`` of ``config.json``."""
        return self.schema.quantization_config(self.ignore)


def trained_weights(obj: nn.Module | object) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The module and its trained weights: an engine's ``export_state_dict`` (fp32
    masters; under FSDP a collective), or a module's own ``state_dict`` in fp32, the
    fp8 scaling state left out either way."""
    if hasattr(obj, "export_state_dict") and hasattr(obj, "module"):
        return obj.module, obj.export_state_dict()
    if not isinstance(obj, nn.Module):
        raise TypeError(f"expected an nn.Module or a MixedPrecision engine, got "
                        f"{type(obj).__name__}")
    scaled = {**fp8_modules(obj), **experts_formats(obj)}
    skip = {f"{n}.{b}" if n else b for n, m in scaled.items() for b in scaling_buffers(m)}
    return obj, {k: (v.detach().float() if v.is_floating_point() else v.detach())
                 for k, v in obj.state_dict().items() if k not in skip}


def unbind_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A 3-D experts projection ``P`` as one 2-D weight per expert, ``P.<e>.weight``; a
    2-D weight keeps its name (the plain export's names)."""
    out = {}
    for k, v in tensors.items():
        if v.dim() == 3:
            out.update({f"{k}.{e}.weight": v[e] for e in range(v.shape[0])})
        else:
            out[k] = v
    return out


def _pieces(site: Site, weight: torch.Tensor, rename: Rename
            ) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """The site's cast of ``weight`` as its on-disk pieces: name -> (codes, each
    element's inverse scale, each element's outer factor or None). The codes go through
    ``rename`` as fp32 values (exact) and come back in their own dtype."""
    c = weight_cast(site, weight)
    codes = rename({site.param: c.codes.float()})
    scales = rename({site.param: c.scale_inv})
    outers = {}
    if c.outer is not None:
        shape = c.outer.shape + (1,) * (c.codes.dim() - c.outer.dim())
        full = c.outer.float().reshape(shape).expand(c.codes.shape).contiguous()
        outers = rename({site.param: full})
    return {k: (v.to(c.codes.dtype), scales[k], outers.get(k)) for k, v in codes.items()}


def export_tensors(model: nn.Module, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                   rename: Rename, drop: set[str] = frozenset()) -> Exported:
    """``weights`` (keyed as ``model.state_dict()``) as the tensors of the quantized
    weights' schema and ``dtype`` for the rest, on-disk names by ``rename``; ``drop``:
    keys not to write (tied weights)."""
    sites = quantized_sites(model)
    if not sites:
        raise ValueError("the model has no quantized weights (its recipe keeps every "
                         "Linear in 16 bits): export it with quantized=False")
    schemas = {s: schema_for(site.quantizer) for s, site in sites.items()}
    if len(set(schemas.values())) > 1:
        raise NotImplementedError(
            "the recipe's layer rules cast the weights in several formats "
            f"({sorted({s.name for s in schemas.values()})}); the export writes one "
            "schema per model: export it with quantized=False")
    schema = next(iter(schemas.values()))
    tensors, quantized, error, notes = {}, {}, 0.0, []
    for p, site in sites.items():  # one at a time: its spelled-out scales are transient
        pieces, fmt = _pieces(site, weights[p], rename), site.quantizer.name
        for k in sorted(pieces):
            if not k.endswith(".weight"):
                raise ValueError(f"quantized weight {k!r} is not a module's 'weight'")
            module, (code, scale, outer) = k.removesuffix(".weight"), pieces[k]
            mine = schema.encode(module, code, scale, outer)
            trained = code.float() * (scale if outer is None else scale * outer)
            error = max(error, relative_error(schema.loader_values(mine, module), trained))
            if (why := schema.loader_warning(tuple(code.shape))) and why not in notes:
                notes.append(why)
            tensors.update({n: t.contiguous() for n, t in mine.items()})
            quantized[module] = fmt
    plain = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in weights.items()
             if k not in sites and k not in drop}
    tensors.update({k: v.contiguous() for k, v in rename(plain).items()})
    kept = [p for p in kept_linears(model) if p in weights and p not in drop]
    ignore = sorted(k.removesuffix(".weight") for k in rename({p: weights[p] for p in kept}))
    if any(site.experts for site in sites.values()) and (why := schema.experts_warning()):
        notes.append(why)
    if error > 0:
        notes.append(f"{schema.name}: the loader reads the weights back within a relative "
                     f"{error:.3g} of the trained values, not exactly (its scales' "
                     "arithmetic differs from the trained cast's)")
    for note in notes:
        warnings.warn(f"mixprec.export: {note}", stacklevel=3)
    return Exported(tensors, schema, ignore, quantized, error, notes)
