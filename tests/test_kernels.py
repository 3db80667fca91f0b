"""The kernel-speed probe: measured numbers, cached."""

import pytest
import torch

from mixprec.kernels import matmul_gflops, relative_speed

pytestmark = pytest.mark.usefixtures("measured")  # what auto decides, not a pinned path


def test_probe_measures_and_caches():
    a = matmul_gflops("cpu", torch.float32, 128, 0.01)
    assert a > 0
    assert matmul_gflops("cpu", torch.float32, 128, 0.01) == a  # cached: same number


def _scripted_probe(monkeypatch, rates: list[float]) -> list:
    """Replace the probe's timings by ``rates`` (GFLOP/s, in call order); returns the
    list the dtypes of the calls are appended to."""
    import mixprec.kernels as k

    times, calls = iter(rates), []

    def fake(dev, dtype, n, seconds):
        calls.append(dtype)
        return next(times)

    monkeypatch.setattr(k.matmul_gflops, "__wrapped__", fake)
    k.relative_speed.cache_clear()
    return calls


def test_relative_speed_is_the_median_of_alternate_ratios(monkeypatch):
    # no timing asserted: the probe's timings are replaced by a scripted sequence
    import mixprec.kernels as k

    calls = _scripted_probe(monkeypatch, [100.0, 50.0, 10.0, 50.0, 60.0, 50.0])
    try:
        assert relative_speed("cpu", torch.float16) == 1.2  # ratios 2.0, 0.2, 1.2
        assert calls == [torch.float16, torch.float32] * 3  # alternated
        assert relative_speed("cpu", torch.float16) == 1.2  # cached: no new timings
        assert len(calls) == 6
    finally:
        k.relative_speed.cache_clear()


def test_a_clearly_slow_dtype_is_decided_by_one_round(monkeypatch):
    import mixprec.kernels as k

    calls = _scripted_probe(monkeypatch, [1.0, 100.0])  # 1% of fp32: 4x below the line
    try:
        assert relative_speed("cpu", torch.float16) == 0.01
        assert calls == [torch.float16, torch.float32]  # no second round
    finally:
        k.relative_speed.cache_clear()


def test_emulation_decision_is_recorded_and_checked_on_resume(monkeypatch):
    import pytest
    from torch import nn

    import mixprec.kernels as k
    from mixprec import MixedPrecision

    def engine(speed):
        monkeypatch.setattr(k, "relative_speed", lambda dev, dt: speed)
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
    import mixprec.kernels as k

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
