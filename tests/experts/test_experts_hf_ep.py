"""transformers' expert parallelism (``DistributedConfig(ep_size=2, ...)``): the engine
finds the experts modules transformers sharded (FSDP2 wraps each in a class of its own,
their weights are DTensors), lists them in its coverage as one process does, and runs
their grouped GEMMs in the recipe's format on the rank's own experts: the module's
output and input gradient on 2 gloo ranks are one process's quantized ones, away from
its high-precision ones (tests/helpers/hf_ep_workers.py)."""

from __future__ import annotations

import functools
import tempfile

import pytest
import torch

from helpers import hf_distcfg_workers as hf
from helpers import hf_ep_workers as ep
from helpers.ranks import spawn_tp

pytestmark = [pytest.mark.long,
              pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")]

LAYOUTS = {"ep-fsdp": {"ep_size": 2, "fsdp_size": 2}, "ep-tp": {"ep_size": 2, "tp_size": 2}}
#: formats whose casts do not depend on the order the rows come in nor draw random
#: numbers: the per-tensor one (a scale per expert) and a block one
RECIPES = ("fp8-current", "mxfp8")
RUNS = [(layout, recipe) for layout in LAYOUTS for recipe in RECIPES]


@functools.cache
def _records() -> dict:
    model_dir = hf.save_model("qwen3_moe", tempfile.mkdtemp(prefix="mixprec-hfep-") + "/m")
    ranks = spawn_tp(ep.experts_under_ep, model_dir,
                     [(LAYOUTS[lay], recipe) for lay, recipe in RUNS], name="hfep")
    return {run: [r[i] for r in ranks] for i, run in enumerate(RUNS)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("layout,recipe", RUNS)
def test_the_experts_under_transformers_ep_are_covered_and_computed_in_the_format(
        layout, recipe):
    for rank, r in enumerate(_records()[layout, recipe]):
        # the coverage lists every projection of both experts modules, in the recipe's
        # format, with the model's parameters: the rows one process shows
        assert r["rows"] == r["one_rows"], (rank, r["rows"], r["one_rows"])
        assert len(r["rows"]) == 4
        assert {row[3] for row in r["rows"]} == {recipe}
        assert all(row[4] is None for row in r["rows"])
        if "fsdp" in layout:
            assert r["class"].startswith("FSDP"), r["class"]
        # the grouped GEMMs ran in the format, on the rank's 2 of the 4 experts
        assert r["calls"] == [((2, 128, 64), "Tensor", recipe),
                              ((2, 64, 64), "Tensor", recipe)], r["calls"]
        # one process's quantized numbers, not its high-precision ones
        for k in ("y", "dx"):
            same = _rel(r["run"][k], r["one"][k])
            apart = _rel(r["high"][k], r["one"][k])
            assert same <= 1e-5, (rank, k, same)
            assert apart >= 1e-2, (rank, k, apart)
