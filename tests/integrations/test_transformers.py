"""Hugging Face transformers models under the engine (skipped where transformers is not
installed: it is not a dependency). Built from small configs: nothing is downloaded."""

from __future__ import annotations

import pytest
import torch

from mixprec import MixedPrecision

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore")


def _model(kind: str):
    torch.manual_seed(0)
    if kind == "llama":  # RMSNorm by class name, GQA, rotary embeddings, SDPA
        cfg = transformers.LlamaConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        return transformers.LlamaForCausalLM(cfg)
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                                  n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0)  # Conv1D layers, tied head
    return transformers.GPT2LMHeadModel(cfg)


def _losses(kind, recipe, checkpointing=False):
    model = _model(kind)
    if checkpointing:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    engine = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-3), recipe)
    idx = torch.randint(0, 128, (4, 33), generator=torch.Generator().manual_seed(1))
    out = []
    for _ in range(3):
        with engine.autocast():
            loss = model(input_ids=idx, labels=idx).loss
        engine.backward(loss)
        assert not bool(engine.step().skipped)
        out.append(loss.item())
    return out, engine


@pytest.mark.paths
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("recipe", ["bf16-master", "fp8", pytest.param(
    "bf16-master,wgrad=fp32", marks=pytest.mark.long)])
def test_transformers_model_trains_and_checkpoints(kind, recipe):
    plain, engine = _losses(kind, recipe)
    if recipe == "fp8":  # GPT-2's Conv1D layers and Llama's Linears both convert
        assert len(engine.fp8_report.converted) >= 4
    ckpt, _ = _losses(kind, recipe, checkpointing=True)
    if engine.emulating and engine.recipe.params != "fp32":
        # a known gap (README, "Not there yet"): with emulated bf16 weights, activation
        # checkpointing of these models recomputes a block's backward slightly
        # differently (benchmarks/cpu_kernels.py: 8.8e-6 and 1.6e-5 of the loss after 1 and 2 steps)
        assert ckpt[0] == plain[0] and ckpt == pytest.approx(plain, rel=1e-4)
    else:
        assert ckpt == plain                              # bit-identical recomputation
    fp32, _ = _losses(kind, "fp32")
    assert plain == pytest.approx(fp32, rel=2e-3)         # bf16/fp8 precision
