"""The planner never contradicts itself: a predicted step is never negative, however the
timings it adds up disagree."""

from __future__ import annotations

import random

import pytest

from mixprec.planner.choose import Baselines, Config, Layer, Option, StateUnit, _Pricer, predict


def _two_layers():
    """A Linear 10x faster in fp8 and one 10x slower, timed alone (on fp8 GEMMs: the
    options have no bound)."""
    return {"a": Layer("a", (64, 64), {"bf16": Option("bf16", 10.0, 100.0),
                                       "fp8-current": Option("fp8-current", 1.0, 50.0,
                                                             30.0)}),
            "b": Layer("b", (64, 64), {"bf16": Option("bf16", 1.0, 100.0),
                                       "fp8-current": Option("fp8-current", 10.0, 50.0,
                                                             30.0)})}


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
