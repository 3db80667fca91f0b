"""A plan reads right: its predicted step is the measured 16-bit step plus the terms its
table shows, its columns never run together and each is explained, and a plan that
leaves a model mostly in 16 bits says so, with the share of the matmul FLOPs and why."""

from __future__ import annotations

import re

import pytest
import torch

import mixprec
from helpers.paths import ROOT
from helpers.plan_timing import fixed_timing_ctx
from mixprec.cli import main
from mixprec.planner import plan_from
from mixprec.planner.choose import STATE_ORDER, Baselines, Config, Layer, Option, StateUnit
from mixprec.planner.planning import Plan, PlanRow
from mixprec.planner.survey import Survey
from mixprec.planner.table import COLUMNS
from mixprec.planner.timing import BF16, recipe_for_format
from mixprec.recipe import LINEAR_PRESETS, Recipe
from mixprec.recipe.presets import SHELL_PRESET

GUIDE = ROOT / "docs" / "guides" / "plan.md"
FP8 = LINEAR_PRESETS[0]
TOKENS = 2048
#: a medium GPT's Linears (in, out): one 256x256 moves to fp8 at 1.03x, the rest stay
SHAPES = {"blocks.0.qkv": (256, 768), "blocks.0.proj": (256, 256),
          "blocks.0.fc": (256, 1024), "blocks.0.out": (1024, 256), "head": (256, 256)}


def _survey(step_16=0.894, step_shell=0.619, scale=0.5) -> Survey:
    """Measurements as numbers: each Linear 1 ms in bf16 (``blocks.0.proj``: 1.03x
    faster in fp8, the others 2x slower), whole steps and a time scale given."""
    layers = {}
    for n, shape in SHAPES.items():
        fp8_s = 1e-3 / 1.03 if n == "blocks.0.proj" else 2e-3
        layers[n] = Layer(n, shape, {BF16: Option(BF16, 1e-3, 1e5),
                                     FP8: Option(FP8, fp8_s, 5e4, 30.0)})
    units = {n: StateUnit(n, (tuple(s[::-1]),)) for n, s in SHAPES.items()}
    base = Baselines(step_16, 1e8, step_shell, 1e8,
                     {"fused": 1e-9, "fp32": 2e-9, "bf16": 2e-9, "int8": 3e-9},
                     time_scale={FP8: scale})
    b = Recipe.parse("bf16-master")
    flops = {n: 2.0 * TOKENS * i * o for n, (i, o) in SHAPES.items()}
    return Survey(b, recipe_for_format(b, SHELL_PRESET), list(SHAPES), layers, units,
                  base, {}, 20.0, {n: n for n in SHAPES}, [], [], flops)


def _one_layer_plan(states: str = "fp32") -> Plan:
    cfg = Config({n: (FP8 if n == "blocks.0.proj" else BF16) for n in SHAPES},
                 {n: states for n in SHAPES})
    cfg.reasons.update({n: "bf16: fastest; its casts cost more than its GEMM saves"
                        for n in SHAPES if n != "blocks.0.proj"})
    return plan_from(_survey(), cfg)


@pytest.mark.parametrize("states", ["fp32", "int8"])
def test_the_predicted_step_is_the_measured_step_plus_the_terms_the_table_shows(states):
    p = _one_layer_plan(states)
    rows = {r.layer: r for r in p.rows}
    # by hand: the fp8 Linear saves (1 - 1/1.03) ms alone, scaled by the whole step's
    # 0.5; the fp8 recipe around the Linears measured 275 ms under the 16-bit step
    saving = 0.5 * (1e-3 / 1.03 - 1e-3)
    assert rows["blocks.0.proj"].delta_s == pytest.approx(saving, rel=1e-12)
    assert all(r.delta_s == 0.0 for r in p.rows if r.choice == BF16)
    assert p.step_terms["base"] == 0.894
    assert p.step_terms["shell"] == pytest.approx(0.619 - 0.894, rel=1e-12)
    numel = sum(i * o for i, o in SHAPES.values())
    # AdamW's states in int8: (3 - 1) ns per element over torch's fused fp32 AdamW
    states_s = 0.0 if states == "fp32" else 2e-9 * numel
    assert p.step_terms["states"] == pytest.approx(states_s, rel=1e-9)
    assert p.predicted_step_s == pytest.approx(
        0.894 + (0.619 - 0.894) + saving + states_s, rel=1e-12)
    assert p.predicted_step_s == pytest.approx(
        sum(p.step_terms.values()) + sum(r.delta_s for r in p.rows), rel=1e-12)
    # the summary line says the same sum, in the ms it prints
    line = next(x for x in p.table().splitlines() if x.startswith("predicted step"))
    nums = [float(a.replace(" ", "")) for a in re.findall(r"[-+]? ?\d+\.\d+(?= ms)", line)]
    total, terms = nums[0], nums[1:]
    assert len(terms) == 4 and total == pytest.approx(sum(terms), abs=0.25)
    # and the rows' step ms column adds up to the Linears' term
    assert terms[2] == pytest.approx(sum(r.delta_s for r in p.rows) * 1e3, abs=0.05)


def test_the_columns_never_run_together_for_the_longest_format_names():
    longest = max(LINEAR_PRESETS, key=len)
    rows = tuple(PlanRow(f"blocks.{i}.fc", (4096, 16384), f, s, 1.5, 21.0, 3e6, "why")
                 for i, (f, s) in enumerate([(longest, STATE_ORDER[0]),
                                             *zip(LINEAR_PRESETS, STATE_ORDER * 4)]))
    p = Plan(Recipe.parse("bf16-master"), rows, "fastest", 20.0, 1.0, 1e6,
             {"16-bit": {"step_s": 1.0, "peak": 1e6}}, "cpu")
    lines = p.table().splitlines()
    head = lines[0]
    assert re.split(r"\s{2,}", head) == list(COLUMNS)
    for line, r in zip(lines[1:], rows):
        cells = re.split(r"\s{2,}", line)
        assert cells[:4] == [r.layer, "4096x16384", r.choice, r.states], line
        # each column starts where its header does: the cells line up
        assert line.index(f"  {r.choice} ") + 2 == head.index("choice")


def test_every_column_is_explained_in_help_and_in_the_guide(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    guide = " ".join(GUIDE.read_text().split())
    for name, what in COLUMNS.items():
        assert f"{name} {what}" in out, name
        assert f"| `{name}` | {what} |" in guide, name


def test_a_plan_mostly_in_16_bits_says_so_with_the_share_of_flops_and_why():
    p = _one_layer_plan()
    # by hand: 2 * tokens * in * out per Linear; only blocks.0.proj is below 16 bits
    flops = {n: 2 * TOKENS * i * o for n, (i, o) in SHAPES.items()}
    share = flops["blocks.0.proj"] / sum(flops.values())
    assert p.low_precision_share == pytest.approx(share, rel=1e-12)
    line = next(x for x in p.table().splitlines() if x.startswith("coverage:"))
    assert line.startswith(f"coverage: {share:.0%} of the matmul FLOPs below 16 bits "
                           "(1 of 5 planned layers); the plan leaves the model mostly "
                           "in 16 bits")
    assert "100% slower in fp8/fp4 than in bf16 on this device" in line
    assert p.kept_flops == {"slower in fp8/fp4 than in bf16 on this device":
                            pytest.approx(sum(flops.values()) - flops["blocks.0.proj"])}


def test_the_flops_a_plan_counts_are_the_models_own():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, 4))
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    with fixed_timing_ctx():
        p = mixprec.plan(model, (x, y), formats=("bf16", FP8), min_sqnr=0.0,
                         max_loss=None)
    low = sum(2 * 64 * r.shape[0] * r.shape[1] for r in p.rows if r.choice != BF16)
    assert p.low_precision_share == pytest.approx(low / (2 * 64 * (16 * 32 + 32 * 4)))
