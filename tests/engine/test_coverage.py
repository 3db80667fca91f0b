"""The engine's coverage report: the share of the matmul weights in each format, per
module kind, with what stayed in 16 bits and why; a low-precision recipe that leaves
most of them in 16 bits warns once, naming the largest."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

from helpers.paths import ROOT
from mixprec import MixedPrecision
from mixprec.engine.coverage import coverage


class _Wide(nn.Module):
    """An MLP whose output head holds most of the weights (the head stays bf16)."""

    def __init__(self):
        super().__init__()
        self.attn_proj = nn.Linear(32, 32)
        self.fc = nn.Linear(32, 32)
        self.head = nn.Linear(32, 512)

    def forward(self, x):
        return self.head(torch.relu(self.fc(self.attn_proj(x))))


def _engine(model, recipe):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), recipe)
    return engine, [str(w.message) for w in seen if "matmul weights" in str(w.message)]


def test_a_recipe_leaving_most_weights_in_bf16_warns_naming_them():
    engine, said = _engine(_Wide(), "fp8-current")
    assert len(said) == 1
    assert "head (16,384 parameters): output head: the last Linear" in said[0]
    cov = engine.coverage
    assert cov.low_precision_share == pytest.approx(2048 / (2048 + 16384))
    assert cov.shares("head") == {"bf16": 1.0}
    assert cov.shares("attention") == {"fp8-current": 1.0}
    assert cov.shares("linear") == {"fp8-current": 1.0}
    assert str(cov).splitlines()[0] == ("coverage: 89% of 18,432 matmul weight parameters "
                                        "in 16 bits (bf16), 11% below 16 bits (fp8-current)")
    assert "  kept head (16,384): output head: the last Linear" in str(cov).splitlines()


def test_a_recipe_covering_most_weights_is_quiet():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 16))
    engine, said = _engine(model, "mxfp8")
    assert said == []
    assert engine.coverage.low_precision_share == pytest.approx(8192 / (8192 + 1024))


def test_a_16_bit_recipe_reports_without_warning():
    engine, said = _engine(_Wide(), "bf16-master")
    assert said == [] and engine.coverage.low_precision_share == 0
    assert engine.coverage.shares() == {"bf16": 1.0}


def test_a_rule_keeping_a_layer_is_named_with_its_rule():
    cov = coverage(_Wide(), "fp8,layer:fc=bf16", {"fc": "rule layer:fc=bf16"})
    row = next(r for r in cov.rows if r.name == "fc")
    assert (row.format, row.reason) == ("bf16", "rule layer:fc=bf16")


def test_coverage_by_flops_weights_experts_by_their_routed_tokens():
    """A tiny Mixtral (hidden 64, 4 experts, top-2, 2 layers) on 64 tokens whose
    routers send the experts 64, 40, 16 and 8 of them: counted by hand, each Linear
    and router ``2 · 64 · params``, each experts projection ``2 · 128 pairs · its
    params per expert``."""
    pytest.importorskip("transformers")
    from helpers.moe_models import SKEWED_TOKENS as TOKENS
    from helpers.moe_models import skewed_batch as _batch
    from helpers.moe_models import skewed_model as _model
    from helpers.moe_models import skewed_routing as _skew

    model = _model("mixtral")
    _skew(model)
    engine, _ = _engine(model, "fp8-current,layer:*.experts=mxfp8")
    batch = _batch()
    with engine.autocast():
        got = engine.coverage_flops(lambda: model(**batch))
    flops = {r.name: r.params for r in got.rows}
    pairs = 2 * TOKENS
    assert flops["model.layers.0.mlp.experts.gate_up_proj"] == 2 * pairs * 128 * 64
    assert flops["model.layers.1.mlp.experts.down_proj"] == 2 * pairs * 64 * 64
    assert flops["model.layers.0.self_attn.k_proj"] == 2 * TOKENS * 64 * 32
    assert flops["model.layers.1.mlp.gate"] == 2 * TOKENS * 4 * 64
    assert flops["lm_head"] == 2 * TOKENS * 64 * 128
    attention = 2 * 2 * TOKENS * (64 * 64 * 2 + 64 * 32 * 2)
    experts = 2 * 2 * pairs * (128 * 64 + 64 * 64)
    rest = 2 * TOKENS * 64 * 128 + 2 * 2 * TOKENS * 4 * 64  # head, routers: bf16
    assert got.total == attention + experts + rest
    assert got.low_precision_share == pytest.approx((attention + experts) / got.total)
    assert got.by_kind()["experts"] == {"mxfp8": 1.0}
    # by parameters the experts weigh their size, not their tokens: another share
    assert engine.coverage.low_precision_share == pytest.approx(
        (2 * (128 * 64 + 64 * 64) * 4 + 2 * 12288) / (2 * 49152 + 2 * 12288 + 8192 + 512))
    lines = str(got).splitlines()
    assert lines[0] == (f"coverage: {rest / got.total:.0%} of {got.total:,} matmul FLOPs in "
                        f"16 bits (bf16), {(attention + experts) / got.total:.0%} below 16 "
                        "bits (fp8-current, mxfp8)")
    # the head and the two routers kept: all three named, no "more"
    assert sum(ln.startswith("  kept ") for ln in lines) == 3 and "more" not in lines[-1]


def _flops_report(recipe, model, x):
    engine, _ = _engine(model, recipe)
    with engine.autocast():
        return engine.coverage_flops(lambda: model(x))


@pytest.mark.parametrize("recipe,width", [("bf16-master", "16 bits (bf16)"),
                                          ("fp32", "32 bits (fp32)")])
def test_a_16_bit_recipe_reads_all_in_16_bits_by_hand_counted_flops(recipe, width):
    """_Wide on 5 × 7 tokens: each Linear ``2 · 35 · in · out`` FLOPs, all of them in the
    recipe's compute format, none below 16 bits, and nothing called kept."""
    torch.manual_seed(0)
    got = _flops_report(recipe, _Wide(), torch.randn(5, 7, 32))
    hand = 2 * 35 * (32 * 32 + 32 * 32 + 32 * 512)
    assert got.total == hand == 1_290_240
    assert (got.high_precision_share, got.low_precision_share) == (1.0, 0.0)
    assert str(got).splitlines()[0] == (f"coverage: 100% of 1,290,240 matmul FLOPs in {width}, "
                                        "0% below 16 bits")
    assert got.kept() == [] and "kept" not in str(got)


def test_a_long_kept_list_says_how_many_more_it_leaves_out():
    """Eight Linears of 16 × 16 and a head of 16 × 512, five of the eight kept by rules:
    the report names the three largest kept (the head first) and counts the other three
    with their FLOPs; so does the warning."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(8)], nn.Linear(16, 512))
    rules = ",".join(f"layer:{i}=bf16" for i in range(5))
    engine, said = _engine(model, f"fp8-current,{rules}")
    with engine.autocast():
        got = engine.coverage_flops(lambda: model(torch.randn(10, 16)))
    tokens, small, head = 10, 16 * 16, 16 * 512
    low, high = 3 * 2 * tokens * small, 2 * tokens * (5 * small + head)
    assert (got.total, got.low_precision_share) == (low + high, low / (low + high))
    lines = str(got).splitlines()
    assert lines[0] == (f"coverage: {high / got.total:.0%} of {got.total:,} matmul FLOPs in "
                        f"16 bits (bf16), {low / got.total:.0%} below 16 bits (fp8-current)")
    assert [ln.split()[1] for ln in lines if ln.startswith("  kept ")] == ["8", "0", "1"]
    assert lines[-1] == (f"  ... and 3 more kept in bf16 ({3 * 2 * tokens * small:,}; "
                         "engine.coverage.kept() lists them)")
    assert len(said) == 1 and "; and 3 more." in said[0]


def test_the_guides_coverage_example_prints_what_the_guide_shows(capsys):
    """docs/guides/your-loop.md: its example's block, run, prints its text block."""
    page = (ROOT / "docs/guides/your-loop.md").read_text()
    code, shown = re.search(r"```python\n(net = .*?)```\n\n```text\n(.*?)```", page, re.S).groups()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the low-coverage warning, which the guide names
        exec(code, {"torch": torch, "MixedPrecision": MixedPrecision})  # noqa: S102
    assert capsys.readouterr().out == shown
