"""Rank function for tests/experts/test_experts_distributed.py: a tiny Mixtral whose experts run
in an fp8/fp4 format, trained under DDP or FSDP2 on gloo ranks (one spawn, several
cases), and the one-process reference of the same micro-batches."""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

from helpers.moe_models import count_experts_gemms, markov_batches, model
from mixprec import MixedPrecision
from mixprec.experts import experts_formats

warnings.simplefilter("ignore")

STEPS, LR = 6, 0.5
#: the step whose loss on rank 1 (the reference's second micro-batch) is made infinite
INF_STEP = 3


def _run(recipe: str, parallel: str | None, rank: int, world: int) -> dict:
    """``STEPS`` SGD steps; with ``parallel`` each rank takes its share of every batch,
    else one process takes the ``world`` shares as micro-batches of one step (each loss
    × ``world``, the learning rate / ``world``: the ranks' average of their means).
    Share 1's loss at ``INF_STEP`` is infinite: every rank must skip that step."""
    m = model("mixtral", seed=rank if parallel else 0)  # ranks: rank 0's broadcast
    engine = MixedPrecision(m, torch.optim.SGD(m.parameters(), lr=LR if parallel
                                               else LR / world), recipe, parallel=parallel,
                            grad_accum_steps=1 if parallel else world)
    skipped, losses = [], []
    with count_experts_gemms() as counted:
        for step, ids in enumerate(markov_batches(STEPS, batch=4)):
            shares = ids.chunk(world)
            for i in [rank] if parallel else range(world):
                with engine.autocast():
                    loss = engine.model(input_ids=shares[i], labels=shares[i]).loss
                if step == INF_STEP and i == 1:
                    loss = loss * float("inf")
                engine.backward(loss if parallel else loss * world)
                result = engine.step()
                losses.append(loss.item())
            skipped.append(bool(result.skipped))
    params = [p.detach() for p in engine.master_params]
    if parallel == "fsdp":
        params = [p.full_tensor() for p in params]
    formats = experts_formats(m)
    return {"params": [p.clone() for p in params], "skipped": skipped, "losses": losses,
            "calls": counted.calls, "formats": sorted({f.format_name for f in
                                                       formats.values()}),
            "n_formats": len(formats), "fsdp_sharded": _sharded_experts(m)}


def _sharded_experts(m) -> list[str]:
    """The experts' 3-D weights FSDP holds as DTensor shards."""
    from torch.distributed.tensor import DTensor

    return [n for n, p in m.named_parameters() if p.dim() == 3 and isinstance(p, DTensor)]


def experts(rank, world, tmp, cases):
    """Each (recipe, parallel) case on this rank; rank 0 also writes the references."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world)
    out = {case: _run(*case, rank, world) for case in cases}
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        for recipe in sorted({r for r, _ in cases}):
            out[(recipe, None)] = _run(recipe, None, 0, world)
    torch.save(out, os.path.join(tmp, f"experts_rank{rank}.pt"))



def _gathered_run(kind: str, recipe: str, rank: int, world: int, tmp: str) -> dict:
    """``GATHER_STEPS`` SGD steps of a tiny ``kind`` model under FSDP2 on this rank's
    shares of the batches: the trained weights, the losses, the weights' all-gather
    bytes per dtype of each step, the experts' fallbacks, the warnings said and how
    often a gathered fp8 weight was dequantized. Then the last step again from a
    checkpoint of FSDP's shards written before it, by an engine built from other
    weights: its loss and weights."""
    from mixprec.modules.linear import fp8_modules
    from mixprec.parallel.gather import Fp8Weight, gathers_fp8

    def engine_of(seed):
        m = model(kind, seed=seed)  # ranks: rank 0's broadcast
        return m, MixedPrecision(m, torch.optim.SGD(m.parameters(), lr=LR), recipe,
                                 parallel="fsdp")

    def step(engine, ids):
        share = ids.chunk(world)[rank]
        with engine.autocast():
            loss = engine.model(input_ids=share, labels=share).loss
        engine.backward(loss)
        engine.step()
        return loss.item()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m, engine = engine_of(rank)
    stats, batches = engine.comm_stats, markov_batches(GATHER_STEPS, batch=2 * world)
    experts_sent = _count_experts_gathers(m)
    sent, losses, path = [], [], os.path.join(tmp, f"{kind}-{recipe}-{rank}.pt")
    dequantize, dequantized = Fp8Weight.dequantize, []
    Fp8Weight.dequantize = lambda w: dequantized.append(w.shape) or dequantize(w)
    try:
        for i, ids in enumerate(batches):
            if i == GATHER_STEPS - 1:
                engine.save(path)
            before = stats.totals()
            experts_sent.append(0)
            losses.append(step(engine, ids))
            sent.append({k[2]: v - before.get(k, 0) for k, v in stats.totals().items()
                         if k[:2] == ("all_gather", "weights")})
    finally:
        Fp8Weight.dequantize = dequantize
    _, resumed = engine_of(7)
    resumed.load(path)
    experts = [p for p in m.parameters() if p.dim() == 3]
    linears = [mod.weight for mod in fp8_modules(m).values() if gathers_fp8(mod)]
    return {"params": [p.full_tensor().clone() for p in engine.master_params],
            "losses": losses, "sent": sent, "dequantized": dequantized,
            "experts_sent": experts_sent[1:],
            "resumed_loss": step(resumed, batches[-1]),
            "resumed": [p.full_tensor().clone() for p in resumed.master_params],
            "shard_numel": {"experts": sum(p.to_local().numel() for p in experts),
                            "linears": sum(p.to_local().numel() for p in linears)},
            "fallbacks": sorted(f.what for f in stats.fallbacks
                                if f.what.startswith("experts:")),
            "said": [str(c.message) for c in caught if "experts:" in str(c.message)]}


def _count_experts_gathers(m) -> list[int]:
    """A list whose last entry each all-gather of an experts weight (a hooked shard)
    adds its inputs' bytes to."""
    counts = [0]

    def counted(inner):
        def fsdp_pre_all_gather(mesh):
            inputs, meta = inner(mesh)
            counts[-1] += sum(t.numel() * t.element_size() for t in inputs)
            return inputs, meta
        return fsdp_pre_all_gather

    for p in m.parameters():
        local = getattr(p, "_local_tensor", None)
        if p.dim() == 3 and hasattr(local, "fsdp_pre_all_gather"):
            local.fsdp_pre_all_gather = counted(local.fsdp_pre_all_gather)
    return counts


#: the steps of each ``gathered`` case
GATHER_STEPS = 3


def gathered(rank, world, tmp, cases):
    """Each (model kind, recipe) case on this rank, FSDP2 over gloo."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world)
    out = {case: _gathered_run(*case, rank, world, tmp) for case in cases}
    dist.barrier()
    dist.destroy_process_group()
    torch.save(out, os.path.join(tmp, f"gathered_rank{rank}.pt"))
