"""The doctor finds each planted fault and gives the right advice; no false alarms."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers.doctor_models import Scale, batches, mlp_factory
from helpers.models import tiny_gpt
from helpers.speeds import EPYC_LOADED, EPYC_ONE_THREAD, set_speeds
from mixprec.diagnostics import (
    NumericsMonitor,
    audit_dtypes,
    audit_scale_history,
    doctor,
    trace_nonfinite,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Offset(nn.Module):
    def __init__(self, c: float = 300.0) -> None:
        super().__init__()
        self.c = c

    def forward(self, x):
        return x + self.c


def test_a_overflowing_layer_is_named_as_the_origin():
    report = doctor(mlp_factory(Scale(1e5)), batches(), "fp16,emulate=false", steps=3,
                    reference_steps=0)
    f = next(f for f in report.findings if f.code == "nonfinite-origin")
    assert f.data["module"] == "2" and f.data["op"] == "Scale" and f.data["phase"] == "forward"
    assert "bf16" in f.advice and "keep 2 in fp32" in f.advice
    assert f.severity == "error"


def test_tracer_direct():
    model = mlp_factory(Scale(1e5))()

    def run():
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(torch.randn(4, 16))
        out.float().sum().backward()
    origin = trace_nonfinite(model, run)
    assert origin.module == "2" and origin.phase == "forward"


def test_b_tiny_gradients_without_loss_scaling_underflow():
    report = doctor(mlp_factory(), batches(scale=1e-9), "fp16,loss_scale=none,emulate=false",
                    steps=2, reference_steps=0)
    f = next(f for f in report.findings if f.code == "grad-underflow")
    assert f.data["share"] > 0.5
    assert "dynamic loss scaling" in f.advice and "bf16" in f.advice
    # with dynamic scaling (2^16) far fewer of the same gradients underflow
    scaled = doctor(mlp_factory(), batches(scale=1e-9), "fp16,emulate=false", steps=2,
                    reference_steps=0)
    rest = [x.data["share"] for x in scaled.findings if x.code == "grad-underflow"]
    assert not rest or rest[0] < f.data["share"] / 4


def test_c_master_weights_in_bf16_are_flagged():
    model = mlp_factory()().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters())
    findings = audit_dtypes(model, opt, "bf16-master")
    f = next(f for f in findings if f.code == "master-dtype")
    assert f.severity == "error" and "bfloat16" in f.title and "bf16-master" in f.advice


def test_c_doctor_reports_a_half_model_instead_of_crashing():
    make = lambda: mlp_factory()().to(torch.bfloat16)  # noqa: E731
    report = doctor(make, batches(), "bf16-master", steps=2, reference_steps=0)
    assert "master-dtype" in report.codes()


class CastNorm(nn.Module):
    """A LayerNorm forced into the autocast dtype (as a wrapper around a 16-bit-only
    fused kernel would be): fp16 under an fp16 recipe, fp32 in the fp32 reference."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        if torch.is_autocast_enabled("cpu"):
            x = x.to(torch.get_autocast_dtype("cpu"))
        mu = x.mean(-1, keepdim=True)
        y = (x - mu) / torch.sqrt(((x - mu) ** 2).mean(-1, keepdim=True) + 1e-5)
        return y * self.weight + self.bias


def test_d_layernorm_forced_to_fp16_is_flagged_by_the_reference():
    """Features with a large offset (1500 ± 1): an fp32 LayerNorm centres them exactly;
    in fp16 (spacing 1 at 1500) the centred values keep about one bit."""
    def make(norm):
        def f():
            torch.manual_seed(0)
            return nn.Sequential(Offset(1500.0), norm(16), nn.Linear(16, 64), nn.GELU(),
                                 nn.Linear(64, 4))
        return f
    report = doctor(make(CastNorm), batches(), "fp16,emulate=false", steps=2,
                    reference_steps=3)
    curves = report.facts["reference_losses"]  # both runs' loss curves, same batches
    assert len(curves["recipe"]) == len(curves["fp32"]) == 3
    f = next(f for f in report.findings if f.code == "reference-divergence")
    assert "1" in f.data["layers"]  # the forced-fp16 norm (and what it feeds)
    clean = doctor(make(nn.LayerNorm), batches(), "fp16,emulate=false", steps=2,
                   reference_steps=3)
    assert "reference-divergence" not in clean.codes(), str(clean)


def test_e_fp16_on_this_cpu_gets_the_measured_kernel_finding(monkeypatch):
    rates = {torch.float32: 300.0, torch.bfloat16: 1800.0, torch.float16: 300.0}
    set_speeds(monkeypatch, rates)
    report = doctor(mlp_factory(), batches(), "fp16,emulate=false", steps=1,
                    reference_steps=0)
    f = next(f for f in report.findings if f.code == "kernel-better-dtype")
    assert "6.0x faster" in f.title and "bf16" in f.advice
    rates[torch.float16] = 4.0  # a CPU without fp16 units (70x slower than fp32)
    report = doctor(mlp_factory(), batches(), "fp16,emulate=false", steps=1,
                    reference_steps=0)
    f = next(f for f in report.findings if f.code == "kernel-slow")
    assert "75x slower" in f.title and "emulate=true" in f.advice


def test_e_real_measurement_runs():
    report = doctor(mlp_factory(), batches(), "fp16,emulate=false", steps=1,
                    reference_steps=0)
    speed = report.facts["matmul_speed"]
    assert speed["bf16"]["ratio"] > 0 and speed["fp16"]["ratio"] > 0
    assert speed["fp16"]["against"] == "fp32" and 1 <= len(speed["fp16"]["rounds"]) <= 3


def test_e_the_doctor_reads_speed_as_the_auto_choice_does(gemm_timer):
    """Multi-threaded rates on a loaded host (fp32 1.4, fp16 2.3 GFLOP/s) made the doctor
    call fp16 "1x slower than fp32" while emulating it for being slow, and stay silent
    about fp16 with emulate=false. It reads what emulate=auto read: 0.023x on one thread."""
    gemm_timer(EPYC_ONE_THREAD, EPYC_LOADED)
    report = doctor(mlp_factory(), batches(), "fp16", steps=1, reference_steps=0)
    f = next(f for f in report.findings if f.code == "kernel-emulated")
    assert "has no fast kernel on cpu (fp16 0.023x fp32)" in f.title, f.title
    assert report.facts["matmul_speed"]["fp16"]["ratio"] == pytest.approx(0.023)
    assert report.facts["matmul_speed"]["bf16"]["ratio"] == pytest.approx(2.0)
    real = doctor(mlp_factory(), batches(), "fp16,emulate=false", steps=1,
                  reference_steps=0)
    f = next(f for f in real.findings if f.code == "kernel-slow")
    assert "43x slower than fp32" in f.title and "use bf16 if it is fast here (bf16 2x" \
        in f.advice


def test_e_a_machine_too_busy_to_measure_is_said_not_turned_into_a_ratio(gemm_timer):
    """fp16's rounds read 0.5x, 0.023x and 2.3x fp32: no kernel-slow or -better-dtype
    ratio from them, a kernel-noisy finding that says so."""
    gemm_timer({torch.float32: 100.0, torch.bfloat16: 200.0,
                torch.float16: [(50.0, 100.0), (2.3, 100.0), (2.3, 1.0)]}, EPYC_LOADED)
    report = doctor(mlp_factory(), batches(), "fp16,emulate=false", steps=1,
                    reference_steps=0)
    codes = report.codes()
    assert "kernel-noisy" in codes and "kernel-slow" not in codes
    assert "kernel-better-dtype" not in codes
    assert report.facts["matmul_speed"]["fp16"]["noisy"]
    f = next(f for f in report.findings if f.code == "kernel-noisy")
    assert f.severity == "info" and "too busy" in f.title
    assert "fp16 against fp32: too noisy to measure (rounds 0.023x to 2.3x)" in f.evidence


def test_f_constant_loss_scale_over_5000_steps_is_flagged():
    f = audit_scale_history([65536.0] * 5000, "fp16")
    assert [x.code for x in f] == ["scale-constant"]
    assert "5000 steps" in f[0].title
    report = doctor(mlp_factory(), batches(), "fp16,emulate=false", steps=1,
                    reference_steps=0, scale_history=[65536.0] * 5000)
    assert "scale-constant" in report.codes()
    moving = [65536.0 * 2 ** (i // 2000) for i in range(5000)]
    assert audit_scale_history(moving, "fp16") == []


def test_g_clean_bf16_run_has_no_false_alarms():
    model_factory = lambda: tiny_gpt(d_model=32, seq_len=32)  # noqa: E731
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 64, (4, 33), generator=g) for _ in range(10)]

    def fn(model, step):
        idx = data[step]
        return model(idx[:, :-1], idx[:, 1:])

    report = doctor(model_factory, fn, "bf16", steps=10, reference_steps=3)
    assert report.ok, str(report)
    assert report.facts["matmul_flops_by_dtype"].get("bfloat16", 0) > 0.9
    assert report.facts["matmul_weights_by_format"]["attention"] == {"bf16": 1.0}
    assert report.facts["matmul_flops_by_format"]["attention"] == {"bf16": 1.0}
    json.loads(report.to_json())


def test_monitor_samples_every_n_steps():
    model = mlp_factory()()
    mon = NumericsMonitor(model, every=3)
    fn = batches()
    for step in range(7):
        with mon.sample(step):
            fn(model, step).backward()
    recs = mon.records["activation:0"]
    assert len(recs) == 3  # steps 0, 3, 6
    s = mon.summary()["param_grad:0.weight"]
    assert 0 <= s["fp16_to_zero"] <= 1 and s["amax"] > 0
    mon.remove()


def test_cli_doctor_json_and_plots(tmp_path, capsys):
    from mixprec.cli import main

    code = main(["doctor", "--recipe", "bf16", "--steps", "2", "--reference-steps", "1",
                 "--json", "--plots", str(tmp_path)])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["recipe"] == "bf16"
    for name in ("grad_histogram.png", "underflow.png", "loss_scale.png"):
        assert (tmp_path / name).stat().st_size > 5_000
    assert main(["doctor", "--model", "no.such.module:factory"]) == 2


def _outlier_batches(factor: float):
    """Batches whose token 3 is ``factor`` times the others (an outlier token)."""
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(4):
        x = torch.randn(32, 16, generator=g)
        x[3] *= factor
        data.append((x, torch.randint(0, 4, (32,), generator=g)))

    def fn(model, step):
        x, y = data[step % len(data)]
        return F.cross_entropy(model(x).float(), y)
    return fn


def fp8_factory():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                         nn.Linear(64, 4))


def test_fp8_outlier_tokens_advise_rowwise_scaling():
    """One token 1e6x the others: per-tensor e4m3 casts flush most of the other tokens'
    inputs to zero; the doctor says so and advises fp8-rowwise, and with fp8-rowwise it
    finds nothing. Ordinary data raises no fp8 finding (no false alarm)."""
    report = doctor(fp8_factory, _outlier_batches(1e6), "fp8-current", steps=2,
                    reference_steps=0)
    f = next(f for f in report.findings if f.code == "fp8-range")
    assert f.data["layers"][0] == "0" and "fp8-rowwise" in f.advice
    assert "input" in f.title and "flushed per-tensor" in f.evidence
    ranges = {(r["layer"], r["tensor"]): r for r in report.facts["fp8_ranges"]}
    first = ranges[("0", "input")]
    assert first["per_tensor"] > 0.5 and first["rowwise"] == 0.0  # 31 of 32 tokens mostly lost
    assert first["spread"] > 20
    assert "fp8-block" in f.advice and first["blockwise"] == 0.0  # tiles of 128: per row
    rowwise = doctor(fp8_factory, _outlier_batches(1e6), "fp8-rowwise", steps=2,
                     reference_steps=0)
    assert "fp8-range" not in rowwise.codes()
    block = doctor(fp8_factory, _outlier_batches(1e6), "fp8-block", steps=2,
                   reference_steps=0)
    assert "fp8-range" not in block.codes()
    assert block.facts["fp8_ranges"][0]["blockwise"] == 0.0
    plain = doctor(fp8_factory, _outlier_batches(1.0), "fp8", steps=2, reference_steps=0)
    assert "fp8-range" not in plain.codes() and "grad-underflow" not in plain.codes()


def test_time_shares_classify_ops_and_bound_the_speed_up():
    """Amdahl's law on a step's profile: matmuls at 40% bound any matmul speed-up at
    1/(1-0.4) = 1.67x; the finding names the largest other ops. At 60% it says nothing."""
    from mixprec.diagnostics.timeshare import audit_time_shares, classify

    assert [classify(op) for op in ("aten::mm", "aten::addmm", "aten::convolution_backward",
                                    "aten::_scaled_dot_product_flash_attention_for_cpu",
                                    "aten::gelu", "aten::copy_")] == [
        "matmul", "matmul", "matmul", "attention", "other", "other"]
    facts = {"total_ms": 100.0, "shares": {"matmul": 0.4, "attention": 0.25, "other": 0.35},
             "ops": [("aten::mm", 40.0),
                     ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", 25.0),
                     ("aten::gelu", 20.0), ("aten::copy_", 15.0)]}
    (f,) = audit_time_shares(facts, "bf16")
    assert f.code == "time-share" and f.severity == "info"
    assert f.data["bound"] == pytest.approx(1 / 0.6) and "1.67x" in f.title
    assert f.data["bound_with_attention"] == pytest.approx(1 / 0.35) and "2.86x" in f.title
    assert "gelu 20%" in f.evidence and "mm 40%" not in f.evidence
    facts["shares"]["matmul"] = 0.6
    assert audit_time_shares(facts, "bf16") == []


def test_doctor_reports_where_the_step_time_goes():
    report = doctor(tiny_gpt, lambda m, i: m(*_gpt_batch()), "bf16", steps=2,
                    reference_steps=0)
    ts = report.facts["time_shares"]
    assert sum(ts["shares"].values()) == pytest.approx(1.0)
    assert ts["total_ms"] > 0 and any(op == "aten::addmm" or op == "aten::mm"
                                      for op, _ in ts["ops"])
    assert report.ok  # an info finding, if any, is advice, not a problem


def _gpt_batch():
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 64, (4, 33), generator=g)
    return idx[:, :-1], idx[:, 1:]


def test_vanished_updates_in_bf16_weights_and_at_2048_in_fp32():
    """Vanishing updates measured, not assumed: AdamW at lr 1e-4 takes steps of ~1e-4, which
    bf16 weights near 1 (half-ulp up to 2^-9) mostly lose and an fp32 master keeps. And
    weights near 2048 lose SGD steps below 1e-4 even in fp32 (half-ulp 1.2e-4 there)."""
    bf16 = doctor(mlp_factory(), batches(), "bf16,params=bf16", steps=2, lr=1e-4,
                  reference_steps=0)
    f = next(f for f in bf16.findings if f.code == "update-vanish")
    assert f.data["share"] > 0.8 and "bf16-master" in f.advice
    assert all(v["dtype"] == "bfloat16" for v in bf16.facts["vanished_updates"])
    assert bf16.facts["vanished_updates"][0]["name"] == "0.weight"
    master = doctor(mlp_factory(), batches(), "bf16-master", steps=2, lr=1e-4,
                    reference_steps=0)
    assert "update-vanish" not in master.codes()
    assert sum(v["vanished"] for v in master.facts["vanished_updates"]) == 0

    def big():  # first-layer weights near 2048; the LayerNorm cancels the shift
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 4))
        with torch.no_grad():
            m[0].weight.add_(2048.0)
        return m

    fp32 = doctor(big, batches(), "fp32", steps=2, lr=1e-4, optimizer="sgd",
                  reference_steps=0)
    f = next(f for f in fp32.findings if f.code == "update-vanish")
    first = fp32.facts["vanished_updates"][0]
    assert first["name"] == "0.weight" and first["dtype"] == "float32"
    assert first["share"] > 0.99 and "learning rate is too small" in f.advice
    assert all(v["share"] < 0.5 for v in fp32.facts["vanished_updates"][1:])


@pytest.mark.long  # a second CLI doctor run (test_cli_doctor_json_and_plots runs one)
def test_cli_doctor_takes_the_runs_learning_rate(capsys):
    """Whether updates vanish depends on the learning rate, so the CLI takes it."""
    from mixprec.cli import main

    code = main(["doctor", "--recipe", "bf16,params=bf16", "--steps", "2",
                 "--reference-steps", "0", "--lr", "1e-4", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert "update-vanish" in [f["code"] for f in report["findings"]]
    with pytest.raises(ValueError, match="valid are 'adamw'"):
        doctor(mlp_factory(), batches(), "bf16", steps=1, optimizer="adam")


def test_profiling_leaves_no_profiler_lines_in_the_users_terminal():
    """torch's profiler (kineto) writes ``USDT: ... profiler_start/stop`` to stderr from
    C++ at every start and stop; the doctor's time-share check runs it, and `mixprec
    compare` printed ten such lines. They are held back; the user's own stderr is not."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from mixprec.diagnostics.timeshare import time_shares\n"
            "def step():\n"
            "    torch.randn(8, 8) @ torch.randn(8, 8)\n"
            "    print('the user says', file=sys.stderr)\n"
            "time_shares(step, 1)\n")
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stderr
    assert "the user says" in err and "USDT" not in err and "profiler_st" not in err


@pytest.mark.parametrize("gemm", ["dequant", "dequant_fp32"])
def test_fp8_gemms_count_as_fp8_whatever_the_route(gemm):
    """The dequant routes multiply exact fp32 or bf16 upcasts of the fp8 operands; the
    coverage check counts those GEMMs as fp8 (dequant_fp32, auto's choice on an AVX2 CPU,
    read as '0% of matmul FLOPs in low precision' before)."""
    from mixprec import MixedPrecision
    from mixprec.diagnostics.audit import matmul_coverage

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.Linear(64, 4))
    engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            f"fp8,fp8_gemm={gemm}")

    def run():
        with engine.autocast():
            model(torch.randn(32, 64)).float().sum().backward()

    cov = matmul_coverage(run)
    assert cov.get("float8_e4m3fn", 0) + cov.get("float8_e5m2", 0) > 0.8, cov
