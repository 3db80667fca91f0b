"""The per-layer precision planner: its choices from measured speeds (replaced here by
chips' speed models, so both outcomes are covered on any machine), its numerics against
an independent float64 / ml_dtypes computation, its byte pricing and its plan files."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from torch import nn

import mixprec
import mixprec.planner.survey as survey_mod
import mixprec.planner.timing as timing
from mixprec import Recipe
from mixprec.planner import NoPlanFits, Plan
from mixprec.planner.choose import Baselines, Layer, Option, StateUnit, choose, predict
from mixprec.planner.numerics import layer_numerics, sqnr_db
from mixprec.planner.timing import LayerCost


class Skinny(nn.Module):
    """A skinny Linear (16 -> 16) and a large one (1024 -> 1024) on 2048 tokens."""

    def __init__(self):
        super().__init__()
        self.small = nn.Linear(16, 16)
        self.up = nn.Linear(16, 1024)
        self.big = nn.Linear(1024, 1024)
        self.down = nn.Linear(1024, 16)

    def forward(self, x):
        return self.down(torch.relu(self.big(torch.relu(self.up(self.small(x))))))


def _chip(fp8_speedup: float, cast_ns: float = 0.5, bf16_gflops: float = 500.0):
    """A speed model of a chip: a Linear's three GEMMs at ``bf16_gflops`` in bf16 and
    ``fp8_speedup`` times that in fp8, whose casts cost ``cast_ns`` per element cast
    (input, weight, gradient, each along two axes)."""
    def measure(shape, formats, recipe, device, seconds):
        d_in, d_out, tokens, _ = shape
        flops = 6.0 * d_in * d_out * tokens
        t16 = flops / (bf16_gflops * 1e9)
        casts = 2 * (tokens * d_in + d_in * d_out + tokens * d_out) * cast_ns * 1e-9
        out = {}
        for f in formats:
            if f == "bf16":
                out[f] = LayerCost(t16, 2 * (tokens * d_in + d_in * d_out), "native")
            else:
                out[f] = LayerCost(t16 / fp8_speedup + casts,
                                   tokens * d_in + d_in * d_out, "scaled_mm")
        return out
    return measure


@pytest.fixture
def chip(monkeypatch):
    """``chip(fp8_speedup)``: the planner measures with that speed model, and the whole
    model's baselines are the sum of its Linears' (nothing else costs time)."""
    timing.clear_cache()

    def set_chip(fp8_speedup, **kw):
        monkeypatch.setattr(timing, "_measure", _chip(fp8_speedup, **kw))

        def baselines(model, b, shell, batch, loss_fn, state_formats, device):
            shapes = survey_mod._shapes(model, survey_mod.linear_names(model), batch, loss_fn)
            t = sum(timing._measure(s, ["bf16"], shell, device, 0)["bf16"].seconds
                    for s in shapes.values())
            cost = {"fused": 1e-9, "fp32": 2e-9, "bf16": 2e-9, "int8": 3e-9, "int4": 4e-9}
            return Baselines(t, 1e8, t, 1e8, cost)
        monkeypatch.setattr(survey_mod, "_baselines", baselines)
        monkeypatch.setattr(survey_mod, "_time_scales", lambda *a: {})
    yield set_chip
    timing.clear_cache()


def _model_and_batch():
    torch.manual_seed(0)
    model = Skinny()
    x = torch.randn(2048, 16)
    return model, x, (lambda m, b: m(b).float().pow(2).mean())


@pytest.mark.parametrize("fp8_speedup,big", [(2.0, "fp8-current"), (0.8, "bf16")])
def test_plan_keeps_the_skinny_linear_in_bf16_and_moves_the_large_one_by_speed(
        chip, fp8_speedup, big):
    # a chip with fp8 units (2x bf16's GEMM rate) and one whose fp8 GEMM is slower
    # (a CPU's dequantizing route): the same model, two plans
    chip(fp8_speedup)
    model, x, loss = _model_and_batch()
    p = mixprec.plan(model, x, loss_fn=loss, formats=("bf16", "fp8-current"),
                     max_loss=None)
    rows = {r.layer: r for r in p.rows}
    assert rows["small"].choice == "bf16"
    assert "casts cost more than its GEMM saves" in rows["small"].reason
    assert rows["big"].choice == big
    if big != "bf16":
        # 6·1024²·2048 flops: 25.8 ms in bf16, 12.9 ms in fp8 + 10.5M casts at 0.5 ns
        t16 = 6 * 1024 * 1024 * 2048 / 500e9
        t8 = t16 / 2 + 2 * (2048 * 1024 * 2 + 1024 * 1024) * 0.5e-9
        assert rows["big"].speedup == pytest.approx(t16 / t8)
        assert p.recipe.compute == "fp8"
        assert p.recipe.layer_format("big") == "fp8-current"
        assert p.recipe.layer_format("small") == "bf16"
        assert p.predicted_step_s < p.baseline["16-bit"]["step_s"]
    else:
        assert str(p.recipe) == "bf16-master"
        assert p.predicted_step_s == p.baseline["16-bit"]["step_s"]


def test_plan_refuses_a_format_below_the_sqnr_floor(chip):
    chip(4.0)
    model, x, loss = _model_and_batch()
    p = mixprec.plan(model, x, loss_fn=loss, formats=("bf16", "fp8-current", "nvfp4"),
                     min_sqnr=22.0, max_loss=None)
    rows = {r.layer: r for r in p.rows}
    # e4m3 outputs keep ~28 dB here and e5m2 gradients ~25 dB; NVFP4 ~15-17 dB
    assert rows["big"].choice == "fp8-current"
    assert 22.0 < rows["big"].sqnr < 27.0
    p2 = mixprec.plan(model, x, loss_fn=loss, formats=("bf16", "nvfp4"), min_sqnr=22.0,
                      max_loss=None)
    assert {r.choice for r in p2.rows} == {"bf16"}
    assert "SQNR" in {r.layer: r for r in p2.rows}["big"].reason


def _e4m3(t: np.ndarray, amax: float) -> np.ndarray:
    """Current scaling to e4m3 in ml_dtypes, dequantized (float64)."""
    scale = np.float32(448.0) / np.float32(amax)
    q = np.clip(t.astype(np.float32) * scale, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return q.astype(np.float64) / np.float64(scale)


def test_sqnr_matches_an_independent_fp8_computation():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(64, 48, bias=False))
    x = torch.randn(96, 64)
    got = layer_numerics(model, [x], lambda m, b: m(b).pow(2).sum(), ["fp8-current"],
                         Recipe.parse("fp8-current"))[("0", "fp8-current")]
    w = model[0].weight.detach().numpy()
    xn = x.numpy()
    bf = lambda a: torch.from_numpy(a).bfloat16().double().numpy()  # noqa: E731
    ref = bf(xn) @ bf(w).T
    out = _e4m3(xn, np.abs(xn).max()) @ _e4m3(w, np.abs(w).max()).T
    want = 10 * math.log10((ref**2).sum() / ((ref - out) ** 2).sum())
    assert got.sqnr_out == pytest.approx(want, abs=0.05)
    assert 25 < got.sqnr_out < 35  # e4m3's 3 mantissa bits: ~31 dB on Gaussian data
    assert got.headroom is None and got.flushed < 1e-3


def test_sqnr_db_edge_cases():
    a = torch.tensor([1.0, 2.0])
    assert sqnr_db(a, a) == math.inf
    assert sqnr_db(a, a * 1.1) == pytest.approx(20.0)
    assert sqnr_db(torch.zeros(2), a) == -math.inf


def test_delayed_scaling_headroom_reads_an_amax_that_outgrows_its_history():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(32, 32, bias=False))
    small, large = torch.randn(64, 32), 16 * torch.randn(64, 32)
    got = layer_numerics(model, [small, large], lambda m, b: m(b).sum(), ["fp8"],
                         Recipe.parse("fp8"))[("0", "fp8")]
    # the second batch's input amax is ~16x (2^4) the history's
    assert got.headroom == pytest.approx(-math.log2(large.abs().max() / small.abs().max()),
                                         abs=1e-6)


def _layers(n=3):
    layers = {}
    for i in range(n):
        layers[f"l{i}"] = Layer(f"l{i}", (256, 256), {
            "bf16": Option("bf16", 1.0, 400.0),
            "fp8-current": Option("fp8-current", 1.5, 200.0, 30.0)})
    return layers


def test_fastest_under_a_budget_takes_the_cheapest_bytes_first():
    layers = _layers()
    units = {f"l{i}": StateUnit(f"l{i}", ((256, 256),)) for i in range(3)}
    base = Baselines(3.0, 2_000_000.0, 3.0, 2_000_000.0,
                     {"fused": 1e-9, "fp32": 1e-9, "bf16": 1e-9, "int8": 2e-9})
    fastest = choose(layers, units, base)
    assert set(fastest.layers.values()) == {"bf16"}
    assert set(fastest.states.values()) == {"fp32"}
    # bf16 states of one 256x256 weight save 2 states x 2 bytes x 65536 = 262144 bytes
    # at no time cost: the budget is met by states before any layer goes to fp8
    cfg = choose(layers, units, base, memory=2_000_000 - 262_144)
    assert sorted(cfg.states.values()) == ["bf16", "fp32", "fp32"]
    assert set(cfg.layers.values()) == {"bf16"}
    t, p = predict(cfg, layers, units, base)
    assert p <= 2_000_000 - 262_144 and t == 3.0
    # int8 everywhere saves 3 x 2 x (262144 - 65536 - 4·blocks)...; fp8 saves 200 each:
    # a budget below every state move needs the layers too
    smallest = choose(layers, units, base, goal="smallest", max_step=100.0)
    _, p_min = predict(smallest, layers, units, base)
    assert set(smallest.layers.values()) == {"fp8-current"}
    with pytest.raises(NoPlanFits, match="no plan fits"):
        choose(layers, units, base, memory=p_min - 1)


def test_smallest_stays_within_the_speed_floor():
    layers = _layers()
    units = {}
    base = Baselines(3.0, 1e6, 3.0, 1e6, {"fused": 1e-9})
    cfg = choose(layers, units, base, goal="smallest", max_step=4.0)
    # each fp8 layer costs 0.5 s: two fit under a 4 s floor, the third does not
    assert sorted(cfg.layers.values()) == ["bf16", "fp8-current", "fp8-current"]
    assert predict(cfg, layers, units, base)[0] <= 4.0


def test_rules_are_compressed_over_repeated_blocks():
    names = [f"blocks.{i}.{n}" for i in range(3) for n in ("qkv", "fc")] + ["head"]
    choice = {n: ("mxfp8" if n.endswith("fc") else "fp8-current") for n in names}
    choice["head"] = "bf16"
    choice["blocks.1.qkv"] = "bf16"
    rules = survey_mod.compress(choice, names, None)
    assert ("blocks.*.fc", "mxfp8") in rules and ("head", "bf16") in rules
    assert ("blocks.1.qkv", "bf16") in rules and ("blocks.0.qkv", "fp8-current") in rules
    r = Recipe.parse("fp8-current,"
                     + ",".join(f"layer:{p}={v}" for p, v in rules))
    assert {n: r.layer_format(n) for n in names} == choice


def test_plan_file_round_trips(chip, tmp_path):
    chip(2.0)
    model, x, loss = _model_and_batch()
    p = mixprec.plan(model, x, loss_fn=loss, formats=("bf16", "fp8-current"),
                     max_loss=None)
    p.save(tmp_path / "plan.json")
    q = Plan.load(tmp_path / "plan.json")
    assert q == p and Recipe.parse(str(q.recipe)) == p.recipe
    assert "big" in q.table() and str(p.recipe) in q.table()
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a mixprec plan file"):
        Plan.load(tmp_path / "bad.json")


@pytest.mark.parametrize("kw,match", [
    ({"goal": "quickest"}, "goal='quickest'"),
    ({"base": "fp16-master"}, "bf16 recipe"),
    ({"formats": ("bf16", "fp9")}, "fp9"),
    ({"state_formats": ("int8",)}, "lacks .fp32."),
    ({"state_formats": ("fp32", "int3")}, "unknown \\[.int3.\\]"),
    ({"max_loss": -1}, "max_loss"),
    ({"memory": "lots"}, "memory='lots'"),
])
def test_bad_arguments_name_the_value_and_the_choices(kw, match):
    model, x, loss = _model_and_batch()
    with pytest.raises(ValueError, match=match):
        mixprec.plan(model, x, loss_fn=loss, **kw)


def test_a_budget_the_16_bit_states_exceed_gets_a_plan_that_fits_measured():
    # fp32 AdamW states of this model are 2 x 4 bytes x 0.79M = 6.3 MB; the budget
    # takes 3 MB off the 16-bit recipe's measured peak, so states must shrink
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1536), nn.GELU(), nn.Linear(1536, 256))
    x = torch.randn(64, 256)
    loss = lambda m, b: m(b).float().pow(2).mean()  # noqa: E731
    _, peak16 = mixprec.planner.measure_step(model, Recipe.parse("bf16-master"), x, loss,
                                             steps=1)
    budget = peak16 - 3e6
    p = mixprec.plan(model, x, loss_fn=loss, memory=budget,
                     formats=("bf16", "fp8-current"), seconds=0.05)
    assert p.predicted_peak <= budget
    assert any(r.value in ("bf16", "int8") for r in p.recipe.state_rules)
    # measured: the plan's recipe in a real engine, one step's high-water mark
    _, measured = mixprec.planner.measure_step(model, p.recipe, x, loss, steps=1)
    assert measured <= budget, (measured, budget, str(p.recipe))
    assert abs(measured - p.predicted_peak) <= 0.1 * measured
    with pytest.raises(NoPlanFits, match="no plan fits"):
        mixprec.plan(model, x, loss_fn=loss, memory=peak16 / 10,
                     formats=("bf16", "fp8-current"), seconds=0.05)


def test_a_linear_of_odd_dims_is_priced_in_fp8_not_refused(chip):
    """1024 → 10: the routes pad it, so the planner times its padded fp8 Linear
    against bf16 and says why it chose (its dims are no longer a reason)."""
    chip(4.0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 10))
    p = mixprec.plan(model, torch.randn(2048, 512), loss_fn=lambda m, b: m(b).float().sum(),
                     formats=("bf16", "fp8-current"), max_loss=None)
    rows = {r.layer: r for r in p.rows}
    two = rows["2"]  # fp8 chosen, or bf16 for a measured speed
    assert two.choice == "fp8-current" or "fp8-current runs at" in two.reason, two
    assert rows["0"].choice == "fp8-current"


def test_the_greedy_prices_each_change_as_predict_does_on_a_big_model():
    import random

    from mixprec.planner.choose import Config, _moves, _Pricer

    layers = {f"l{i}": Layer(f"l{i}", (4096, 4096), {
        "bf16": Option("bf16", 1.0, 400.0, working_bytes=10 + i % 7),
        "fp8-current": Option("fp8-current", 1.5, 200.0, 30.0, working_bytes=20 + i % 5),
        "mxfp8": Option("mxfp8", 1.7, 210.0, 30.0, working_bytes=5)}) for i in range(224)}
    units = {f"l{i}": StateUnit(f"l{i}", ((4096, 4096), (4096,))) for i in range(224)}
    units.update({f"n{i}": StateUnit(f"n{i}", ((4096,),)) for i in range(100)})
    base = Baselines(300.0, 1e12, 290.0, 1.1e12, {"fused": 1e-9, "fp32": 1e-9,
                                                  "bf16": 1e-9, "int8": 2e-9},
                     time_scale={"mxfp8": 0.8})
    pricer = _Pricer(Config({n: "bf16" for n in layers}, {u: "fp32" for u in units}),
                     layers, units, base)
    rng = random.Random(0)
    for _ in range(200):
        move = rng.choice(list(_moves(pricer.cfg, layers, units, ("fp32", "bf16", "int8"))))
        new = pricer.cfg.copy()
        (new.layers if move[0] == "layer" else new.states)[move[1]] = move[2]
        assert pricer.after(*move) == pytest.approx(predict(new, layers, units, base),
                                                     rel=1e-9)
        pricer.apply(*move)
        assert pricer.now() == pytest.approx(predict(pricer.cfg, layers, units, base),
                                             rel=1e-9)
    # a 224-Linear model under a budget that needs hundreds of changes (about half a
    # second; summing the whole model for every candidate took more than ten minutes)
    budget = 1e12 - 224 * 4096 * 4096 * 2 * 2
    cfg = choose(layers, units, base, memory=budget)
    assert predict(cfg, layers, units, base)[1] <= budget
