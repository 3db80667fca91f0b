"""The composition matrix's Lightning cells (tests/integrations/test_lightning_matrix.py):
Lightning's own ``Trainer`` with mixprec's ``MixedPrecisionPlugin`` on the matrix's MLP
(tests/helpers/matrix_workers.py), one launch running every scenario in turn:

    python -m torch.distributed.run --nproc-per-node 2 tests/helpers/lightning_matrix.py \\
        OUT_DIR LAYOUT:RECIPE ...

A scenario fits 6 AdamW steps (``gradient_clip_val=1.0``, a ``ModelCheckpoint`` every 3
steps), then a fresh Trainer resumes from the step-3 checkpoint
(``fit(ckpt_path=...)``) and fits steps 4 to 6 again. Each rank takes its share of every
global batch (the data chosen by the global step, as Lightning restarts a plain
DataLoader's epoch on resume). The record has matrix_workers' shape: the global losses
(the ranks' mean), the engine's grad norms and skips, the quantized Linears, the
coverage, and ``resumed`` (or the error the resume raised); or the error the fit
raised. Rank r writes ``OUT_DIR/records_rank<r>.pt``."""

from __future__ import annotations

import glob
import os
import sys
import traceback
import warnings

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

from helpers import matrix_workers as mw
from mixprec.integrations.lightning import MixedPrecisionPlugin

__all__ = ["STRATEGIES", "MatrixMLP", "Record", "fit", "scenario", "main"]

STEPS = 6


def _ddp(world: int):
    return "ddp"


def _fsdp(world: int):
    return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)


def _fsdp_file(world: int):
    return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1,
                                 save_distributed_checkpoint=False)


def _tp(world: int):
    return ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=world)


#: a layout's Trainer strategy (tests/helpers/matrix_cells.py's ``lightning`` family) and
#: whether its data is split over the ranks; ``lit-user-fsdp``'s ``configure_model``
#: shards the blocks itself
STRATEGIES = {"lit-ddp": (_ddp, True), "lit-fsdp": (_fsdp, True),
              "lit-fsdp-file": (_fsdp_file, True), "lit-tp": (_tp, False),
              "lit-user-fsdp": (_fsdp, True)}


class MatrixMLP(pl.LightningModule):
    """mw.Net as plain Lightning: its layers built in ``configure_model`` (under
    ModelParallelStrategy the plugin's engine shards them), held as the module's own
    children, so the coverage names them as the one-process engine does."""

    def __init__(self, dp_size: int, shard_self: bool = False) -> None:
        super().__init__()
        self.dp_size, self.shard_self = dp_size, shard_self
        self.data = mw.make_data(STEPS)
        self.losses: list[float] = []
        self.blocks = None

    def configure_model(self) -> None:
        if self.blocks is not None:
            return
        net = mw.make_model()
        self.norm, self.blocks, self.head = net.norm, net.blocks, net.head
        if self.shard_self:
            for blk in self.blocks:
                fully_shard(blk)

    def forward(self, x):
        return mw.Net.forward(self, x)

    def training_step(self, batch, batch_idx):
        x, y = self.data[self.global_step]
        per, dp_rank = mw.BATCH // self.dp_size, self.global_rank % self.dp_size
        part = slice(dp_rank * per, (dp_rank + 1) * per)
        loss = F.cross_entropy(self(x[part]), y[part])
        self.losses.append(loss.detach().float().clone())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=mw.LR)


class Record(pl.Callback):
    """Each optimizer step's grad norm and skip, as ``engine.step()`` returns them (the
    plugin's engine, once the fit built it)."""

    def __init__(self) -> None:
        self.norms: list[float] = []
        self.skipped: list[bool] = []

    def on_train_start(self, trainer, module) -> None:
        engine = trainer.precision_plugin.engine
        step = engine.step

        def recorded():
            out = step()
            if not out.accumulating:
                self.norms.append(float(out.grad_norm))
                self.skipped.append(bool(out.skipped))
            return out

        engine.step = recorded


def _global(losses: list[torch.Tensor], dp_size: int) -> list[float]:
    """The global batch's losses: the ranks' mean (as matrix_workers averages them)."""
    seen = torch.stack(losses)
    if dp_size > 1:
        dist.all_reduce(seen)
        seen /= dp_size
    return seen.tolist()


def fit(layout: str, recipe: str, world: int, ckpt_dir: str, resume: str | None = None
        ) -> tuple[dict, MixedPrecisionPlugin, MatrixMLP]:
    """One ``Trainer.fit`` to step 6 (from ``resume``'s checkpoint, if given), saving a
    checkpoint every 3 steps to ``ckpt_dir``: its record, the plugin and the module."""
    strategy, split = STRATEGIES[layout]
    dp_size = world if split else 1
    module = MatrixMLP(dp_size, shard_self=layout == "lit-user-fsdp")
    plugin, record = MixedPrecisionPlugin(recipe), Record()
    callbacks = [record]
    if resume is None:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3,
                                         save_top_k=-1, filename="{step}"))
    trainer = pl.Trainer(accelerator="cpu", devices=world, num_nodes=1,
                         strategy=strategy(world) if world > 1 else "auto",
                         max_steps=STEPS, plugins=[plugin], gradient_clip_val=1.0,
                         callbacks=callbacks, logger=False,
                         enable_checkpointing=resume is None, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False,
                         num_sanity_val_steps=0)
    loader = torch.utils.data.DataLoader(range(STEPS), batch_size=None)
    trainer.fit(module, loader, ckpt_path=resume)
    return ({"losses": _global(module.losses, dp_size), "norms": record.norms,
             "skipped": record.skipped}, plugin, module)


def scenario(layout: str, recipe: str, world: int, out: str) -> dict:
    """A scenario's record: the fit, its coverage, and the resume from step 3."""
    ckpt_dir = os.path.join(out, f"ckpt-{layout}-{recipe}")
    record, plugin, _ = fit(layout, recipe, world, ckpt_dir)
    engine = plugin.engine
    record["quantized"] = mw._quantized(engine.module)
    record["coverage"] = mw._coverage(engine)
    record["kept"] = sorted({r.reason for r in engine.coverage.rows if r.reason})
    record["parallel"] = engine.parallelism.name
    record["checkpoints"] = sorted(os.listdir(ckpt_dir))
    path = glob.glob(os.path.join(ckpt_dir, "step=3*"))
    if len(path) != 1:
        record["resumed"] = {"error": f"no single step-3 checkpoint in {record['checkpoints']}"}
        return record
    try:
        record["resumed"], _, _ = fit(layout, recipe, world, ckpt_dir, resume=path[0])
    except Exception as e:  # noqa: BLE001  the test reads what was raised
        record["resumed"] = {"error": f"{type(e).__name__}: {e}"}
    return record


def main(out: str, scenarios: list[str]) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    records = {"world": world}
    for name in scenarios:
        layout, recipe = name.split(":")
        try:
            records[name] = scenario(layout, recipe, world, out)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # the test reads what was raised (a distributed
            # checkpoint's CheckpointException is a BaseException)
            records[name] = {"error": f"{type(e).__name__}: {e}",
                             "trace": traceback.format_exc()}
        # written after each: a launch a later scenario breaks still shows the earlier
        torch.save(records, os.path.join(out, f"records_rank{rank}.pt"))
        if dist.is_initialized():
            dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
