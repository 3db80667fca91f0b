"""The per-layer precision planner on a transformers mixture-of-experts model: its
experts modules are not planned (their grouped GEMMs are neither timed nor scored), and
the plan says so and keeps them in bf16 by rule, rather than leaving them to the plan's
fp8 default unmeasured."""

from __future__ import annotations

import pytest
import torch

import mixprec
from mixprec.experts.hook import convert_experts, experts_modules
from mixprec.planner.planning import NOT_PLANNED, Plan
from plan_helpers import fixed_timing

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore")


def test_plan_lists_experts_modules_as_not_planned_and_keeps_them_bf16(monkeypatch,
                                                                        tmp_path):
    fixed_timing(monkeypatch)
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(hidden_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     vocab_size=128, max_position_embeddings=64,
                                     num_experts_per_tok=2, intermediate_size=64,
                                     num_local_experts=4)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    ids = torch.randint(0, 128, (4, 16))
    p = mixprec.plan(model, {"input_ids": ids, "labels": ids},
                     formats=("bf16", "fp8-current"), max_loss=None,
                     loss_fn=lambda m, b: m(**b).loss)
    experts = list(experts_modules(model))
    assert experts == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert p.not_planned == dict.fromkeys(experts, NOT_PLANNED)
    assert all(r.layer not in experts for r in p.rows)
    assert p.table().count("not planned: model.layers.") == 2
    assert p.recipe.compute == "fp8"  # the Linears went fp8 (fixed speeds: 2x bf16) ...
    assert convert_experts(model, p.recipe) == dict.fromkeys(experts, "bf16")  # ... not these
    p.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json").not_planned == p.not_planned
