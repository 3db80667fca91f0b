"""The kernel-speed probe: measured numbers, cached, and shown as the choices took them."""

import re

import pytest
import torch

from helpers.speeds import EPYC_LOADED, EPYC_ONE_THREAD, set_speeds
from mixprec import Recipe
from mixprec.engine.devices import matmul_gflops, relative_speed

pytestmark = pytest.mark.usefixtures("measured")  # what auto decides, not a pinned path


def test_probe_measures_and_caches():
    a = matmul_gflops("cpu", torch.float32, 128, 0.01)
    assert a > 0
    assert matmul_gflops("cpu", torch.float32, 128, 0.01) == a  # cached: same number


def _scripted_probe(monkeypatch, rates: list[float]) -> list:
    """Replace the probe's timings by ``rates`` (GFLOP/s, in call order); returns the
    list the dtypes of the calls are appended to."""
    import mixprec.engine.devices as k

    times, calls = iter(rates), []

    def fake(dev, dtype, n, seconds):
        calls.append(dtype)
        return next(times)

    monkeypatch.setattr(k.matmul_gflops, "__wrapped__", fake)
    k._speed_reading.cache_clear()
    return calls


def test_relative_speed_is_the_median_of_alternate_ratios(monkeypatch):
    # no timing asserted: the probe's timings are replaced by a scripted sequence
    import mixprec.engine.devices as k

    calls = _scripted_probe(monkeypatch, [100.0, 50.0, 10.0, 50.0, 60.0, 50.0])
    try:
        assert relative_speed("cpu", torch.float16) == 1.2  # ratios 2.0, 0.2, 1.2
        assert calls == [torch.float16, torch.float32] * 3  # alternated
        assert relative_speed("cpu", torch.float16) == 1.2  # cached: no new timings
        assert len(calls) == 6
    finally:
        k._speed_reading.cache_clear()


def test_a_clearly_slow_dtype_is_decided_by_one_round(monkeypatch):
    import mixprec.engine.devices as k

    calls = _scripted_probe(monkeypatch, [1.0, 100.0])  # 1% of fp32: 4x below the line
    try:
        assert relative_speed("cpu", torch.float16) == 0.01
        assert calls == [torch.float16, torch.float32]  # no second round
    finally:
        k._speed_reading.cache_clear()


def test_emulation_decision_is_recorded_and_checked_on_resume(monkeypatch):
    import pytest
    from torch import nn

    import mixprec.engine.devices as k
    from mixprec import MixedPrecision

    def engine(speed):
        set_speeds(monkeypatch, fp16=speed)
        m = nn.Linear(4, 4)
        with pytest.warns(UserWarning) if speed < k.FAST_ENOUGH else _nothing():
            return MixedPrecision(m, torch.optim.SGD(m.parameters(), lr=0.1), "fp16")

    state = engine(0.01).state_dict()  # auto resolved to emulation
    assert state["emulating"] is True
    with pytest.warns(UserWarning, match="trained with emulation on.*resolves to off"):
        engine(1.0).load_state_dict(state)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_probe_ignores_the_callers_autocast():
    """The first auto decision may be taken inside a forward pass: under bf16 autocast the
    fp32 probe would run in bf16 and report the ratio as ~1 (then cached)."""
    import mixprec.engine.devices as k

    seen = []

    def fake(dev, dtype, n, seconds):
        seen.append(torch.is_autocast_enabled("cpu"))
        return 1.0

    orig = k._gflops
    k._gflops = fake
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            k.matmul_gflops.__wrapped__("cpu", torch.float32, 64, 0.0)
    finally:
        k._gflops = orig
    assert seen == [False]


def test_describe_gives_the_reading_the_choice_took_not_a_stalled_rate(gemm_timer):
    """A multi-threaded GEMM on a loaded host stalls (fp32 read 1.4 GFLOP/s in one run
    and 131 in the next on a busy 2-core machine): ``describe`` printed such rates,
    fp16 faster than fp32 beside emulate=on. It gives the one-thread alternating
    reading that emulate=auto decided on, as ratios, on the decision's side."""
    import mixprec.engine.devices as k

    gemm_timer(EPYC_ONE_THREAD, EPYC_LOADED)
    kc = k.choices(Recipe.parse("fp16"), "cpu")
    assert kc.emulate and k.emulating(Recipe.parse("bf16"), "cpu") is False
    text = kc.describe()
    assert "fp16 0.023x fp32" in text and "bf16 2x fp32" in text, text
    printed = {m[0]: float(m[1]) for m in re.findall(r"(bf16|fp16) ([\d.]+)x fp32", text)}
    assert (printed["fp16"] < k.FAST_ENOUGH) is kc.emulate
    assert (printed["bf16"] < k.FAST_ENOUGH) is k.emulating(Recipe.parse("bf16"), "cpu")
    assert "GFLOP/s" not in text


def test_rounds_that_disagree_are_reported_as_too_noisy(gemm_timer):
    """bf16's three rounds read 2x, 40x and 0.2x fp32: the choice takes the median (2x:
    real kernels), and describe says the machine was too noisy instead of a ratio."""
    import mixprec.engine.devices as k

    gemm_timer({torch.float32: 100.0, torch.float16: 2.3,
                torch.bfloat16: [(200.0, 100.0), (200.0, 5.0), (20.0, 100.0)]}, EPYC_LOADED)
    kc = k.choices(Recipe.parse("bf16"), "cpu")
    assert kc.emulate is False  # the median round, as before
    text = kc.describe()
    assert "bf16 against fp32: too noisy to measure (rounds 0.2x to 40x)" in text, text
    assert "fp16 0.023x fp32" in text and not re.search(r"bf16 [\d.]+x fp32", text)
    reading = k.speed_reading("cpu", torch.bfloat16)
    assert reading.rounds == (2.0, 40.0, 0.2) and reading.ratio == 2.0 and reading.noisy


def test_a_reading_is_noisy_beyond_the_spread_bound():
    from mixprec.engine.devices import NOISE_SPREAD, SpeedReading

    def r(*rounds):
        return SpeedReading(name="bf16", base="fp32", rounds=rounds)

    assert not r(1.0, 1.0 * NOISE_SPREAD, 1.5).noisy and r(1.0, 2.01, 1.5).noisy
    assert str(r(0.9, 1.1, 1.0)) == "bf16 1x fp32" and str(r(0.011,)) == "bf16 0.011x fp32"
    assert str(r(30.0, 31.0, 29.0)) == "bf16 30x fp32"
