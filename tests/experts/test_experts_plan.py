"""The per-layer precision planner on transformers mixture-of-experts models: each
experts module is a candidate, timed on its grouped GEMMs at the tokens its router
really sends each expert (skewed), scored on its real inputs, given the format that is
fastest within the numerics and the loss budget (by a ``layer:`` rule), and the engine
runs the plan's recipe with the experts in that format. Tiny models from configs
(2 layers, hidden 64, 4 experts, top-2); measured speeds are replaced by fixed ones."""

from __future__ import annotations

import pytest
import torch

import mixprec
from helpers.moe_models import SKEWED_TOKENS as TOKENS
from helpers.moe_models import skewed_batch as _batch
from helpers.moe_models import skewed_model as _model
from helpers.moe_models import skewed_routing as _skew
from helpers.plan_timing import fixed_timing
from mixprec.experts import hook as experts_hook
from mixprec.experts.hook import convert_experts, experts_modules
from mixprec.optim import adamw_for
from mixprec.planner import experts as planner_experts
from mixprec.planner import survey as planner_survey
from mixprec.planner.planning import Plan
from mixprec.planner.timing import BF16, LayerCost, clear_cache

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore")

#: the forced routing below sends expert 0 every token, expert 1 five in eight,
#: expert 2 two in eight, expert 3 one in eight: counted by hand
SKEWED = (64, 40, 16, 8)


def _loss(m, b):
    return m(**b).loss


def _fake_experts(speed: dict[str, float], seen: list):
    """``experts_costs`` with fixed seconds per format (bf16: 1 ms), recording the
    shapes it was asked to time."""
    def costs(modules, formats, recipe, device, *, seconds=0.25, cache_file=None):
        seen.extend(modules)
        return {(s, f): LayerCost(1e-3 * speed.get(f, 1.0), 1000, "fixed")
                for s in modules for f in formats}
    return costs


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_experts_are_candidates_timed_at_the_routers_skewed_token_counts(
        kind, monkeypatch, tmp_path):
    fixed_timing(monkeypatch)
    seen, shells = [], []
    monkeypatch.setattr(planner_survey, "experts_costs",
                        _fake_experts({"fp8-current": 0.5}, seen))
    baselines = planner_survey._baselines
    monkeypatch.setattr(planner_survey, "_baselines",
                        lambda m, b, shell, *a: shells.append(shell) or baselines(
                            m, b, shell, *a))
    model = _model(kind)
    _skew(model)
    p = mixprec.plan(model, _batch(), formats=("bf16", "fp8-current"), max_loss=None,
                     loss_fn=_loss)
    experts = list(experts_modules(model))
    assert experts == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert p.not_planned == {}
    rows = {r.layer: r for r in p.rows}
    assert [rows[n].choice for n in experts] == ["fp8-current"] * 2
    assert rows[experts[0]].shape == (64, 64)
    # the two modules have one shape: timed once, at the router's counts, not 32 each
    assert len(seen) == 1 and seen[0].counts == SKEWED and seen[0].top_k == 2
    assert seen[0].tokens == TOKENS
    # the fp8 recipe's baseline with nothing converted keeps the experts in bf16 too
    assert [shells[0].layer_format(n) for n in experts] == ["bf16", "bf16"]
    assert shells[0].layer_format("model.layers.0.self_attn.q_proj") == "fp8-current"
    assert convert_experts(model, p.recipe) == dict.fromkeys(experts, "fp8-current")
    p.save(tmp_path / "plan.json")
    assert [r.layer for r in Plan.load(tmp_path / "plan.json").rows][-2:] == experts


@pytest.mark.parametrize("faster", [True, False])
def test_plan_puts_experts_in_mxfp8_where_faster_and_the_engine_runs_them_so(
        faster, monkeypatch):
    fixed_timing(monkeypatch)  # the Linears: every fp8 format twice bf16's speed
    speed = {"mxfp8": 0.25, "fp8-current": 0.8} if faster else {"mxfp8": 1.5,
                                                                 "fp8-current": 1.2}
    monkeypatch.setattr(planner_survey, "experts_costs", _fake_experts(speed, []))
    model = _model("mixtral")
    _skew(model)
    p = mixprec.plan(model, _batch(), formats=("bf16", "fp8-current", "mxfp8"),
                     max_loss=0.05, loss_fn=_loss)
    want = "mxfp8" if faster else BF16
    experts = list(experts_modules(model))
    rows = {r.layer: r for r in p.rows}
    assert [rows[n].choice for n in experts] == [want] * 2
    assert rows[experts[0]].speedup == pytest.approx(4.0 if faster else 1.0)
    if not faster:
        assert rows[experts[0]].reason.startswith("bf16: fastest; fp8-current runs at "
                                                  "0.83x")
    assert p.loss_delta is not None and p.loss_delta <= 0.05
    assert f"layer:model.layers.*.mlp.experts={want}" in str(p.recipe)
    assert rows["model.layers.0.self_attn.q_proj"].choice == "fp8-current"
    # the plan applied: the engine's coverage and the grouped GEMMs that run
    calls = []
    grouped = experts_hook.grouped_mm
    monkeypatch.setattr(experts_hook, "grouped_mm", lambda x, w, offs, fmt, **kw: (
        calls.append((fmt.format_name, offs[-1].item())) or grouped(x, w, offs, fmt, **kw)))
    engine = mixprec.MixedPrecision(model, adamw_for(p.recipe, model.named_parameters(),
                                                     lr=1e-3), p.recipe)
    got = {r.name: r.format for r in engine.coverage.rows if r.kind == "experts"}
    assert got == {f"{n}.{proj}": want for n in experts
                   for proj in ("gate_up_proj", "down_proj")}
    with engine.autocast():
        loss = _loss(model, _batch())
    engine.backward(loss)
    engine.step()
    assert torch.isfinite(loss)
    # two projections in each of two layers, every (token, expert) pair routed
    assert calls == ([("mxfp8", 2 * TOKENS)] * 4 if faster else [])


def test_experts_refused_below_the_sqnr_floor_stay_bf16(monkeypatch):
    fixed_timing(monkeypatch)  # experts in fp8 twice bf16's speed
    model = _model("mixtral")
    p = mixprec.plan(model, _batch(), formats=("bf16", "fp8-current", "nvfp4"),
                     max_loss=None, loss_fn=_loss, min_sqnr=20.0)
    rows = {r.layer: r for r in p.rows}
    fp8 = planner_experts.experts_numerics(
        model, [_batch()], _loss, ["fp8-current", "nvfp4"],
        mixprec.Recipe.parse("fp8-current"))
    name = "model.layers.0.mlp.experts"
    # e4m3 casts of Gaussian-like values keep ~25-30 dB; NVFP4's e2m1 ~10-17 dB
    assert 22 < fp8[(name, "fp8-current")].sqnr < 35
    assert 5 < fp8[(name, "nvfp4")].sqnr < 20
    assert rows[name].choice == "fp8-current"
    assert rows[name].sqnr == pytest.approx(fp8[(name, "fp8-current")].sqnr, abs=0.01)
    strict = mixprec.plan(model, _batch(), formats=("bf16", "fp8-current"),
                          max_loss=None, loss_fn=_loss, min_sqnr=40.0)
    row = {r.layer: r for r in strict.rows}[name]
    assert row.choice == BF16 and "SQNR" in row.reason and "< floor 40 dB" in row.reason


def test_experts_timed_for_real_route_each_expert_its_counted_tokens():
    clear_cache()
    model = _model("mixtral")
    m = experts_modules(model)["model.layers.0.mlp.experts"]
    shape = planner_experts.ExpertsShape("MixtralExperts", tuple(m.gate_up_proj.shape),
                                         tuple(m.down_proj.shape), 2, (30, 0, 6, 4))
    _, index, _ = planner_experts._routing(shape, 64, "cpu", torch.Generator())
    assert index.shape == (20, 2)
    assert torch.bincount(index.reshape(-1), minlength=4).tolist() == [30, 0, 6, 4]
    unreached = shape._replace(counts=(0, 0, 0, 0))
    costs = planner_experts.experts_costs({shape: m, unreached: m},
                                          ("bf16", "fp8-current"),
                                          mixprec.Recipe.parse("fp8-current"),
                                          seconds=0.01)
    assert costs.pop((unreached, "bf16")).seconds == 0  # nothing routed: nothing timed
    assert costs.pop((unreached, "fp8-current")).route == "none"
    assert set(costs) == {(shape, "bf16"), (shape, "fp8-current")}
    assert all(c.seconds > 0 for c in costs.values())
    assert costs[(shape, "bf16")].route == "native"
    assert costs[(shape, "fp8-current")].route != "native"
    # fp8 saves the casts of every expert's rows for backward: more than none
    assert costs[(shape, "fp8-current")].saved_bytes > 0


def test_plan_check_measures_the_planned_experts_again(monkeypatch):
    from mixprec.planner.check import plan_sqnr

    fixed_timing(monkeypatch)
    model = _model("mixtral")
    p = mixprec.plan(model, _batch(), formats=("bf16", "fp8-current"), max_loss=None,
                     loss_fn=_loss)
    got = {c.layer: c for c in plan_sqnr(p, model, _loss, [_batch()])}
    rows = {r.layer: r for r in p.rows}
    for name in experts_modules(model):  # same weights, same batch: the planned SQNR
        assert got[name].fmt == "fp8-current"
        assert got[name].sqnr == pytest.approx(rows[name].sqnr, abs=0.01)
