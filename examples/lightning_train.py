"""Train the workbench GPT with PyTorch Lightning under a mixprec recipe.

    python examples/lightning_train.py --recipe bf16-master --steps 50
    python examples/lightning_train.py --recipe fp16-master --steps 100 --resume last.ckpt
    python examples/lightning_train.py --devices 2 --recipe fp16-master --inject-inf 3:1

The LightningModule is plain Lightning; mixprec comes in through one plugin
(``mixprec.integrations.lightning.MixedPrecisionPlugin``). Needs ``pip install
mixprec[lightning]``. A checkpoint is written to ``--save`` at the end. ``--devices 2``
trains with Lightning's DDP on 2 CPU processes (gloo), each on its own batches.
``--inject-inf STEP:RANK`` makes that rank's loss inf at that step: every rank skips it.
``--out PATH`` writes each rank's skips and a digest of its final fp32 weights as JSON
(rank 0's to PATH, others' to PATH.rankN).
"""

from __future__ import annotations

import argparse
import hashlib
import json

import lightning.pytorch as pl
import torch

from mixprec.integrations.lightning import MixedPrecisionPlugin
from mixprec.workbench import GPT, GPTConfig
from mixprec.workbench.data import load_corpus, sample_batch


class LitGPT(pl.LightningModule):
    def __init__(self, cfg: GPTConfig, lr: float = 3e-3, poison=None):
        super().__init__()
        self.gpt, self.lr, self.poison = GPT(cfg), lr, poison

    def training_step(self, batch, batch_idx):
        x, y = batch
        if x.dim() == 3:  # one list of batches per rank: this rank's
            x, y = x[self.global_rank], y[self.global_rank]
        loss = self.gpt(x, y)
        self.log("loss", loss, prog_bar=True, sync_dist=False)
        if self.poison == (self.global_step, self.global_rank):
            loss = loss * float("inf")
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.9, 0.95))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--recipe", default="bf16-master")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--accumulate", type=int, default=1)
    ap.add_argument("--resume", default=None, help="a checkpoint to continue from")
    ap.add_argument("--save", default="last.ckpt")
    ap.add_argument("--devices", type=int, default=1, help="> 1: Lightning's DDP")
    ap.add_argument("--inject-inf", default=None, metavar="STEP:RANK")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = GPTConfig(n_layers=2, d_model=128, n_heads=4, seq_len=64)
    corpus = load_corpus(max_bytes=300_000)
    g = torch.Generator().manual_seed(0)
    batches = [sample_batch(corpus.train, 8, cfg.seq_len, g)
               for _ in range(args.steps * args.accumulate)]
    if args.devices > 1:  # every rank gets the whole list and trains on its own slice
        batches = [sample_batch(corpus.train, 8 * args.devices, cfg.seq_len, g)
                   for _ in range(args.steps * args.accumulate)]
        batches = [(x.view(args.devices, 8, -1), y.view(args.devices, 8, -1))
                   for x, y in batches]
    plugin = MixedPrecisionPlugin(args.recipe)
    poison = tuple(map(int, args.inject_inf.split(":"))) if args.inject_inf else None
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, max_steps=args.steps,
                         strategy="ddp" if args.devices > 1 else "auto",
                         use_distributed_sampler=False,
                         plugins=[plugin], accumulate_grad_batches=args.accumulate,
                         gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
                         enable_model_summary=False, enable_progress_bar=args.devices == 1)
    trainer.fit(LitGPT(cfg, poison=poison),
                torch.utils.data.DataLoader(batches, batch_size=None),
                ckpt_path=args.resume)
    trainer.save_checkpoint(args.save)
    e = plugin.engine
    if args.out:
        h = hashlib.sha256()
        state = e.fp32_state_dict()
        for k in sorted(state):
            h.update(state[k].contiguous().view(torch.uint8).numpy().tobytes())
        rank = trainer.global_rank
        with open(args.out if rank == 0 else f"{args.out}.rank{rank}", "w") as f:
            json.dump({"rank": rank, "world": trainer.world_size, "steps": e.steps,
                       "skipped": int(e.skipped_steps), "weights": h.hexdigest(),
                       "ddp": type(e.model).__name__}, f)
    if trainer.global_rank == 0:
        print(f"{args.recipe}: {e.steps} steps, {int(e.skipped_steps)} skipped, "
              f"loss scale {float(e.scale):g}; checkpoint {args.save}")


if __name__ == "__main__":
    main()
