"""The doctor on training dynamics: a diverging loss and oversized updates are named as
the learning rate's doing, with the run's numbers; an overflow the dynamics caused is
told from one the format's range caused; a healthy run raises nothing."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from helpers.doctor_models import Scale, batches, mlp_factory
from mixprec.diagnostics import doctor
from mixprec.diagnostics.dynamics import (
    DIVERGE_FACTOR,
    WeightWatch,
    audit_dynamics,
    divergence,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _read(losses, ratios=None, lr=10.0):
    n = len(losses)
    ratios = ratios if ratios is not None else [1e-3] * n
    return divergence(losses, ratios, [1.0] * n, 1.0, [1.0] * n, lr)


def test_the_trajectory_decides_divergence():
    """The loss seen on a user's MLP at lr 10 (2.3 → 2.8e6 → 4.4e7) diverged; a falling
    loss, a one-step spike the run recovers from, and growth under the factor did not."""
    (f,) = audit_dynamics(_read([2.3, 2.8e6, 4.4e7]))
    assert f.code == "loss-diverging" and f.severity == "error"
    assert "lr 10" in f.title and "learning rate" in f.advice and "warm" in f.advice
    assert "clip" in f.advice and "2.3 (step 0)" in f.evidence and "4.4e+07" in f.evidence
    assert f.data["loss_growth"] == pytest.approx(4.4e7 / 2.3)
    assert audit_dynamics(_read([2.3, 2.1, 1.9, 1.8])) == []
    assert audit_dynamics(_read([2.3, 2.3 * DIVERGE_FACTOR * 2, 2.0])) == []  # recovered
    assert audit_dynamics(_read([2.3, 2.3 * (DIVERGE_FACTOR - 1)])) == []
    nan = _read([2.3, 5e30, math.nan])
    assert nan.diverged and nan.first_nonfinite == 2
    (f,) = audit_dynamics(nan)
    assert "then inf/NaN" in f.title and "NaN (step 2)" in f.evidence


def test_updates_far_above_the_usual_are_flagged_while_the_loss_holds():
    (f,) = audit_dynamics(_read([2.3, 2.2, 2.25], ratios=[0.5, 0.4, 0.45], lr=0.3))
    assert f.code == "update-ratio" and f.severity == "warning"
    assert f.data["update_ratio"] == pytest.approx(0.45)
    # the suggestion scales the first step's ratio (0.5) to 1e-2: lr 0.3 * 0.02
    assert "about lr 0.006" in f.advice
    assert audit_dynamics(_read([2.3, 2.2, 2.25], ratios=[0.01, None, 0.02])) == []


def test_the_watch_reads_an_sgd_step_as_lr_times_the_gradient():
    """SGD moves w by lr * g: the ratio is lr * ||g|| / ||w||, computed here by hand; a
    skipped step reads None."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 4)
    opt = torch.optim.SGD(lin.parameters(), lr=0.5)
    lin(torch.randn(16, 8)).pow(2).mean().backward()
    params = list(lin.parameters())
    w = torch.cat([p.detach().flatten() for p in params]).double()
    g = torch.cat([p.grad.flatten() for p in params]).double()
    watch = WeightWatch(params)
    watch.before()
    opt.step()
    watch.after(skipped=False)
    watch.before()
    watch.after(skipped=True)
    assert watch.ratios[0] == pytest.approx(float(0.5 * g.norm() / w.norm()), rel=1e-5)
    assert watch.norms[0] == pytest.approx(float(w.norm()), rel=1e-6)
    assert watch.ratios[1] is None


@pytest.mark.parametrize("lr", [10.0, 1e4])
def test_a_diverging_run_on_the_users_own_model_names_the_learning_rate(lr):
    report = doctor(mlp_factory(), batches(), "bf16-master", steps=10, lr=lr,
                    reference_steps=0)
    assert not report.ok
    f = next(f for f in report.findings if f.code == "loss-diverging")
    assert f.severity == "error" and f"lr {lr:g}" in f.title
    assert f.data["loss_growth"] > 1e3 and f.data["update_ratio"] > 0.1
    losses = report.facts["losses"]
    assert max(abs(v) for v in losses if math.isfinite(v)) > 1e3 * losses[0]
    # no advice points at the data or the format when the dynamics overflowed
    for g in report.findings:
        if g.code in ("nonfinite", "nonfinite-origin"):
            assert g.data["cause"] == "dynamics" and "learning rate" in g.advice
            assert "log(0)" not in g.advice and "use bf16" not in g.advice


@pytest.mark.parametrize("lr", [pytest.param("10", marks=pytest.mark.long), "1e4"])
def test_a_diverging_workbench_run_names_the_learning_rate(lr, capsys):
    from mixprec.cli import main

    code = main(["doctor", "--recipe", "bf16-master", "--lr", lr, "--steps", "6",
                 "--reference-steps", "0", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"]
    (f,) = [f for f in report["findings"] if f["code"] == "loss-diverging"]
    assert f"lr {float(lr):g}" in f["title"] and "learning rate" in f["advice"]
    assert code == 1  # an error


def test_a_healthy_run_raises_no_dynamics_finding():
    report = doctor(mlp_factory(), batches(), "bf16-master", steps=10, lr=1e-3,
                    reference_steps=0)
    assert report.ok, str(report)
    ratios = [r for r in report.facts["update_ratios"] if r is not None]
    assert len(ratios) == 10 and max(ratios) < 0.1


def test_an_fp16_overflow_at_a_modest_loss_is_the_formats_range():
    """A layer that multiplies by 1e5 overflows fp16 on the first step, whatever the
    learning rate: the range is the cause, and the advice is the format's."""
    report = doctor(mlp_factory(Scale(1e5)), batches(), "fp16,emulate=false", steps=3,
                    reference_steps=0)
    f = next(f for f in report.findings if f.code == "nonfinite-origin")
    assert f.data["cause"] == "range" and "format's range" in f.advice
    assert "learning rate" not in f.advice
    assert "loss-diverging" not in report.codes()
