"""The Linears and the parameter count of a transformer described by a
``TransformerSpec``: GPT's fused QKV and GELU MLP, or today's grouped-query attention,
SwiGLU MLPs and mixtures of experts (``estimate`` prices a bare count from these).

Per layer (``h`` hidden, ``q = heads·head_dim``, ``kv = kv_heads·head_dim``, MLP width
``f``, expert width ``g``, ``E`` experts, shared width ``c``):

- attention: Q, K, V (``h·(q + 2·kv)``) and the output projection (``q·h``);
- a dense MLP: ``2·h·f`` (GELU), ``3·h·f`` (gated: gate, up, down);
- an MoE layer: ``E`` experts of ``3·h·g`` (``2·h·g`` ungated), the router (``h·E``)
  and a shared MLP of ``3·h·c``;
- two norms of ``h`` (RMSNorm) or ``2·h`` (LayerNorm, with bias).

Plus the embedding (``V·h``), the head (``h·V``, unless tied to the embedding) and the
final norm, and ``2·head_dim`` a layer for per-head query and key norms (``qk_norm``,
Qwen3). Biases and position embeddings are left out (each under 0.1% of today's
models).
"""

from __future__ import annotations

from mixprec.memory.spec import TransformerSpec

__all__ = ["spec_linears", "param_count", "linear_params"]


def spec_linears(spec: TransformerSpec) -> list[tuple[int, int, str, int]]:
    """``(in, out, role, count)`` of the model's Linears: ``role`` is ``layer`` (the
    attention's and dense MLPs'), ``expert`` (routed experts' projections, each run on
    ``top_k/experts`` of the tokens on average), ``router`` or ``head``; ``count`` how
    many such Linears the whole model has."""
    h = spec.hidden
    q, kv, ffn, inner, moe = spec.dims
    dense = spec.layers - moe
    n = spec.layers
    qkv = [(h, q + 2 * kv, "layer", n)] if spec.qkv_linears == 1 else [
        (h, q, "layer", n), (h, kv, "layer", 2 * n)]
    out = [*qkv, (q, h, "layer", n)]

    def mlp(width: int, role: str, count: int) -> list[tuple[int, int, str, int]]:
        if not count or not width:
            return []
        up = [(h, width, role, (2 if spec.gated else 1) * count)]
        return up + [(width, h, role, count)]

    out += mlp(ffn, "layer", dense)
    if moe:
        out += mlp(inner, "expert", moe * spec.experts)
        out += [(h, spec.experts, "router", moe)]
        out += mlp(spec.shared_ffn_hidden, "layer", moe)
    if spec.vocab:
        out.append((h, spec.vocab, "head", 1))
    return out


def linear_params(spec: TransformerSpec) -> int:
    """Elements of the Linears' weights, the head's included."""
    return sum(i * o * c for i, o, _, c in spec_linears(spec))


def param_count(spec: TransformerSpec) -> int:
    """The model's parameters (see the module docstring): its Linears, the norms, and
    the embedding (once where the head is tied to it).

    >>> param_count(TransformerSpec(layers=2, hidden=64, heads=4, seq_len=8))
    98944
    """
    h = spec.hidden
    norm = h if spec.norm == "rms" else 2 * h
    total = linear_params(spec) + (2 * spec.layers + 1) * norm
    if spec.qk_norm:
        total += 2 * spec.layers * (spec.head_dim or h // spec.heads)
    if spec.vocab and not spec.tied_embeddings:  # a tied head is the embedding
        total += spec.vocab * h
    return total
