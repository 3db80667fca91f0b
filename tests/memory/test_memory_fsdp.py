"""The fp8 weight casts an FSDP2 engine holds per rank (2 gloo ranks on the CPU),
counted on its autograd graph, against the memory planner's ``weight_casts``."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from helpers import memory_workers as w

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_fp8_weight_casts_under_fsdp_are_held_whole_per_rank_as_estimated():
    """Each rank keeps every fp8 Linear's weight cast whole (1 byte per element) and the
    tied head's bf16 copy (2 bytes) from the forward to the backward: the gathered
    weight is freed after the forward, its cast is not; with ``fp8_all_gather`` the
    Linear copies the gathered codes (``per_tensor.cast``). ``estimate`` of the sharded
    module and of the bare spec predict it within 5%."""
    recipes = ["fp8", "fp8,fp8_all_gather=true"]
    tmp = tempfile.mkdtemp(prefix="mixprec-memory-")
    mp.start_processes(w.fsdp_casts, args=(2, tmp, recipes), nprocs=2, join=True,
                       start_method="forkserver")
    ranks = [torch.load(os.path.join(tmp, f"casts_rank{r}.pt")) for r in range(2)]
    d = w.WIDTH
    whole = w.LAYERS * 12 * d * d + 2 * w.VOCAB * d  # fp8 Linears at 1 B, head's bf16 at 2
    for got in ranks:
        for recipe in recipes:
            r = got[recipe]
            assert r["graph"] == whole, recipe  # not sharded: half of it would be a shard's
            assert r["module"] == pytest.approx(r["graph"], rel=0.05), recipe
            assert r["spec"] == pytest.approx(r["graph"], rel=0.05), recipe
            # measure() sees the same tensors: FSDP2 frees gathered weights during the
            # forward, and a cast made at a freed weight's address is still a cast
            assert r["measured"] == r["graph"], recipe
