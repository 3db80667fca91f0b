"""Quantized Linears under torch's tensor-parallel plans (``parallelize_module``).

``ColwiseParallel`` leaves a Linear's weight ``Shard(0)`` (its outputs split) and feeds
it a replicated input; ``RowwiseParallel`` leaves it ``Shard(1)`` (its inputs split),
feeds it an input sharded on the last dim and all-reduces its partial output. A
``QuantizedLinear`` with such a DTensor weight (``tp_linear``) runs its three GEMMs on
the local shards, with the scales one process would use:

- a per-tensor amax (the weight's, an activation's, a gradient's) of an operand sharded
  on any dim is agreed by an all-reduce MAX over the tensor-parallel group;
- a per-row amax (rowwise, int8) of an operand sharded along the cast's own dim (the
  contracted K) is agreed the same way (one value per row); along the other dim a row is
  whole on every rank;
- block, MX and NVFP4 blocks are local where every shard cut lies on a block boundary
  (``tp_refusal`` says where not: ``engine.convert`` then keeps that Linear in 16 bits and
  warns); NVFP4's per-tensor amax is agreed, and its stochastic rounding draws the
  whole tensor's random numbers and keeps this rank's slice.

A colwise Linear's output is ``Shard(-1)``; a rowwise one's is ``Partial``: each rank's
sum over its share of K. Under the recipe's ``tp_reduce="fp32"`` (the default; its
``layout``, ``mixprec.recipe.configs.LayoutOptions``) those partial sums are the GEMM's
fp32 accumulators, so the all-reduce (or reduce-scatter) torch's plan then runs carries
fp32, and a forward hook after the plan's rounds the whole sum once to the output's
dtype and adds the bias, as one process does;
``tp_reduce="compute"`` rounds each rank's partial sum to the output's 16 bits first,
as torchao's ``Float8RowwiseParallel`` does (half the bytes, an ulp off one process's
sum). The backward's partial sums, a colwise Linear's input gradient, follow the same
option where the input is narrower than fp32 (an fp32 input's gradient is summed in
fp32 anyway). These sums are recorded in the engine's ``CommStats`` (``what="outputs"``,
``"input_grads"``), as are the amax all-reduces (``op="all_reduce", what="amax"``),
where the engine attached it (``attach_comm_stats``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from mixprec.formats.gemm.base import LinearFormat
from mixprec.formats.mm import _QuantizedMatmul
from mixprec.formats.quantized import Quantized
from mixprec.parallel.comm_stats import CommStats
from mixprec.parallel.tp_agree import agreement

if TYPE_CHECKING:
    from torch import nn

__all__ = ["TPLayout", "tp_layout", "layout_of", "read_layout",
           "tp_refusal", "spec_refusal", "tp_linear", "attach_comm_stats",
           "is_dtensor", "watch_sums"]


#: the role -> sharded dim of its 2-D operand, by the weight's sharded dim (0: colwise,
#: 1: rowwise); None: the operand is whole on every rank
_ROLE_DIMS = {0: {"input": None, "weight": 0, "grad_output": 1},
              1: {"input": 1, "weight": 1, "grad_output": None}}



def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor (without importing DTensor where none exists)."""
    return type(t).__name__ == "DTensor" and hasattr(t, "placements")


@dataclass(frozen=True)
class TPLayout:
    """How a Linear's weight lies on its tensor-parallel mesh."""

    #: the 1-D mesh the weight is sharded on
    mesh: Any
    #: the weight's sharded dim in (out, in) layout: 0 colwise, 1 rowwise
    sharded: int
    #: this rank's offset along that dim, and the dim's whole size
    offset: int
    full: int

    def holds(self, w: torch.Tensor) -> bool:
        """Whether ``w`` (a DTensor weight in (out, in) layout) lies as this layout says:
        the same mesh, sharded dim and whole size (what fixes the offset)."""
        return (w.device_mesh is self.mesh and w.placements[0].is_shard()
                and w.placements[0].dim % 2 == self.sharded
                and w.shape[self.sharded] == self.full)

    @property
    def group(self) -> dist.ProcessGroup:
        """The tensor-parallel process group (the mesh's one dim)."""
        return self.mesh.get_group(0)

    def dim_of(self, role: str) -> int | None:
        """The dim of ``role``'s 2-D operand that is sharded (None: whole everywhere)."""
        return _ROLE_DIMS[self.sharded][role]


def _placement_error(w) -> str | None:
    return _lie_error(w.device_mesh, w.placements)


def _lie_error(mesh, placements) -> str | None:
    if mesh.ndim != 1:
        return (f"its weight is a DTensor on a {mesh.ndim}-D mesh; quantized "
                "Linears take a 1-D tensor-parallel mesh (FSDP over TP gathers to one)")
    p = placements[0]
    if not p.is_shard() or p.dim not in (0, 1, -1, -2):
        return (f"its weight is placed {p} on the mesh; quantized Linears take torch's "
                "ColwiseParallel (Shard(0)) and RowwiseParallel (Shard(1)) weights")
    return None


def tp_layout(w: torch.Tensor) -> TPLayout:
    """``w`` (a DTensor weight in (out, in) layout) as a ``TPLayout``."""
    why = _placement_error(w)
    if why is not None:
        raise NotImplementedError(f"tensor-parallel quantized Linear: {why}. Keep the "
                                  "Linear in 16 bits (a recipe rule layer:NAME=bf16).")
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    dim = w.placements[0].dim % 2
    _, offset = compute_local_shape_and_global_offset(w.shape, w.device_mesh, w.placements)
    return TPLayout(w.device_mesh, dim, int(offset[dim]), int(w.shape[dim]))


def layout_of(mod: nn.Module, w: torch.Tensor) -> TPLayout:
    """``mod``'s cached ``TPLayout`` of its DTensor weight ``w``, computed once (the
    offset is read from the mesh on the host) and again only where ``w`` lies otherwise:
    compiled code reads it as a constant instead of breaking the graph at the offset."""
    lay = mod._tp_layout
    if lay is None or not lay.holds(w):
        lay = mod._tp_layout = tp_layout(w)
    return lay


def read_layout(mod: nn.Module) -> None:
    """``mod``'s layout (``layout_of``) read now, on the host, where its DTensor weight
    takes one: a compiled forward then finds it cached."""
    w = mod.weight.t() if mod.transposed else mod.weight
    if is_dtensor(w) and _placement_error(w) is None:
        layout_of(mod, w)


def tp_refusal(fmt: LinearFormat, weight: torch.Tensor) -> str | None:
    """Why a Linear of format ``fmt`` whose weight is ``weight`` ((out, in)) cannot run on its
    tensor-parallel shards (None: it can, or the weight is no DTensor): a placement
    other than colwise / rowwise, or a block-scaled format whose blocks a shard cut
    splits."""
    if not is_dtensor(weight):
        return None
    return _format_refusal(fmt) or _refusal(fmt, weight.device_mesh, weight.placements,
                                            weight.shape)


def spec_refusal(fmt: LinearFormat, spec: Any, transposed: bool = False) -> str | None:
    """``tp_refusal`` of the DTensor weight a forward will see, given by its ``spec``
    (a ``DTensorSpec``: FSDP2's unsharded parameter over a tensor-parallel plan, on the
    plan's mesh while the stored shard lies on FSDP's and the plan's);
    ``transposed``: the weight is stored (in, out), as GPT-2's ``Conv1D`` holds it."""
    from torch.distributed.tensor import Shard

    placements, shape = tuple(spec.placements), tuple(spec.shape)
    if transposed:
        placements = tuple(Shard(1 - p.dim % 2) if p.is_shard() else p for p in placements)
        shape = shape[::-1]
    return _format_refusal(fmt) or _refusal(fmt, spec.mesh, placements, shape)


def _format_refusal(fmt: LinearFormat) -> str | None:
    if fmt.tp_unsupported is None:
        return None
    return (f"tensor parallel: the {fmt.name} format does not run on shards: "
            f"{fmt.tp_unsupported}; it runs in 16 bits")


def _refusal(fmt: LinearFormat, mesh, placements, shape) -> str | None:
    why = _lie_error(mesh, placements)
    if why is not None:
        return f"tensor parallel: {why}"
    dim = placements[0].dim % 2
    unit = fmt.scales.tile if fmt.block_scaled else 1
    n, world = shape[dim], mesh.size()
    chunk = math.ceil(n / world)
    if unit > 1 and world > 1 and chunk % unit:
        what = ("output features" if dim == 0 else "input features")
        return (f"tensor parallel: its {n} {what} split over {world} ranks cut at "
                f"multiples of {chunk}, not of the {fmt.name} format's {unit}-element "
                f"blocks, which would then span two ranks; it runs in 16 bits (make "
                f"the dim a multiple of {unit * world}, or pick fp8-current / "
                "fp8-rowwise for it)")
    return None


def attach_comm_stats(modules: dict, stats: CommStats | None) -> None:
    """The quantized Linears (by name) record their collectives in ``stats``."""
    for name, m in modules.items():
        m.tp_comm_stats, m.tp_name = stats, name


def _local(t):
    return t.to_local() if is_dtensor(t) else t


def _sums_fp32(mod: nn.Module, dtype: torch.dtype) -> bool:
    """Whether ``mod``'s partial sums, wanted in ``dtype``, cross the ranks in fp32
    instead (the recipe's ``tp_reduce="fp32"`` and a ``dtype`` narrower than fp32)."""
    return mod.fp8_recipe.layout.tp_reduce == "fp32" and dtype != torch.float32


def tp_linear(mod: nn.Module, x: torch.Tensor, w: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """``mod``'s forward on tensor-parallel shards: ``x`` (a DTensor as torch's plan
    prepared it, or a local tensor of the layout's input) times the DTensor weight ``w``
    (out, in), plus the bias; a DTensor ``Shard(-1)`` (colwise) or ``Partial``
    (rowwise, in fp32 under ``tp_reduce="fp32"``) that the plan's output hook
    redistributes, and ``mod``'s rounding hook (``_round_sum``) then finishes."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    lay = layout_of(mod, w)
    mesh = lay.mesh
    want = [Replicate()] if lay.sharded == 0 else [Shard(x.dim() - 1)]
    if not is_dtensor(x):
        x = DTensor.from_local(x, mesh, want, run_check=False)
    split = x.placements[0]
    if lay.sharded == 0 and split.is_shard() and split.dim % x.dim() != x.dim() - 1:
        xl = _gather_input(mod, x, lay)  # sequence parallel: gathered as the format's codes
    elif lay.sharded == 0 and x.requires_grad and _sums_fp32(mod, x.dtype):
        xl = x.redistribute(mesh, want).to_local(grad_placements=[Replicate()])
        xl = _SummedGrad.apply(xl, lay, mod.tp_comm_stats)  # its dgrad sums in fp32
    else:
        x = x.redistribute(mesh, want)
        # colwise: each rank's input gradient is a partial sum over the output shards
        xl = x.to_local(grad_placements=[Partial()] if lay.sharded == 0 else None)
    lead = xl.shape[:-1]
    wide = lay.sharded == 1 and _sums_fp32(mod, out_dtype)
    y = _QuantizedMatmul.apply(xl.reshape(-1, xl.shape[-1]), w.to_local(), mod,
                               torch.float32 if wide else out_dtype,
                               torch.is_grad_enabled(), out_dtype if wide else None)
    if lay.sharded == 0:
        if mod.bias is not None:  # this rank's slice of the bias, in high precision
            y = (y.float() + _local(mod.bias).float()).to(out_dtype)
        y = y.reshape(*lead, y.shape[-1])
        shape = (*lead, mod.out_features)
        stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        return DTensor.from_local(y, mesh, [Shard(y.dim() - 1)], run_check=False,
                                  shape=torch.Size(shape), stride=stride)
    y = DTensor.from_local(y.reshape(*lead, y.shape[-1]), mesh, [Partial()],
                           run_check=False)
    if mod.bias is not None and not wide:  # DTensor adds the bias once to the partials
        y = (y.float() + mod.bias.float()).to(out_dtype)
    watch_sums(mod)
    sent = torch.empty(y.shape, dtype=y.dtype, device="meta")  # for CommStats
    mod._tp_sum = (sent, out_dtype if wide else None)
    return y


def watch_sums(mod: nn.Module) -> None:
    """``mod`` (a quantized Linear on tensor-parallel shards) gets its rounding hook
    (``_round_sum``) once, after the hooks it has: the plan's output hook, and before
    FSDP's, which ``engine.convert`` (that calls this) precedes."""
    if _round_sum not in mod._forward_hooks.values():
        mod.register_forward_hook(_round_sum)


def _round_sum(mod: nn.Module, inputs, out):
    """A rowwise Linear's forward hook, after the plan's: the sum it reduced is recorded
    (``all_reduce`` where ``out`` is whole, ``reduce_scatter`` where it is split,
    ``what="outputs"``); an fp32 sum (``tp_reduce="fp32"``) is rounded once to the
    output's dtype and the bias added in fp32, as one process does."""
    from torch.distributed.tensor import Partial, Replicate

    if getattr(mod, "_tp_sum", None) is None:
        return None
    (sent, dtype), mod._tp_sum = mod._tp_sum, None
    if is_dtensor(out):
        p = out.placements[0]
        op = None if p.is_partial() else "all_reduce" if p.is_replicate() else "reduce_scatter"
    else:
        op = "all_reduce" if out.numel() == sent.numel() else "reduce_scatter"
    if op is not None and mod.tp_comm_stats is not None:
        mod.tp_comm_stats.record(sent, op=op, what="outputs")
    if dtype is None:
        return None
    y = out.to(dtype)
    if mod.bias is not None:
        b = mod.bias
        if is_dtensor(b) and not is_dtensor(y):  # split tokens: each rank's bias grad
            b = b.to_local(grad_placements=[Replicate() if op == "all_reduce"  # is a
                                            else Partial()])  # partial sum
        y = (y.float() + b.float()).to(dtype)
    return y


class _SummedGrad(torch.autograd.Function):
    """A colwise Linear's input (whole on each rank) in fp32: the input gradient, each
    rank's partial sum over its output features, is all-reduced in fp32 and rounded
    once to the input's dtype (``tp_reduce="fp32"``)."""

    @staticmethod
    def forward(ctx, x, lay, stats):
        ctx.lay, ctx.stats, ctx.dtype = lay, stats, x.dtype
        return x.float()

    @staticmethod
    def backward(ctx, g):
        g = g.float().contiguous().clone()
        if ctx.stats is not None:
            ctx.stats.record(g, op="all_reduce", what="input_grads")
        dist.all_reduce(g, group=ctx.lay.group)
        return g.to(ctx.dtype), None, None


class _Gathered(torch.autograd.Function):
    """The gathered input (``value``, whole) as a function of this rank's rows
    ``local``: its gradient, a partial sum on each rank (fp32 where ``value`` is), is
    reduce-scattered back to the rows (as torch's plan does for a 16-bit gather) and
    recorded in ``stats`` (``what="input_grads"``)."""

    @staticmethod
    def forward(ctx, local, value, mesh, dim, stats):
        ctx.mesh, ctx.dim, ctx.stats = mesh, dim, stats
        return value

    @staticmethod
    def backward(ctx, g):
        from torch.distributed.tensor import DTensor, Partial, Shard

        if ctx.stats is not None:
            ctx.stats.record(g, op="reduce_scatter", what="input_grads")
        part = DTensor.from_local(g.contiguous(), ctx.mesh, [Partial()], run_check=False)
        grad = part.redistribute(ctx.mesh, [Shard(ctx.dim)]).to_local()
        return grad, None, None, None, None


#: a CommStats for the fallback warnings of a Linear outside an engine
_LOOSE_STATS: list = []


def _stats_of(mod):
    if mod.tp_comm_stats is not None:
        return mod.tp_comm_stats
    if not _LOOSE_STATS:
        _LOOSE_STATS.append(CommStats())
    return _LOOSE_STATS[0]


def _gather_input(mod, x, lay: TPLayout) -> torch.Tensor:
    """A colwise Linear's input sharded on a token dim (``SequenceParallel`` before it),
    whole on this rank: a per-tensor format casts its rows with the amax agreed over the
    group and all-gathers the fp8 codes, which the forward GEMM and wgrad take as the
    input's cast (``mod._given_input``); the other formats cast the input along tokens
    for wgrad, from its high-precision values, so those are gathered (a ``CommStats.fallback``).
    Each gather is recorded as ``("all_gather", "activations")``."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    stats, dim, q = _stats_of(mod), x.placements[0].dim % x.dim(), mod.quantizer
    name = getattr(mod, "tp_name", None) or f"Linear({mod.in_features}, {mod.out_features})"
    local = x.to_local()
    if not q.per_tensor:
        stats.fallback(f"activations:{name}", q.name, local.dtype,
                       f"the {q.name} format casts a Linear's input along the tokens for "
                       "its weight gradient, from its high-precision values, so sequence "
                       "parallelism gathers those (fp8-current and fp8 gather e4m3 codes)")
        stats.record(local, op="all_gather", what="activations")
        value = x.redistribute(lay.mesh, [Replicate()]).to_local().detach()
        if _sums_fp32(mod, local.dtype):  # the input gradient's sums in fp32
            value = value.float()
        return _Gathered.apply(local, value, lay.mesh, dim, mod.tp_comm_stats)
    cast = q.cast(local.reshape(-1, local.shape[-1]), "input", 1, mod.scaling_state(),
                  torch.is_grad_enabled(),  # rows are split: the amax is the whole's
                  agree=agreement(lay, "input", stats, dim=0))
    codes = cast.codes.view(local.shape)
    stats.record(codes, op="all_gather", what="activations")
    raw = DTensor.from_local(codes.view(torch.uint8), lay.mesh, [Shard(dim)],
                             run_check=False, shape=x.shape, stride=x.stride())
    whole = raw.full_tensor().view(codes.dtype)  # gloo has no fp8: the codes as bytes
    mod._given_input = Quantized(whole.reshape(-1, whole.shape[-1]), cast.inv)
    value = whole.float() * cast.inv  # what the 16-bit gather held, cast
    if not _sums_fp32(mod, local.dtype):  # fp32: the input gradient's sums stay fp32
        value = value.to(local.dtype)
    return _Gathered.apply(local, value, lay.mesh, dim, mod.tp_comm_stats)
