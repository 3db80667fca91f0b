"""LightningModules under Lightning's ``ModelParallelStrategy`` (the plugin's engine
shards them, FSDP2), for tests/integrations/test_lightning.py. Lightning's launcher
re-runs this file on each rank; every later Trainer in it joins the same two processes,
so one launch runs every scenario:

    python tests/helpers/lightning_sharded.py OUT_DIR

Each rank holds the whole batch list and trains on its own slice of each batch. Rank 0
writes one record per scenario (gathered fp32 weights, losses, LRs, skips) to OUT_DIR.
``fit(devices=1, ...)`` is the one-process reference, run in the test's own process."""

from __future__ import annotations

import os
import sys
import warnings

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy

from mixprec.integrations.lightning import MixedPrecisionPlugin
from mixprec.workbench import GPT, GPTConfig

CFG = GPTConfig(vocab=64, seq_len=32, n_layers=2, d_model=64, n_heads=4)
BATCH = 8


class ShardedGPT(pl.LightningModule):
    """Plain Lightning for ModelParallelStrategy: the layers are built in
    ``configure_model`` and not sharded there (the plugin's engine shards them).
    ``poison``: (step, rank) whose loss is multiplied by inf."""

    def __init__(self, world: int, data: list[torch.Tensor], poison=None) -> None:
        super().__init__()
        self.world, self.gpt, self.data, self.poison = world, None, data, poison
        self.losses: list[float] = []
        self.lrs: list[float] = []

    def configure_model(self) -> None:
        if self.gpt is None:
            torch.manual_seed(0)
            self.gpt = GPT(CFG)

    def training_step(self, batch, batch_idx):
        # by global step, not the loader's position: Lightning restarts a plain
        # DataLoader's epoch on resume, which would change the data, not the numerics
        x = self.data[self.global_step].chunk(self.world)[self.global_rank]
        loss = self.gpt(x[:, :-1], x[:, 1:])
        self.losses.append(loss.item())
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        if self.poison == (self.global_step, self.global_rank):
            loss = loss * float("inf")
        return loss

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, CFG.vocab, (BATCH, CFG.seq_len + 1), generator=g)
            for _ in range(n)]


def fit(devices: int, recipe: str, steps: int, total: int | None = None, save=None,
        resume=None, distributed_checkpoint: bool = False, poison=None) -> dict:
    """One ``Trainer.fit``; the record of what it trained (on every rank)."""
    warnings.simplefilter("ignore")
    strategy = (ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1,
                                      save_distributed_checkpoint=distributed_checkpoint)
                if devices > 1 else "auto")
    plugin = MixedPrecisionPlugin(recipe)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy,
                         max_steps=steps, plugins=[plugin], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False,
                         num_sanity_val_steps=0)
    data = batches(total or steps)
    module = ShardedGPT(devices, data, poison)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=None),
                ckpt_path=resume)
    if save:
        trainer.save_checkpoint(save)
    engine = plugin.engine
    return {"weights": engine.export_state_dict(),  # a collective under FSDP
            "losses": module.losses, "lrs": module.lrs, "world": trainer.world_size,
            "steps": engine.steps, "skipped": int(engine.skipped_steps),
            "model": type(engine.model).__name__,
            "units": sorted({type(m).__name__ for m in engine.model.modules()
                             if type(m).__name__.startswith("FSDP")})}


def main(out: str) -> None:
    records = {
        "fp32": fit(2, "fp32", 6),
        "fp16-master": fit(2, "fp16-master", 6, poison=(2, 1)),
    }
    for kind, dcp in (("file", False), ("distributed", True)):
        path = os.path.join(out, "ck.ckpt" if kind == "file" else "ck")
        records[f"{kind}-part"] = fit(2, "fp16-master", 3, 6, save=path,
                                      distributed_checkpoint=dcp, poison=(2, 1))
        records[f"{kind}-resumed"] = fit(2, "fp16-master", 6, resume=path,
                                         distributed_checkpoint=dcp, poison=(2, 1))
        records[f"{kind}-layout"] = sorted(os.listdir(path)) if dcp else "file"
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(records, os.path.join(out, "records.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
