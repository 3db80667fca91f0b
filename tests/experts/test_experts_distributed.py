"""transformers MoE experts under data parallel: a tiny Mixtral with its experts in
fp8-current, MXFP8 and delayed fp8 (the experts' amax histories agreed across the
ranks) on 2 gloo ranks, with DDP and with FSDP2 (the experts' 3-D weights
sharded like any parameter), trains as one process that takes the same two halves as
micro-batches of one step, bit for bit, the experts running in the format on every rank,
and a step one rank's infinite loss spoils is skipped on both."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from helpers import moe_dist_workers as w

pytest.importorskip("transformers")
pytestmark = [pytest.mark.long, pytest.mark.filterwarnings("ignore")]

CASES = [(r, p) for r in ("fp8-current", "mxfp8", "fp8") for p in ("ddp", "fsdp")]


@pytest.fixture(scope="module")
def ranks():
    tmp = tempfile.mkdtemp(prefix="mixprec-moe-dist-")
    mp.start_processes(w.experts, args=(2, tmp, CASES), nprocs=2, join=True,
                       start_method="forkserver")
    return [torch.load(os.path.join(tmp, f"experts_rank{r}.pt"), weights_only=False)
            for r in range(2)]


@pytest.mark.parametrize("recipe,parallel", CASES)
def test_two_ranks_train_as_one_process_of_the_same_micro_batches(ranks, recipe, parallel):
    ref = ranks[0][(recipe, None)]
    for r in ranks:
        got = r[(recipe, parallel)]
        # the experts ran mixprec's grouped GEMM in the format: 2 layers x 2 projections
        # per forward, on every rank
        assert got["n_formats"] == 4 and got["formats"] == [recipe]
        assert got["calls"] == 4 * w.STEPS
        # rank 1's infinite loss at one step: both ranks skip it, as the reference does
        want = [step == w.INF_STEP for step in range(w.STEPS)]
        assert got["skipped"] == ref["skipped"] == want
        for p, q in zip(got["params"], ref["params"], strict=True):
            assert torch.equal(p, q)
    if parallel == "fsdp":  # both projections of both layers, sharded on the experts dim
        assert len(ranks[0][(recipe, parallel)]["fsdp_sharded"]) == 4
    for p, q in zip(ranks[0][(recipe, parallel)]["params"],
                    ranks[1][(recipe, parallel)]["params"]):
        assert torch.equal(p, q)  # replicas identical
