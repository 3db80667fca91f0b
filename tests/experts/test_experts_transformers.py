"""transformers' mixture-of-experts models under low-precision recipes: their experts
modules run mixprec's grouped GEMM through transformers' own ``ExpertsInterface``, in
the recipe's format (not silently in bf16), train like bf16-master, resume bit for bit,
follow ``layer:`` rules, and show up in the engine's coverage. Built from tiny configs
(2 layers, hidden 64, 4 experts, top-2): nothing is downloaded."""

from __future__ import annotations

import copy
import functools
import subprocess
import sys
import warnings

import pytest
import torch

from helpers import moe_models
from mixprec import MixedPrecision
from mixprec.experts import experts_formats
from mixprec.experts.hook import IMPLEMENTATION, convert_experts

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore")

MODELS = list(moe_models.MODELS)
RECIPES = ["fp8", "fp8-current", "fp8-rowwise", "fp8-block", "mxfp8", "nvfp4"]


def _model(kind: str, seed: int = 0):
    return moe_models.model(kind, seed, experts_std=0.05)


def _routing(tokens: int = 24, seed: int = 0):
    """Top-2 of experts 0-2: expert 3 receives no token."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, 4, generator=g)
    scores[:, 3] = -1
    weights, index = scores.softmax(-1).topk(2, dim=-1)
    return torch.randn(tokens, 64, generator=g), index, weights


def _original(experts, dtype, x, index, weights):
    """The module's own (eager) experts forward in ``dtype``."""
    m = copy.deepcopy(experts).to(dtype)
    m.config = copy.copy(m.config)
    m.config._experts_implementation_internal = "eager"
    with torch.no_grad():
        return m(x.to(dtype), index, weights.to(dtype)).double()


def sqnr_db(ref, y) -> float:
    return (10 * torch.log10(ref.pow(2).sum() / (ref - y).pow(2).sum())).item()


@functools.cache
def _experts(kind: str):
    return _model(kind).model.layers[0].mlp.experts


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("kind", MODELS)
def test_experts_run_in_the_recipes_format(kind, recipe):
    """Two quantized GEMMs in a row: e4m3 ~25 dB against float64, e2m1 ~12 dB."""
    experts = copy.deepcopy(_experts(kind))
    x, index, weights = _routing()
    ref = _original(experts, torch.float64, x, index, weights)
    bf16 = _original(experts, torch.bfloat16, x, index, weights)
    holder = torch.nn.ModuleDict({"experts": experts})
    assert convert_experts(holder, recipe) == {"experts": recipe}
    assert experts.config._experts_implementation == IMPLEMENTATION
    xg = x.clone().requires_grad_()
    y = experts(xg, index, weights)
    lo, hi = (9, 30) if recipe == "nvfp4" else (20, 38)
    assert lo <= sqnr_db(ref, y.detach().double()) <= hi
    assert sqnr_db(ref, bf16) > hi + 5  # bf16 is far more exact: the format did apply
    y.backward(torch.ones_like(y))
    up = "gate_up_proj" if experts.has_gate else "up_proj"
    grad = getattr(experts, up).grad
    assert torch.equal(grad[3], torch.zeros_like(grad[3]))  # no token for expert 3
    assert grad[:3].abs().amin(dim=(1, 2)).gt(0).any() and xg.grad.abs().sum() > 0


def _train(kind, recipe, steps, model=None, engine=None):
    model = model or _model(kind)
    engine = engine or MixedPrecision(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), recipe)
    idx = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        with engine.autocast():
            loss = model(input_ids=idx, labels=idx).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, model, engine


@functools.cache
def _bf16_master(kind: str) -> tuple[float, ...]:
    return tuple(_train(kind, "bf16-master", 8)[0])


@pytest.mark.parametrize("kind,recipe,within", [
    ("mixtral", "fp8", 0.02), ("qwen3_moe", "fp8-current", 0.02),
    ("deepseek_v3", "fp8-block", 0.02), ("gpt_oss", "fp8-rowwise", 0.02),
    ("gpt_oss", "mxfp8", 0.02),
    # e2m1 in every converted Linear too: ~2% above bf16-master after 8 steps here
    ("mixtral", "nvfp4", 0.03)])
def test_training_ends_near_bf16_master(kind, recipe, within):
    """Both weight layouts: concatenated (out, in) experts (Mixtral, Qwen3-MoE,
    DeepSeek-V3), GPT-OSS's interleaved gate-up in (in, out) with biases."""
    ref = _bf16_master(kind)
    got, model, engine = _train(kind, recipe, 8)
    assert got[-1] < 0.85 * got[0]  # it trains
    assert abs(got[-1] - ref[-1]) <= within * ref[-1]
    assert len(experts_formats(model)) == 4  # 2 layers x 2 projections
    assert engine.coverage.shares("experts") == {recipe: 1.0}


@pytest.mark.parametrize("kind,recipe", [
    ("mixtral", "fp8"), ("mixtral", "nvfp4"),
    # a shared expert beside the routed ones; biased, interleaved (in, out) experts
    ("deepseek_v3", "fp8"), ("gpt_oss", "nvfp4")])
def test_resume_is_bit_identical(tmp_path, kind, recipe):
    """Saved at step 2 of 4 and resumed into a model of other weights: the losses and
    the experts' scaling state equal the uninterrupted run's. Delayed scaling's amax
    histories and NVFP4's rounding stream of the experts travel in the checkpoint."""
    whole, model, _ = _train(kind, recipe, 4)
    first, _, engine = _train(kind, recipe, 2)
    engine.save(tmp_path / "ck.pt")
    fresh = _model(kind, seed=1)
    eng2 = MixedPrecision(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3), recipe)
    eng2.load(tmp_path / "ck.pt")
    rest, fresh, _ = _train(kind, recipe, 2, fresh, eng2)
    assert first + rest == whole
    for (name, a), b in zip(experts_formats(model).items(),
                            experts_formats(fresh).values()):
        for key, t in a.scaling_state().items():
            assert torch.equal(t, b.scaling_state()[key]), (name, key)
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    if recipe == "fp8":
        hist = next(iter(experts_formats(model).values())).fp8_amax_history
        assert hist.abs().sum() > 0  # the histories are live, not the initial zeros


def test_layer_rules_pick_the_experts_format():
    model = _model("mixtral")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                "fp8-current,layer:*.experts=mxfp8")
    assert not [w for w in seen if "match no Linear" in str(w.message)]
    assert {f.scaling for f in experts_formats(model).values()} == {"mx"}
    assert engine.coverage.shares("experts") == {"mxfp8": 1.0}
    assert engine.coverage.shares("attention") == {"fp8-current": 1.0}


def test_a_bf16_rule_keeps_the_experts_on_their_own_implementation():
    model = _model("mixtral")
    experts = model.model.layers[1].mlp.experts
    x, index, weights = _routing()
    before = experts(x, index, weights)
    engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            "fp8-current,layer:model.layers.1.mlp.experts=bf16")
    assert list(experts_formats(model)) == ["model.layers.0.mlp.experts.gate_up_proj_fp8",
                                            "model.layers.0.mlp.experts.down_proj_fp8"]
    assert torch.equal(experts(x, index, weights), before)
    kept = {r.name: r for r in engine.coverage.rows if r.kind == "experts"}
    assert kept["model.layers.1.mlp.experts.down_proj"].format == "bf16"
    assert "rule" in kept["model.layers.1.mlp.experts.down_proj"].reason
    assert kept["model.layers.0.mlp.experts.down_proj"].format == "fp8-current"


def test_close_gives_the_config_back_its_experts_implementation():
    """The engine points the shared config at mixprec's implementation; close() restores
    the value it had, and the experts then run their own implementation again."""
    model = _model("mixtral")
    experts = model.model.layers[0].mlp.experts
    x, index, weights = _routing()
    before_impl = model.config._experts_implementation_internal
    before = experts(x, index, weights)
    engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp8-current")
    assert model.config._experts_implementation_internal == IMPLEMENTATION
    assert not torch.equal(experts(x, index, weights), before)  # fp8 now
    engine.close()
    assert model.config._experts_implementation_internal == before_impl
    assert experts.config is model.config
    assert torch.equal(experts(x, index, weights), before)
    engine.close()  # twice is harmless
    assert model.config._experts_implementation_internal == before_impl


def test_the_core_imports_transformers_only_for_its_models():
    code = ("import sys, torch, mixprec\nfrom torch import nn\n"
            "m = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))\n"
            "mixprec.MixedPrecision(m, torch.optim.SGD(m.parameters(), lr=0.1), 'fp8')\n"
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
