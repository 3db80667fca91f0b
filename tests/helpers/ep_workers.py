"""Rank functions for tests/experts/test_expert_parallel.py: the dispatch of seeded
tokens in each format on gloo ranks (what each rank received, its GEMM's output and
the bytes recorded), and tiny transformers MoE models trained expert-parallel."""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

from helpers.moe_models import markov_batches, model
from mixprec import MixedPrecision
from mixprec.experts import ExpertsFormat
from mixprec.experts.dispatch import combine, dispatch, dispatched_mm, exchange
from mixprec.experts.expert_parallel import expert_parallel
from mixprec.parallel.comm_stats import CommStats

warnings.simplefilter("ignore")

EXPERTS, K, N = 4, 256, 64


def tokens(rank: int, empty: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s rows (bf16, an outlier per row) and their experts, sorted;
    ``empty``: every row goes to experts 0 and 1 (rank 0's), and rank 1 sends none."""
    g = torch.Generator().manual_seed(100 + rank)
    rows = 0 if empty and rank == 1 else 37 + 6 * rank
    x = torch.randn(rows, K, generator=g) * torch.exp(torch.randn(rows, 1, generator=g))
    x[:, 5] *= 20
    ids = torch.randint(0, 2 if empty else EXPERTS, (rows,), generator=g)
    ids, order = torch.sort(ids, stable=True)
    return x[order].to(torch.bfloat16), ids


def weights() -> torch.Tensor:
    """The experts' weights (E × N × K), the same on every rank."""
    return torch.randn(EXPERTS, N, K, generator=torch.Generator().manual_seed(7)) / 16


def wire(rank, world, tmp, recipes):
    """Each recipe's dispatch (and the empty-rank routing) on this rank: the received
    casts per local expert, the GEMM's output, its gradients, the bytes recorded."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world)
    out = {}
    for recipe in recipes:
        for empty in (False, True):
            stats = CommStats()
            x, ids = tokens(rank, empty)
            x.requires_grad_(True)
            counts = torch.bincount(ids, minlength=EXPERTS)
            r = exchange(counts, None, stats)
            fmt = ExpertsFormat(recipe)
            w = weights()[r.first:r.first + EXPERTS // world].clone().requires_grad_(True)
            xr, casts = dispatch(x, ids, r, fmt, stats)
            y = dispatched_mm(xr, w, r.offsets, fmt, casts, torch.bfloat16)
            back = combine(y, r, stats)
            (back.float() * torch.linspace(-1, 1, N)).sum().backward()
            out[(recipe, empty)] = {
                "casts": [None if c is None else (c.data, c.scale_inv, c.rows, c.cols,
                                                  c.outer) for c in casts or ()],
                "values": xr.detach(), "y": y.detach(), "back": back.detach(),
                "dx": x.grad, "dw": w.grad, "counts": r.local_counts,
                "totals": stats.totals(), "records": [(c.op, c.what, c.nbytes)
                                                      for c in stats.records]}
    dist.barrier()
    dist.destroy_process_group()
    torch.save(out, os.path.join(tmp, f"wire{rank}.pt"))


STEPS, LR = 4, 5e-3


def _train(kind: str, recipe: str, rank: int, world: int, ep: bool) -> dict:
    """``STEPS`` AdamW steps of a tiny ``kind`` model; expert-parallel on this rank's
    half of each batch, or one process on the whole batch."""
    m = model(kind, seed=0)
    shards = expert_parallel(m) if ep else None
    opt = torch.optim.AdamW(m.parameters(), lr=LR)
    engine = MixedPrecision(m, opt, recipe)
    losses = []
    for ids in markov_batches(STEPS, batch=4):
        share = ids.chunk(world)[rank] if ep else ids
        with engine.autocast():
            loss = engine.model(input_ids=share, labels=share).loss
        engine.backward(loss)
        if ep:
            shards.average_grads(zip(engine.param_state.names, engine.param_state.grads))
        engine.step()
        detached = loss.detach()
        if ep:
            dist.all_reduce(detached)
            detached /= world
        losses.append(detached.item())
    stats = shards.stats if ep else None
    return {"losses": losses, "totals": stats.totals() if stats else {},
            "fallbacks": [f.what for f in stats.fallbacks] if stats else []}


def training(rank, world, tmp, cases):
    """Each (model kind, recipe) trained expert-parallel; rank 0 also one process."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world)
    out = {case: _train(*case, rank, world, True) for case in cases}
    m = model("mixtral")
    expert_parallel(m)
    try:  # DDP would average the ranks' different experts
        MixedPrecision(m, torch.optim.SGD(m.parameters(), lr=0.1), "mxfp8", parallel="ddp")
        out["refused"] = None
    except NotImplementedError as e:
        out["refused"] = str(e)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        for case in cases:
            out[case + ("one",)] = _train(*case, 0, world, False)
    torch.save(out, os.path.join(tmp, f"train{rank}.pt"))
