"""FSDP2 all-gather of rowwise, block, MX and NVFP4 weights as the codes and scales of
their casts (``fp8_all_gather=true``), bit for bit the casts of the whole weight.

FSDP2 cuts a weight into row shards (``ceil(out / world)`` rows each, the last padded).
Each rank casts its rows as the format casts the whole weight's, and the ranks gather
the codes and the scales of each weight cast the step takes (``weight_cast_dims``: the
forward's along ``in``, and dgrad's along ``out`` where the forward's cannot serve it):

- a scale that covers part of a row (rowwise's forward, 1×128 / 1×32 / 1×16 tiles) is
  the shard's own;
- a scale that covers several rows (128×128 and 16×16 blocks, dgrad's 32×1 and 16×1
  tiles) is the shard's own where the cut falls on a multiple of its rows
  (``shard_rows``); elsewhere the weight is gathered in 16 bits instead
  (``CommStats.fallback``, one warning per cause);
- what spans every row (NVFP4's per-tensor amax, rowwise dgrad's column amaxes) the
  ranks agree on once per optimizer step, in the all-reduce MAX of ``agree_amaxes_``
  (``gather_amax``, kept in the ``fp8_gather_amax`` buffer, not saved).

The Linear gets a ``CastWeight``: each cast rebuilt from the gathered bytes on use
(NVFP4's codes cross as two e2m1 codes per byte, MX's scales as e8m0 bytes, NVFP4's as
e4m3). The hooks take FSDP2's one-argument form: its five-argument form requires every
input of a padded (last) shard to have the shard's padded shape, which scales cannot.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_map

from mixprec.formats.gemm.base import LinearFormat
from mixprec.formats.quantized import Quantized, expand_blocks
from mixprec.parallel.comm_stats import CommStats

__all__ = ["CastWeight", "install_cast_gather", "plain_gather_hooks", "why_not_gathered",
           "send_shard", "parts_hooks",
           "pack_fp4", "unpack_fp4", "fp4_tables"]

_U8 = torch.uint8
_E4M3 = torch.float8_e4m3fn
# the e2m1 values of codes 0..15 (sign bit 3)
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]) * torch.tensor([[1.0], [-1.0]])
_DECODE = _E2M1.reshape(-1).to(_E4M3).view(_U8)  # nibble -> e4m3 byte
_ENCODE = torch.zeros(256, dtype=_U8)  # e4m3 byte -> nibble
_ENCODE[_DECODE.long()] = torch.arange(16, dtype=_U8)


@functools.cache
def _tables_on(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return _ENCODE.to(device), _DECODE.to(device)


def fp4_tables(device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """The (encode, decode) lookup tables on ``device``, copied there once per device
    (read-only: callers must not modify them); under ``torch.compile`` the CPU tables,
    which a graph keeps as constants."""
    if torch.compiler.is_compiling():
        return _ENCODE.to(device), _DECODE.to(device)
    return _tables_on(torch.device(device))


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 values held as e4m3 bytes (``cast_nvfp4``'s codes), two to a byte (an odd
    last column padded with 0)."""
    n = fp4_tables(codes.device)[0][codes.view(_U8).long()]
    n = torch.nn.functional.pad(n, (0, n.shape[1] % 2))
    return n[:, 0::2] | (n[:, 1::2] << 4)


def unpack_fp4(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """``pack_fp4``'s inverse: ``cols`` e4m3 codes per row."""
    lut = fp4_tables(packed.device)[1]
    both = torch.stack([lut[(packed & 15).long()], lut[(packed >> 4).long()]], dim=-1)
    return both.reshape(packed.shape[0], -1)[:, :cols].view(_E4M3)


@dataclass(frozen=True)
class _Wire:
    """How one weight cast crosses the wire: its contracted ``dim``, block shape, code
    dtype, the scale's wire dtype (None: the scale is the same on every rank and stays
    in ``shared``), NVFP4's per-tensor ``outer``, and whether codes are packed fp4."""

    dim: int
    rows: int
    cols: int
    codes: torch.dtype
    scales: torch.dtype | None
    shared: torch.Tensor | None
    outer: torch.Tensor | None
    fp4: bool


def _pad(t: torch.Tensor, rows: int, fill: float = 0) -> torch.Tensor:
    """``t`` with ``rows`` rows: its own, then ``fill``."""
    if t.shape[0] == rows:
        return t.contiguous()
    pad = t.new_full((rows - t.shape[0], *t.shape[1:]), fill)
    return torch.cat([t, pad])


def _scale_dtype(fmt) -> torch.dtype:
    """The wire dtype of the format's block scales: the kernel's (e8m0, e4m3: exact for
    MX's and NVFP4's), else fp32."""
    kernel = fmt.kernel
    return kernel.scale_dtype if kernel is not None and fmt.block_scaled else torch.float32


def _send(fmt, shard: torch.Tensor, dim: int, amax, rows: int
          ) -> tuple[list[torch.Tensor], _Wire]:
    """The shard's cast along ``dim`` as uint8 tensors of ``rows`` (padded) rows: the
    codes, and the scales unless every rank holds them."""
    q = fmt.cast_shard(shard, dim, amax)
    fp4 = bool(fmt.kernel is not None and fmt.kernel.fp4)
    codes = _pad(q.data.view(_U8), rows)
    out = [pack_fp4(codes) if fp4 else codes]
    per_row = bool(q.rows or q.cols) or (dim == 1 and q.scale_inv.shape[0] == shard.shape[0])
    if not per_row:  # broadcast over rows (rowwise dgrad's columns): the same everywhere
        return out, _Wire(dim, 0, 0, q.data.dtype, None, q.scale_inv, q.outer, fp4)
    br, sdt = max(q.rows, 1), _scale_dtype(fmt)
    s = _pad(q.scale_inv.float(), math.ceil(rows / br), 1).to(sdt)
    out.append(s.view(_U8))
    return out, _Wire(dim, q.rows, q.cols, q.data.dtype, sdt, None, q.outer, fp4)


def send_shard(fmt: LinearFormat, shard: torch.Tensor, amax: torch.Tensor | None, rows: int
               ) -> tuple[list[torch.Tensor], list[_Wire]]:
    """What a rank all-gathers of its weight rows ``shard`` (padded to ``rows``): the
    uint8 inputs of each of ``fmt``'s weight casts, cast with the agreed ``amax`` and
    autocast off, as the Linear casts; and how to read them back."""
    inputs, wires = [], []
    with torch.autocast(shard.device.type, enabled=False):
        for d in fmt.weight_cast_dims():
            parts, wire = _send(fmt, shard, d, amax, rows)
            inputs += parts
            wires.append(wire)
    return inputs, wires


class CastWeight(torch.Tensor):
    """A weight FSDP2 gathered as its casts: the gathered bytes and how to read them,
    shaped and typed as the weight it stands for. A QuantizedLinear takes ``cast(dim)``
    as its weight cast; any other op sees the forward cast's value."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, parts: Sequence[torch.Tensor], wires: Sequence[_Wire],
                shape: torch.Size, dtype: torch.dtype, device: torch.device):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device,
                                                   requires_grad=False)

    def __init__(self, parts: Sequence[torch.Tensor], wires: Sequence[_Wire],
                 shape: torch.Size, dtype: torch.dtype, device: torch.device) -> None:
        self._parts, self._wires = tuple(parts), tuple(wires)

    def cast(self, dim: int) -> Quantized:
        """The whole weight's cast along ``dim``, in fresh tensors (FSDP frees the
        gathered bytes after the forward; the backward keeps this)."""
        out, cols = self.shape
        i = 0
        for w in self._wires:
            n = 1 if w.scales is None else 2
            if w.dim == dim:
                raw = self._parts[i]
                codes = (unpack_fp4(raw[:out], cols) if w.fp4
                         else raw[:out].clone().view(w.codes))
                if w.scales is None:
                    return Quantized(codes, w.shared, outer=w.outer)
                scales = self._parts[i + 1].view(w.scales)[:math.ceil(out / max(w.rows, 1))]
                inv = scales.to(torch.float32, copy=True)
                if w.fp4:  # a block holding an inf or NaN: its codes are NaN
                    bad = expand_blocks(inv.isnan(), w.rows, w.cols, codes.shape)
                    codes = torch.where(bad, codes.new_full((), float("nan")), codes)
                return Quantized(codes, inv, w.rows, w.cols, outer=w.outer)
            i += n
        raise RuntimeError(f"the weight was gathered as its casts along dims "
                           f"{[w.dim for w in self._wires]}, not {dim}")

    def dequantize(self) -> torch.Tensor:
        """The forward cast's value in this tensor's dtype."""
        return self.cast(1).dequant().to(self.dtype)

    def __repr__(self) -> str:
        return f"CastWeight(shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        w = args[0] if args else None
        same = isinstance(w, CastWeight) and (
            func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default)
            or func in (torch.ops.aten.view.default, torch.ops.aten.as_strided.default,
                        torch.ops.aten._unsafe_view.default)
            and tuple(args[1]) == tuple(w.shape))
        if same:  # FSDP's views of the unsharded parameter: the same weight
            return CastWeight(w._parts, w._wires, w.shape, w.dtype, w.device)

        def unwrap(t):
            return t.dequantize() if isinstance(t, CastWeight) else t
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))


def why_not_gathered(m: nn.Module) -> str | None:
    """Why FSDP2 cannot gather ``m``'s weight as its casts (None: it can)."""
    q = m.quantizer
    mesh = m.weight.device_mesh
    if mesh.ndim != 1:
        return ("its weight is a DTensor over a 2-D mesh (FSDP over tensor parallelism): "
                "the casts of its shards are not its rows of the whole weight's")
    world = mesh.size()
    if not q.gathers_casts:
        return f"fp8_scaling={q.name} has no gathered cast"
    if m.transposed:
        return ("its weight is stored (in, out) (a GPT-2 Conv1D): FSDP2 cuts it across "
                "the forward cast's rows")
    out = m.weight.shape[0]
    rows = math.ceil(out / world)
    for d in q.weight_cast_dims():
        span = q.shard_rows(d)
        if world > 1 and rows < out and rows % span:
            return (f"its {out} rows shard {rows} to a rank, not a multiple of the "
                    f"{span} rows one scale of its cast along dim {d} spans; out_features "
                    f"a multiple of {span * world} gathers it as codes")
    return None


def _hooks(m: nn.Module, stats):
    fmt, shape = m.quantizer, m.weight.shape  # the whole weight's

    def send(mesh):
        rows = math.ceil(shape[0] / mesh.size())
        shard = m.weight._local_tensor.detach()
        return send_shard(fmt, shard, getattr(m, "fp8_gather_amax", None), rows)

    def wrap(outputs, wires, param_dtype):
        return CastWeight(outputs, wires, shape, param_dtype, outputs[0].device)

    return parts_hooks(send, wrap, stats)


def parts_hooks(send: Callable, wrap: Callable, stats: CommStats | None
                ) -> tuple[Callable, Callable]:
    """FSDP2's one-argument pre- and post-all-gather hooks over ``send(mesh)``, the
    uint8 inputs of the rank and the wires that read them (each input recorded in
    ``stats``), and ``wrap(outputs, wires, param_dtype)``, the tensor the module gets,
    whose ``_parts`` and ``_wires`` a gather into the same buffers renews."""

    def fsdp_pre_all_gather(mesh):
        inputs, wires = send(mesh)
        if stats is not None:
            for t in inputs:
                stats.record(t, op="all_gather", what="weights")
        return tuple(inputs), tuple(wires)

    def fsdp_post_all_gather(outputs, wires, param_dtype, *, out=None):
        if out is not None:  # the same buffers, gathered again: new wires
            out._parts, out._wires = tuple(outputs), tuple(wires)
            return None
        return wrap(outputs, wires, param_dtype), tuple(outputs)

    return fsdp_pre_all_gather, fsdp_post_all_gather


def plain_gather_hooks(param: torch.Tensor, stats: CommStats, sent: torch.dtype | None
                       ) -> tuple[Callable, Callable]:
    """FSDP2's own gather of ``param`` (a sharded parameter: a weight gathered in 16
    bits, an experts module's 3-D weight) as extension hooks that record it: the padded
    shard in ``sent`` (default: the parameter's dtype) goes out, the gathered rows are
    the parameter's, each gather recorded in ``stats``. Returns ``(pre, post)``."""
    rows = param.shape[0]

    def fsdp_pre_all_gather(mesh):
        shard = param._local_tensor.detach()
        sent_shard = _pad(shard.to(sent or shard.dtype), math.ceil(rows / mesh.size()))
        stats.record(sent_shard, op="all_gather", what="weights")
        return (sent_shard,), None

    def fsdp_post_all_gather(outputs, metadata, param_dtype, *, out=None):
        if out is not None:  # the same buffer, gathered again
            return None
        return outputs[0], tuple(outputs)

    return fsdp_pre_all_gather, fsdp_post_all_gather


def install_cast_gather(named: dict[str, nn.Module], stats: CommStats | None = None,
                        sent: torch.dtype | None = None) -> list[nn.Module]:
    """Set the hooks on each of ``named``'s sharded QuantizedLinears of a format with
    casts to gather (not per tensor: ``mixprec.parallel.gather``'s); a weight that cannot be
    gathered so stays in 16 bits, noted in ``stats`` (``CommStats.fallback``) as
    ``sent`` (default: the weight's dtype), and each of its gathers recorded there.
    Returns the hooked modules (those gathered as casts). On a mesh of one rank, where
    FSDP2 copies the shard instead of gathering it, the Linear casts its weight itself."""
    done = []
    for name, m in named.items():
        local = getattr(getattr(m, "weight", None), "_local_tensor", None)
        if m.quantizer.per_tensor or local is None:
            continue
        if m.weight.device_mesh.ndim == 1 and m.weight.device_mesh.size() == 1:
            continue  # one rank: FSDP2 gathers nothing, and passes on one input only
        why = why_not_gathered(m)
        if why is not None:
            if stats is not None:
                stats.fallback(f"weight:{name}", m.quantizer.name, sent or m.weight.dtype,
                               why)
                if m.weight.device_mesh.ndim == 1:  # its 16-bit gathers: counted too
                    local.fsdp_pre_all_gather, local.fsdp_post_all_gather = \
                        plain_gather_hooks(m.weight, stats, sent)
                    local.gathers_16_bits = True
            continue
        amax = m.quantizer.gather_amax(local)
        if amax is not None and getattr(m, "fp8_gather_amax", None) is None:
            m.register_buffer("fp8_gather_amax", torch.zeros_like(amax), persistent=False)
        local.fsdp_pre_all_gather, local.fsdp_post_all_gather = _hooks(m, stats)
        done.append(m)
    return done
