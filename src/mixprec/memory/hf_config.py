"""A ``TransformerSpec`` from a transformers model config (a ``PretrainedConfig``, its
``config.json`` or a dict of it), so the planner prices a Llama, a Mixtral or a
Qwen3-MoE by its own shapes, not as a GPT. Nothing is downloaded and transformers is
not imported: the config's fields are read by name.

Each spec field from the config's fields (the first found):

- ``layers``, ``hidden``, ``heads``: ``num_hidden_layers``, ``hidden_size``,
  ``num_attention_heads`` (GPT-2's ``n_layer``, ``n_embd``, ``n_head``);
- ``kv_heads``, ``head_dim``: ``num_key_value_heads``, ``head_dim``;
- ``ffn_hidden``: ``intermediate_size``, ``n_inner`` (default ``4·hidden``);
- ``gated``: a ``hidden_act`` of ``silu`` or ``swish`` (Llama, Mistral, Mixtral, Qwen),
  or a Gemma's ``gelu``;
- ``experts``, ``top_k``: ``num_local_experts``, ``num_experts``, ``n_routed_experts``;
  ``num_experts_per_tok``;
- ``expert_ffn_hidden``: ``moe_intermediate_size``, else ``intermediate_size``
  (Mixtral's experts);
- ``shared_ffn_hidden``: ``shared_expert_intermediate_size`` (Qwen2-MoE), or
  ``n_shared_experts·moe_intermediate_size`` (DeepSeek);
- ``dense_layers``: ``mlp_only_layers`` and ``decoder_sparse_step`` (Qwen-MoE),
  ``first_k_dense_replace`` (DeepSeek);
- ``vocab``, ``tied_embeddings``: ``vocab_size``, ``tie_word_embeddings`` (default
  true);
- ``norm``: ``rms`` where the config has ``rms_norm_eps``, else ``layer``.

A model with a separate K and V projection each (every transformers decoder but GPT-2's
fused ``c_attn``) gets ``qkv_linears=3``. Multi-head latent attention (DeepSeek-V3's)
and a multimodal config's nested text config are not read: pass the text config, and
price MLA from the model itself (``estimate(model, ...)``).
"""

from __future__ import annotations

import json
import os
from typing import Any

from mixprec.memory.spec import TransformerSpec

__all__ = ["spec_from_config", "read_config"]

_GPT_STYLE = ("gpt2", "gpt_bigcode", "openai-gpt")  # a fused QKV Linear (Conv1D)
_QK_NORM = ("qwen3",)  # an RMSNorm of head_dim on each head's queries and keys


def read_config(config: Any) -> dict[str, Any]:
    """The config's fields as a dict: a ``PretrainedConfig`` (its attribute names
    resolved, ``n_embd`` as ``hidden_size``), a dict, or the path of a ``config.json``
    (or of the folder holding one)."""
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"config {os.fspath(config)!r}: no such file; pass a "
                                    "config.json, the folder holding one, or a "
                                    "transformers PretrainedConfig")
        with open(path) as f:
            return json.load(f)
    if isinstance(config, dict):
        return dict(config)
    if hasattr(config, "to_dict"):
        out = config.to_dict()
        for alias, name in getattr(config, "attribute_map", {}).items():
            out.setdefault(name, getattr(config, name, None))
            out.setdefault(alias, getattr(config, alias, None))
        return out
    raise TypeError(f"config of type {type(config).__name__}: pass a transformers "
                    "PretrainedConfig, a dict, or the path of a config.json")


def _first(cfg: dict, *names: str, default: Any = None) -> Any:
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    return default


def _dense_layers(cfg: dict, layers: int) -> int:
    """Layers whose MLP is dense in an MoE config."""
    if cfg.get("first_k_dense_replace") is not None:
        return int(cfg["first_k_dense_replace"])
    only = set(cfg.get("mlp_only_layers") or ())
    step = int(cfg.get("decoder_sparse_step") or 1)
    return sum(1 for i in range(layers) if i in only or (i + 1) % step)


def spec_from_config(config: Any, seq_len: int, micro_batch: int = 1,
                     **overrides: Any) -> TransformerSpec:
    """The ``TransformerSpec`` of a transformers config (see the module docstring) for
    sequences of ``seq_len`` tokens, ``micro_batch`` per rank; ``overrides`` set any
    other spec field (``attention="flash"``, ``recompute=...``, ``dropout=False``).

    >>> spec = spec_from_config({"model_type": "llama", "hidden_size": 4096,
    ...     "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    ...     "intermediate_size": 14336, "vocab_size": 128256, "hidden_act": "silu",
    ...     "rms_norm_eps": 1e-5, "tie_word_embeddings": False}, seq_len=8192)
    >>> spec.kv_heads, spec.ffn_hidden, spec.gated, spec.norm
    (8, 14336, True, 'rms')
    """
    cfg = read_config(config)
    missing = [n for n, alts in (("hidden_size", ("hidden_size", "n_embd")),
                                 ("num_hidden_layers", ("num_hidden_layers", "n_layer")),
                                 ("num_attention_heads", ("num_attention_heads", "n_head")))
               if _first(cfg, *alts) is None]
    if missing:
        raise ValueError(f"config (model_type {cfg.get('model_type')!r}) has no "
                         f"{', '.join(missing)}: pass a decoder's config (for a multimodal "
                         "model its text_config)")
    hidden = int(_first(cfg, "hidden_size", "n_embd"))
    layers = int(_first(cfg, "num_hidden_layers", "n_layer"))
    heads = int(_first(cfg, "num_attention_heads", "n_head"))
    kind = str(cfg.get("model_type") or "")
    act = str(_first(cfg, "hidden_act", "hidden_activation", "activation_function",
                         default=""))
    ffn = int(_first(cfg, "intermediate_size", "n_inner", default=4 * hidden))
    experts = int(_first(cfg, "num_local_experts", "num_experts", "n_routed_experts",
                         default=0))
    moe_width = _first(cfg, "moe_intermediate_size")
    shared = int(_first(cfg, "shared_expert_intermediate_size", default=0))
    if not shared and cfg.get("n_shared_experts") and moe_width:
        shared = int(cfg["n_shared_experts"]) * int(moe_width)
    spec = {
        "layers": layers, "hidden": hidden, "heads": heads,
        "kv_heads": int(_first(cfg, "num_key_value_heads", default=heads)),
        "head_dim": _first(cfg, "head_dim"),
        "ffn_hidden": ffn,
        "gated": act in ("silu", "swish") or (kind.startswith("gemma") and "gelu" in act),
        "vocab": _first(cfg, "vocab_size"),
        "tied_embeddings": bool(_first(cfg, "tie_word_embeddings", default=True)),
        "norm": "rms" if cfg.get("rms_norm_eps") is not None else "layer",
        "qkv_linears": 1 if kind in _GPT_STYLE else 3,
        "qk_norm": kind.startswith(_QK_NORM),
        "seq_len": seq_len, "micro_batch": micro_batch,
    }
    if experts:
        spec.update(experts=experts, top_k=int(_first(cfg, "num_experts_per_tok",
                                                       "top_k", default=1)),
                    expert_ffn_hidden=int(moe_width or ffn), shared_ffn_hidden=shared,
                    dense_layers=_dense_layers(cfg, layers))
    spec.update(overrides)
    return TransformerSpec(**spec)
