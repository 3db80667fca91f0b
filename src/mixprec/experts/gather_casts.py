"""FSDP2's ``fp8_all_gather`` for experts weights in the formats with gathered casts
(rowwise, block, MX, NVFP4): each expert's casts cross the wire.

FSDP2 cuts an experts weight (E × N × K) along the experts, so every expert is whole
on one rank, which casts it as the grouped GEMM casts it (each weight cast the step
takes: ``weight_cast_dims``), nothing agreed with the other ranks. Each expert's casts
go out as ``mixprec.parallel.gather_casts.send_shard`` sends a Linear's weight (codes,
NVFP4's two to a byte; block scales in the kernel's dtype), plus what that function
leaves in its metadata because a Linear's ranks agree on it, and which here is each
expert's own: rowwise dgrad's column scales and NVFP4's per-tensor descale, in fp32.
The projection gets an ``ExpertsCasts``: ``w[e]`` is expert e's ``CastWeight``, whose
casts the grouped GEMM takes (``mixprec.experts.adapter.cast``) without casting again:
bit for bit the casts of the weight FSDP would have gathered (the shard first rounded
to the dtype FSDP sends). The grouped GEMM takes its host-read routes on such a weight
(under ``torch.compile``: a graph break), but for rowwise on a GPU, whose route stacks
the experts' casts on the device (``mixprec.experts.codes_grouped``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from mixprec.parallel.gather_casts import CastWeight, parts_hooks, send_shard

__all__ = ["ExpertsCasts", "cast_hooks"]

_SAME = {torch.ops.aten.as_strided.default, torch.ops.aten.view.default,
         torch.ops.aten._unsafe_view.default}


def _own(wires) -> list[tuple[int, str, torch.Size]]:
    """(wire, field, shape) of each per-expert value ``send_shard`` keeps in a wire."""
    return [(i, f, getattr(w, f).shape) for i, w in enumerate(wires)
            for f in ("shared", "outer") if getattr(w, f) is not None]


class ExpertsCasts(torch.Tensor):
    """An experts weight FSDP2 gathered as each expert's casts: per input of
    ``send_shard`` one tensor with a leading experts dim, then each expert's own
    column scales / descales as fp32 bytes; ``wires`` read them (``_own``). Shaped and
    typed as the weight; ``w[e]`` is expert e's ``CastWeight``, views that keep dim 0
    keep the casts, any other op sees the forward casts' values."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, parts: Sequence[torch.Tensor], wires: Sequence, shape: torch.Size,
                dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype,
                                                   device=parts[0].device,
                                                   requires_grad=False)

    def __init__(self, parts: Sequence[torch.Tensor], wires: Sequence, shape: torch.Size,
                 dtype: torch.dtype) -> None:
        self._parts, self._wires = tuple(parts), tuple(wires)

    def expert(self, e: int) -> CastWeight:
        """Expert ``e``'s casts as a ``CastWeight`` (its own column scales and
        descale in its wires)."""
        own = _own(self._wires)
        n = len(self._parts) - len(own)
        wires = list(self._wires)
        for (i, field, shape), raw in zip(own, self._parts[n:]):
            value = raw[e].view(torch.float32).reshape(shape).clone()
            wires[i] = dataclasses.replace(wires[i], **{field: value})
        return CastWeight([p[e] for p in self._parts[:n]], wires, self.shape[1:],
                          self.dtype, self.device)

    def dequantize(self) -> torch.Tensor:
        """Each expert's forward cast's value, stacked, in this tensor's dtype."""
        return torch.stack([self.expert(e).dequantize() for e in range(self.shape[0])])

    def __repr__(self) -> str:
        return f"ExpertsCasts(shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        w = args[0] if args else None
        if isinstance(w, ExpertsCasts):
            if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
                return ExpertsCasts(w._parts, w._wires, w.shape, w.dtype)
            if func is torch.ops.aten.select.int and args[1] == 0:
                return w.expert(args[2] % w.shape[0])
            if func in _SAME and not kwargs and len(args[1]) == w.dim() \
                    and tuple(args[1][1:]) == tuple(w.shape[1:]) \
                    and args[1][0] <= w.shape[0] \
                    and (func is not torch.ops.aten.as_strided.default
                         or len(args) < 4 or args[3] in (0, None)):
                n = args[1][0]  # FSDP's view of the first experts of a padded gather
                return ExpertsCasts([p[:n] for p in w._parts], w._wires,
                                    torch.Size([n, *w.shape[1:]]), w.dtype)

        def unwrap(t):
            return t.dequantize() if isinstance(t, ExpertsCasts) else t
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))


def _send_experts(q, shard: torch.Tensor, per: int) -> tuple[list[torch.Tensor], list]:
    """The uint8 inputs of this rank's experts (``shard``: e × N × K, padded to ``per``
    experts) and the wires of one expert (a rank without experts casts a zero one)."""
    experts = list(shard) or [shard.new_zeros(shard.shape[1:])]
    rows, sends = shard.shape[1], []
    with torch.autocast(shard.device.type, enabled=False):
        for t in experts:
            inputs, wires = send_shard(q, t, q.gather_amax(t), rows)
            own = [getattr(wires[i], f).float().reshape(-1).view(torch.uint8)
                   for i, f, _ in _own(wires)]
            sends.append(inputs + own)
    out = []
    for col in zip(*sends):
        t = torch.stack(col)[:shard.shape[0]]
        pad = t.new_zeros((per - t.shape[0], *t.shape[1:]))
        out.append(torch.cat([t, pad]).contiguous())
    return out, wires


def cast_hooks(fmt: nn.Module, w: torch.Tensor, sent: torch.dtype | None, stats: Any
               ) -> tuple[Callable, Callable]:
    """FSDP2's one-argument pre- and post-all-gather hooks for experts weight ``w``
    (its sharded parameter) of format ``fmt`` (an ``ExpertsFormat``): each rank's
    experts' casts out as uint8, recorded in ``stats``; an ``ExpertsCasts`` back."""
    shape = w.shape

    def send(mesh):
        local = w._local_tensor.detach()
        return _send_experts(fmt.quantizer, local.to(sent or local.dtype),
                             math.ceil(shape[0] / mesh.size()))

    def wrap(outputs, wires, param_dtype):
        rows = torch.Size([outputs[0].shape[0], *shape[1:]])
        return ExpertsCasts(outputs, wires, rows, param_dtype)

    return parts_hooks(send, wrap, stats)
