"""fp8 all-gather under FSDP2: the weights of per-tensor Linear formats cross the wire
as e4m3 bytes (``fp8_all_gather=true``: 0.25x of fp32's bytes, the same codes); those of
the other formats as the codes and scales of their casts (``mixprec.parallel.gather_casts``,
installed from here too).

Each rank casts its shard with a scale every rank holds before the gather: delayed
scaling's from the amax history the ranks agree on each step, current scaling's from the
weights' amax, agreed once after each optimizer step (``agree_amaxes_``: one all-reduce
MAX per step). FSDP2's ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` hooks, set on
the local shards after ``fully_shard``, send the codes as uint8 and hand the Linear an
``Fp8Weight`` (the codes and their scale; any other use sees the dequantized weight).
Training so equals training without it bit for bit where the weight is fp32. The 3-D
weights of transformers experts modules in these formats gather the same way, with one
scale per expert (``mixprec.experts.gather``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from mixprec.formats.precast import Fp8Weight
from mixprec.formats.scaling import amax_to_scale, cast_to_fp8, fp8_max_tensor, nan_if_not_finite
from mixprec.parallel.comm_stats import CommStats
from mixprec.parallel.gather_casts import install_cast_gather

__all__ = ["Fp8Weight", "install_fp8_all_gather", "gathers_fp8", "agree_amaxes_",
           "refresh_gather_scales_"]

_E4M3 = torch.float8_e4m3fn


def gathers_fp8(m: nn.Module) -> bool:
    """Whether ``m``'s weight is all-gathered as fp8 (its local shard has the hooks,
    not those of a weight left in 16 bits)."""
    w = getattr(m, "weight", None)
    local = getattr(w, "_local_tensor", None)
    return (local is not None and hasattr(local, "fsdp_pre_all_gather")
            and not getattr(local, "gathers_16_bits", False))


def _shard(m: nn.Module) -> torch.Tensor:
    """The rank's shard of ``m.weight`` (a DTensor's local tensor)."""
    return m.weight._local_tensor


def _local_amax(m: nn.Module) -> torch.Tensor:
    """The shard's amax in fp32 (0 for an empty shard: more ranks than rows)."""
    t = _shard(m).detach()
    if t.numel() == 0:
        return torch.zeros((), device=t.device)
    return t.abs().amax().float()


def _hooks(m: nn.Module, stats=None):
    """The pre- and post-all-gather hooks for Float8Linear ``m``'s weight (each gather
    recorded in ``stats``, a ``CommStats``, where given)."""

    def fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy):
        shard = _shard(m).detach()
        amax = _local_amax(m)
        if not m.quantizer.has_history:  # current scaling
            scale = m.fp8_gather_scale
        else:
            scale = nan_if_not_finite(m.fp8_scale[1], amax)
        scale = scale.detach().clone()  # this gather's scale, whatever the buffer does next
        codes = cast_to_fp8(shard, scale, _E4M3).view(torch.uint8)
        rows = math.ceil(outer_size[0] / mesh.size()) if len(outer_size) else 0
        if len(outer_size) and codes.shape[0] < rows:  # FSDP's even shard: pad the tail
            pad = codes.new_zeros((rows - codes.shape[0], *codes.shape[1:]))
            codes = torch.cat([codes, pad])
        if stats is not None:
            stats.record(codes, op="all_gather", what="weights")
        return (codes,), (scale, amax)

    def fsdp_post_all_gather(outputs, metadata, param_dtype, *, out=None):
        (raw,), (scale, amax) = outputs, metadata
        if out is not None:  # the same buffer, gathered again: scale and amax are new
            out._scale, out._amax = scale, amax
            return None
        return Fp8Weight(raw.view(_E4M3), scale, amax, param_dtype), (raw,)

    return fsdp_pre_all_gather, fsdp_post_all_gather


def install_fp8_all_gather(modules: list[nn.Module] | dict[str, nn.Module],
                           stats: CommStats | None = None,
                           sent: torch.dtype | None = None) -> list[nn.Module]:
    """Set the hooks on each Float8Linear whose weight FSDP2 shards (a DTensor);
    returns those modules. Per-tensor formats here (current scaling
    gets a ``fp8_gather_scale`` buffer, not saved: it follows from the weights, filled
    by ``refresh_gather_scales_``); the others by ``gather_casts.install_cast_gather``,
    which notes each weight it leaves in 16 bits (``sent``) in ``stats``."""
    named = modules if isinstance(modules, dict) else {str(i): m for i, m in
                                                       enumerate(modules)}
    done = install_cast_gather(named, stats, sent)
    for m in named.values():
        if not m.quantizer.per_tensor or \
                not hasattr(getattr(m, "weight", None), "_local_tensor"):
            continue
        if not m.quantizer.has_history and getattr(m, "fp8_gather_scale", None) is None:
            m.register_buffer("fp8_gather_scale", torch.ones((), device=_shard(m).device),
                              persistent=False)
        pre, post = _hooks(m, stats)
        local = _shard(m)
        local.fsdp_pre_all_gather, local.fsdp_post_all_gather = pre, post
        done.append(m)
    return done


def _current(fp8_modules) -> list[nn.Module]:
    return [m for m in fp8_modules if m.quantizer.per_tensor and not m.quantizer.has_history
            and gathers_fp8(m)]


def _agreed(fp8_modules) -> list[nn.Module]:
    """The modules whose gathered casts need an amax the ranks agree on (an experts
    format gathered as codes: one per expert, ``mixprec.experts.gather``)."""
    return [m for m in fp8_modules if getattr(m, "fp8_gather_amax", None) is not None
            and (gathers_fp8(m) or hasattr(m, "gather_amax_part"))]


def _set_agreed(mods, flat: torch.Tensor) -> None:
    n = 0
    for m in mods:
        k = m.fp8_gather_amax.numel()
        m.fp8_gather_amax.copy_(flat[n:n + k].view_as(m.fp8_gather_amax))
        n += k


def _agreed_parts(mods) -> list[torch.Tensor]:
    return [m.gather_amax_part() if hasattr(m, "gather_amax_part")
            else m.quantizer.gather_amax(_shard(m)).reshape(-1) for m in mods]


def _set_gather_scales(mods, amax: torch.Tensor) -> None:
    for m, a in zip(mods, amax):
        # as the per-tensor cast divides (a tensor max, not reciprocal(a) * 448)
        s = amax_to_scale(a, fp8_max_tensor(_E4M3, a.device), m.margin, torch.ones_like(a))
        m.fp8_gather_scale.copy_(nan_if_not_finite(s, a))


def refresh_gather_scales_(fp8_modules: Sequence[nn.Module],
                           all_reduce_max_: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Current scaling's gather scales, and the other formats' agreed amaxes, from the
    weights as they are now: the shards' amaxes, max over ranks in one all-reduce (a
    collective: every rank calls it)."""
    mods, agreed = _current(fp8_modules), _agreed(fp8_modules)
    if mods or agreed:
        flat = all_reduce_max_(torch.cat([_local_amax(m).reshape(1) for m in mods]
                                         + _agreed_parts(agreed)))
        _set_gather_scales(mods, flat[:len(mods)])
        _set_agreed(agreed, flat[len(mods):])


def agree_amaxes_(fp8_modules: Sequence[nn.Module],
                  all_reduce_max_: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """After an optimizer step: the step's amax histories become the max over ranks and
    current scaling's gather scales and the other formats' agreed amaxes follow the new
    weights, in one all-reduce (none where no module has any)."""
    mods, agreed = _current(fp8_modules), _agreed(fp8_modules)
    hists = [m for m in fp8_modules if m.quantizer.has_history]
    parts = [m.fp8_amax_history[:, 0] for m in hists] + [_local_amax(m).reshape(1)
                                                         for m in mods]
    parts += _agreed_parts(agreed)
    if not parts:
        return
    flat = torch.cat(parts)
    all_reduce_max_(flat)
    n = 0
    for m in hists:
        rows = m.fp8_amax_history.shape[0]
        m.fp8_amax_history[:, 0] = flat[n:n + rows]
        n += rows
    _set_gather_scales(mods, flat[n:n + len(mods)])
    _set_agreed(agreed, flat[n + len(mods):])
