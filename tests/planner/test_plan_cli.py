"""``mixprec plan`` and plans in ``mixprec compare``: the JSON it writes loads and its
recipe is the printed one; a plan file and the ``plan`` entry train under their recipe
and the report shows their tables."""

from __future__ import annotations

import argparse
import json

import pytest

from helpers.plan_timing import FORMATS, TINY, fixed_timing, fixed_timing_ctx
from mixprec.cli import main
from mixprec.cli.plan import parse_share
from mixprec.planner import Plan
from mixprec.planner.numerics import linear_names
from mixprec.recipe import Recipe
from mixprec.workbench.planning import plan_workbench, workbench_model

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    """A plan of the tiny GPT (fixed timing: the fp8 layers that pass the floor are
    chosen), saved as ``mine.json``."""
    with fixed_timing_ctx():
        p = plan_workbench(**TINY, formats=FORMATS)
    path = tmp_path_factory.mktemp("plan") / "mine.json"
    p.save(path)
    return path


@pytest.mark.parametrize("text, share", [("1%", 0.01), ("+1%", 0.01), ("0.01", 0.01),
                                         ("2.5%", 0.025), ("0", 0.0), ("none", None)])
def test_max_loss_takes_a_percentage_or_a_share(text, share):
    assert parse_share(text) == pytest.approx(share) if share is not None else \
        parse_share(text) is None


@pytest.mark.parametrize("bad", ["-1%", "lots", "%"])
def test_a_bad_max_loss_names_the_value_and_the_valid_forms(bad):
    with pytest.raises(argparse.ArgumentTypeError, match="1%, \\+1% or 0.01"):
        parse_share(bad)


def test_plan_writes_a_loadable_plan_whose_recipe_is_the_printed_one(tmp_path, capsys,
                                                                     monkeypatch):
    fixed_timing(monkeypatch)
    out = tmp_path / "p.json"
    assert main(["plan", "--size", "tiny", "--batch", "4", "--formats", ",".join(FORMATS),
                 "--max-loss", "+5%", "--min-sqnr", "15", "--calibration", "2",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    p = Plan.load(out)
    line = next(x for x in printed.splitlines() if x.startswith("recipe: "))
    assert Recipe.parse(line.removeprefix("recipe: ")) == p.recipe
    assert str(p.recipe) == line.removeprefix("recipe: ")
    assert p.max_loss == pytest.approx(0.05) and p.min_sqnr == 15.0
    assert [r.layer for r in p.rows] == linear_names(workbench_model("tiny"))
    assert {r.choice for r in p.rows} <= set(FORMATS)
    for r in p.rows:  # the table is printed, one Linear a line
        assert any(x.startswith(r.layer) and r.choice in x for x in printed.splitlines())
    # at twice bf16's speed, the layers above the floor run in fp8 and the recipe says so
    fp8 = [r for r in p.rows if r.choice != "bf16"]
    assert fp8 and all(r.sqnr >= 15.0 for r in fp8)
    assert p.recipe.compute == "fp8" and p.recipe.layers
    for r in p.rows:
        assert p.recipe.for_layer(r.layer).compute == ("bf16" if r.choice == "bf16"
                                                       else "fp8"), r


def test_plan_json_bounds_a_dequantizing_route_and_reports_noisy_timings(tmp_path, capsys,
                                                                         monkeypatch):
    import mixprec.planner.survey as survey_mod
    from mixprec.planner.timing import LayerCost

    fixed_timing(monkeypatch)

    def noisy(shapes, formats, recipe, device, *, seconds=0.25, cache_file=None):
        # bf16's timings caught stalls: every fp8 format 12x "faster" on the dequant
        # route, whose GEMM is bf16's own
        return {(s, f): LayerCost(1e-3 if f == "bf16" else 1e-3 / 12, 1000,
                                  "native" if f == "bf16" else "dequant")
                for s in shapes for f in formats}
    monkeypatch.setattr(survey_mod, "layer_costs", noisy)
    out = tmp_path / "p.json"
    assert main(["plan", "--size", "tiny", "--batch", "4", "--formats", ",".join(FORMATS),
                 "--max-loss", "none", "--min-sqnr", "15", "--calibration", "1",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["predicted_step_s"] > 0
    assert max(r["speedup"] for r in saved["rows"]) <= 1.0  # not 12x
    assert saved["recipe"] == "bf16-master"
    noise = saved["timing_noise"]
    assert noise and all("timed 12.00x bf16's speed; its dequant GEMM can give at most "
                         "1.00x (1 measurement)" in n for n in noise)
    assert Plan.load(out).timing_noise == tuple(noise)
    assert "timings noisy: " + "; ".join(noise) in printed.splitlines()


def test_plan_with_a_bad_format_is_a_clear_error(tmp_path, capsys):
    assert main(["plan", "--size", "tiny", "--formats", "bf16,fp7",
                 "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert "fp7" in err and "mxfp8" in err  # the bad value and the valid ones
    assert not (tmp_path / "p.json").exists()


def test_compare_trains_a_plan_file_and_a_plan_made_now(tmp_path, plan_file, capsys,
                                                         monkeypatch):
    fixed_timing(monkeypatch)
    out = tmp_path / "c"
    # ',' splits: a path, the literal entry 'plan' and a preset
    assert main(["compare", "--recipes", f"{plan_file},plan,bf16", "--size", "tiny",
                 "--batch", "4", "--steps", "3", "--no-progress", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    rep = json.loads((out / "report.json").read_text())
    rows = {r["recipe"]: r for r in rep["summary"]}
    assert list(rows) == ["mine", "plan", "bf16"]
    saved = Plan.load(plan_file)
    assert rows["mine"]["recipe_string"] == str(saved.recipe)
    assert rows["mine"]["plan"]["rows"] == json.loads(plan_file.read_text())["rows"]
    assert Recipe.parse(rows["plan"]["recipe_string"]) == Recipe.parse(
        rows["plan"]["plan"]["recipe"])
    assert "plan" not in rows["bf16"] and rows["bf16"]["recipe_string"] == "bf16"
    for label in ("mine", "plan"):
        assert rows[label]["final_val_loss"] > 0 and "mine" in printed
        # each trained under its own recipe: its run folder's config says so
        cfg = json.loads((out / label / "config.json").read_text())
        assert cfg["recipe"] == rows[label]["recipe_string"]
    page = (out / "report.html").read_text()
    plans = page[page.index("id='plans'"):page.index("Doctor's findings")]
    for r in saved.rows:
        assert f"<td>{r.layer}</td>" in plans
    assert plans.count("<table class='plan'>") == 2


def test_compare_refuses_a_plan_made_for_another_size(tmp_path, plan_file, capsys):
    assert main(["compare", "--recipes", f"{plan_file},bf16", "--size", "small",
                 "--steps", "2", "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert "another model" in err and "mixprec plan --size small" in err
    assert not (tmp_path / "c").exists()  # refused before any training


def test_compare_names_a_missing_plan_file(tmp_path, capsys):
    assert main(["compare", "--recipes", "nowhere.json,bf16", "--size", "tiny",
                 "--out", str(tmp_path / "c")]) == 2
    assert "'nowhere.json' does not exist" in capsys.readouterr().err
