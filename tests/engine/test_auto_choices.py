"""Both outcomes of every ``auto`` choice, on any chip: the measured speeds are replaced.

A CPU with bf16/fp16 units (AVX-512 BF16, AMX, AVX512-FP16) and one without (AVX2) are
each simulated here, so a decision tuned on one machine cannot break on the next.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import mixprec.engine.devices as k
from helpers.models import mlp, tiny_gpt
from helpers.speeds import set_speeds
from mixprec import MixedPrecision, Recipe
from mixprec.diagnostics import doctor
from mixprec.memory import TransformerSpec, estimate
from mixprec.modules.linear import Float8Linear

pytestmark = pytest.mark.usefixtures("measured")  # what auto decides, not a pinned path

# GFLOP/s of each kind of chip, as measured on the machines this project ran on:
# the Xeon (AMX-BF16, AVX512-FP16) and an AMD EPYC with AVX2 only
FAST_BF16 = {torch.float32: 300.0, torch.bfloat16: 2000.0, torch.float16: 300.0}
NO_UNITS = {torch.float32: 45.0, torch.bfloat16: 0.5, torch.float16: 0.5}


@pytest.fixture
def chip(monkeypatch):
    """``chip(rates, scaled_mm=...)`` makes mixprec.engine.devices measure those rates."""
    def set_rates(rates, scaled_mm=0.1):
        set_speeds(monkeypatch, rates, scaled_mm)
    return set_rates


@pytest.mark.parametrize("rates,emulated", [(FAST_BF16, False), (NO_UNITS, True)])
@pytest.mark.parametrize("recipe", ["bf16", "bf16-master", "fp16"])
def test_emulate_auto_follows_the_measured_speed(chip, rates, emulated, recipe):
    chip(rates)
    model = mlp()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        engine = MixedPrecision(model, torch.optim.AdamW(model.parameters()), recipe)
    assert engine.emulating is emulated and engine.kernels.emulate is emulated
    said = [str(x.message) for x in w if "no fast kernels" in str(x.message)]
    assert bool(said) is emulated  # the engine says so, with the measured rates
    if emulated:  # the reading the choice took, as a ratio
        assert "measured on one thread, alternating: bf16 0.011x fp32" in said[0]
    with engine.autocast():
        y = model(torch.randn(4, 16))
    assert y.dtype == (torch.float32 if emulated else Recipe.parse(recipe).compute_dtype)


@pytest.mark.parametrize("rates,scaled_mm,route", [
    (FAST_BF16, 0.1, "dequant"),        # AMX Xeon: CPU _scaled_mm a reference kernel
    (NO_UNITS, 0.1, "dequant_fp32"),    # AVX2: bf16 GEMMs 90x slower than fp32
    (NO_UNITS, 66.0, "scaled_mm"),      # _scaled_mm > 1.25x the fastest dequant route
    (NO_UNITS, 50.0, "dequant_fp32"),   # faster, but not by the margin
])
def test_fp8_gemm_auto_takes_the_fastest_route_measured(chip, rates, scaled_mm, route):
    chip(rates, scaled_mm)
    assert k.fp8_gemm_route("cpu") == route
    assert k.fp8_gemm_route("cpu", "dequant") == "dequant"  # a choice is kept
    model = mlp(d_in=32, hidden=32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = MixedPrecision(model, torch.optim.AdamW(model.parameters()), "fp8")
    assert engine.kernels.fp8_gemm == route
    assert {m.backend for m in model.modules() if isinstance(m, Float8Linear)} == {route}


@pytest.mark.parametrize("fast", [True, False])
def test_the_dequant_route_follows_the_same_bf16_decision_as_the_rest(monkeypatch, fast):
    """A loaded host can misread a multi-threaded best-of GEMM rate (fp32 read 25x slow):
    the route takes the one-thread bf16 decision that fp8_rest takes, not those rates."""
    monkeypatch.delenv(k.EMULATE_ENV, raising=False)
    set_speeds(monkeypatch, {torch.float32: 1.0, torch.bfloat16: 4.7 if fast else 0.02,
                             torch.float16: 1.0}, scaled_mm=0.1)
    # multi-threaded rates that say the opposite of the readings
    monkeypatch.setattr(k, "matmul_gflops", lambda dev, dt, *a: {
        torch.bfloat16: 1.0 if fast else 100.0, torch.float32: 100.0 if fast else 1.0}[dt])
    fp8 = Recipe.parse("fp8")
    assert k.fp8_gemm_route("cpu") == ("dequant" if fast else "dequant_fp32")
    assert k.fp8_rest(fp8, "cpu") == ("bf16" if fast else "fp32")


@pytest.mark.parametrize("rates,rest", [(FAST_BF16, "bf16"), (NO_UNITS, "fp32")])
def test_fp8_recipes_run_their_other_layers_where_they_are_fast(chip, rates, rest):
    chip(rates)
    model = mlp(d_in=32, hidden=32)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        engine = MixedPrecision(model, torch.optim.AdamW(model.parameters()), "fp8-current")
    assert engine.kernels.fp8_rest == rest
    assert any("around the fp8 Linears compute in fp32" in str(x.message)
               for x in w) is (rest == "fp32")
    with engine.autocast():
        h = model[0](torch.randn(4, 32))        # a Float8Linear
        out = model(torch.randn(4, 32))
    want = torch.bfloat16 if rest == "bf16" else torch.float32
    assert h.dtype == out.dtype == want
    engine.backward(F.mse_loss(out.float(), torch.zeros_like(out.float())))
    assert not bool(engine.step().skipped)
    # bf16 working weights need bf16 autocast to meet their inputs: kept everywhere
    assert k.fp8_rest(Recipe.parse("fp8,params=bf16,master=fp32"), "cpu") == "bf16"


def test_an_lstm_under_fp8_trains_on_a_chip_without_bf16(chip):
    """oneDNN has no bf16 LSTM on an AVX2 CPU ("could not create a primitive descriptor");
    there fp8's other layers run in fp32, so the LSTM runs."""
    chip(NO_UNITS)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm, self.head = torch.nn.LSTM(16, 32, batch_first=True), torch.nn.Linear(32, 16)

        def forward(self, x):
            return self.head(self.lstm(x)[0])

    torch.manual_seed(0)
    model = Net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # only the head is a Linear, so fp8 converts nothing: the filter says it is meant
        engine = MixedPrecision(model, torch.optim.AdamW(model.parameters()), "fp8",
                                fp8_filter=lambda m, fqn: False)
    with engine.autocast():
        loss = model(torch.randn(2, 5, 16)).square().mean()
    engine.backward(loss)
    assert not bool(engine.step().skipped)


@pytest.mark.parametrize("rates,per", [(FAST_BF16, 2), (NO_UNITS, 4)])
@pytest.mark.parametrize("recipe", ["bf16-master", "fp8"])
def test_the_memory_planner_prices_activations_as_they_will_be_stored(chip, rates, per,
                                                                      recipe):
    chip(rates)
    spec = TransformerSpec(layers=2, hidden=64, heads=4, seq_len=32, micro_batch=2,
                           attention="flash", dropout=False)
    got = estimate(tiny_gpt(), recipe, activations=spec)
    assert f"{per}-byte values" in " ".join(got.notes)


def _doctor(recipe):
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 64, (4, 33), generator=g) for _ in range(2)]
    return doctor(lambda: tiny_gpt(d_model=32, seq_len=32),
                  lambda m, step: m(data[step][:, :-1], data[step][:, 1:]), recipe,
                  steps=2, reference_steps=0)


@pytest.mark.parametrize("rates", [FAST_BF16, NO_UNITS])
def test_the_doctor_never_advises_what_is_already_on(chip, rates):
    chip(rates)
    report = _doctor("bf16")
    codes = report.codes()
    if rates is NO_UNITS:  # emulated: said, as information, and nothing to turn on
        f = next(f for f in report.findings if f.code == "kernel-emulated")
        assert f.severity == "info" and "emulates it exactly" in f.title
        assert "emulate=true" not in f.advice and "kernel-slow" not in codes
    else:
        assert "kernel-emulated" not in codes and "kernel-slow" not in codes
    assert report.ok, str(report)
    real = _doctor("bf16,emulate=false")  # the user turned emulation off on a slow chip
    assert ("kernel-slow" in real.codes()) is (rates is NO_UNITS)


@pytest.mark.parametrize("rates", [FAST_BF16, NO_UNITS])
@pytest.mark.parametrize("pin,emulated", [("on", True), ("off", False), ("auto", None)])
def test_mixprec_emulate_pins_every_auto_choice_to_one_path(chip, monkeypatch, rates, pin,
                                                           emulated):
    """MIXPREC_EMULATE=on takes the path of a chip without 16-bit units whatever this one
    measures, =off the path of one with them; auto (and unset) measures."""
    chip(rates)
    monkeypatch.setenv(k.EMULATE_ENV, pin)
    if emulated is None:
        emulated = rates is NO_UNITS
    fp8 = Recipe.parse("fp8")
    assert k.emulating(Recipe.parse("bf16"), "cpu") is emulated
    assert k.emulating(Recipe.parse("fp16-master"), "cpu") is emulated
    assert k.fp8_rest(fp8, "cpu") == ("fp32" if emulated else "bf16")
    assert k.fp8_gemm_route("cpu") == ("dequant_fp32" if emulated else "dequant")
    got = k.choices(fp8, "cpu")
    assert got.source == ("measured" if pin == "auto" else f"MIXPREC_EMULATE={pin}")
    # an explicit choice in the recipe is never overridden
    assert k.emulating(Recipe.parse("bf16,emulate=false"), "cpu") is False
    assert k.emulating(Recipe.parse("bf16,emulate=true"), "cpu") is True
    model = mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = MixedPrecision(model, torch.optim.AdamW(model.parameters()), "bf16-master")
    assert engine.emulating is emulated
    assert engine.param_state.working[0].dtype == (torch.float32 if emulated
                                                    else torch.bfloat16)


def test_a_pinned_scaled_mm_that_is_clearly_faster_still_wins(chip, monkeypatch):
    chip(FAST_BF16, scaled_mm=5000.0)
    monkeypatch.setenv(k.EMULATE_ENV, "on")
    assert k.fp8_gemm_route("cpu") == "scaled_mm"


def test_a_bad_mixprec_emulate_names_the_value_and_the_valid_ones(monkeypatch):
    monkeypatch.setenv(k.EMULATE_ENV, "yes please")
    with pytest.raises(ValueError, match=r"MIXPREC_EMULATE='yes please'; valid: on, off"):
        k.emulating(Recipe.parse("bf16"), "cpu")
