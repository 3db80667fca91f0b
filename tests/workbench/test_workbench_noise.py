"""Timed figures held to their rounds' agreement (a fake clock stands in for a busy
machine); `mixprec compare` shows where it is in any output and keeps what finished
on Ctrl-C."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import mixprec.diagnostics.timeshare as timeshare
import mixprec.workbench.bench as bench_mod
import mixprec.workbench.compare as compare_mod
import mixprec.workbench.train as train_mod
from mixprec.cli import main
from mixprec.diagnostics import doctor
from mixprec.diagnostics.noise import NOISY_SPREAD, agreement, spread

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class FakeClock:
    """A ``perf_counter`` that moves on by ``seconds(n)`` at its n-th call: an interval
    timed as ``t = clock(); ...; clock() - t`` reads ``seconds`` of its closing call."""

    def __init__(self, seconds) -> None:
        self.seconds, self.calls, self.t = seconds, 0, 0.0

    def __call__(self) -> float:
        self.t += self.seconds(self.calls)
        self.calls += 1
        return self.t


def test_the_spread_is_the_interquartile_range_over_the_median():
    # statistics' inclusive quartiles of 1..5 are 2 and 4: IQR 2 over median 3
    assert spread([5.0, 1.0, 3.0, 2.0, 4.0]) == pytest.approx(2 / 3)
    assert spread([7.0]) == 0.0
    a = agreement("fp32's per-step tokens/s", [1210.0, 62806.0, 30000.0, 1300.0], "")
    assert a.noisy and "ranged 1,210 to 62,806" in str(a) and "the rounds disagree" in str(a)
    assert not agreement("x", [1.0, 1.1, 1.05, 0.95]).noisy
    assert NOISY_SPREAD == 0.25


def test_compare_gives_speed_advice_only_from_steps_that_agree(tmp_path, monkeypatch):
    """fp32, bf16 and bf16-master, 5 tiny steps each and the doctor on each, under a
    fake step clock (a step opens and closes with one call each: calls 0-9 time fp32's
    steps, 10-19 bf16's, 20-29 bf16-master's). fp32 steady at 1 ms and bf16 at 3 ms:
    the speed-up and the step-slow advice stand. bf16-master's steps alternate 1 ms and
    50 ms (as on a busy host, where a recipe's tokens/s ranged 1,210 to 62,806): no
    speed-up, no advice, and the report says the timings disagree and by how much."""
    def seconds(n):
        return 0.001 if n < 10 else 0.003 if n < 20 else (0.001 if (n // 2) % 2 else 0.05)
    monkeypatch.setattr(train_mod, "perf_counter", FakeClock(seconds))
    rep = compare_mod.compare(["fp32", "bf16", "bf16-master"], steps=5, size="tiny",
                              batch=2, seq=16, out=tmp_path, progress=False, doctor_steps=1)
    rows = {r["recipe"]: r for r in rep["summary"]}
    assert not rows["fp32"]["timing"]["noisy"] and not rows["bf16"]["timing"]["noisy"]
    assert rows["bf16"]["speedup_vs_fp32"] == pytest.approx(1 / 3)
    f = next(f for f in rows["bf16"]["findings"] if f["code"] == "step-slow")
    assert "3.0x the fp32 step" in f["title"] and "train in fp32" in f["advice"]

    noisy = rows["bf16-master"]
    assert noisy["timing"]["noisy"] and noisy["speedup_vs_fp32"] is None
    assert "step-slow" not in [f["code"] for f in noisy["findings"]]
    # compare's own (the doctor's time share may say the same of its profiled steps)
    (f,) = [f for f in noisy["findings"]
            if f["code"] == "timing-noisy" and "step timings" in f["title"]]
    # tokens per step 2 x 16 = 32: 32 / 0.05 = 640 and 32 / 0.001 = 32,000 tokens/s
    assert "bf16-master's per-step tokens/s ranged 640 to 32,000" in f["evidence"]
    assert "train in fp32" not in f["advice"]
    assert rep["timing_noise"] == [f["evidence"]]
    page = (tmp_path / "report.html").read_text()
    assert "Timings disagree" in page and "<td>noisy</td>" in page


def test_a_noisy_fp32_baseline_gives_no_advice_on_any_recipe(tmp_path, monkeypatch):
    """The baseline's own steps disagree (fp32's alternate 1 ms and 50 ms; bf16's are
    a steady 30 ms, as in the report that read bf16 at 0.03x fp32): no step-slow."""
    monkeypatch.setattr(train_mod, "perf_counter", FakeClock(
        lambda n: (0.001 if (n // 2) % 2 else 0.05) if n < 10 else 0.03))
    cfg = dict(steps=5, size="tiny", batch=2, seq=16, corpus_bytes=300_000)
    results = {r: train_mod.train(train_mod.TrainConfig(recipe=r, **cfg), progress=False)
               for r in ("fp32", "bf16")}
    (f,) = compare_mod.slow_step_findings("bf16", results, {})
    assert f.code == "timing-noisy" and "fp32's per-step tokens/s ranged 640" in f.evidence
    steady = {r: _result(r, [32 / 0.001] * 4 if r == "fp32" else [32 / 0.03] * 4)
              for r in ("fp32", "bf16")}
    (f,) = compare_mod.slow_step_findings("bf16", steady, {})
    assert f.code == "step-slow" and "train in fp32" in f.advice


def _result(recipe, tokens_per_s):
    return train_mod.TrainResult(train_mod.TrainConfig(recipe=recipe),
                                 steps=[{"tokens_per_s": t} for t in tokens_per_s])


def _small_workload(model, size, batch, seq, dev):
    """bench's workload shrunk to one 16-wide Linear: the timer is under test here."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 16))
    return build, lambda m: m(x).float().pow(2).mean(), 8, 6 * 272 * 8, 8


@pytest.mark.parametrize("noisy", [True, False])
def test_bench_gives_no_speed_up_from_steps_that_disagree(monkeypatch, noisy):
    """A phase of 1 warm-up step (one clock call: its time is not kept) and 6 timed
    steps (two calls each) of the engine and its hand-written twin, in turns: fp32's
    phase is calls 0-25, bf16's (at 3x fp32's step) the rest. Noisy: fp32's steps
    read 1 ms and 50 ms in pairs."""
    def seconds(n):
        if n >= 26:
            return 0.03
        return (0.001 if (n // 8) % 2 else 0.05) if noisy else 0.01
    monkeypatch.setattr(bench_mod, "_workload", _small_workload)
    monkeypatch.setattr(bench_mod, "perf_counter", FakeClock(seconds))
    out = bench_mod.bench(["fp32", "bf16"], steps=6, warmup=1)
    rows = {r["recipe"]: r for r in out["rows"]}
    table = bench_mod.format_table(out)
    if noisy:
        assert rows["fp32"]["timing"]["noisy"] and rows["bf16"]["speedup_vs_fp32"] is None
        assert "timings disagree: fp32's step time ranged 1 to 50 ms" in table
        assert table.splitlines()[3].split()[3] == "noisy"  # bf16's vs fp32 column
    else:
        assert rows["bf16"]["speedup_vs_fp32"] == pytest.approx(1 / 3)
        assert "timings disagree" not in table and out["timing_noise"] == []


def _rounds(monkeypatch, totals):
    """Profiled rounds of 40% matmul, 60% gelu, totalling ``totals`` ms."""
    it = iter(totals)

    def fake(step):
        t = next(it)
        return {"aten::mm": 0.4 * t, "aten::gelu": 0.6 * t}
    monkeypatch.setattr(timeshare, "_profile", fake)


def test_the_doctors_time_share_draws_no_bound_from_rounds_that_disagree(monkeypatch):
    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    _rounds(monkeypatch, [10.0, 80.0, 12.0])
    rep = doctor(mlp, lambda m, i: m(x).pow(2).mean(), "bf16", steps=1, reference_steps=0)
    f = next(f for f in rep.findings if f.code == "timing-noisy")
    assert "ranged 10 to 80 ms" in f.evidence and "time-share" not in rep.codes()
    assert rep.facts["time_shares"]["noisy"]
    _rounds(monkeypatch, [10.0, 11.0, 10.5])
    rep = doctor(mlp, lambda m, i: m(x).pow(2).mean(), "bf16", steps=1, reference_steps=0)
    f = next(f for f in rep.findings if f.code == "time-share")
    assert f.data["bound"] == pytest.approx(1 / 0.6) and "timing-noisy" not in rep.codes()


def test_compare_prints_progress_lines_when_piped(tmp_path, capsys):
    compare_mod.compare(["fp32", "bf16"], steps=4, size="tiny", batch=2, seq=16,
                        out=tmp_path, doctor_steps=0)
    err = capsys.readouterr().err.splitlines()
    assert "compare: training fp32 (1 of 2), 4 steps" in err
    assert "compare: training bf16 (2 of 2), 4 steps" in err
    steps = [line for line in err if line.startswith("bf16: step ")]
    assert [s.split()[2] for s in steps] == ["1/4", "2/4", "3/4", "4/4"]
    assert "tok/s" in steps[-1] and any(line.startswith("compare: fp32 done in")
                                        for line in err)


def test_ctrl_c_keeps_the_finished_recipes_and_exits_130(tmp_path, monkeypatch, capsys):
    real = compare_mod.train

    def train(cfg, *a, **k):  # Ctrl-C arrives in bf16's run
        if cfg.recipe == "bf16":
            raise KeyboardInterrupt
        return real(cfg, *a, **k)
    monkeypatch.setattr(compare_mod, "train", train)
    code = main(["compare", "--recipes", "fp32,bf16,fp16", "--size", "tiny", "--steps",
                 "3", "--batch", "2", "--seq", "16", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 130
    report = json.loads((tmp_path / "report.json").read_text())
    assert [r["recipe"] for r in report["summary"]] == ["fp32"]
    assert report["interrupted"] == "bf16's training"
    assert "Interrupted during bf16&#x27;s training" in (tmp_path / "report.html").read_text()
    (line,) = [x for x in err.splitlines() if "interrupted" in x]
    assert line.startswith("mixprec compare: interrupted during bf16's training")
    assert "Traceback" not in err and out.splitlines()[1].startswith("fp32")


def test_ctrl_c_ends_train_with_one_line_and_130(tmp_path, monkeypatch, capsys):
    def train(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(train_mod, "train", train)
    code = main(["train", "--size", "tiny", "--steps", "2", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 130 and "Traceback" not in err
    assert err.strip() == (f"mixprec train: interrupted; the last checkpoint in {tmp_path} "
                           "(written every 50 steps) continues with --resume")
