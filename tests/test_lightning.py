"""mixprec.integrations.lightning: a LightningModule written for plain Lightning trains
under MixedPrecisionPlugin exactly as mixprec's own loop trains it."""

from __future__ import annotations

import warnings

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from mixprec import MixedPrecision  # noqa: E402
from mixprec.integrations.lightning import MixedPrecisionPlugin  # noqa: E402
from mixprec.workbench import GPT, GPTConfig  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")

CFG = GPTConfig(vocab=64, seq_len=32, n_layers=2, d_model=64, n_heads=4)


def _batches(n: int, batch: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, CFG.vocab, (batch, CFG.seq_len + 1), generator=g)
            for _ in range(n)]


class LitGPT(pl.LightningModule):
    """Written for plain Lightning: nothing in it knows about mixprec. ``poison``: the
    global steps whose loss is multiplied by inf (an overflow to skip)."""

    def __init__(self, poison=(), by_step=None):
        super().__init__()
        torch.manual_seed(0)
        self.gpt = GPT(CFG)
        self.poison = set(poison)
        self.by_step = by_step  # batches chosen by global step, not by the loader
        self.losses: list[float] = []
        self.lrs: list[float] = []

    def training_step(self, batch, batch_idx):
        if self.by_step is not None:
            batch = self.by_step[self.global_step]
        loss = self.gpt(batch[:, :-1], batch[:, 1:])
        self.losses.append(loss.item())
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        if self.global_step in self.poison:
            loss = loss * float("inf")
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _trainer(recipe, max_steps, accum=1, clip=None):
    return pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps,
                      plugins=[MixedPrecisionPlugin(recipe)], accumulate_grad_batches=accum,
                      gradient_clip_val=clip, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0)


def _fit(recipe, batches, max_steps, accum=1, clip=None, module=None, ckpt=None):
    module = module or LitGPT()
    trainer = _trainer(recipe, max_steps, accum, clip)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None),
                    ckpt_path=ckpt)
    return module, trainer


def _own_loop(recipe, batches, steps, accum=1, clip=None):
    """mixprec's own loop over the same module, optimizer, schedule and data."""
    torch.manual_seed(0)
    gpt = GPT(CFG)
    opt = torch.optim.AdamW(gpt.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    engine = MixedPrecision(gpt, opt, recipe, grad_accum_steps=accum, max_grad_norm=clip)
    losses = []
    it = iter(batches * 10)
    for _ in range(steps):
        for _ in range(accum):
            b = next(it)
            with engine.autocast():
                loss = gpt(b[:, :-1], b[:, 1:])
            losses.append(loss.item())
            engine.backward(loss)
            out = engine.step()
        if not out.skipped:
            sched.step()
    return losses, engine


@pytest.mark.parametrize("recipe", ["bf16-master", "fp16-master", "fp8"])
def test_lightning_trains_as_mixprecs_own_loop_bit_for_bit(recipe):
    """Same seed and data, accumulation over 2 micro-batches (a power of two, so
    Lightning's loss / 2 then scale equals the engine's loss * scale / 2 exactly), and
    clipping at 1.0: every micro-batch's loss is equal."""
    batches = _batches(8)
    module, trainer = _fit(recipe, batches, 4, accum=2, clip=1.0)
    want, _ = _own_loop(recipe, batches, 4, accum=2, clip=1.0)
    assert module.losses == want
    plugin = trainer.precision_plugin
    assert isinstance(plugin, MixedPrecisionPlugin) and plugin.engine.steps == 4


def test_skipped_steps_do_not_advance_the_scheduler():
    batches = _batches(6)
    module, trainer = _fit("fp16-master", batches, 6, module=LitGPT(poison={1, 3}))
    engine = trainer.precision_plugin.engine
    assert int(engine.skipped_steps) == 2
    sched = trainer.lr_scheduler_configs[0].scheduler
    assert sched.last_epoch == 4  # 6 steps, 2 skipped
    # the lr of each step: held over each skipped step
    assert module.lrs == [3e-3 / k for k in (1, 2, 2, 3, 3, 4)]


def test_resume_from_a_lightning_checkpoint_is_bit_identical(tmp_path):
    """3 steps, ``trainer.save_checkpoint``, then a fresh module and Trainer resume with
    ``ckpt_path`` for 3 more: the same losses as 6 steps in one go. (Each step's batch
    is picked by the global step: Lightning restarts a plain DataLoader's epoch on
    resume, which would change the data, not the numerics under test.) The checkpoint's
    state_dict holds the fp32 weights, which plain Lightning loads strictly."""
    data = _batches(6)
    full, _ = _fit("bf16-master", data, 6, module=LitGPT(by_step=data))
    part, trainer = _fit("bf16-master", data, 3, module=LitGPT(by_step=data))
    ckpt = tmp_path / "ck.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)
    assert all(v.dtype != torch.bfloat16 for v in saved["state_dict"].values())
    LitGPT().load_state_dict(saved["state_dict"])  # strictly, into plain Lightning
    resumed, _ = _fit("bf16-master", data, 6, module=LitGPT(by_step=data), ckpt=str(ckpt))
    assert part.losses + resumed.losses == full.losses


def test_what_the_plugin_refuses_names_the_fix():
    with pytest.raises(ValueError, match="accumulate_grad_batches"):
        MixedPrecisionPlugin("bf16-master", grad_accum_steps=2)
    with pytest.raises(NotImplementedError, match="clips by norm only"):
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False,
                             plugins=[MixedPrecisionPlugin("bf16")], gradient_clip_val=1.0,
                             gradient_clip_algorithm="value", enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(LitGPT(), torch.utils.data.DataLoader(_batches(2), batch_size=None))
