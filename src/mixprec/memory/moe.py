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
  format's cast for the weight gradient (``expert_casts.cast_bytes``; a format whose
  wgrad runs in 16 bits, INT8's, keeps the 16-bit copy);
- the attention (``mixprec.memory.attention``): under ``sdpa``'s fused kernel Q, K, V
  and the output at ``b`` bytes and an fp32 log-sum-exp per head; under its CPU math
  fallback (q·k and v head dims differ: DeepSeek-V3's) fp32 Q, K, V and ``s×s``
  probabilities; under ``eager`` (GPT-OSS's) the fp32 softmax, its 16-bit copy and Q,
  K, V; a dense gated MLP (a shared expert) its gate, up and activation outputs;
- the router: its 16-bit input, fp32 probabilities per expert, the top-k ids (int64)
  and weights;
- the experts: three int64 index vectors of ``R`` (sort order, permutation, inverse),
  what the activation saves (its input, the gate-up output, and its own tensors:
  ``activation_saved`` runs the module's activation on a few rows to count them),
  the down-projection output and the routing weights; under a format, each expert's
  casts of its tokens and weights (``mixprec.experts.grouped``: the casts the backward
  reuses or makes along the token dim; on a sync-free route the whole operand's cast,
  the tile formats' of a buffer padded so every expert starts on a tile, and each
  row's expert id: ``mixprec.memory.expert_casts``); without one, transformers'
  grouped GEMM keeps the 16-bit inputs of both projections;
- the head's input, the loss's fp32 log-probabilities (``4·V``) and the token ids.

The working sets on top of that: the loss at the forward's end (the head's 16-bit
logits, their fp32 copy and the reduction, ``8·T·V``), the last layer's experts
forward under a format (``experts_forward``: biased experts adding their bias in fp32,
a sync-free route's fp32 operands and product) and its experts backward
(``experts_backward``: on the ``loop`` route each expert's casts and the busiest one's
GEMM scratch; on a sync-free route whole-operand fp32 casts, ``expert_casts``), less
what the backward has freed by then (the forward: less what is not saved yet). Each expert
is taken to get the average ``R/E`` rows unless ``routed_rows`` read a sample batch's
routing: the busiest expert's scratch is larger, by as much as the routing is uneven.
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from mixprec.experts.hook import experts_modules
from mixprec.memory.attention import (
    PRICED_ATTENTION,
    attention_impl,
    attention_modules,
    attention_path,
    attention_saved,
)
from mixprec.memory.expert_casts import (
    cast_bytes,
    saved_cast,
    sync_free_backward,
    sync_free_forward,
    sync_free_route,
    token_casts,
)
from mixprec.memory.layers import layer_recipes
from mixprec.memory.transient import linear_shapes
from mixprec.recipe.linear_format import quantizer_for

__all__ = ["moe_experts", "activation_saved", "moe_saved_bytes", "experts_forward",
           "experts_backward",
           "loss_transient", "routed_rows", "moe_terms", "moe_notes"]


def moe_experts(model: nn.Module) -> dict[str, nn.Module]:
    """The model's transformers experts modules by name (empty: not an MoE model)."""
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


def activation_saved(m: nn.Module, width: int) -> float:
    """Values per routed row an experts module's activation saves, its input (the
    gate-up output, ``width`` wide) included: its own ``_apply_gate`` (or ``act_fn``)
    run on 4 fp32 rows under ``saved_tensors_hooks`` (Mixtral's SiLU-and-multiply saves
    ``1.5·width``, GPT-OSS's clamped sigmoid gate ``3·width``)."""
    import torch

    seen: dict = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st  # held: a freed address is not reused
        return t

    x = torch.randn(4, width, requires_grad=True)
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack,
                                                                             lambda t: t):
            (m._apply_gate if m.has_gate else m.act_fn)(x)
    except Exception:  # an activation that needs more than its input: SwiGLU's count
        return 1.5 * width if m.has_gate else 2.0 * width
    return sum(st.nbytes() for st in seen.values()) / 4 / x.element_size()


def moe_saved_bytes(model: nn.Module, tokens: int, linear_formats: dict[str, Any],
                    quantizers: dict[str, Any], act_bytes: float,
                    seq_len: int | None = None, device: str = "cpu",
                    rows: dict[str, list[int]] | None = None,
                    experts_route: str = "loop") -> float:
    """Bytes one forward of ``tokens`` tokens (sequences of ``seq_len``, default one)
    saves for backward on ``device`` (see the module doc).

    ``linear_formats``: each Linear's quantizer (None: a 16-bit or fp32 Linear);
    ``quantizers``: each experts module's quantizer by name (None or absent: it runs in
    16 bits on transformers' own implementation); ``rows``: each experts module's rows
    per expert (``routed_rows``; default the average); ``experts_route``: ``loop`` or
    ``grouped`` (``expert_casts.sync_free_route``)."""
    t, b, s = tokens, act_bytes, seq_len or tokens
    total = sum(8.0 * w + 4.0 * g for w, g in _norm_widths(model)) * t
    impl = attention_impl(model)
    fused = {f"{n}.o_proj" for n, m in attention_modules(model).items()
             if attention_path(m, impl, device) == "fused"}
    for fqn, i, _ in linear_shapes(model):
        total += _linear_saved(linear_formats.get(fqn), t, i, b, fqn in fused)
    for m in model.modules():
        if type(m).__name__.endswith("Attention") and hasattr(m, "config"):
            total += t * attention_saved(m, attention_path(m, impl, device), s, b)
        elif _dense_mlp(m):
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
        # indices, the activation's saved values (the gate-up output among them), down out
        total += 24 * r + b * r * (activation_saved(m, up) + h)
        q = quantizers.get(name)
        if q is None:  # transformers' grouped_mm: 16-bit inputs, fp32 routing weights
            total += b * r * (h + inner) + 4 * r
            continue
        counts = (rows or {}).get(name) or [r / e] * e  # the average, unless read
        route = sync_free_route(q, experts_route, device)
        total += b * r + (token_casts(q, counts, h, b, route)
                          + token_casts(q, counts, inner, b, route)
                          + e * (saved_cast(q, up, h, "weight")
                                 + saved_cast(q, h, inner, "weight")))
    vocab = _vocab(model)
    total += t * (4 * vocab + 16)  # the loss's log-probabilities, labels and token ids
    return float(total)


def _linear_saved(q: Any, t: int, i: int, b: float, fused: bool = False) -> float:
    """What a Linear of ``i`` inputs keeps of ``t`` tokens' input: its format's cast
    for wgrad, or a 16-bit copy where wgrad runs in 16 bits (none where the input is a
    fused kernel's output, saved already)."""
    total = 0.0 if q is None else saved_cast(q, t, i, "input")
    if (q is None or "wgrad" not in q.quantized_gemms) and not fused:
        total += b * t * i
    return total


def _dense_mlp(m: nn.Module) -> bool:
    return all(isinstance(getattr(m, n, None), nn.Linear)
               for n in ("gate_proj", "up_proj", "down_proj"))


def _shared_saved(model: nn.Module, name: str, tokens: int, linears: dict[str, Any],
                  b: float) -> float:
    """What the dense gated MLPs beside experts module ``name`` save (DeepSeek-V3's
    shared expert, which runs after the routed ones): their 16-bit gate, up and
    activation outputs and their Linears' inputs."""
    parent = name.rpartition(".")[0]
    total = 0.0
    for child, m in dict(model.named_modules()).get(parent, nn.Module()).named_children():
        if _dense_mlp(m):
            total += 3 * b * tokens * m.up_proj.out_features + sum(
                _linear_saved(linears.get(f"{parent}.{child}.{n}"), tokens,
                              getattr(m, n).in_features, b)
                for n in ("gate_proj", "up_proj", "down_proj"))
    return total


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


def experts_forward(model: nn.Module, tokens: int, quantizers: dict[str, Any],
                    act_bytes: float, head_bytes: float = 2.0, experts_route: str = "loop",
                    device: str = "cpu", linears: dict[str, Any] | None = None) -> float:
    """The most bytes the last layer's experts forward holds beyond everything the
    forward saves, before the activation, the down projection, the head and the loss
    have saved theirs (and a shared expert, ``linears`` its Linears' quantizers): where
    a format runs experts with biases (GPT-OSS's), the gate-up
    projection adding its bias in fp32 (``mixprec.experts.hook``: the 16-bit output's
    fp32 copy, the gathered bias (and its fp32 copy) and the fp32 sum,
    ``(4 + bias + 4)·R·up`` beyond the output); on a sync-free route, its GEMM's fp32
    operands and product (``sync_free_forward``); beside the routed tokens it gathered
    (fp32, ``4·R·hidden``)."""
    experts = moe_experts(model)
    if not experts:
        return 0.0
    name, m = list(experts.items())[-1]
    q = quantizers.get(name)
    if q is None:
        return 0.0
    e, h, inner, k = _experts_dims(m)
    r, b = k * tokens, act_bytes
    up = 2 * inner if m.has_gate else inner
    route = sync_free_route(q, experts_route, device)
    held = sync_free_forward(route, q, r, e, h, up, b) if route else 0.0
    if m.has_bias:
        bias = getattr(m, "gate_up_proj_bias" if m.has_gate else "up_proj_bias").element_size()
        held = max(held, (4 + bias + (0 if bias == 4 else 4) + 4) * r * up)
    later = (b * r * (activation_saved(m, up) - up + h)
             + token_casts(q, [r / e] * e, inner, b, route)
             + _shared_saved(model, name, tokens, linears or {}, b)
             + _top_saved(model, tokens, head_bytes))
    # the routed tokens gathered from the fp32 residual stream, held while the experts run
    return 4 * r * h + held - later


def experts_backward(model: nn.Module, tokens: int, quantizers: dict[str, Any],
                     act_bytes: float, route_bytes: Any, head_bytes: float = 2.0,
                     rows: list[int] | None = None, experts_route: str = "loop",
                     device: str = "cpu") -> float:
    """The most bytes the last layer's experts backward holds beyond everything the
    forward saved; negative where what it frees first (the loss's and head's saved
    tensors, the activation's and down projection's saved tensors) outweighs it.

    Per projection of ``I`` inputs and ``O`` outputs over ``R`` rows: the arriving
    gradient (``b·R·O``), the input gradient (fp32 for the gate-up projection, whose
    tokens come from the fp32 residual stream) and the fp32 weight gradient of every
    expert (``4·E·O·I``); on the ``loop`` route (a CPU's eager choice) the gradient's
    casts for every expert (for dgrad, and along the tokens for wgrad unless reused)
    and the busiest expert's GEMM scratch (its format's ``backward_bytes`` on its rows,
    ``route_bytes(q, rows, in, out)``); ``rows``: the rows each expert of this layer
    got (default: the average ``R/E`` each). On a sync-free route
    (``expert_casts.sync_free_route``), its whole-operand casts instead
    (``expert_casts.sync_free_backward``)."""
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
    counts = rows or [math.ceil(r / e)] * e
    free = None if q is None else sync_free_route(q, experts_route, device)
    top = _top_saved(model, tokens, head_bytes)
    out_and_weights = b * r * h + (b if q is not None else 4) * r
    down_in = (b * r * inner if q is None else
               token_casts(q, rows or [r / e] * e, inner, b, free))
    down_w = 0.0 if q is None else e * saved_cast(q, h, inner, "weight")
    # (in, out, dx bytes, freed before it runs, a fresh weight gradient already there)
    steps = ((inner, h, b, top + out_and_weights, 0.0),
             (h, up, 4, top + out_and_weights + b * r * activation_saved(m, up) + down_in
              + down_w, 4 * e * h * inner))
    for i, o, dx_bytes, freed, held in steps:
        need = b * r * o + dx_bytes * r * i + 4 * e * o * i + held - freed
        if free:
            need += sync_free_backward(free, q, r, e, i, o, b, dx_bytes)
        elif q is not None:
            for n in counts:
                need += cast_bytes(q, n, o, "grad_output", 1)
                if not q.reuses("grad_output"):
                    need += cast_bytes(q, n, o, "grad_output", 0)
            need += route_bytes(q, max(counts), i, o)
        best = max(best, need)
    return best


def routed_rows(model: nn.Module, batch: Any) -> dict[str, list[int]]:
    """The rows each expert of each experts module gets on ``batch`` (a dict of keyword
    inputs, a tuple of positional ones, or a tensor): one forward without grad, the
    router's top-k ids (the experts forward's second argument, or its ``top_k_index`` /
    ``router_indices`` keyword) counted per expert; a module called otherwise is left
    out (priced at the average). The model's buffers are restored after."""
    import torch

    counts: dict[str, list[int]] = {}

    def hook(name, m):
        def read(_mod, args, kwargs):
            ids = args[1] if len(args) > 1 else kwargs.get(
                "top_k_index", kwargs.get("router_indices"))
            if not isinstance(ids, torch.Tensor):  # a signature not known: the average
                return
            e = _experts_dims(m)[0]
            got = torch.bincount(ids.reshape(-1).clamp(0, e), minlength=e + 1)[:e]
            counts[name] = [int(c) for c in got.tolist()]
        return read

    handles = [m.register_forward_pre_hook(hook(n, m), with_kwargs=True)
               for n, m in moe_experts(model).items()]
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    try:
        with torch.no_grad():
            if isinstance(batch, dict):
                model(**batch)
            elif isinstance(batch, (tuple, list)):
                model(*batch)
            else:
                model(batch)
    finally:
        for h in handles:
            h.remove()
        with torch.no_grad():
            named = dict(model.named_buffers())
            for k, v in buffers.items():
                named[k].copy_(v)
    return counts


def moe_terms(model: nn.Module, r: Any, tokens: int, act_bytes: float, route: str,
              seq_len: int | None = None, rows: dict[str, list[int]] | None = None,
              experts_route: str = "loop") -> tuple[float, float]:
    """``(saved activations, working set)`` of an MoE model under recipe ``r``: what one
    forward of ``tokens`` tokens (sequences of ``seq_len``) saves, and the largest of
    the loss's working set, the biased experts' forward and the widest experts
    projection's backward (``route``: the fp8 GEMM route of one expert's GEMMs;
    ``rows``: each experts module's rows per expert, ``routed_rows``; ``experts_route``:
    the experts' grouped route, ``loop`` or ``grouped``)."""
    if experts_route not in ("loop", "grouped"):
        raise ValueError(f"experts_route={experts_route!r}; valid: loop (a CPU's eager "
                         "route), grouped (a GPU's, and a compiled CPU model's)")
    linears = ({fqn: quantizer_for(rec) for fqn, rec in layer_recipes(model, r).items()
                if rec is not None} if r.linear is not None else {})
    experts = {}
    if r.linear is not None:
        experts = {name: quantizer_for(r.for_layer(name)) for name in moe_experts(model)
                   if r.layer_format(name) != "bf16"}
    device = next(model.parameters()).device.type
    saved = moe_saved_bytes(model, tokens, linears, experts, act_bytes, seq_len, device,
                            rows, experts_route)
    last = list(moe_experts(model))[-1:]
    work = max(loss_transient(model, tokens),
               experts_forward(model, tokens, experts, act_bytes,
                               experts_route=experts_route, device=device, linears=linears),
               experts_backward(model, tokens, experts, act_bytes,
                                lambda q, t, i, o: q.backward_bytes(t, i, o, act_bytes,
                                                                    route),
                                rows=(rows or {}).get(last[0]) if last else None,
                                experts_route=experts_route, device=device))
    return saved, work


def moe_notes(model: nn.Module) -> list[str]:
    """What the pricing leaves out or assumes for this model: an attention
    implementation other than ``sdpa`` and ``eager`` is priced as a fused kernel (its
    log-sum-exp only), and the ``eager`` and ``math`` paths' ``s×s`` probabilities are
    flagged where they are priced."""
    impl = attention_impl(model)
    if impl not in PRICED_ATTENTION:
        return [f"activations: attention implementation {impl!r}: priced as a fused "
                "kernel (Q, K, V, the output and a log-sum-exp per head)"]
    device = next(model.parameters()).device.type
    paths = {attention_path(m, impl, device) for m in attention_modules(model).values()}
    if paths & {"eager", "math"}:
        how = "eager" if "eager" in paths else "sdpa's math fallback (q·k and v head dims differ)"
        return [f"activations: attention runs {how}: its fp32 s×s probabilities per head "
                "are priced; a fused kernel would save a log-sum-exp per head instead"]
    return []
