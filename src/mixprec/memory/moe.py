"""The saved activations and backward working sets of a transformers mixture-of-experts
causal LM (Mixtral, Qwen3-MoE and their kin: RMSNorm, rotary attention, a router and
an experts module with 3-D weights), read off the model's own modules; ``estimate``
prices such a model with them in place of the GPT formula of ``TransformerSpec``.

Per token (``T = seq_len · micro_batch`` tokens, ``R = top_k · T`` routed rows, ``b``
the activations' width: 2 bytes under a 16-bit or fp8 recipe), what one forward saves:

- each RMSNorm of width ``w`` (transformers' upcasts to fp32): its fp32 input and
  normalized values and one fp32 rsqrt per group, ``8·w + 4·w/group``;
- each Linear its input: a 16-bit copy ``b·in`` (autocast casts it once per Linear; the
  attention's output projection reads the attention output as it is, no copy), or its
  format's cast for the weight gradient (``cast_bytes``);
- the attention (``F.scaled_dot_product_attention``'s fused kernel): Q, K, V and the
  output at ``b`` bytes, an fp32 log-sum-exp per head; a dense gated MLP (a shared
  expert) its gate, up and activation outputs;
- the router: its 16-bit input, fp32 probabilities per expert, the top-k ids (int64)
  and weights;
- the experts: three int64 index vectors of ``R`` (sort order, permutation, inverse),
  the gate-up output (``b·R·2I``), the activation's output (``b·R·I``), the
  down-projection output and the routing weights; under a format, each expert's casts
  of its tokens and weights (``mixprec.experts.grouped``: the casts the backward
  reuses or makes along the token dim); without one, transformers' grouped GEMM keeps
  the 16-bit inputs of both projections;
- the head's input, the loss's fp32 log-probabilities (``4·V``) and the token ids.

The working sets on top of that: the loss at the forward's end (the head's 16-bit
logits, their fp32 copy and the reduction, ``8·T·V``) and the last layer's experts
backward on the ``loop`` route (the CPU's; ``experts_backward``), less what the backward
has freed by then. Each expert is taken to get the average ``R/E`` rows: the busiest
one's scratch is larger, by as much as the routing is uneven.
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from mixprec.memory.transient import linear_shapes

__all__ = ["moe_experts", "cast_bytes", "moe_saved_bytes", "experts_backward",
           "loss_transient", "moe_terms", "moe_notes"]


def moe_experts(model: nn.Module) -> dict[str, nn.Module]:
    """The model's transformers experts modules by name (empty: not an MoE model)."""
    from mixprec.experts.hook import experts_modules

    return experts_modules(model)


def _experts_dims(m: nn.Module) -> tuple[int, int, int, int]:
    """``(experts, hidden, inner, top_k)`` of an experts module; ``inner`` the width of
    the down projection's input (the gate-up projection's output is ``2·inner`` when
    gated)."""
    down = m.down_proj  # (E, hidden, inner), or (E, inner, hidden) transposed
    e, a, b = down.shape
    hidden, inner = (b, a) if m.is_transposed else (a, b)
    cfg = m.config
    k = getattr(cfg, "num_experts_per_tok", None) or getattr(cfg, "top_k", None) or 1
    return int(e), int(hidden), int(inner), int(k)


def cast_bytes(q: Any, rows: int, cols: int, role: str, dim: int) -> float:
    """Bytes of one cast of a (rows, cols) tensor by quantizer ``q`` along ``dim``:
    one byte per code (fp4 codes too) and an fp32 scale per tensor, row or tile."""
    if rows == 0:
        return 0.0
    if q.per_tensor:
        return float(rows * cols + 4)
    kernel = q.kernel
    tile = kernel.tile if kernel is not None else 0
    if not tile:  # rowwise: one scale per row of the contracted dim
        return float(rows * cols + 4 * (rows if dim == 1 else cols))
    extra = q.global_scale_bytes
    if dim == 0 and role != "weight":  # NVFP4's Hadamard blocks of 16 tokens
        rows += (-rows) % q.token_multiple
    if role == "weight" and q.reuses("weight"):  # square tiles serve both GEMMs
        scales = math.ceil(rows / tile) * math.ceil(cols / tile)
    elif dim == 1:
        scales = rows * math.ceil(cols / tile)
    else:
        scales = math.ceil(rows / tile) * cols
    return float(rows * cols + 4 * scales + extra)


def _saved_cast(q: Any, rows: int, cols: int, role: str) -> float:
    """What a GEMM keeps of its operand for the backward: the forward cast where the
    backward reuses it, else a cast along the other dim (``mixprec.experts.grouped``)."""
    if role == "input" and "wgrad" not in q.quantized_gemms:
        return 0.0
    return cast_bytes(q, rows, cols, role, 1 if q.reuses(role) else 0)


def _norm_widths(model: nn.Module) -> list[tuple[int, int]]:
    """``(width per token, groups per token)`` of each RMSNorm: a head norm (``q_norm``,
    ``k_norm``) spans its projection's output."""
    out = []
    mods = dict(model.named_modules())
    for name, m in mods.items():
        if not type(m).__name__.endswith("RMSNorm") or getattr(m, "weight", None) is None:
            continue
        group = m.weight.numel()
        width = group
        parent, _, leaf = name.rpartition(".")
        proj = mods.get(f"{parent}.{leaf[0]}_proj") if leaf in ("q_norm", "k_norm") else None
        if isinstance(proj, nn.Linear):
            width = proj.out_features
        out.append((width, width // group))
    return out


def _attention_widths(m: nn.Module) -> tuple[int, int, int, int, int]:
    """``(Q, K, V, output widths per token, heads)`` the attention kernel saves: the q,
    k and v projections' outputs (the output has every head's V width), or under
    multi-head latent attention (DeepSeek's: no ``q_proj``/``k_proj`` pair) the
    config's head dims."""
    cfg = m.config
    heads = getattr(cfg, "num_attention_heads", 1)
    q, k, v = (getattr(m, f"{n}_proj", None) for n in "qkv")
    if all(isinstance(x, nn.Linear) for x in (q, k, v)):
        groups = getattr(cfg, "num_key_value_heads", None) or heads
        vd = v.out_features
        return q.out_features, k.out_features, vd, vd * heads // groups, heads
    qk = getattr(cfg, "qk_head_dim", None) or (getattr(cfg, "qk_nope_head_dim", 0)
                                                + getattr(cfg, "qk_rope_head_dim", 0))
    vd = heads * getattr(cfg, "v_head_dim", qk)
    return heads * qk, heads * qk, vd, vd, heads


def moe_saved_bytes(model: nn.Module, tokens: int, linear_formats: dict[str, Any],
                    quantizers: dict[str, Any], act_bytes: float) -> float:
    """Bytes one forward of ``tokens`` tokens saves for backward (see the module doc).

    ``linear_formats``: each Linear's quantizer (None: a 16-bit or fp32 Linear);
    ``quantizers``: each experts module's quantizer by name (None or absent: it runs in
    16 bits on transformers' own implementation)."""
    t, b = tokens, act_bytes
    total = sum(8.0 * w + 4.0 * g for w, g in _norm_widths(model)) * t
    for fqn, i, _ in linear_shapes(model):
        q = linear_formats.get(fqn)
        if q is not None:
            total += _saved_cast(q, t, i, "input")
        elif not fqn.endswith("o_proj"):  # the attention output is saved already
            total += b * t * i
    for m in model.modules():
        if type(m).__name__.endswith("Attention") and hasattr(m, "config"):
            qd, kd, vd, od, heads = _attention_widths(m)
            total += t * (b * (qd + kd + vd + od) + 4 * heads)
        elif all(isinstance(getattr(m, n, None), nn.Linear)
                 for n in ("gate_proj", "up_proj", "down_proj")):
            # a dense gated MLP (a shared expert, a dense layer): its gate and up
            # outputs and the activation's, 16-bit
            total += 3 * b * t * m.up_proj.out_features
    mods = dict(model.named_modules())
    for name, m in moe_experts(model).items():
        e, h, inner, k = _experts_dims(m)
        r = k * t
        up = 2 * inner if m.has_gate else inner
        # the router: its 16-bit input (a Linear's is counted above), probabilities,
        # top-k ids and weights
        router = getattr(mods.get(name.rpartition(".")[0]), "gate", None)
        total += t * (4 * e + 12 * k + 4 + (0 if isinstance(router, nn.Linear) else b * h))
        total += 24 * r + b * r * (up + inner + h)  # indices, gate-up, act, down out
        q = quantizers.get(name)
        if q is None:  # transformers' grouped_mm: 16-bit inputs, fp32 routing weights
            total += b * r * (h + inner) + 4 * r
            continue
        per = r / e  # the rows of one expert, on average
        total += b * r + e * (_saved_cast(q, per, h, "input")
                              + _saved_cast(q, per, inner, "input")
                              + _saved_cast(q, up, h, "weight")
                              + _saved_cast(q, h, inner, "weight"))
    vocab = _vocab(model)
    total += t * (4 * vocab + 16)  # the loss's log-probabilities, labels and token ids
    return float(total)


def _vocab(model: nn.Module) -> int:
    head = getattr(model, "lm_head", None)
    return head.out_features if isinstance(head, nn.Linear) else 0


def loss_transient(model: nn.Module, tokens: int) -> float:
    """The loss's working set at the forward's end: the head's 16-bit logits, their
    fp32 copy and the reduction's scratch (``8·T·V``)."""
    return 8.0 * tokens * _vocab(model)


def _top_saved(model: nn.Module, tokens: int, head_bytes: float) -> float:
    """What the final norm, the head and the loss save: freed before the experts of the
    last layer run backward."""
    head = getattr(model, "lm_head", None)
    width = head.in_features if isinstance(head, nn.Linear) else 0
    return tokens * (8.0 * width + 4 + head_bytes + 4 * _vocab(model) + 8)


def experts_backward(model: nn.Module, tokens: int, quantizers: dict[str, Any],
                     act_bytes: float, route_bytes: Any, head_bytes: float = 2.0) -> float:
    """The most bytes the last layer's experts backward holds beyond everything the
    forward saved, on the ``loop`` route (the CPU's); negative where what it frees
    first (the loss's and head's saved tensors, the activation's and down projection's
    saved tensors) outweighs it.

    Per projection of ``I`` inputs and ``O`` outputs over ``R`` rows: the arriving
    gradient (``b·R·O``), then the gradient's casts for every expert (for dgrad, and
    along the tokens for wgrad unless reused), the input gradient (fp32 for the gate-up
    projection, whose tokens come from the fp32 residual stream), the fp32 weight
    gradient of every expert (``4·E·O·I``), and one expert's GEMM scratch: its format's
    ``backward_bytes`` on its rows (``route_bytes(q, rows, in, out)``)."""
    best = -math.inf
    experts = moe_experts(model)
    if not experts:
        return 0.0
    name, m = list(experts.items())[-1]  # the last layer's runs backward first
    e, h, inner, k = _experts_dims(m)
    r = k * tokens
    up = 2 * inner if m.has_gate else inner
    q = quantizers.get(name)
    b = act_bytes
    top = _top_saved(model, tokens, head_bytes)
    out_and_weights = b * r * h + (b if q is not None else 4) * r
    down_in = b * r * inner if q is None else e * _saved_cast(q, r / e, inner, "input")
    down_w = 0.0 if q is None else e * _saved_cast(q, h, inner, "weight")
    # (in, out, dx bytes, freed before it runs, a fresh weight gradient already there)
    steps = ((inner, h, b, top + out_and_weights, 0.0),
             (h, up, 4, top + out_and_weights + b * r * (up + inner) + down_in + down_w,
              4 * e * h * inner))
    for i, o, dx_bytes, freed, held in steps:
        need = b * r * o + dx_bytes * r * i + 4 * e * o * i + held - freed
        if q is not None:
            per = math.ceil(r / e)
            need += e * cast_bytes(q, per, o, "grad_output", 1)
            if not q.reuses("grad_output"):
                need += e * cast_bytes(q, per, o, "grad_output", 0)
            need += route_bytes(q, per, i, o)
        best = max(best, need)
    return best


def moe_terms(model: nn.Module, r: Any, tokens: int, act_bytes: float, route: str
              ) -> tuple[float, float]:
    """``(saved activations, working set)`` of an MoE model under recipe ``r``: what one
    forward saves, and the larger of the loss's working set and the widest experts
    projection's backward (``route``: the fp8 GEMM route of one expert's GEMMs)."""
    from mixprec.fp8.quantizers import quantizer_for
    from mixprec.memory.layers import layer_recipes

    linears = ({fqn: quantizer_for(rec) for fqn, rec in layer_recipes(model, r).items()
                if rec is not None} if r.linear is not None else {})
    experts = {}
    if r.linear is not None:
        experts = {name: quantizer_for(r.for_layer(name)) for name in moe_experts(model)
                   if r.layer_format(name) != "bf16"}
    saved = moe_saved_bytes(model, tokens, linears, experts, act_bytes)
    work = max(loss_transient(model, tokens),
               experts_backward(model, tokens, experts, act_bytes,
                                lambda q, t, i, o: q.backward_bytes(t, i, o, act_bytes,
                                                                    route)))
    return saved, work


def moe_notes(model: nn.Module) -> list[str]:
    """What the pricing leaves out for this model: an attention implementation other
    than ``sdpa`` (``eager`` saves each head's s×s probabilities, not priced)."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None) or "sdpa"
    if impl == "sdpa":
        return []
    return [f"activations: attention implementation {impl!r}: priced as sdpa's fused "
            "kernel (its s×s scores and probabilities are not counted); load the model "
            "with attn_implementation='sdpa' for the priced path"]
