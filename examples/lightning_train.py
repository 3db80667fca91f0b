"""Train the workbench GPT with PyTorch Lightning under a mixprec recipe.

    python examples/lightning_train.py --recipe bf16-master --steps 50
    python examples/lightning_train.py --recipe fp16-master --steps 100 --resume last.ckpt

The LightningModule is plain Lightning; mixprec comes in through one plugin
(``mixprec.integrations.lightning.MixedPrecisionPlugin``). Needs ``pip install
mixprec[lightning]``. A checkpoint is written to ``--save`` at the end.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch

from mixprec.integrations.lightning import MixedPrecisionPlugin
from mixprec.workbench import GPT, GPTConfig
from mixprec.workbench.data import load_corpus, sample_batch


class LitGPT(pl.LightningModule):
    def __init__(self, cfg: GPTConfig, lr: float = 3e-3):
        super().__init__()
        self.gpt, self.lr = GPT(cfg), lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.gpt(x, y)
        self.log("loss", loss, prog_bar=True)
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
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = GPTConfig(n_layers=2, d_model=128, n_heads=4, seq_len=64)
    corpus = load_corpus(max_bytes=300_000)
    g = torch.Generator().manual_seed(0)
    batches = [sample_batch(corpus.train, 8, cfg.seq_len, g)
               for _ in range(args.steps * args.accumulate)]
    plugin = MixedPrecisionPlugin(args.recipe)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=args.steps,
                         plugins=[plugin], accumulate_grad_batches=args.accumulate,
                         gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
                         enable_model_summary=False)
    trainer.fit(LitGPT(cfg), torch.utils.data.DataLoader(batches, batch_size=None),
                ckpt_path=args.resume)
    trainer.save_checkpoint(args.save)
    e = plugin.engine
    print(f"{args.recipe}: {e.steps} steps, {int(e.skipped_steps)} skipped, "
          f"loss scale {float(e.scale):g}; checkpoint {args.save}")


if __name__ == "__main__":
    main()
