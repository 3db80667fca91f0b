"""Expert parallelism's bytes per rank (``estimate(..., expert_parallel=e)``): the routed
experts' weights and states divided over the ``e`` ranks of the group, and the buffers
of one MoE layer's token exchange (``mixprec.experts.dispatch``).

Each rank routes its ``T = seq_len · micro_batch`` tokens to ``top_k`` experts each,
``R = T·k`` rows of ``hidden`` values, and receives as many on average (a balanced
routing; the busiest rank receives more by as much as the routing is uneven). Per MoE
layer, what crosses the wire, as ``CommStats`` records it (``what``):

- ``dispatch-counts``: the rows per expert, ``E`` int64s;
- where the format dispatches codes (``codes_dispatch``): ``dispatch-codes``, ``R``
  rows of ``hidden`` codes of the format's element bits (8, or 4 packed two to a
  byte), and ``dispatch-scales``, each row's scales as the format lays them out
  (its ``ScaleGrain``: none per tensor, one fp32 per row, one per ``tile`` elements
  in the block kernel's scale dtype); a scale spanning an expert's rows (per tensor,
  or a global one beside the block scales) is agreed first, ``dispatch-amax``: ``E``
  fp32 (all-reduce);
- otherwise ``dispatch``: the rows in 16 bits (the activations' width);
- ``combine``: the experts' outputs back, ``R`` rows in 16 bits.

``ep_buffers`` prices one layer's send and receive buffers of the dispatch and the
combine together (the received codes are the experts' GEMM input while the combine
sends); the backward's exchanges (``dispatch-grad``, ``combine-grad``) are 16-bit
buffers of the combine's size, made after the forward's are freed.
"""

from __future__ import annotations

import math

from mixprec.experts.dispatch import codes_dispatch
from mixprec.experts.format import ExpertsFormat
from mixprec.formats.elements import get, names
from mixprec.memory.spec import TransformerSpec
from mixprec.recipe import Recipe

__all__ = ["expert_params", "dispatch_traffic", "ep_buffer_bytes"]


def expert_params(spec: TransformerSpec) -> int:
    """The routed experts' parameters of the whole model (``E`` experts of gate, up and
    down projections per MoE layer; up and down ungated)."""
    h, inner, moe = spec.hidden, spec.dims[3], spec.dims[4]
    return moe * spec.experts * (3 if spec.gated else 2) * h * inner


def _row_layout(recipe: Recipe, h: int) -> tuple[float, float, bool] | None:
    """``(code bytes, scale bytes, agreed amax)`` of a row of ``h`` values the format
    dispatches as codes, asked of the format (its element bits and ``ScaleGrain``, the
    block kernel's scale dtype, as the dispatch sends them); None where it sends 16
    bits."""
    if recipe.linear is None:
        return None
    fmt = ExpertsFormat(recipe)
    if not codes_dispatch(fmt):
        return None
    q = fmt.quantizer
    bits = (get(q.elements).total_bits if q.elements in names()
            else 8 * q.dtype("input").itemsize)
    g = q.scales
    if g.kind == "tensor":
        scales = 0.0
    elif g.kind == "row":
        scales = 4.0  # one fp32 scale per row
    else:
        kernel = q.kernel
        each = (kernel.scale_dtype.itemsize if kernel is not None and q.block_scaled
                else 4)
        scales = float(math.ceil(h / g.tile) * each)
    return float(math.ceil(h * bits / 8)), scales, g.kind == "tensor" or g.global_bytes > 0


def dispatch_traffic(spec: TransformerSpec, recipe: Recipe | str, ep: int,
                     act_bytes: float = 2.0) -> dict[str, float]:
    """Bytes one rank sends in one MoE layer's forward exchanges, by ``CommStats``
    ``what`` (module doc); ``act_bytes``: the 16-bit wire's width."""
    r = Recipe.coerce(recipe)
    if not spec.experts:
        raise ValueError("expert_parallel prices a mixture of experts: the spec has "
                         "experts=0; give experts= (and top_k=) or drop expert_parallel")
    if not isinstance(ep, int) or ep < 1 or spec.experts % ep:
        raise ValueError(f"expert_parallel={ep!r}: an integer >= 1 that divides "
                         f"experts={spec.experts}")
    e, h = spec.experts, spec.hidden
    rows = spec.seq_len * spec.micro_batch * spec.top_k
    out = {"dispatch-counts": 8.0 * e}
    layout = _row_layout(r, h)
    if layout is None:
        out["dispatch"] = rows * h * act_bytes
    else:
        code, scales, agreed = layout
        out["dispatch-codes"] = rows * code
        if scales:
            out["dispatch-scales"] = rows * scales
        if agreed:
            out["dispatch-amax"] = 4.0 * e
    out["combine"] = rows * h * act_bytes
    return out


def ep_buffer_bytes(spec: TransformerSpec, recipe: Recipe | str, ep: int,
                    act_bytes: float = 2.0) -> float:
    """``ep_buffers``: one MoE layer's dispatch and combine send and receive buffers
    (module doc); 0 for a dense model or ``ep=1``."""
    if not spec.experts or ep == 1:
        return 0.0
    sent = dispatch_traffic(spec, recipe, ep, act_bytes)
    rows = sum(v for k, v in sent.items() if k in ("dispatch", "dispatch-codes",
                                                    "dispatch-scales", "combine"))
    return 2.0 * rows
