"""mixprec.recipe.schedule: the pure description of recipes by step."""

from __future__ import annotations

import dataclasses

import pytest

from mixprec import PrecisionSchedule, Recipe


def test_phases_by_step_and_by_fraction_give_the_same_steps():
    by_step = PrecisionSchedule([(0, "nvfp4"), (800, "bf16-master")])
    by_share = PrecisionSchedule([(0, "nvfp4"), (0.8, "bf16-master")], total_steps=1000)
    assert by_step.starts() == by_share.starts() == (0, 800)
    for s in (by_step, by_share):
        assert [s.phase_at(n) for n in (0, 799, 800, 5000)] == [0, 0, 1, 1]
        assert s.recipe_at(799) == Recipe.parse("nvfp4")
        assert s.recipe_at(800) == Recipe.parse("bf16-master")


def test_the_string_form_round_trips_and_reads_steps_and_fractions():
    s = PrecisionSchedule.parse("nvfp4>bf16-master@0.8")
    assert s.phases[1][0] == 0.8 and isinstance(s.phases[1][0], float)
    assert str(s) == "nvfp4>bf16-master@0.8"
    assert PrecisionSchedule.parse(str(s)) == s
    warm = PrecisionSchedule.parse("bf16-master@0>fp8,margin=1@100")
    assert warm.starts() == (0, 100) and warm.recipes[1].linear.margin == 1
    assert str(warm) == "bf16-master>fp8,margin=1@100"


def test_a_fractional_phase_needs_the_runs_length():
    s = PrecisionSchedule.parse("nvfp4>bf16-master@0.8")
    with pytest.raises(ValueError, match="total_steps is not set"):
        s.phase_at(3)
    assert s.with_total_steps(10).starts() == (0, 8)


@pytest.mark.parametrize("phases, match", [
    ([(5, "bf16")], "first phase must start at 0"),
    ([(0, "bf16"), (1.5, "fp8")], r"outside \[0, 1\)"),
    ([(0, "bf16"), (-1, "fp8")], "negative"),
    ([(0, "bf16"), ("10", "fp8")], "not a step"),
    ([(0, "bf16"), (10, "fp8"), (5, "nvfp4")], "must start after"),
    ([(0, 3)], "not a Recipe"),
    ([], "first phase must start at 0"),
])
def test_bad_phases_are_refused_naming_the_value(phases, match):
    with pytest.raises(ValueError, match=match):
        PrecisionSchedule(phases)


def test_fields_are_keyword_only_frozen_and_checked():
    s = PrecisionSchedule([(0, "bf16")])
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.total_steps = 3
    with pytest.raises(TypeError):
        PrecisionSchedule([(0, "bf16")], 10)  # total_steps is keyword-only
    with pytest.raises(ValueError, match="fp8_state='drop'"):
        PrecisionSchedule([(0, "bf16")], fp8_state="drop")
    with pytest.raises(ValueError, match="no @START"):
        PrecisionSchedule.parse("nvfp4>bf16-master")
    # fractions rounding to the same step leave a phase of no step
    with pytest.raises(ValueError, match="must start after"):
        PrecisionSchedule.parse("bf16>fp8@0.5>nvfp4@0.51", total_steps=10)
