"""A Lightning Fabric loop under a mixprec recipe.

    python examples/fabric_train.py --recipe bf16-master
    python examples/fabric_train.py --devices 2 --recipe fp16-master --inject-inf 3:1

``mixprec.integrations.lightning.setup_fabric`` replaces ``fabric.setup``; the rest is
Fabric's own loop (``fabric.backward``, ``optimizer.step``, ``fabric.save``). ``--devices
2`` runs 2 CPU processes (Fabric's DDP launch, gloo) through the engine's DDP, each on
its own batches. ``--inject-inf STEP:RANK`` makes that rank's loss inf at that step:
every rank skips it. ``--record PATH`` writes each rank's skips and a digest of its
final fp32 weights as JSON (PATH, PATH.rankN).
"""

from __future__ import annotations

import argparse
import hashlib
import json

import torch
from lightning.fabric import Fabric

from mixprec.integrations.lightning import setup_fabric
from mixprec.workbench import GPT, GPTConfig
from mixprec.workbench.data import load_corpus, sample_batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="bf16-master")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--inject-inf", default=None, metavar="STEP:RANK")
    ap.add_argument("--record", default=None)
    args = ap.parse_args()

    fabric = Fabric(accelerator="cpu", devices=args.devices,
                    strategy="ddp" if args.devices > 1 else "auto")
    fabric.launch()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=256, seq_len=64, n_layers=2, d_model=64, n_heads=4)
    gpt = GPT(cfg)
    opt = torch.optim.AdamW(gpt.parameters(), lr=3e-3)
    model, optimizer = setup_fabric(fabric, gpt, opt, recipe=args.recipe, max_grad_norm=1.0)
    engine = optimizer.engine
    corpus = load_corpus(max_bytes=200_000)
    g = torch.Generator().manual_seed(100 + fabric.global_rank)  # each rank its own data
    poison = tuple(map(int, args.inject_inf.split(":"))) if args.inject_inf else None
    for step in range(args.steps):
        x, y = sample_batch(corpus.train, 4, cfg.seq_len, g)
        loss = model(x, y)
        if poison == (step, fabric.global_rank):
            loss = loss * float("inf")
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    if args.record:
        h, state = hashlib.sha256(), engine.fp32_state_dict()
        for k in sorted(state):
            h.update(state[k].contiguous().view(torch.uint8).numpy().tobytes())
        rank = fabric.global_rank
        with open(args.record if rank == 0 else f"{args.record}.rank{rank}", "w") as f:
            json.dump({"rank": rank, "world": fabric.world_size, "steps": engine.steps,
                       "skipped": int(engine.skipped_steps), "weights": h.hexdigest(),
                       "model": type(model).__name__}, f)
    fabric.print(f"{args.recipe}: {engine.steps} steps, {int(engine.skipped_steps)} "
                 f"skipped, loss scale {float(engine.scale):g}")


if __name__ == "__main__":
    main()
