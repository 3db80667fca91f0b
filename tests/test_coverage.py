"""The engine's coverage report: the share of the matmul weights in each format, per
module kind, with what stayed in 16 bits and why; a low-precision recipe that leaves
most of them in 16 bits warns once, naming the largest."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from mixprec import MixedPrecision
from mixprec.coverage import coverage


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
    assert "head" in str(cov) and "11% of 18,432" in str(cov)


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
