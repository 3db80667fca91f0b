"""fp8 all-gather under FSDP2: the weights of per-tensor Linear formats cross the wire
as e4m3 bytes (``fp8_all_gather=true``: 0.25x of fp32's bytes, the same codes); those of
the other formats as the codes and scales of their casts (``mixprec.fp8.gather_casts``,
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
from torch.utils._pytree import tree_map

from mixprec.fp8.scaling import amax_to_scale, cast_to_fp8, fp8_max_tensor, nan_if_not_finite
from mixprec.parallel.comm_stats import CommStats

__all__ = ["Fp8Weight", "install_fp8_all_gather", "gathers_fp8", "agree_amaxes_",
           "refresh_gather_scales_"]

_E4M3 = torch.float8_e4m3fn
# ops that keep a Fp8Weight (applied to the codes; the scale is per tensor)
_KEEP = {torch.ops.aten.detach.default, torch.ops.aten.alias.default,
         torch.ops.aten.as_strided.default, torch.ops.aten.t.default,
         torch.ops.aten.transpose.int, torch.ops.aten.view.default,
         torch.ops.aten._unsafe_view.default}


class Fp8Weight(torch.Tensor):
    """A gathered weight as e4m3 codes and the scale they were cast with
    (``value = codes / scale``), shaped and typed as the weight it stands for, and this
    rank's shard amax (for delayed scaling's history). Float8Linear takes the codes as
    its cast; any other op sees the dequantized value.

    An experts weight (E × N × K) has one scale and one agreed amax per expert (vectors
    of E): views that keep dim 0 keep them, ``w[e]`` is expert e's per-tensor cast."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, codes: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor,
                dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(
            cls, codes.shape, strides=codes.stride(), storage_offset=codes.storage_offset(),
            dtype=dtype, device=codes.device, requires_grad=False)

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor,
                 dtype: torch.dtype):
        self._codes, self._scale, self._amax = codes, scale, amax

    def dequantize(self) -> torch.Tensor:
        """``codes / scale`` in this tensor's dtype (the codes times the inverse scale,
        in fp32, as the fp8 GEMMs apply it)."""
        inv = torch.reciprocal(self._scale)
        if inv.dim():  # one per expert: along dim 0
            inv = inv.view(-1, *[1] * (self._codes.dim() - 1))
        return (self._codes.float() * inv).to(self.dtype)

    def __repr__(self) -> str:
        return f"Fp8Weight(shape={tuple(self.shape)}, dtype={self.dtype}, e4m3 codes)"

    def __tensor_flatten__(self):
        return ["_codes", "_scale", "_amax"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner, dtype, outer_size, outer_stride):
        return Fp8Weight(inner["_codes"], inner["_scale"], inner["_amax"], dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _KEEP and isinstance(args[0], Fp8Weight) and not args[0]._scale.dim():
            w = args[0]
            codes = func(w._codes, *args[1:], **kwargs)
            return Fp8Weight(codes, w._scale, w._amax, w.dtype)
        if isinstance(args[0] if args else None, Fp8Weight) and args[0]._scale.dim():
            kept = _per_expert(func, args, kwargs)
            if kept is not None:
                return kept
        unwrap = lambda t: t.dequantize() if isinstance(t, Fp8Weight) else t  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))


_SAME_EXPERTS = {torch.ops.aten.as_strided.default, torch.ops.aten.view.default,
                 torch.ops.aten._unsafe_view.default}


def _per_expert(func, args, kwargs) -> Fp8Weight | None:
    """An op on an experts weight that keeps each expert's codes whole (None: it does
    not, and sees the dequantized value): ``w[e]`` (expert e's scale), a transpose of
    the last two dims, and FSDP's views of the first experts (a padded gather cut to E:
    their scales)."""
    w = args[0]
    if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
        return Fp8Weight(func(w._codes), w._scale, w._amax, w.dtype)
    if func is torch.ops.aten.select.int and args[1] == 0:
        e = args[2]
        return Fp8Weight(w._codes[e], w._scale[e], w._amax[e], w.dtype)
    if func is torch.ops.aten.transpose.int and 0 not in (args[1] % w.dim(),
                                                          args[2] % w.dim()):
        return Fp8Weight(func(w._codes, *args[1:]), w._scale, w._amax, w.dtype)
    if func in _SAME_EXPERTS and not kwargs and len(args[1]) == w.dim() \
            and tuple(args[1][1:]) == tuple(w.shape[1:]) and args[1][0] <= w.shape[0] \
            and (func is not torch.ops.aten.as_strided.default
                 or (tuple(args[2]) == w._codes.contiguous().stride()
                     and (len(args) < 4 or args[3] in (0, None)) and w._codes.is_contiguous())):
        n = args[1][0]
        return Fp8Weight(func(w._codes, *args[1:]), w._scale[:n], w._amax[:n], w.dtype)
    return None


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
    from mixprec.fp8.gather_casts import install_cast_gather

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
