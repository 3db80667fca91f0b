"""The planner's expert parallelism against a tiny Mixtral trained expert-parallel on 2
gloo ranks: the dispatch and combine buffers (the bytes of the tensors
``all_to_all_single`` sends and receives, and what ``CommStats`` records) within 5% of
``dispatch_traffic`` and ``ep_buffers``, and a rank's weights and states to the byte."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from helpers import memory_ep_workers as w
from helpers.moe_models import config
from mixprec.memory import estimate
from mixprec.memory.expert_dispatch import dispatch_traffic, expert_params
from mixprec.memory.hf_config import spec_from_config
from mixprec.memory.shapes import param_count

pytestmark = pytest.mark.filterwarnings("ignore")
pytest.importorskip("transformers")

#: a format that dispatches codes, and one (delayed scaling) that sends 16 bits
RECIPES = ("mxfp8", "fp8")
WORLD = 2


@pytest.fixture(scope="module")
def ranks():
    tmp = tempfile.mkdtemp(prefix="mixprec-memory-ep-")
    mp.start_processes(w.buffers, args=(WORLD, tmp, list(RECIPES)), nprocs=WORLD,
                       join=True, start_method="forkserver")
    return [torch.load(os.path.join(tmp, f"ep{r}.pt"), weights_only=False)
            for r in range(WORLD)]


def _spec():
    return spec_from_config(config("mixtral"), seq_len=w.SEQ, micro_batch=w.BATCH)


@pytest.mark.long  # one spawn of 2 ranks, two recipes: ~20-40 s on two loaded cores
@pytest.mark.parametrize("recipe", RECIPES)
def test_dispatch_buffers_and_a_ranks_states_match_the_plan(ranks, recipe):
    from mixprec.engine.devices import emulating
    from mixprec.recipe import Recipe

    spec = _spec()
    moe = spec.dims[4]
    # a CPU without bf16 units emulates the 16-bit path: the 16-bit wire is fp32 there
    # (the dtype the combine recorded)
    wire = next(k[2] for k in ranks[0][recipe]["totals"] if k[1] == "combine")
    emulated = wire.itemsize == 4 or emulating(Recipe.coerce(recipe), torch.device("cpu"))
    plan = dispatch_traffic(spec, recipe, WORLD, 4.0 if emulated else 2.0)
    # what each rank sends per layer, by CommStats' what: the hand count (every rank
    # sends all its T·k rows, the ones it keeps included)
    for r in ranks:
        got = {what: n for (op, what, _), n in r[recipe]["totals"].items()
               if op in ("all_to_all", "all_reduce")}
        assert set(got) == set(plan), (recipe, got, plan)
        for what, n in got.items():  # the combine sends back what this rank received
            if what != "combine":
                assert n == pytest.approx(moe * plan[what], rel=0.05), (recipe, what)
    combined = sum(r[recipe]["totals"][k] for r in ranks for k in r[recipe]["totals"]
                   if k[1] == "combine") / WORLD
    assert combined == pytest.approx(moe * plan["combine"], rel=0.05)
    # the buffers: what the tensors handed to all_to_all_single hold, sent and
    # received, over the ranks (the received rows depend on the routing; on average
    # as many as sent)
    wire = ("dispatch", "dispatch-codes", "dispatch-scales", "combine")
    measured = sum(sent + got for r in ranks for what, sent, got in r[recipe]["exchanges"]
                   if what in wire) / WORLD / moe
    planned = estimate(spec, f"{recipe},emulate=true" if emulated else recipe,
                       expert_parallel=WORLD)
    assert planned["ep_buffers"] == pytest.approx(measured, rel=0.05)
    assert planned["ep_buffers"] == 2 * sum(v for k, v in plan.items() if k in wire)
    if recipe == "mxfp8":  # codes: 1 byte per value, scales: an e8m0 byte per 32
        rows = w.SEQ * w.BATCH * spec.top_k
        assert plan["dispatch-codes"] == rows * spec.hidden
        assert plan["dispatch-scales"] == rows * spec.hidden // 32
    else:  # delayed scaling has no codes dispatch: 16-bit rows
        assert "dispatch-codes" not in plan and plan["dispatch"] == plan["combine"]
    # the weights and states a rank holds: the routed experts' divided over the group
    items = ranks[0][recipe]["items"]
    held = param_count(spec) - expert_params(spec) + expert_params(spec) // WORLD
    assert planned["grads"] == 4 * held  # fp32 gradients under the fp8 recipes
    for item in ("params", "grads", "master"):
        assert planned[item] == items.get(item, 0.0), (recipe, item)
    # AdamW's states; the module also holds a 4-byte step count per tensor
    assert planned["optimizer"] == items["optimizer"] - 4 * ranks[0][recipe]["tensors"]


def test_bad_expert_parallel_settings_are_refused_with_the_fix():
    spec = _spec()
    with pytest.raises(ValueError, match="does not divide experts=4"):
        estimate(spec, "mxfp8", expert_parallel=3)
    with pytest.raises(ValueError, match="needs a TransformerSpec with experts"):
        estimate("7B", "mxfp8", expert_parallel=2)
    with pytest.raises(ValueError, match="integer >= 1"):
        estimate(spec, "mxfp8", expert_parallel=0)
    from helpers.moe_models import model

    with pytest.raises(ValueError, match="call mixprec.experts.expert_parallel"):
        estimate(model("mixtral"), "mxfp8", activations=spec, expert_parallel=2)


def test_the_guides_mixtral_by_hand():
    """docs/guides/memory.md, "Expert parallelism": Mixtral-8x7B over 8 ranks."""
    from mixprec.memory import TransformerSpec

    spec = TransformerSpec(layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336,
                           gated=True, experts=8, top_k=2, vocab=32000,
                           tied_embeddings=False, norm="rms", seq_len=4096,
                           attention="flash", dropout=False, qkv_linears=3)
    plan = dispatch_traffic(spec, "mxfp8", 8)
    assert (plan["dispatch-codes"], plan["dispatch-scales"], plan["combine"]) == (
        33_554_432, 1_048_576, 67_108_864)
    b = estimate(spec, "mxfp8", expert_parallel=8)
    assert b["ep_buffers"] == 203_423_744
    four = dispatch_traffic(spec, "nvfp4", 8)
    assert (four["dispatch-codes"], four["dispatch-scales"]) == (16_777_216, 2_097_152)
    assert round(estimate(spec, "nvfp4", expert_parallel=8)["ep_buffers"] / 1e9, 3) == 0.172
    assert round(estimate(spec, "bf16-master", expert_parallel=8)["ep_buffers"] / 1e9,
                 3) == 0.268
    assert (param_count(spec), expert_params(spec)) == (46_702_792_704, 45_097_156_608)
    assert b["params"] == 4 * 7_242_780_672
