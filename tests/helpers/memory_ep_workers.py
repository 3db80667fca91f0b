"""Rank function for tests/memory/test_memory_ep.py: a tiny Mixtral trained
expert-parallel on gloo ranks, with the bytes of every exchange's send and receive
buffers read off the tensors ``all_to_all_single`` is handed, the bytes ``CommStats``
recorded, and the weights and states a rank holds."""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

from helpers.moe_models import markov_batches, model
from mixprec import MixedPrecision
from mixprec.experts.expert_parallel import expert_parallel
from mixprec.memory import measure

warnings.simplefilter("ignore")

#: sequences per rank and their length
BATCH, SEQ = 2, 16


def _spy(seen: list) -> object:
    """``all_to_all_single`` recording each call's (input, output) bytes."""
    inner = dist.all_to_all_single

    def call(output, input, *args, **kwargs):
        seen.append((input.numel() * input.element_size(),
                     output.numel() * output.element_size()))
        return inner(output, input, *args, **kwargs)

    return inner, call


def buffers(rank, world, tmp, recipes):
    """Per recipe: the forward's exchanges (``what``, sent, received bytes), the
    CommStats totals, and ``measure``'s items after a step."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world)
    out = {}
    ids = markov_batches(1, batch=BATCH * world, seq=SEQ)[0].chunk(world)[rank]
    for recipe in recipes:
        m = model("mixtral", seed=0)
        shards = expert_parallel(m)
        engine = MixedPrecision(m, torch.optim.AdamW(m.parameters(), lr=1e-3), recipe)
        seen: list = []
        inner, spy = _spy(seen)
        for i in range(2):  # optimizer states after step 1, gradients after backward 2
            dist.all_to_all_single = spy
            try:
                with engine.autocast():
                    loss = engine.model(input_ids=ids, labels=ids).loss
            finally:
                dist.all_to_all_single = inner
            if i == 0:
                forward = [r for r in shards.stats.records if r.op == "all_to_all"]
                exchanges = [(r.what, sent, got) for r, (sent, got) in zip(forward, seen)]
                totals = shards.stats.totals()
            engine.backward(loss)
            shards.average_grads(zip(engine.param_state.names, engine.param_state.grads))
            if i == 0:
                engine.step()
        out[recipe] = {"exchanges": exchanges, "totals": totals,
                       "calls": len(seen) // 2, "items": dict(measure(m, engine).items),
                       "tensors": len(list(m.parameters()))}
    dist.barrier()
    dist.destroy_process_group()
    torch.save(out, os.path.join(tmp, f"ep{rank}.pt"))
