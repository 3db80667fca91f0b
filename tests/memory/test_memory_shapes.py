"""The memory planner on today's shapes (grouped-query attention, SwiGLU, experts):
parameter counts and per-part bytes of Llama-3-70B and Mixtral-8x7B against the hand
counts of docs/guides/memory.md, counts of small transformers models, and the fp8
weight casts ZeRO-3 holds per rank."""

from __future__ import annotations

import pytest
import torch

from mixprec.cli import main
from mixprec.memory import TransformerSpec, estimate
from mixprec.memory.hf_config import spec_from_config
from mixprec.memory.shapes import param_count

transformers = pytest.importorskip("transformers")

LLAMA3_70B = dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                  num_key_value_heads=8, intermediate_size=28672, vocab_size=128256,
                  tie_word_embeddings=False)
MIXTRAL_8X7B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, intermediate_size=14336, num_local_experts=8,
                    num_experts_per_tok=2, vocab_size=32000, tie_word_embeddings=False)

# the hand counts of docs/guides/memory.md ("Today's models, by hand"): parameters, and
# GB per rank under AdamW, ZeRO-3 over 64 ranks
HAND = {
    "llama": {"params": 70_553_706_496,
              "bf16-master": {"params": 2.2048, "grads": 4.4096, "master": 4.4096,
                              "optimizer": 8.8192},
              "fp8": {"params": 4.4096, "grads": 4.4096, "optimizer": 8.8192,
                      "weight_casts": 70.5524}},
    "mixtral": {"params": 46_702_792_704,
                "bf16-master": {"params": 1.4595, "grads": 2.9189, "master": 2.9189,
                                "optimizer": 5.8378},
                "fp8": {"params": 2.9189, "grads": 2.9189, "optimizer": 5.8378,
                        "weight_casts": 46.7036}},
}


def _config(kind: str):
    if kind == "llama":
        return transformers.LlamaConfig(**LLAMA3_70B)
    return transformers.MixtralConfig(**MIXTRAL_8X7B)


@pytest.mark.parametrize("kind,published", [("llama", 70.55e9), ("mixtral", 46.70e9)])
def test_the_count_from_a_config_is_the_hand_count_and_the_published_one(kind, published):
    spec = spec_from_config(_config(kind), seq_len=4096)
    assert param_count(spec) == HAND[kind]["params"]
    assert param_count(spec) == pytest.approx(published, rel=1e-3)
    # priced as a GPT of the same width and depth, the count is off by a lot
    gpt = TransformerSpec(layers=spec.layers, hidden=spec.hidden, heads=spec.heads,
                          seq_len=4096, vocab=spec.vocab)
    assert abs(param_count(gpt) / published - 1) > 0.05


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
@pytest.mark.parametrize("recipe", ["bf16-master", "fp8"])
def test_each_part_matches_the_hand_count_within_5_percent(kind, recipe):
    spec = spec_from_config(_config(kind), seq_len=4096, attention="flash", dropout=False)
    got = estimate(spec, recipe, zero_stage=3, world_size=64)
    for item, gb in HAND[kind][recipe].items():
        assert got.gb(item) == pytest.approx(gb, rel=0.05), item
        assert got.gb(item) == pytest.approx(gb, abs=1e-4), item  # the docs' 4 decimals
    if "master" not in HAND[kind][recipe]:
        assert got["master"] == 0.0  # fp8's fp32 weights are their own masters


def test_mixprec_memory_prices_a_config_json(tmp_path, capsys):
    path = tmp_path / "config.json"
    _config("llama").to_json_file(path)
    main(["memory", "--config", str(tmp_path), "--seq", "4096", "--recipe", "fp8",
          "--zero", "3", "--gpus", "64"])  # the folder holding config.json
    out = capsys.readouterr().out
    flat = " ".join(out.split())  # the title wraps
    assert "70.55B (counted from the shapes)" in flat
    assert "70.55" in out.split("weight_casts")[1].split("\n")[0]
    assert "not sharded" in flat  # the ZeRO-3 note says why the casts are whole


def test_a_config_that_is_not_there_or_not_a_decoders_is_refused_with_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file; pass a config.json"):
        spec_from_config(tmp_path, seq_len=8)
    with pytest.raises(ValueError, match="has no hidden_size.*text_config"):
        spec_from_config({"model_type": "llava", "vocab_size": 10}, seq_len=8)
    with pytest.raises(ValueError, match="kv_heads=3.*divides heads=8"):
        TransformerSpec(layers=1, hidden=64, heads=8, kv_heads=3, seq_len=8)


def test_the_shape_options_price_the_same_model_as_its_config(capsys):
    args = ["memory", "--layers", "32", "--hidden", "4096", "--heads", "32", "--seq", "4096",
            "--kv-heads", "8", "--ffn-hidden", "14336", "--swiglu", "--experts", "8",
            "--top-k", "2", "--vocab", "32000", "--untied", "--rms-norm", "--recipe", "fp8"]
    main(args)
    out = " ".join(capsys.readouterr().out.split())
    assert "46.70B (counted from the shapes)" in out
    assert main(["memory", "--config", "x.json"]) != 0
    assert "--config needs --seq" in capsys.readouterr().err
    assert main(["memory", "--kv-heads", "8"]) != 0
    assert "need all of --layers" in capsys.readouterr().err


def _tiny(kind: str):
    base = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=96, vocab_size=100)
    if kind == "llama":
        return transformers.LlamaConfig(**base), transformers.LlamaForCausalLM
    if kind == "mixtral":
        return (transformers.MixtralConfig(**base, num_local_experts=4,
                                           num_experts_per_tok=2),
                transformers.MixtralForCausalLM)
    cfg = transformers.Qwen3MoeConfig(**base, num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=32, mlp_only_layers=[0],
                                      head_dim=32)
    return cfg, transformers.Qwen3MoeForCausalLM


@pytest.mark.parametrize("kind", ["llama", "mixtral", "qwen3_moe"])
def test_the_count_is_the_models_own(kind):
    """A small model built from the same config: the same count, Qwen3's per-head q and
    k norms (2·head_dim a layer) included."""
    cfg, cls = _tiny(kind)
    torch.manual_seed(0)
    model = cls(cfg)
    own = sum(p.numel() for p in model.parameters())
    spec = spec_from_config(cfg, seq_len=16)
    assert param_count(spec) == own
    assert spec.qk_norm == (kind == "qwen3_moe")
    if kind == "qwen3_moe":  # one dense layer (mlp_only_layers), one of 4 experts of 32
        assert (spec.dense_layers, spec.expert_ffn_hidden, spec.head_dim) == (1, 32, 32)


def test_shared_experts_are_read_and_counted():
    cfg = transformers.Qwen2MoeConfig(hidden_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=96, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=48, num_experts=4,
                                      num_experts_per_tok=2, vocab_size=100)
    spec = spec_from_config(cfg, seq_len=16)
    assert spec.shared_ffn_hidden == 48
    without = spec_from_config({**cfg.to_dict(), "shared_expert_intermediate_size": 0},
                               seq_len=16)
    assert param_count(spec) - param_count(without) == 2 * 3 * 64 * 48
    assert estimate(spec, "bf16-master")["activations"] > \
        estimate(without, "bf16-master")["activations"]


def test_fp8_casts_under_zero_3_are_whole_per_rank_and_one_layer_under_recompute():
    """The formula the 2-rank FSDP measurement checks (tests/memory/test_memory_fsdp.py): every
    fp8 Linear's weight at 1 byte, the head's bf16 autocast copy at 2, whatever the
    number of ranks; under full recomputation one layer's."""
    spec = spec_from_config(_config("llama"), seq_len=4096)
    layer = 855_654_400 - 2 * 8192  # a layer's Linears
    head = 128256 * 8192
    for world in (1, 8, 64):
        got = estimate(spec, "fp8", zero_stage=3, world_size=world)
        assert got["weight_casts"] == 80 * layer + 2 * head
    full = spec_from_config(_config("llama"), seq_len=4096, recompute="full")
    assert estimate(full, "fp8", zero_stage=3, world_size=64)["weight_casts"] == \
        layer + 2 * head


def test_grouped_query_attention_and_swiglu_change_the_saved_activations():
    """Per layer and token (16-bit, flash, no dropout, a fused QKV Linear), in units of
    ``hidden``: 2 norms (2+2), QKV input (2), Q, K, V (2·(1 + 2·kv/heads)), the
    attention output (2), MLP input (2 per reading Linear), and the MLP's values: GELU
    ``2f + 2f``, SwiGLU ``3·2f + 2f``; plus 4 bytes of log-sum-exp per head."""
    h, s, a = 64, 8, 4
    base = dict(layers=1, hidden=h, heads=a, seq_len=s, attention="flash", dropout=False,
                fp32_norms=False)

    def saved(**kw):
        return estimate(TransformerSpec(**base, **kw), "bf16-master")["activations"]

    gpt = s * h * (4 + 2 + 6 + 2 + 2 + 8 + 8) + 4 * a * s
    assert saved() == gpt
    gqa = s * h * (4 + 2 + 2 * 1.5 + 2 + 2 + 8 + 8) + 4 * a * s  # kv_heads = heads / 4
    assert saved(kv_heads=1) == gqa
    swiglu = s * h * (4 + 2 + 6 + 2 + 2 * 2 + 3 * 2 * 3 + 2 * 3) + 4 * a * s  # f = 3
    assert saved(gated=True, ffn_hidden=3 * h) == swiglu


class _LlamaBlock(torch.nn.Module):
    """The workbench GPT's block with grouped-query attention (a fused Linear to Q and
    ``kv_heads`` K and V heads, ``sdpa(enable_gqa=True)``) and a SwiGLU MLP."""

    def __init__(self, h: int, heads: int, kv_heads: int, ffn: int) -> None:
        super().__init__()
        self.heads, self.kv, self.d = heads, kv_heads, h // heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(h), torch.nn.LayerNorm(h)
        self.qkv = torch.nn.Linear(h, h + 2 * kv_heads * self.d)
        self.proj = torch.nn.Linear(h, h)
        self.gate, self.up = torch.nn.Linear(h, ffn), torch.nn.Linear(h, ffn)
        self.down = torch.nn.Linear(ffn, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        kw = self.kv * self.d
        q, k, v = self.qkv(self.ln1(x)).split([h, kw, kw], dim=-1)
        q = q.view(b, t, self.heads, self.d).transpose(1, 2)
        k, v = (z.view(b, t, self.kv, self.d).transpose(1, 2) for z in (k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                             enable_gqa=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, h))
        z = self.ln2(x)
        return x + self.down(torch.nn.functional.silu(self.gate(z)) * self.up(z))


@pytest.mark.parametrize("recipe", ["fp32", "bf16-master", "fp8"])
def test_gqa_and_swiglu_activations_within_10_percent_of_a_measured_forward(recipe):
    """As the GPT's (tests/memory/test_memory.py), on a model with 4 of 8 heads' K and V and a
    SwiGLU MLP of width 3·hidden."""
    from mixprec import MixedPrecision
    from mixprec.memory import measure
    from mixprec.workbench import GPT, GPTConfig

    torch.manual_seed(0)
    layers, h, heads, kv, s, b = 4, 128, 8, 2, 128, 8
    model = GPT(GPTConfig(n_layers=layers, d_model=h, n_heads=heads, seq_len=s))
    model.blocks = torch.nn.ModuleList(_LlamaBlock(h, heads, kv, 3 * h)
                                       for _ in range(layers))
    idx = torch.randint(0, 256, (b, s + 1))
    engine = MixedPrecision(model, torch.optim.AdamW(model.parameters()), recipe)
    with engine.autocast():
        loss = engine.model(idx[:, :-1], idx[:, 1:])
    engine.backward(loss)
    engine.step()
    got = measure(model, engine, (idx[:, :-1], idx[:, 1:]))
    spec = TransformerSpec(layers=layers, hidden=h, heads=heads, kv_heads=kv, seq_len=s,
                           micro_batch=b, vocab=256, attention="flash", dropout=False,
                           gated=True, ffn_hidden=3 * h)
    want = estimate(model, recipe, activations=spec)["activations"]
    assert got["activations"] == pytest.approx(want, rel=0.10)
    # the GPT formula (4·hidden GELU MLP, every head's K and V) misses by more
    gpt = TransformerSpec(layers=layers, hidden=h, heads=heads, seq_len=s, micro_batch=b,
                          vocab=256, attention="flash", dropout=False)
    assert abs(estimate(model, recipe, activations=gpt)["activations"]
               / got["activations"] - 1) > 0.10


@pytest.mark.parametrize("kind,recipe", [(k, r) for k in ("llama", "mixtral")
                                         for r in ("fp32", "bf16-master", "fp8")])
def test_a_spec_read_off_a_config_prices_the_transformers_models_activations(kind, recipe,
                                                                            monkeypatch):
    """A small transformers Llama and Mixtral (hidden 128, 8 heads, 2 K and V heads,
    intermediate 256; Mixtral 4 experts, top-2): the bare spec of their config against
    the bytes one forward saves (transformers' RMSNorm keeps its fp32 input and
    normalized values)."""
    from mixprec import MixedPrecision
    from mixprec.engine.devices import EMULATE_ENV
    from mixprec.memory import measure

    monkeypatch.setenv(EMULATE_ENV, "off")  # the spec prices the real 16-bit kernels' bytes
    base = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=2, intermediate_size=256, vocab_size=256)
    if kind == "llama":
        cfg, cls = transformers.LlamaConfig(**base), transformers.LlamaForCausalLM
    else:
        cfg = transformers.MixtralConfig(**base, num_local_experts=4, num_experts_per_tok=2)
        cls = transformers.MixtralForCausalLM
    torch.manual_seed(0)
    model = cls(cfg)
    s, b = 128, 4
    ids = torch.randint(0, 256, (b, s))
    batch = {"input_ids": ids, "labels": ids}
    engine = MixedPrecision(model, torch.optim.AdamW(model.parameters()), recipe)
    with engine.autocast():
        loss = engine.model(**batch).loss
    engine.backward(loss)
    engine.step()
    got = measure(model, engine, batch, loss_fn=lambda o: o.loss)["activations"]
    spec = spec_from_config(cfg, seq_len=s, micro_batch=b, attention="flash", dropout=False)
    # fp8 experts: the bare spec prices each routed row's cast, not each expert's
    # weight-sized casts of its tokens (mixprec.memory.moe prices the module's)
    rel = 0.10 if (kind, recipe) == ("mixtral", "fp8") else 0.03
    assert estimate(spec, recipe)["activations"] == pytest.approx(got, rel=rel)
