"""FSDP2's ``fp8_all_gather`` for experts weights: per-tensor formats gather the codes.

FSDP2 cuts an experts module's 3-D weight (E × N × K, or E × K × N transposed) along
dim 0, the experts: each rank holds ``ceil(E / world)`` whole experts (the last fewer,
padded), so a per-tensor format's cast of each expert (``fp8``, ``fp8-current``: one
scale per expert, ``mixprec.experts.grouped``) is the cast of the rank's experts with
scales every rank holds. Those scales follow from each expert's amax, agreed once after
each optimizer step in the all-reduce MAX that carries the Linears' (``agree_amaxes_``:
E floats per projection, kept in the format's ``fp8_gather_amax`` buffer, not saved).

Each rank sends its experts' e4m3 codes (1 byte per element); the projection gets an
``Fp8Weight`` with one scale and one amax per expert, which the grouped GEMM takes as
its forward casts (the dgrad reuses them, as a per-tensor Linear's does) without a
second cast: the same codes and scales as casting the weight FSDP would have gathered
(the shard is first rounded to the dtype FSDP sends), so training is bit for bit the
same. Delayed scaling records each expert's agreed amax as it would record the
gathered weight's.

Rowwise, block, MX and NVFP4 gather each expert's casts
(``mixprec.experts.gather_casts``); a weight neither can take (``why_not_gathered``:
int8, GPT-OSS's in × out layout outside the per-tensor formats, one rank, a mesh not
cut along the experts) is gathered as FSDP holds it, a ``CommStats`` fallback
(``note_whole_gathers``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from mixprec.experts import adapter
from mixprec.experts.gather_casts import cast_hooks
from mixprec.experts.hook import _projections, experts_modules
from mixprec.formats.precast import Fp8Weight
from mixprec.parallel.gather_casts import plain_gather_hooks

__all__ = ["why_not_gathered", "install_experts_gather", "note_whole_gathers",
           "WHOLE_GATHER"]


def why_not_gathered(fmt: nn.Module, w: torch.Tensor, transposed: bool = False
                     ) -> str | None:
    """Why FSDP2 cannot gather experts weight ``w`` (its sharded parameter) of format
    ``fmt`` as codes (None: it can): in a per-tensor format it needs the weight cut
    along the experts on a 1-D mesh; in a format with gathered casts, also more than
    one rank and the weight stored out × in (not ``transposed``)."""
    from torch.distributed.tensor import Shard

    q = fmt.quantizer
    if w.device_mesh.ndim != 1 or tuple(w.placements) != (Shard(0),):
        return (f"its weight is sharded {tuple(w.placements)} over a {w.device_mesh.ndim}-D "
                "mesh, not cut along the experts on a 1-D mesh")
    if q.per_tensor:
        return None
    if not q.gathers_casts:
        return f"fp8_scaling={q.name} has no gathered cast"
    if transposed:
        return ("its weight is stored in × out (GPT-OSS): its experts' casts are made "
                "along the transposed view; the per-tensor formats (fp8, fp8-current) "
                "gather it as codes")
    if w.device_mesh.size() == 1:
        return ("one rank: FSDP2 copies the weight there, passing on one input only, "
                "not the casts' several")
    return None


def _shard(w: torch.Tensor, sent: torch.dtype | None) -> torch.Tensor:
    """The rank's experts of sharded weight ``w`` as FSDP would send them (``sent``)."""
    local = w._local_tensor.detach()
    return local.to(sent or local.dtype)


def _first(w: torch.Tensor) -> tuple[int, int]:
    """The rank's first expert and the experts per rank (``ceil(E / world)``)."""
    mesh = w.device_mesh
    per = math.ceil(w.shape[0] / mesh.size())
    return mesh.get_local_rank() * per, per


def _amax_part(w: torch.Tensor, sent: torch.dtype | None):
    """A format's ``gather_amax_part``: each expert's amax of this rank's shard of
    ``w`` (0 for the experts other ranks hold), for the all-reduce MAX that makes it
    each expert's."""
    start, _ = _first(w)

    def gather_amax_part() -> torch.Tensor:
        shard = _shard(w, sent)
        out = torch.zeros(w.shape[0], device=shard.device)
        if shard.shape[0]:
            out[start:start + shard.shape[0]] = shard.abs().amax(dim=(1, 2)).float()
        return out

    return gather_amax_part


def _hooks(fmt: nn.Module, w: torch.Tensor, sent: torch.dtype | None, stats: Any):
    """FSDP2's one-argument pre- and post-all-gather hooks: each rank's experts cast
    with the agreed scales go out as uint8; the projection gets an ``Fp8Weight``."""
    experts = w.shape[0]
    start, per = _first(w)
    dtype = fmt.quantizer.dtype("weight")

    def fsdp_pre_all_gather(mesh):
        shard = _shard(w, sent)
        amax = fmt.fp8_gather_amax.detach().clone()  # this gather's, whatever comes next
        with torch.autocast(shard.device.type, enabled=False):
            scale = adapter.segment_scales(fmt, amax, "weight")
            mine = scale[start:start + shard.shape[0]].view(-1, 1, 1)
            codes = adapter.cast_scaled(fmt, shard, mine, "weight").view(torch.uint8)
        if codes.shape[0] < per:  # FSDP's even shard: pad the tail
            codes = torch.cat([codes, codes.new_zeros((per - codes.shape[0],
                                                       *codes.shape[1:]))])
        if stats is not None:
            stats.record(codes, op="all_gather", what="weights")
        return (codes.contiguous(),), (scale, amax)

    def fsdp_post_all_gather(outputs, metadata, param_dtype, *, out=None):
        (raw,), (scale, amax) = outputs, metadata
        if out is not None:  # the same buffer, gathered again: scales and amaxes are new
            out._scale, out._amax = scale, amax
            return None
        rows = raw.shape[0]  # the padded experts of the last rank: scale 1, amax 0
        scale = torch.cat([scale, scale.new_ones(rows - experts)])
        amax = torch.cat([amax, amax.new_zeros(rows - experts)])
        return Fp8Weight(raw.view(dtype), scale, amax, param_dtype), (raw,)

    return fsdp_pre_all_gather, fsdp_post_all_gather


#: why FSDP2's ``fp8_all_gather`` leaves an experts module's weights in high precision
WHOLE_GATHER = ("FSDP2 gathers this experts module's 3-D weight as it holds it and the "
                "grouped GEMM casts each expert's slice after the gather, not as codes "
                "and scales: ")


def note_whole_gathers(model: nn.Module, stats: Any, sent: torch.dtype | None) -> list[str]:
    """Under FSDP2 with ``fp8_all_gather``: note in ``stats`` (``CommStats.fallback``,
    a warning once) each converted experts projection whose 3-D weight FSDP shards and
    does not gather as codes (``install_experts_gather``), gathered in ``sent``
    (default: the weight's dtype), and record each of its gathers there (on a 1-D
    mesh). Returns their names."""

    noted = []
    for name, m in experts_modules(model).items():
        for proj in _projections(m):
            fmt, w = getattr(m, f"{proj}_fp8", None), getattr(m, proj)
            if fmt is None or not hasattr(w, "_local_tensor") \
                    or getattr(fmt, "gathered_as_codes", False):
                continue
            what = f"experts:{name}.{proj}"
            why = why_not_gathered(fmt, w, m.is_transposed) or "its hooks are not set"
            stats.fallback(what, fmt.quantizer.name, sent or w.dtype, WHOLE_GATHER + why)
            if w.device_mesh.ndim == 1:
                w._local_tensor.fsdp_pre_all_gather, w._local_tensor.fsdp_post_all_gather \
                    = plain_gather_hooks(w, stats, sent)
            noted.append(what)
    return noted


def install_experts_gather(model: nn.Module, stats: Any,
                           sent: torch.dtype | None) -> list[nn.Module]:
    """Under FSDP2 with ``fp8_all_gather``: the hooks on each converted experts
    projection whose weight can be gathered as codes (``why_not_gathered``), each gather
    recorded in ``stats`` (a ``CommStats``); the others noted there as fallbacks
    (``note_whole_gathers``). Returns the per-tensor formats gathered as codes, whose
    ``fp8_gather_amax`` ``refresh_gather_scales_`` fills before the first forward (the
    other formats' casts, ``gather_casts.cast_hooks``, need nothing agreed)."""
    done = []
    for m in experts_modules(model).values():
        for proj in _projections(m):
            fmt, w = getattr(m, f"{proj}_fp8", None), getattr(m, proj)
            if fmt is None or not hasattr(w, "_local_tensor") \
                    or why_not_gathered(fmt, w, m.is_transposed) is not None:
                continue
            if not fmt.quantizer.per_tensor:  # each expert's casts, whole on one rank
                local = w._local_tensor
                local.fsdp_pre_all_gather, local.fsdp_post_all_gather = cast_hooks(
                    fmt, w, sent, stats)
                fmt.gathered_as_codes = True
                continue
            if getattr(fmt, "fp8_gather_amax", None) is None:
                fmt.register_buffer("fp8_gather_amax", torch.zeros(
                    w.shape[0], device=w._local_tensor.device), persistent=False)
            fmt.gathered_as_codes = True
            fmt.gather_amax_part = _amax_part(w, sent)
            local = w._local_tensor
            local.fsdp_pre_all_gather, local.fsdp_post_all_gather = _hooks(fmt, w, sent,
                                                                           stats)
            done.append(fmt)
    note_whole_gathers(model, stats, sent)
    return done
