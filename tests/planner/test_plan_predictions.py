"""The planner never contradicts itself: a predicted step is never negative, a format on a
dequantizing GEMM route is never predicted faster than the GEMM it dequantizes into, and
timings that disagree beyond their noise are measured again and, where they still
disagree, reported. The timings are injected here, as noisy as a loaded host gives them."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from torch import nn

import mixprec.engine.devices as kernels
import mixprec.planner.steps as steps_mod
import mixprec.planner.survey as survey_mod
import mixprec.planner.timing as timing
from helpers.speeds import set_speeds
from mixprec import Recipe
from mixprec.planner import plan_from
from mixprec.planner.choose import (
    Baselines,
    Config,
    Layer,
    Option,
    StateUnit,
    _Pricer,
    choose,
    predict,
)
from mixprec.planner.timing import LayerCost

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TOKENS = 256
A, B = (64, 64, TOKENS, True), (64, 256, TOKENS, True)
COSTS = {"fused": 1e-9, "fp32": 2e-9, "bf16": 2e-9, "int8": 3e-9}


class TwoLinears(nn.Module):
    """A 64x64 Linear and a 64x256 one."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 256)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _loss(m, x):
    return m(x).float().pow(2).mean()


@pytest.fixture
def host(monkeypatch):
    """``host(per_shape, steps)``: the planner's per-Linear timings come from
    ``per_shape[shape[:2]]`` (a list of ``{format: LayerCost}``, one per measurement,
    the last repeated), the whole-model steps from ``steps`` (``"16-bit"``, ``"shell"``,
    ``"fp8"``: seconds); bf16 runs at twice fp32's GEMM rate. Returns the calls made,
    per shape and per step kind."""
    timing.clear_cache()
    monkeypatch.setattr(kernels, "relative_speed", lambda device, dtype: 2.0)

    def set_host(per_shape, steps):
        calls = {"shape": {}, "step": {}}

        def measure(shape, formats, recipe, device, seconds):
            n = calls["shape"].get(shape[:2], 0)
            calls["shape"][shape[:2]] = n + 1
            got = per_shape[shape[:2]]
            return {f: got[min(n, len(got) - 1)][f] for f in formats}

        def measure_step(model, recipe, batch, loss_fn=None, *, fp8_filter=None, steps=4,
                         peak=True):
            kind = ("16-bit" if recipe.compute != "fp8" else
                    "fp8" if fp8_filter is not None and fp8_filter(None, "") else "shell")
            calls["step"][kind] = calls["step"].get(kind, 0) + 1
            return steps_of[kind], (1e6 if peak else None)

        def baselines(model, b, shell, batch, loss_fn, state_formats, device):
            return Baselines(steps_of["16-bit"], 1e6, steps_of["shell"], 1e6, COSTS)

        def measure_steps(model, runs, batch, loss_fn=None, *, steps=4, peak=True):
            return [survey_mod.measure_step(model, r, batch, loss_fn, fp8_filter=f,
                                            steps=steps, peak=peak) for r, f in runs]

        steps_of = steps
        monkeypatch.setattr(timing, "_measure", measure)
        monkeypatch.setattr(survey_mod, "measure_step", measure_step)
        monkeypatch.setattr(survey_mod, "measure_steps", measure_steps)
        monkeypatch.setattr(survey_mod, "_baselines", baselines)
        return calls
    yield set_host
    timing.clear_cache()


def _survey(model, x):
    return survey_mod.survey(model, x, base=Recipe.parse("bf16-master"),
                             formats=("bf16", "fp8-current"), state_formats=("fp32",),
                             min_sqnr=15.0, loss_fn=_loss, batches=[x])


def test_a_dequantizing_route_timed_12x_faster_on_a_busy_host_is_not_predicted_faster(host):
    # the 64x64 Linear's bf16 timing caught a stall (12.24x "faster" in fp8 on the
    # dequant_fp32 route), the 64x256 one's fp8 timing another, and the whole fp8 step
    # read 20 ms under the shell's: taken as they are, the timings scale the 64x64's
    # "saving" by 3.9 and predict a step of -0.17 s with it in fp8
    slow_bf16 = {"bf16": LayerCost(0.060, 1000, "native"),
                 "fp8-current": LayerCost(0.0049, 1000, "dequant_fp32")}
    calls = host({A[:2]: [slow_bf16],
                  B[:2]: [{"bf16": LayerCost(0.010, 1000, "native"),
                           "fp8-current": LayerCost(0.060, 1000, "dequant_fp32")}]},
                 {"16-bit": 0.05, "shell": 0.05, "fp8": 0.03})
    torch.manual_seed(0)
    model, x = TwoLinears(), torch.randn(TOKENS, 64)
    sv = _survey(model, x)
    base = sv.baselines
    for layers in ({"a": "fp8-current", "b": "bf16"}, {"a": "fp8-current", "b": "fp8-current"},
                   {"a": "bf16", "b": "fp8-current"}):
        t, _ = sv.predict(Config(layers, {u: "fp32" for u in sv.units}))
        # a dequantizing route cannot make the step faster than the fp8 recipe's with
        # no Linear converted (nor negative)
        assert t >= base.step_shell > 0, layers
    # the route's bound: its fp32 GEMM runs at half bf16's rate, so at most 1x bf16
    a = sv.layers["a"].options
    assert a["bf16"].seconds / a["fp8-current"].seconds <= 1.0
    assert a["fp8-current"].max_speedup == 1.0
    p = plan_from(sv, choose(sv.layers, sv.units, base))
    assert p.predicted_step_s == pytest.approx(0.05) and str(p.recipe) == "bf16-master"
    assert all(r.speedup <= 1.0 for r in p.rows)
    assert "fp8-current runs at 1.00x bf16's speed" in {r.layer: r for r in p.rows}["a"].reason
    # measured again: the 64x64 shape up to the limit (its timings kept disagreeing), the
    # 64x256 one once; the fp8 step and the shell's in turn, again as they kept
    # disagreeing
    assert calls["shape"] == {A[:2]: timing.MAX_MEASUREMENTS, B[:2]: 1}
    assert calls["step"] == {"fp8": 3, "shell": 3}
    noise = "\n".join(p.timing_noise)
    assert "fp8-current 64x64 at 256 tokens timed 12.24x bf16's speed" in noise
    assert "its dequant_fp32 GEMM can give at most 1.00x (3 measurements)" in noise
    assert "fp8-current: the whole step with every Linear in it measured -20.00 ms" in noise
    assert "timings noisy: " in p.table()


def _cost(seconds, spread, route="native"):
    return LayerCost(seconds, 1000, route, spread=spread)


@pytest.mark.parametrize("settles", [True, False])
def test_timings_with_a_wide_spread_are_measured_again_and_reported_if_they_stay(
        host, settles, tmp_path):
    fp8 = _cost(0.5e-3, 0.02, "scaled_mm")
    noisy = [{"bf16": _cost(3e-3, 0.6), "fp8-current": fp8},
             {"bf16": _cost(2e-3, 0.4), "fp8-current": fp8},
             {"bf16": _cost(2.5e-3, 0.5), "fp8-current": fp8}]
    steady = {"bf16": _cost(1e-3, 0.03), "fp8-current": fp8}
    calls = host({A[:2]: noisy[:1] + [steady] if settles else noisy}, {})
    shell = timing.recipe_for_format(Recipe.parse("bf16-master"), "fp8-current")
    cache = tmp_path / "speeds.json"
    got = timing.layer_costs([A], ["bf16", "fp8-current"], shell, cache_file=cache)
    cost = got[(A, "bf16")]
    kept = [json.loads(k)[2] for k in json.loads(cache.read_text())]
    if settles:  # the second measurement agreed: it is kept, and nothing is reported
        assert calls["shape"][A[:2]] == 2 and cost.seconds == 1e-3
        assert timing.disagreements(A, {"bf16": cost, "fp8-current": fp8}, shell, "cpu") == []
        assert timing.noise_report(got, shell, "cpu") == []
        assert kept == ["bf16", "fp8-current"]
    else:  # all three spread: the steadiest is kept, reported, and not cached on disk
        assert calls["shape"][A[:2]] == timing.MAX_MEASUREMENTS == 3
        assert (cost.seconds, cost.spread, cost.measurements) == (2e-3, 0.4, 3)
        assert timing.disagreements(A, {"bf16": cost, "fp8-current": fp8}, shell, "cpu") == [
            "spread 40% on bf16 64x64 at 256 tokens"]
        assert timing.noise_report(got, shell, "cpu") == [
            "spread over 25% in 1 of 2 timings (worst 40% on bf16 64x64 at 256 tokens, "
            "after 3 measurements)"]
        assert kept == ["fp8-current"]


def _two_layers():
    """A Linear 10x faster in fp8 and one 10x slower, timed alone (on fp8 GEMMs: the
    options have no bound)."""
    return {"a": Layer("a", (64, 64), {"bf16": Option("bf16", 10.0, 100.0),
                                       "fp8-current": Option("fp8-current", 1.0, 50.0,
                                                             30.0)}),
            "b": Layer("b", (64, 64), {"bf16": Option("bf16", 1.0, 100.0),
                                       "fp8-current": Option("fp8-current", 10.0, 50.0,
                                                             30.0)})}


@pytest.mark.parametrize("settles", [True, False])
def test_a_whole_step_that_disagrees_with_its_linears_is_measured_again(host, settles,
                                                                          monkeypatch):
    # the Linears alone say fp8 saves 2 ms; the first whole fp8 step reads 6 ms slower
    # than the shell's (a stall), the next one 1.5 ms faster (a scale of 0.75), or the
    # stall lasts
    layers = {n: Layer(n, (64, 64), {
        "bf16": Option("bf16", 2e-3, 100.0),
        "fp8-current": Option("fp8-current", 1e-3, 50.0, 30.0)})
        for n in ("a", "b")}
    fp8_steps = iter([0.056, 0.0485] if settles else [0.056, 0.057, 0.058])
    calls = host({}, {"16-bit": 0.05, "shell": 0.05, "fp8": None})
    counted = survey_mod.measure_step

    def measure_step(model, recipe, batch, loss_fn=None, **kw):
        t, peak = counted(model, recipe, batch, loss_fn, **kw)
        return (next(fp8_steps) if t is None else t), peak
    monkeypatch.setattr(survey_mod, "measure_step", measure_step)
    args = (None, Recipe.parse("fp8-current"), None, None, layers, {},
            Baselines(0.05, 1e6, 0.05, 1e6, COSTS))
    if settles:
        assert survey_mod._time_scales(*args) == {"fp8-current": pytest.approx(0.75)}
        assert calls["step"] == {"fp8": 2, "shell": 2}
    else:
        noise: list[str] = []
        assert survey_mod._time_scales(*args, noise) == {}
        assert calls["step"] == {"fp8": 3, "shell": 3}
        assert noise == ["fp8-current: the whole step with every Linear in it measured "
                         "+8.00 ms against the fp8 recipe's with none, its Linears timed "
                         "alone -2.00 ms (3 measurements): their timings alone are used"]


def test_a_prediction_is_never_negative_however_the_timings_disagree():
    # a Linear 10x faster in fp8 alone whose format's whole step set a scale of 4, and a
    # fused optimizer timed at five times the whole 16-bit step: taken as they are,
    # 5 - 4 * 9 = -31 s, and 1 - 10 * (0.5 - 0.01) = -3.9 s
    layers = _two_layers()
    units = {"u": StateUnit("u", ((10,),))}
    base = Baselines(1.0, 1e6, 5.0, 1e6, {"fused": 0.5, "fp32": 0.01, "int8": 0.01},
                     time_scale={"fp8-current": 4.0})
    for layers_cfg, states in ((("fp8-current", "bf16"), "fp32"),
                               (("bf16", "bf16"), "int8"),
                               (("fp8-current", "bf16"), "int8")):
        cfg = Config(dict(zip(("a", "b"), layers_cfg)), {"u": states})
        t, _ = predict(cfg, layers, units, base)
        assert t > 0, (layers_cfg, states)
        pricer = _Pricer(Config({"a": "bf16", "b": "bf16"}, {"u": "fp32"}), layers, units,
                         base)
        for n, f in cfg.layers.items():
            pricer.apply("layer", n, f)
        pricer.apply("states", "u", states)
        assert pricer.now()[0] == pytest.approx(t, rel=1e-12)
    # any timings, scales and configurations: every prediction a positive duration
    rng = random.Random(0)
    for _ in range(300):
        lay = {f"l{i}": Layer(f"l{i}", (64, 64), {
            "bf16": Option("bf16", rng.uniform(1e-4, 1), 1.0),
            "fp8": Option("fp8", rng.uniform(1e-4, 1), 1.0, 30.0)}) for i in range(4)}
        base = Baselines(rng.uniform(1e-3, 1), 1e6, rng.uniform(1e-3, 1), 1e6,
                         {"fused": rng.uniform(0, 1e-2), "fp32": rng.uniform(0, 1e-3),
                          "int8": rng.uniform(0, 1e-3)},
                         time_scale={"fp8": rng.uniform(0.25, 4)})
        cfg = Config({n: rng.choice(("bf16", "fp8")) for n in lay},
                     {"u": rng.choice(("fp32", "int8"))})
        assert predict(cfg, lay, units, base)[0] > 0


def test_the_bound_of_each_gemm_route_is_what_it_multiplies_in(monkeypatch, measured):
    fp8 = timing.recipe_for_format(Recipe.parse("bf16-master"), "fp8-current")
    fp32_rest = timing.recipe_for_format(Recipe.parse("fp32"), "fp8-current")
    for bf16_rate, dequant_fp32 in ((2.0, 1.0), (0.02, 50.0)):
        # bf16 twice fp32's GEMM rate (AVX-512 BF16, AMX), or in software (AVX2)
        set_speeds(monkeypatch, bf16=bf16_rate)
        assert timing.max_speedup("scaled_mm", fp8, "cpu") == math.inf
        # the bf16 Linear and the dequant route run the same bf16 GEMM
        assert timing.max_speedup("dequant", fp8, "cpu") == 1.0
        # an fp32 GEMM against bf16's: faster only where bf16 is slower than fp32
        assert timing.max_speedup("dequant_fp32", fp8, "cpu") == pytest.approx(dequant_fp32)
    # where the layers around fp8 Linears run in fp32 (no fast bf16, fp32 params), the
    # dequant_fp32 route multiplies in the very GEMM the "bf16" Linear runs
    assert kernels.fp8_rest(fp32_rest, "cpu") == "fp32"
    assert timing.max_speedup("dequant_fp32", fp32_rest, "cpu") == 1.0
    assert timing.max_speedup("dequant", fp32_rest, "cpu") == 1.0


@pytest.fixture
def step_clock(monkeypatch):
    """``step_clock(cost)``: ``measure_steps`` runs its real copies and engines, its
    clock reads a virtual time that each step of a copy advances by ``cost(kind, n)``
    (kind ``"16-bit"``, ``"shell"`` or ``"fp8"``, as the copy's engine was built; ``n``
    the steps taken before it). Returns the kinds in the order stepped."""
    def set_clock(cost):
        now, kinds, taken = [0.0], {}, []
        build, call = steps_mod.step_engine, steps_mod.call_loss

        def step_engine(model, recipe, fp8_filter=None, **kw):
            kinds[id(model)] = ("16-bit" if recipe.compute != "fp8" else
                                "fp8" if fp8_filter(None, "") else "shell")
            return build(model, recipe, fp8_filter, **kw)

        def call_loss(model, batch, loss_fn):
            now[0] += cost(kinds[id(model)], len(taken))
            taken.append(kinds[id(model)])
            return call(model, batch, loss_fn)

        monkeypatch.setattr(steps_mod, "step_engine", step_engine)
        monkeypatch.setattr(steps_mod, "call_loss", call_loss)
        monkeypatch.setattr(steps_mod, "time", type("Clock", (), {
            "perf_counter": staticmethod(lambda: now[0])}))
        monkeypatch.setattr(survey_mod, "state_step_costs", lambda *a, **k: {})
        return taken
    return set_clock


def _baselines_of(model):
    return survey_mod._baselines(model, Recipe.parse("bf16-master"),
                                 Recipe.parse("fp8-current"), torch.randn(8, 64), _loss,
                                 ("fp32",), "cpu")


def test_the_baselines_are_the_steps_after_the_process_warms_up(step_clock):
    # a process whose first 8 whole-model steps run 1.3x slow (its allocator and kernel
    # caches settling), every step after them steady: 100 ms under the 16-bit recipe,
    # 90 ms under the fp8 shell
    steady = {"16-bit": 0.1, "shell": 0.09}
    taken = step_clock(lambda kind, n: steady[kind] * (1.3 if n < 8 else 1.0))
    b = _baselines_of(TwoLinears())
    # the steady steps, not the first ones (0.13 s taken as the 16-bit step)
    assert b.step_16 == pytest.approx(0.1) and b.step_shell == pytest.approx(0.09)
    assert taken[:survey_mod.WARMUP_STEPS] == ["16-bit"] * survey_mod.WARMUP_STEPS
    assert b.peak_16 > 0 and b.peak_shell > 0


def test_the_baselines_are_stepped_in_turn_so_a_slowing_machine_moves_both_alike(
        step_clock):
    # every step 1 ms longer than the one before (a machine getting busier): measured
    # one after the other, the shell's 4 steps would read 5 ms longer than the 16-bit
    # recipe's for the same work, and every predicted ratio would move with that
    steady = {"16-bit": 0.1, "shell": 0.09}
    taken = step_clock(lambda kind, n: steady[kind] + 1e-3 * n)
    b = _baselines_of(TwoLinears())
    assert b.step_16 - b.step_shell == pytest.approx(0.01, abs=1e-9)
    # one untimed step each, then rounds in turn, the order reversed every round
    assert taken[8:18] == ["16-bit", "shell"] + ["16-bit", "shell", "shell", "16-bit"] * 2


def test_the_time_scale_steps_the_fp8_recipe_in_turn_with_the_shell(step_clock):
    # the Linears alone say fp8 saves 1 ms; the whole steps, 89.5 ms in fp8 and 90 ms
    # in the shell, save 0.5 ms: a scale of 0.5. With every step 1 ms longer than the
    # one before, the fp8 step measured alone after the shell's baseline would read
    # 2 ms slower than the shell (a scale of -2, refused)
    layers = {n: Layer(n, (64, 64), {
        "bf16": Option("bf16", 2e-3, 100.0),
        "fp8-current": Option("fp8-current", 1.5e-3, 50.0, 30.0)}) for n in ("a", "b")}
    steady = {"fp8": 0.0895, "shell": 0.09}
    taken = step_clock(lambda kind, n: steady[kind] + 1e-3 * n)
    got = survey_mod._time_scales(TwoLinears(), Recipe.parse("fp8-current"),
                                  torch.randn(8, 64), _loss, layers, {},
                                  Baselines(0.1, 1e6, 0.09, 1e6, COSTS))
    assert got == {"fp8-current": pytest.approx(0.5)}
    assert taken == ["fp8", "shell", "fp8", "shell", "shell", "fp8"]
