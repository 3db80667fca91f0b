"""Tiny transformers mixture-of-experts models built from configs (nothing downloaded)
and a learnable token stream, shared by the experts tests and benchmarks/moe_parity.py.

Four families: Mixtral and Qwen3-MoE (concatenated gate-up, out × in), DeepSeek-V3
(a shared expert beside the routed ones, grouped routing), GPT-OSS (interleaved gate-up
in in × out with biases). Each: 2 layers, hidden 64, 4 experts, top-2, vocabulary 128.
The stream is a fixed random Markov chain: each token has 4 possible successors, so a
model that learns the chain reaches the loss floor ln 4 = 1.39 (from ln 128 = 4.85).
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["MODELS", "VOCAB", "config", "model", "markov_batches", "train",
           "count_experts_gemms", "SKEWED_TOKENS", "skewed_model", "skewed_routing",
           "skewed_batch"]

MODELS = ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")
VOCAB = 128


def config(kind: str):
    """The tiny config of family ``kind`` (one of ``MODELS``)."""
    import transformers

    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                  num_experts_per_tok=2)
    if kind == "mixtral":
        return transformers.MixtralConfig(**common, intermediate_size=64,
                                          num_local_experts=4)
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, intermediate_size=64,
                                           moe_intermediate_size=64, num_experts=4,
                                           head_dim=16)
    if kind == "deepseek_v3":
        return transformers.DeepseekV3Config(
            **{**common, "num_key_value_heads": 4}, intermediate_size=64,
            moe_intermediate_size=64, n_routed_experts=4, n_group=1, topk_group=1,
            first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=32,
            qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, n_shared_experts=1)
    if kind == "gpt_oss":
        return transformers.GptOssConfig(**common, intermediate_size=64,
                                         num_local_experts=4, head_dim=16)
    raise ValueError(f"kind={kind!r}; valid: {', '.join(MODELS)}")


def model(kind: str, seed: int = 0, experts_std: float | None = None) -> torch.nn.Module:
    """A float32 causal LM of family ``kind`` in transformers' init; with
    ``experts_std``, the experts' weights and biases drawn N(0, experts_std²) instead
    (transformers' init leaves GPT-OSS's expert biases at zero)."""
    import transformers

    from mixprec.experts.hook import experts_modules

    torch.manual_seed(seed)
    m = transformers.AutoModelForCausalLM.from_config(config(kind), dtype=torch.float32)
    for experts in experts_modules(m).values() if experts_std else ():
        for p in experts.parameters():
            torch.nn.init.normal_(p, std=experts_std)
    return m


def markov_batches(steps: int, batch: int = 8, seq: int = 16, seed: int = 0
                   ) -> list[torch.Tensor]:
    """``steps`` batches (batch × seq token ids) of a Markov chain: token t is followed
    by one of ``successors[t]`` (4 distinct tokens), uniformly."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.stack([torch.randperm(VOCAB, generator=g)[:4] for _ in range(VOCAB)])
    out = []
    for _ in range(steps):
        ids = torch.empty(batch, seq, dtype=torch.long)
        ids[:, 0] = torch.randint(0, VOCAB, (batch,), generator=g)
        for i in range(1, seq):
            pick = torch.randint(0, 4, (batch,), generator=g)
            ids[:, i] = successors[ids[:, i - 1], pick]
        out.append(ids)
    return out


def train(model: torch.nn.Module, engine, batches) -> list[float]:
    """One engine step per batch (next-token loss); the losses."""
    losses = []
    for ids in batches:
        with engine.autocast():
            loss = model(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    return losses


class _Counted:
    """``hook.grouped_mm`` counting its calls."""

    def __init__(self, inner):
        self.calls, self.inner = 0, inner

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


@contextlib.contextmanager
def count_experts_gemms():
    """Counts the grouped GEMMs the experts run in a low-precision format (mixprec's
    hook calls ``grouped_mm`` once per projection): the counter's ``calls``."""
    from mixprec.experts import hook

    counted = _Counted(hook.grouped_mm)
    hook.grouped_mm = counted
    try:
        yield counted
    finally:
        hook.grouped_mm = counted.inner


#: the tokens of ``skewed_batch``: 4 sequences of 16
SKEWED_TOKENS = 64


def skewed_model(kind: str) -> torch.nn.Module:
    """Family ``kind``'s model (seed 0) with experts' weights of std 0.05."""
    return model(kind, 0, experts_std=0.05)


def skewed_routing(model) -> None:
    """Every router picks experts 0 and 1 + (0, 0, 0, 0, 0, 1, 1, 2)[token % 8]: on
    ``skewed_batch`` expert 0 gets every token, expert 1 five in eight, expert 2 two in
    eight, expert 3 one in eight."""
    second = torch.tensor([1, 1, 1, 1, 1, 2, 2, 3]).repeat(SKEWED_TOKENS // 8)
    index = torch.stack([torch.zeros(SKEWED_TOKENS, dtype=torch.long), second], dim=1)

    def force(mod, args, out):
        logits, scores, _ = out
        return logits, scores, index

    for name, m in model.named_modules():
        if name.endswith("mlp.gate"):
            m.register_forward_hook(force)


def skewed_batch() -> dict:
    """4 sequences of 16 tokens (seed 1), as ``input_ids`` and ``labels``."""
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}
