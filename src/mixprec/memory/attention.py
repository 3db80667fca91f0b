"""What a transformers attention module saves for backward, by how it runs: ``sdpa``'s
fused kernel, its CPU math fallback, or transformers' ``eager`` matmul-softmax-matmul
(``mixprec.memory.moe`` prices a mixture-of-experts model with it)."""

from __future__ import annotations

from torch import nn

__all__ = ["PRICED_ATTENTION", "attention_modules", "attention_impl", "attention_path",
           "attention_saved"]

#: attention implementations priced by their own saved tensors (``attention_path``)
PRICED_ATTENTION = ("sdpa", "eager")


def _attention_dims(m: nn.Module) -> tuple[int, int, int, int, int, int]:
    """``(heads, kv heads, q·k head dim, v head dim, K width, V width)`` of an attention
    module: from its q, k and v projections, or under multi-head latent attention
    (DeepSeek's: no ``q_proj``/``k_proj`` pair, K and V expanded per head) the
    config's head dims."""
    cfg = m.config
    heads = getattr(cfg, "num_attention_heads", 1)
    q, k, v = (getattr(m, f"{n}_proj", None) for n in "qkv")
    if all(isinstance(x, nn.Linear) for x in (q, k, v)):
        groups = getattr(cfg, "num_key_value_heads", None) or heads
        return (heads, groups, q.out_features // heads, v.out_features // groups,
                k.out_features, v.out_features)
    qk = getattr(cfg, "qk_head_dim", None) or (getattr(cfg, "qk_nope_head_dim", 0)
                                                + getattr(cfg, "qk_rope_head_dim", 0))
    vd = getattr(cfg, "v_head_dim", qk)
    return heads, heads, qk, vd, heads * qk, heads * vd


def attention_path(m: nn.Module, impl: str, device: str = "cpu") -> str:
    """How an attention module runs: ``fused`` (``sdpa``'s flash or memory-efficient
    kernel, or a flash/flex implementation), ``math`` (``sdpa`` on a CPU where the
    q·k and v head dims differ: torch's fused CPU kernel needs them equal) or
    ``eager`` (transformers' matmul-softmax-matmul)."""
    if impl == "eager":
        return "eager"
    _, _, qk, vd, _, _ = _attention_dims(m)
    return "math" if impl == "sdpa" and device == "cpu" and qk != vd else "fused"


def attention_saved(m: nn.Module, path: str, seq_len: int, b: float) -> float:
    """Bytes per token an attention module saves for backward beyond its Linears'
    inputs (``b``: the activations' bytes).

    - ``fused``: Q, K, V and the output at ``b`` and an fp32 log-sum-exp per head;
    - ``math`` (torch's CPU fallback, which upcasts 16-bit inputs): the scaled Q, and
      K and V expanded to every head, in fp32, the fp32 ``s×s`` probabilities, and
      the output projection's own input;
    - ``eager``: Q and the expanded K and V at ``b``, the fp32 softmax over ``s``
      columns (one more per head's sink, with the row maximum's int64 index) and its
      ``b`` copy the PV matmul reads, and the output projection's input."""
    heads, groups, qk, vd, kw, vw = _attention_dims(m)
    qw, ow = heads * qk, heads * vd
    if path == "fused":
        return b * (qw + kw + vw + ow) + 4 * heads
    full = qw + heads * qk + heads * vd  # Q, and K and V repeated to every head
    if path == "math":
        return 4.0 * full + 4 * heads * seq_len + b * ow
    sink = getattr(m, "sinks", None) is not None
    return (b * full + heads * (4 * (seq_len + sink) + b * seq_len + 8 * sink)
            + b * ow)


def attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The model's attention modules by name (a class named ``...Attention`` with a
    config)."""
    return {n: m for n, m in model.named_modules()
            if type(m).__name__.endswith("Attention") and hasattr(m, "config")}


def attention_impl(model: nn.Module) -> str:
    """The model's attention implementation (its config's; ``sdpa`` unless set)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) or "sdpa"
