"""Bytes each rank sends per optimizer step, by communication dtype (DDP, 2 gloo ranks).

    python benchmarks/comm.py [--layers 4 --d-model 128]

Counted inside mixprec's DDP comm hook: numel × element size of every tensor it
all-reduces. An all-reduce moves about 2·(N-1)/N times that over the wire (ring), the
same factor for every dtype, so the ratios between rows are what matters.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mixprec import MixedPrecision
from mixprec.workbench import GPT, GPTConfig


def worker(rank, world, tmp, recipe, layers, d_model, steps):
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world)
    torch.manual_seed(0)
    cfg = GPTConfig(n_layers=layers, d_model=d_model, n_heads=4, seq_len=64)
    model = GPT(cfg)
    engine = MixedPrecision(model, torch.optim.AdamW(model.parameters(), fused=True), recipe,
                            parallel="ddp")
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        idx = torch.randint(0, 256, (4, 65), generator=g)
        with engine.autocast():
            loss = engine.model(idx[:, :-1], idx[:, 1:])
        engine.backward(loss)
        engine.step()
    if rank == 0:
        torch.save({"bytes": engine.comm_stats.bytes_sent / steps,
                    "params": sum(p.numel() for p in model.parameters())},
                   os.path.join(tmp, "out.pt"))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for recipe in ("bf16", "bf16,comm=bf16", "fp16,comm=fp16", "bf16-master"):
        tmp = tempfile.mkdtemp()
        mp.spawn(worker, args=(2, tmp, recipe, args.layers, args.d_model, args.steps),
                 nprocs=2, join=True)
        out = torch.load(os.path.join(tmp, "out.pt"))
        rows.append((recipe, out["bytes"], out["params"]))
    print(f"# DDP, 2 gloo ranks, GPT {args.layers}x{args.d_model}, per optimizer step")
    print(f"{'recipe':<18} {'comm':>5} {'bytes/rank/step':>16} {'bytes/param':>12}")
    for recipe, b, n in rows:
        comm = recipe.split("comm=")[1] if "comm=" in recipe else "fp32"
        print(f"{recipe:<18} {comm:>5} {b:>16,.0f} {b / n:>12.2f}")


if __name__ == "__main__":
    main()
