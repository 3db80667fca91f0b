"""A weight that arrives cast: ``Fp8Weight`` holds a weight's e4m3 codes and the per-tensor
scale they were cast with (one per expert for a 3-D experts weight), and a rank's shard
amax. FSDP2's fp8 all-gather (``mixprec.parallel.gather``) hands one to a Linear or an
experts module in place of the weight; a per-tensor format takes its codes as its cast,
and any other op sees the dequantized value."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

__all__ = ["Fp8Weight"]

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
