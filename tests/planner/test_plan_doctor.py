"""The doctor given a plan: it trains under the plan's recipe and holds each fp8/fp4
Linear's SQNR, measured as the planner measures it, to the plan's floor."""

from __future__ import annotations

import dataclasses

import pytest

from helpers.plan_timing import FORMATS, TINY, fixed_timing_ctx
from mixprec.cli import main
from mixprec.diagnostics import doctor
from mixprec.planner.check import audit_plan, plan_sqnr
from mixprec.workbench.planning import plan_workbench, workbench_batches, workbench_model

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def planned():
    """A plan of the tiny GPT with fp8 layers (fixed timing), and its batches."""
    with fixed_timing_ctx():
        p = plan_workbench(**TINY, formats=FORMATS, calibration=2)
    assert any(r.choice != "bf16" for r in p.rows)
    return p, workbench_batches(4, size="tiny", batch=4)


def _target(batches):
    def batch_fn(model, step):
        return model(*batches[step % len(batches)])
    return (lambda: workbench_model("tiny")), batch_fn


def test_the_check_measures_as_the_planner_does(planned):
    """At the planner's own weights and calibration batches, the check finds the SQNR
    the plan's table holds for each fp8 layer."""
    p, batches = planned
    checks = plan_sqnr(p, workbench_model("tiny"), lambda m, b: m(*b), batches[:2])
    fp8 = {r.layer: r for r in p.rows if r.choice != "bf16"}
    assert {c.layer for c in checks} == set(fp8)
    for c in checks:
        assert c.fmt == fp8[c.layer].choice and c.floor == p.min_sqnr
        assert c.sqnr == pytest.approx(fp8[c.layer].sqnr, abs=0.01), c
        assert not c.below


@pytest.mark.parametrize("as_file", [False, True])
def test_the_doctor_flags_each_planned_layer_below_the_floor(planned, tmp_path, as_file):
    p, batches = planned
    strict = dataclasses.replace(p, min_sqnr=200.0)  # no fp8 cast reaches 200 dB
    arg = strict
    if as_file:
        strict.save(tmp_path / "strict.json")
        arg = str(tmp_path / "strict.json")
    factory, batch_fn = _target(batches)
    rep = doctor(factory, batch_fn, arg, steps=2, reference_steps=0)
    assert rep.recipe == str(p.recipe)
    found = [f for f in rep.findings if f.code == "plan-floor"]
    fp8 = sorted(r.layer for r in p.rows if r.choice != "bf16")
    assert sorted(f.data["layer"] for f in found) == fp8
    for f in found:
        layer = f.data["layer"]
        assert f.severity == "warning" and layer in f.title and "200 dB" in f.title
        assert f"{f.data['sqnr']:.1f} dB" in f.title and f.data["sqnr"] < 200
        assert f"layer:{layer}=bf16" in f.advice and "re-plan" in f.advice
    measured = {c["layer"]: c for c in rep.facts["plan_sqnr"]}
    assert sorted(measured) == fp8 and all(c["below"] for c in measured.values())


def test_the_doctor_is_quiet_when_the_floor_holds(planned):
    p, batches = planned
    lax = dataclasses.replace(p, min_sqnr=0.0)
    factory, batch_fn = _target(batches)
    rep = doctor(factory, batch_fn, lax, steps=2, reference_steps=0)
    assert "plan-floor" not in rep.codes()
    checks = rep.facts["plan_sqnr"]
    assert checks and all(10 < c["sqnr"] < 200 and not c["below"] for c in checks)


def test_audit_of_a_plan_for_another_model_names_the_layers(planned):
    import torch

    p, _ = planned
    other = torch.nn.Sequential(torch.nn.Linear(16, 16))
    with pytest.raises(ValueError, match="blocks.0.qkv"):
        audit_plan(p, other, lambda m, b: m(b).sum(), [torch.ones(2, 16)])


def test_doctor_command_takes_a_plan_file(planned, tmp_path, capsys):
    p, _ = planned
    dataclasses.replace(p, min_sqnr=200.0).save(tmp_path / "strict.json")
    main(["doctor", "--recipe", str(tmp_path / "strict.json"), "--steps", "2",
          "--reference-steps", "0", "--json"])
    out = capsys.readouterr().out
    assert '"plan-floor"' in out and "200 dB" in out
