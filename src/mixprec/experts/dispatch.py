"""Expert parallelism's token exchange: dispatch to the rank owning each expert, in the
recipe's low-precision format, and combine back, each with its backward.

An EP group of ``world`` ranks holds ``E / world`` consecutive experts each. A rank
sorts its (token, expert) pairs by expert, exchanges the per-expert row counts
(``exchange``: one ``all_to_all_single`` of ``E`` int64s, then one host read: the split
sizes ``all_to_all_single`` takes), and sends each row to the owner of its expert:

- as the codes and scales of the format's forward input cast (``codes_dispatch``:
  ``fp8-current``'s e4m3 codes under each expert's per-tensor scale, ``fp8-rowwise``'s
  e4m3 row with one fp32 scale, ``fp8-block``'s 1×128 tiles with fp32 scales, MXFP8's
  1×32 tiles with e8m0 scales, NVFP4's e2m1 codes two to a byte with 1×16 e4m3
  scales). The sender casts with the very cast the receiver's grouped GEMM would make
  (the format's ``cast``; for ``fp8-current`` and NVFP4, whose scale spans an expert's
  rows, with the expert's amax, agreed first in an all-reduce MAX of ``E`` fp32, from
  which every rank computes the expert's scale or NVFP4 descale), and the receiver's
  GEMM takes the received casts as its input casts (``Dispatched``): no cast again,
  bit for bit the casts of the received tokens in one process. Its weight gradient
  takes the per-tensor casts as they are, and casts the dispatched values (the codes
  times their scales) along the tokens in the other formats, as DeepSeek-V3 does;
- in 16 bits otherwise (delayed scaling, whose scale is each rank's own history, INT8,
  MXFP6, a bf16 experts module), the receiver casting as usual; a format that asked
  for low precision is noted in ``CommStats.fallbacks``.

The combine (the experts' outputs back to their tokens), the dispatch's backward (the
input gradients back) and the combine's backward (the output gradients to the experts)
go in 16 bits: the autocast dtype where autocast is on, else the tensor's own. Each
``all_to_all_single`` and all-reduce is recorded in a ``CommStats``
(``op="all_to_all"``; ``what``: ``dispatch-counts``, ``dispatch-codes``,
``dispatch-scales``, ``dispatch-amax``, ``dispatch``, ``dispatch-grad``, ``combine``,
``combine-grad``) with the bytes of this rank's whole input, the rows it keeps included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mixprec.experts import adapter
from mixprec.experts.format import ExpertsFormat
from mixprec.experts.grouped import PerExpert, grouped_mm
from mixprec.formats.fp4 import cast_nvfp4, nvfp4_descale
from mixprec.formats.mm import QuantizedGemm
from mixprec.formats.quantized import Quantized, expand_blocks
from mixprec.parallel.comm_stats import CommStats
from mixprec.parallel.gather_casts import pack_fp4, unpack_fp4

__all__ = ["codes_dispatch", "Routing", "exchange", "dispatch", "combine", "Dispatched",
           "dispatched_mm", "wire_dtype"]

#: the element kinds whose codes cross the wire (fp8 bytes, e2m1 two to a byte)
_WIRE_ELEMENTS = ("fp8", "fp4_e2m1")
#: the scalings that dispatch codes, as the messages name them
_WIRE_NAMES = "per-tensor current scaling, rowwise, 128-element blocks, MXFP8 and NVFP4"
_U8 = torch.uint8
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True, kw_only=True)
class Routing:
    """Who sends how many rows to whom, as ``exchange`` agreed it (host integers)."""

    #: rows this rank sends to each rank of the group
    send_splits: list[int]
    #: rows this rank receives from each rank
    recv_splits: list[int]
    #: rows received per (source rank, local expert)
    recv_counts: list[list[int]]
    #: the received rows (source-major) in expert-major order: index per row
    order: torch.Tensor
    #: the local expert of each received row, in expert-major order
    expert_ids: torch.Tensor
    #: the rows each local expert receives
    local_counts: list[int]
    #: the cumulative row counts of the local experts (``grouped_mm``'s offsets)
    offsets: torch.Tensor
    #: the index of this rank's first expert among the group's
    first: int
    #: the process group
    group: object


def _a2a(x: torch.Tensor, send: list[int], recv: list[int], group, stats: CommStats,
         what: str) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    stats.record(x, "all_to_all", what)
    dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send,
                           group=group)
    return out


def exchange(counts: torch.Tensor, group: dist.ProcessGroup | None, stats: CommStats
             ) -> Routing:
    """The routing of one dispatch from this rank's rows per expert ``counts`` (E,
    every expert of the group): one ``all_to_all_single`` of the counts and one host
    read (the split sizes)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n = counts.numel()
    if n % world:
        raise ValueError(f"{n} experts do not split over an expert-parallel group of "
                         f"{world} ranks; use a group size that divides {n}")
    per = n // world
    counts = counts.to(torch.int64)
    got = _a2a(counts, [per] * world, [per] * world, group, stats, "dispatch-counts")
    both = torch.cat([counts, got]).tolist()  # the splits all_to_all_single takes
    sent, recv = both[:n], both[n:]
    matrix = [recv[s * per:(s + 1) * per] for s in range(world)]
    recv_splits = [sum(row) for row in matrix]
    base = [sum(recv_splits[:s]) for s in range(world)]
    pieces, local = [], []
    for j in range(per):
        local.append(sum(row[j] for row in matrix))
        for s in range(world):
            start = base[s] + sum(matrix[s][:j])
            pieces.append(torch.arange(start, start + matrix[s][j]))
    dev = counts.device
    local_t = torch.tensor(local, dtype=torch.int64)
    return Routing(send_splits=[sum(sent[r * per:(r + 1) * per]) for r in range(world)],
                   recv_splits=recv_splits, recv_counts=matrix, local_counts=local,
                   order=torch.cat(pieces).to(dev) if pieces else counts.new_zeros(0),
                   expert_ids=torch.repeat_interleave(torch.arange(per), local_t).to(dev),
                   offsets=local_t.cumsum(0).to(torch.int32).to(dev),
                   first=rank * per, group=group)


def wire_dtype(t: torch.Tensor) -> torch.dtype:
    """The 16-bit dtype ``t`` crosses the wire in: the autocast dtype where autocast
    is on, else ``t``'s own."""
    dev = t.device.type
    if dev != "meta" and torch.is_autocast_enabled(dev) and t.dtype.is_floating_point:
        return torch.get_autocast_dtype(dev)
    return t.dtype


class _AllToAll(torch.autograd.Function):
    """Rows to the ranks ``send`` says, ``recv`` back; the backward sends the
    gradients the other way."""

    @staticmethod
    def forward(ctx, x, send, recv, group, stats, what, back):
        ctx.args = (recv, send, group, stats, back)
        return _a2a(x, send, recv, group, stats, what)

    @staticmethod
    def backward(ctx, g):
        recv, send, group, stats, back = ctx.args
        return _a2a(g, recv, send, group, stats, back), None, None, None, None, None, None


def _exchange_16(x: torch.Tensor, send, recv, group, stats, what: str, back: str,
                 dtype: torch.dtype) -> torch.Tensor:
    """``x`` exchanged in ``dtype`` (its gradient too), back in ``x``'s dtype."""
    return _AllToAll.apply(x.to(dtype), send, recv, group, stats, what, back).to(x.dtype)


@dataclass(frozen=True)
class _Wire:
    """How received bytes rebuild a cast: the codes' dtype, the tile, the scales'
    wire dtype (None: per tensor, every rank holds them) and whether the codes are
    packed e2m1."""

    codes: torch.dtype
    rows: int
    cols: int
    scales: torch.dtype | None
    fp4: bool

    def build(self, codes: torch.Tensor, scales: torch.Tensor | None, k: int,
              extra: torch.Tensor | None) -> Quantized:
        """The received rows' cast; ``extra``: each row's NVFP4 descale, or its
        per-tensor inverse scale (``scales`` None)."""
        if self.fp4:
            c = (unpack_fp4(codes, k) if codes.shape[0]
                 else codes.new_empty(0, k).view(self.codes))
        else:
            c = codes.view(self.codes)
        if scales is None:
            return Quantized(c, extra)
        inv = scales.view(self.scales).float()
        if self.fp4:  # a block holding an inf or NaN: its codes are NaN
            bad = expand_blocks(inv.isnan(), self.rows, self.cols, c.shape)
            c = torch.where(bad, c.new_full((), float("nan")), c)
        return Quantized(c, inv, self.rows, self.cols, outer=extra)


def _send_cast(fmt: ExpertsFormat, x: torch.Tensor, amax: torch.Tensor | None,
               scale: torch.Tensor | None) -> tuple[Quantized, _Wire]:
    """The rows' forward input cast, as the receiver's grouped GEMM would make it
    (``amax``: each row's expert's, NVFP4's; ``scale``: each row's expert's per-tensor
    scale)."""
    q = fmt.quantizer
    if scale is not None:
        c = Quantized(adapter.cast_scaled(fmt, x, scale.unsqueeze(1), "input"),
                      torch.reciprocal(scale))
        return c, _Wire(c.data.dtype, 0, 0, None, False)
    if _global_scale(q):
        c = cast_nvfp4(x, 1, amax=amax.unsqueeze(1))
    else:
        c = adapter.cast(fmt, x, "input", 1)
    kernel = q.kernel
    sdt = kernel.scale_dtype if kernel is not None and q.block_scaled else torch.float32
    return c, _Wire(c.data.dtype, c.rows, c.cols, sdt, _global_scale(q))


def _global_scale(q: object) -> bool:
    """The format carries a per-tensor scale beside its block scales (NVFP4's)."""
    return q.scales.global_bytes > 0


def codes_dispatch(fmt: ExpertsFormat) -> bool:
    """Whether ``fmt``'s dispatch sends its forward input cast's codes and scales: a
    scaling without an amax history whose elements are fp8 or e2m1 (the others send
    their 16-bit rows, recorded in ``CommStats.fallbacks``)."""
    q = fmt.quantizer
    return (not q.has_history and q.elements in _WIRE_ELEMENTS
            and q.dtype("input") in _FP8)


class _Dispatch(torch.autograd.Function):
    """The codes and scales to their experts' ranks; out: the received values (the
    codes times their scales in fp32, exact: the differentiable output), codes and
    scales (source-major). The backward sends the values' gradients back."""

    @staticmethod
    def forward(ctx, x, codes, scales, wire, k, extra, r, stats, grad_dtype):
        send, recv, group = r.send_splits, r.recv_splits, r.group
        got_c = _a2a(codes, send, recv, group, stats, "dispatch-codes")
        got_s = (None if scales is None
                 else _a2a(scales, send, recv, group, stats, "dispatch-scales"))
        q = wire.build(got_c, got_s, k, extra)
        ctx.args = (r, stats, grad_dtype, x.dtype)
        values = q.dequant()
        inv = q.scale_inv if got_s is not None else got_c.new_empty(0)
        ctx.mark_non_differentiable(q.data, inv)
        return values, q.data, inv

    @staticmethod
    def backward(ctx, g, *_):
        r, stats, grad_dtype, x_dtype = ctx.args
        back = _a2a(g.to(grad_dtype), r.recv_splits, r.send_splits, r.group, stats,
                    "dispatch-grad")
        return back.to(x_dtype), None, None, None, None, None, None, None, None


def dispatch(x: torch.Tensor, ids: torch.Tensor, r: Routing, fmt: ExpertsFormat | None,
             stats: CommStats, what: str = "experts"
             ) -> tuple[torch.Tensor, list[Quantized | None] | None]:
    """Rows ``x`` (sorted by their experts ``ids``, global indices) to their experts'
    ranks. Returns the received rows in expert-major order (differentiable in ``x``;
    where ``fmt`` dispatches codes, their values in fp32) and, where it does, each
    local expert's received input cast (None for an expert without rows), else None."""
    send, recv, group = r.send_splits, r.recv_splits, r.group
    if fmt is None or not codes_dispatch(fmt):
        if fmt is not None:
            stats.fallback(f"dispatch:{what}", fmt.format_name, wire_dtype(x),
                           f"{fmt.scaling} scaling has no codes dispatch (the scalings "
                           f"that have: {_WIRE_NAMES})")
        got = _exchange_16(x, send, recv, group, stats, "dispatch", "dispatch-grad",
                           wire_dtype(x))
        return got[r.order], None
    k = x.shape[1]
    q, local = fmt.quantizer, slice(r.first, r.first + len(r.local_counts))
    amax = descale = scale = inv = extra = None
    # a scale spanning an expert's rows (per tensor, or NVFP4's global one): each
    # expert's amax over every rank's rows
    if _global_scale(q) or q.scales.kind == "tensor":
        per = _agreed_amax(x, ids, len(r.local_counts) * len(r.recv_counts), group, stats)
        if _global_scale(q):
            amax, descale = per[ids], nvfp4_descale(per[local])
        else:  # the format's scale of each expert's amax (as its own cast makes it)
            scales_e = adapter.segment_scales(fmt, per, "input")
            scale, inv = scales_e[ids], torch.reciprocal(scales_e[local])
    with adapter.no_autocast(x):
        c, wire = _send_cast(fmt, x.detach(), amax, scale)
    codes = pack_fp4(c.data) if wire.fp4 else c.data.view(_U8)
    scales = None if wire.scales is None else c.scale_inv.float().to(wire.scales).view(_U8)
    if descale is not None or inv is not None:  # each received row's, by its expert
        extra = (descale if inv is None else inv)[_source_major_ids(r)].unsqueeze(1)
    values, got_c, got_s = _Dispatch.apply(x, codes, scales, wire, k, extra, r, stats,
                                           wire_dtype(x))
    order = r.order
    got_c = got_c[order]
    got_s = got_s[order] if scales is not None else None
    casts, start = [], 0
    for j, n in enumerate(r.local_counts):
        if n == 0:
            casts.append(None)
        elif inv is not None:
            casts.append(Quantized(got_c[start:start + n], inv[j]))
        else:
            casts.append(Quantized(got_c[start:start + n], got_s[start:start + n],
                                   wire.rows, wire.cols,
                                   outer=None if descale is None else descale[j]))
        start += n
    return values[order], casts


def _agreed_amax(x: torch.Tensor, ids: torch.Tensor, experts: int, group,
                 stats: CommStats) -> torch.Tensor:
    """Each expert's amax over the rows every rank sends it (fp32, all-reduce MAX)."""
    row_amax = x.detach().abs().amax(dim=1).float() if x.shape[0] else x.new_zeros(0)
    per = torch.zeros(experts, device=x.device).scatter_reduce(0, ids, row_amax.float(),
                                                                "amax")
    stats.record(per, "all_reduce", "dispatch-amax")
    dist.all_reduce(per, dist.ReduceOp.MAX, group=group)
    return per


def _source_major_ids(r: Routing) -> torch.Tensor:
    """The local expert of each received row in the order it arrives (source-major)."""
    per = len(r.recv_counts[0])
    counts = torch.tensor([n for row in r.recv_counts for n in row], dtype=torch.int64)
    ids = torch.repeat_interleave(torch.arange(per).repeat(len(r.recv_counts)), counts)
    return ids.to(r.order.device)


def combine(y: torch.Tensor, r: Routing, stats: CommStats) -> torch.Tensor:
    """The experts' output rows (expert-major, as ``dispatch`` handed them) back to
    the ranks and rows they came from, in 16 bits (the gradients too)."""
    src = torch.empty_like(r.order)
    src[r.order] = torch.arange(r.order.numel(), device=r.order.device)
    return _exchange_16(y[src], r.recv_splits, r.send_splits, r.group, stats, "combine",
                        "combine-grad", wire_dtype(y))


class Dispatched(PerExpert):
    """The per-expert GEMMs whose forward input casts came over the wire (``casts``:
    one per expert, None without rows): the format casts everything else (the weights,
    wgrad's tokens from the dispatched values, the gradients)."""

    def __init__(self, site: ExpertsFormat, casts: list, route: str = "loop",
                 bounds: list | None = None, shape: tuple = (),
                 offs: torch.Tensor | None = None, device: torch.device | None = None
                 ) -> None:
        super().__init__(site, route, bounds, shape, offs, device)
        self.casts = casts

    def bind(self, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> Dispatched:
        """As ``PerExpert.bind``, keeping the received casts."""
        b = super().bind(x, w, offsets)
        return Dispatched(self.site, self.casts, b.route, b.bounds, b.shape, b.offs,
                          b.device)

    def cast_x(self, t: torch.Tensor, role: str, dim: int, record: bool = False,
               key: object = None) -> object:
        """The forward's input casts are the received ones."""
        if role == "input" and dim == 1:
            return list(self.casts)
        return super().cast_x(t, role, dim, record, key)


def dispatched_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                  fmt: ExpertsFormat, casts: list | None,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``grouped_mm`` on the ``loop`` route with the received input ``casts`` (``x``:
    their values, which wgrad casts along the tokens); with ``casts`` None (a 16-bit
    dispatch), ``grouped_mm`` on ``x``. ``out_dtype``: default the autocast dtype,
    else ``x``'s."""
    if casts is None:
        return grouped_mm(x, weight, offsets, fmt, out_dtype=out_dtype)
    if len(casts) != weight.shape[0] or offsets.numel() != weight.shape[0]:
        raise ValueError(f"dispatched_mm got {len(casts)} casts and {offsets.numel()} "
                         f"offsets for {weight.shape[0]} experts; pass dispatch's casts "
                         "and the routing's offsets")
    if out_dtype is None:
        out_dtype = wire_dtype(x)
    return QuantizedGemm.apply(x, weight, fmt, out_dtype, torch.is_grad_enabled(), None,
                               offsets, Dispatched(fmt, casts))
