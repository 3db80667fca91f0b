"""mixprec.integrations.lightning: a LightningModule written for plain Lightning trains
under MixedPrecisionPlugin exactly as mixprec's own loop trains it."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from helpers.paths import HELPERS  # noqa: E402
from mixprec import MixedPrecision, PrecisionSchedule  # noqa: E402
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


def _own_loop(recipe, batches, steps, accum=1, clip=None, clip_call=False):
    """mixprec's own loop over the same module, optimizer, schedule and data; the clip by
    ``max_grad_norm``, or with ``clip_call`` as a trainer asks for it (the engine's
    ``clip_grad_norm_`` at each window's end, torch's norm)."""
    torch.manual_seed(0)
    gpt = GPT(CFG)
    opt = torch.optim.AdamW(gpt.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    engine = MixedPrecision(gpt, opt, recipe, grad_accum_steps=accum,
                            max_grad_norm=None if clip_call else clip)
    losses = []
    it = iter(batches * 10)
    for _ in range(steps):
        for j in range(accum):
            b = next(it)
            with engine.autocast():
                loss = gpt(b[:, :-1], b[:, 1:])
            losses.append(loss.item())
            engine.backward(loss)
            if clip_call and clip and j == accum - 1:
                engine.clip_grad_norm_(clip)
            out = engine.step()
        if not out.skipped:
            sched.step()
    return losses, engine


@pytest.mark.parametrize("recipe", ["bf16-master", "fp16-master",
                                    pytest.param("fp8", marks=pytest.mark.long)])
def test_lightning_trains_as_mixprecs_own_loop_bit_for_bit(recipe):
    """Same seed and data, accumulation over 2 micro-batches (a power of two, so
    Lightning's loss / 2 then scale equals the engine's loss * scale / 2 exactly), and
    clipping at 1.0 (Lightning's gradient_clip_val: the engine's clip_grad_norm_ at each
    window's end): every micro-batch's loss is equal."""
    batches = _batches(8)
    module, trainer = _fit(recipe, batches, 4, accum=2, clip=1.0)
    want, _ = _own_loop(recipe, batches, 4, accum=2, clip=1.0, clip_call=True)
    assert module.losses == want
    plugin = trainer.precision_plugin
    assert isinstance(plugin, MixedPrecisionPlugin) and plugin.engine.steps == 4


def test_the_short_window_at_an_epochs_end_updates_as_lightning_counts_it():
    """One epoch of 7 batches with accumulate_grad_batches=2: Lightning steps after
    batches 2, 4, 6 and 7 (the short window). The engine updates at each, the last
    one through ``backward(last=True)``: the fp32 weights equal mixprec's own loop's,
    whose 7th backward ends the window the same way (loss / 2, as Lightning divides)."""
    batches = _batches(7)
    module = LitGPT()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1,
                         plugins=[MixedPrecisionPlugin("bf16-master")],
                         accumulate_grad_batches=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
    engine = trainer.precision_plugin.engine
    assert trainer.global_step == 4 and engine.steps == 4
    torch.manual_seed(0)
    gpt = GPT(CFG)
    opt = torch.optim.AdamW(gpt.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    own = MixedPrecision(gpt, opt, "bf16-master", grad_accum_steps=2, scheduler=sched)
    for i, b in enumerate(batches):
        with own.autocast():
            loss = gpt(b[:, :-1], b[:, 1:])
        own.backward(loss, last=True if i == 6 else None)
        own.step()
    got = engine.fp32_state_dict()
    assert all(torch.equal(got["gpt." + k], v) for k, v in own.fp32_state_dict().items())


def test_skipped_steps_do_not_advance_the_scheduler():
    batches = _batches(6)
    module, trainer = _fit("fp16-master", batches, 6, module=LitGPT(poison={1, 3}))
    engine = trainer.precision_plugin.engine
    assert int(engine.skipped_steps) == 2
    sched = trainer.lr_scheduler_configs[0].scheduler
    assert sched.last_epoch == 4  # 6 steps, 2 skipped
    # the lr of each step: held over each skipped step
    assert module.lrs == [3e-3 / k for k in (1, 2, 2, 3, 3, 4)]


@pytest.mark.paths
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


def test_lightning_ddp_on_two_cpu_processes_agrees_on_skips_and_weights(tmp_path):
    """``examples/lightning_train.py --devices 2``: Lightning's DDP strategy on 2 gloo
    processes, each rank on its own batches, rank 1's loss inf at step 3. The plugin
    swaps Lightning's DDP for the engine's: both ranks skip step 3 and end with the same
    fp32 weights (sha256), which only a gradient reduction gives from different data."""
    import sys

    from helpers.launch import two_rank_records
    from helpers.paths import EXAMPLES

    out = tmp_path / "run.json"
    r0, r1 = two_rank_records(
        [sys.executable, str(EXAMPLES / "lightning_train.py"), "--devices", "2",
         "--recipe", "fp16-master", "--steps", "6", "--accumulate", "2", "--inject-inf",
         "3:1", "--out", str(out), "--save", str(tmp_path / "last.ckpt")], out, tmp_path)
    assert r0["ddp"] == "DistributedDataParallel"
    assert r0["steps"] == r1["steps"] == 6 and r0["skipped"] == r1["skipped"] == 1
    assert r0["weights"] == r1["weights"]


def _fabric_loop(recipe, batches, accum=1, poison=(), ckpt=None, resume=None, start=0):
    """A Fabric loop with ``setup_fabric``: backward and step every micro-batch."""
    from lightning.fabric import Fabric

    from mixprec.integrations.lightning import setup_fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    torch.manual_seed(0)
    gpt = GPT(CFG)
    opt = torch.optim.AdamW(gpt.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    model, optimizer, scheduler = setup_fabric(fabric, gpt, opt, recipe=recipe,
                                               scheduler=sched, grad_accum_steps=accum,
                                               max_grad_norm=1.0)
    engine = optimizer.engine
    if resume is not None:
        fabric.load(resume, {"mixprec": engine})
    losses, lrs = [], []
    for i, b in enumerate(batches[start:], start):
        loss = model(b[:, :-1], b[:, 1:])
        losses.append(loss.item())
        if i // accum in poison:
            loss = loss * float("inf")
        fabric.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        lrs.append(scheduler.get_last_lr()[0])
        if ckpt is not None and i == len(batches) // 2 - 1:
            fabric.save(ckpt, {"mixprec": engine})
    return losses, lrs, engine


@pytest.mark.parametrize("recipe", ["bf16-master", "fp16-master",
                                    pytest.param("fp8", marks=pytest.mark.long)])
def test_fabric_loop_trains_as_mixprecs_own_loop_bit_for_bit(recipe):
    batches = _batches(8)
    losses, _, engine = _fabric_loop(recipe, batches, accum=2)
    want, own = _own_loop(recipe, batches, 4, accum=2, clip=1.0)
    assert losses == want and engine.steps == own.steps == 4
    got, exp = engine.fp32_state_dict(), own.fp32_state_dict()
    assert all(torch.equal(got[k], exp[k]) for k in exp)


@pytest.mark.paths
def test_fabric_skips_hold_the_scheduler_and_fabric_save_resumes_bit_for_bit(tmp_path):
    _, lrs, engine = _fabric_loop("fp16-master", _batches(6), poison={1, 3})
    assert int(engine.skipped_steps) == 2
    assert lrs == [3e-3 / k for k in (2, 2, 3, 3, 4, 5)]
    data = _batches(6)
    full, _, whole = _fabric_loop("bf16-master", data, ckpt=tmp_path / "f.ckpt")
    rest, _, resumed = _fabric_loop("bf16-master", data, resume=tmp_path / "f.ckpt", start=3)
    assert rest == full[3:] and resumed.steps == whole.steps == 6
    got, exp = resumed.fp32_state_dict(), whole.fp32_state_dict()
    assert all(torch.equal(got[k], exp[k]) for k in exp)


def test_setup_fabric_refuses_fabrics_own_precision():
    from lightning.fabric import Fabric

    from mixprec.integrations.lightning import setup_fabric

    gpt = GPT(CFG)
    with pytest.raises(ValueError, match="32-true"):
        setup_fabric(Fabric(accelerator="cpu", devices=1, precision="bf16-mixed"), gpt,
                     torch.optim.AdamW(gpt.parameters()), recipe="bf16-master")


@pytest.mark.long  # Lightning's Trainer launches the same 2-process DDP check above
def test_fabric_ddp_on_two_cpu_processes_agrees_on_skips_and_weights(tmp_path):
    """``examples/fabric_train.py --devices 2``: Fabric's DDP launch (gloo), the
    engine's DDP, each rank on its own batches, rank 1's fp16 loss inf at step 3: both
    ranks skip it and end with the same fp32 weights (sha256)."""
    import sys

    from helpers.launch import two_rank_records
    from helpers.paths import EXAMPLES

    rec = tmp_path / "run.json"
    r0, r1 = two_rank_records(
        [sys.executable, str(EXAMPLES / "fabric_train.py"), "--devices", "2", "--recipe",
         "fp16-master", "--steps", "6", "--inject-inf", "3:1", "--record", str(rec)],
        rec, tmp_path)
    assert r0["model"] == "DistributedDataParallel"
    assert r0["steps"] == r1["steps"] == 6 and r0["skipped"] == r1["skipped"] == 1
    assert r0["weights"] == r1["weights"]


# --- the frameworks' own clip calls ----------------------------------------------------

class LitMLP(pl.LightningModule):
    """Plain Lightning; ``poison``: global steps whose loss is multiplied by inf."""

    def __init__(self, poison=()):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                       torch.nn.Linear(32, 4))
        self.poison = set(poison)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        return loss * float("inf") if self.global_step in self.poison else loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _mlp_batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
            for _ in range(n)]


def _fit_mlp(plugins, clip, algorithm=None, module=None, steps=4):
    module = module or LitMLP()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, plugins=plugins,
                         gradient_clip_val=clip, gradient_clip_algorithm=algorithm,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, torch.utils.data.DataLoader(_mlp_batches(steps),
                                                        batch_size=None))
    return module, trainer


def test_lightning_gradient_clip_val_clips_as_plain_lightning_does():
    """Trainer(gradient_clip_val=1e-3) clips every update. Under fp32,master=fp32 the
    trained weights equal plain Lightning's bit for bit; by value is refused with the
    fix."""
    plain, _ = _fit_mlp([], 1e-3)
    ours, trainer = _fit_mlp([MixedPrecisionPlugin("fp32,master=fp32")], 1e-3)
    engine = trainer.precision_plugin.engine
    want = plain.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in engine.export_state_dict().items())
    free, _ = _fit_mlp([], None)
    assert not torch.equal(free.net[0].weight, plain.net[0].weight)  # the clip mattered
    with pytest.raises(NotImplementedError, match="gradient_clip_algorithm='norm'"):
        _fit_mlp([MixedPrecisionPlugin("bf16-master")], 0.5, algorithm="value")


def test_fabric_clip_gradients_returns_the_true_norm_and_skips_an_overflow():
    """fabric.clip_gradients(model, optimizer, max_norm=...) under fp16-master: the norm
    of the unscaled fp32 gradients (the loss scale divided out), and the clip of that
    update; on an inf loss it returns a non-finite norm, nothing raises, and the step is
    skipped with the masters unchanged."""
    from lightning.fabric import Fabric

    from mixprec.integrations.lightning import setup_fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    net = LitMLP().net
    model, optimizer = setup_fabric(fabric, net, torch.optim.SGD(net.parameters(), lr=0.1),
                                    recipe="fp16-master")
    engine = optimizer.engine
    for i, (x, y) in enumerate(_mlp_batches(4)):
        with engine.autocast():
            loss = torch.nn.functional.cross_entropy(model(x), y)
        fabric.backward(loss * float("inf") if i == 2 else loss)
        before = [m.detach().clone() for m in engine.master_params]
        scale = engine.scale.double()
        grads = [g.double() / scale for g in engine.param_state.gradients()]
        norm = fabric.clip_gradients(model, optimizer, max_norm=1e-3)
        optimizer.step()
        if i == 2:
            assert not torch.isfinite(norm) and optimizer.step_was_skipped
            assert all(torch.equal(a, b) for a, b in zip(before, engine.master_params))
            continue
        true = float(sum((g ** 2).sum() for g in grads).sqrt())
        assert abs(float(norm) / true - 1) <= 1e-5 and float(scale) > 1
        coef = min(1.0, 1e-3 / (true + 1e-6))
        for w0, g, w in zip(before, grads, engine.master_params):
            torch.testing.assert_close(w.double(), w0.double() - 0.1 * coef * g,
                                       rtol=1e-6, atol=1e-9)
    with pytest.raises(NotImplementedError, match="max_norm"):
        fabric.clip_gradients(model, optimizer, clip_val=0.5)


class _EpochLR(LitMLP):
    """A StepLR (step_size=1, gamma=0.5) stepped per epoch; 2 batches an epoch."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}

    def on_train_epoch_start(self):
        self.epoch_lrs = getattr(self, "epoch_lrs", [])
        self.epoch_lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])


def test_a_skip_at_an_epochs_end_does_not_hold_a_per_epoch_scheduler():
    """fp16 with the last step of epoch 0 overflowing (global step 1 of 2 per epoch): the
    step is skipped, and the per-epoch StepLR still halves at each epoch's end, as plain
    Lightning's does over the same epochs."""
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=3,
                         plugins=[MixedPrecisionPlugin("fp16-master")], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    module = _EpochLR(poison={1})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, torch.utils.data.DataLoader(_mlp_batches(2), batch_size=None))
    assert int(trainer.precision_plugin.engine.skipped_steps) == 1
    assert module.epoch_lrs == [0.1, 0.05, 0.025]


def test_fabrics_own_accumulation_pattern_with_no_backward_sync():
    """Fabric's documented accumulation loop (no_backward_sync on the micro-batches that
    accumulate, optimizer.step() at the window's end) under setup_fabric(
    grad_accum_steps=2) updates once per window, exactly as stepping every micro-batch
    does; without grad_accum_steps it is refused, naming it."""
    from lightning.fabric import Fabric

    from mixprec.integrations.lightning import setup_fabric

    def run(fabric_style):
        fabric = Fabric(accelerator="cpu", devices=1)
        net = LitMLP().net
        model, optimizer = setup_fabric(fabric, net, torch.optim.SGD(net.parameters(),
                                                                     lr=0.1),
                                        recipe="bf16-master", grad_accum_steps=2)
        for i, (x, y) in enumerate(_mlp_batches(6)):
            accumulating = i % 2 == 0
            ctx = (fabric.no_backward_sync(model, enabled=accumulating) if fabric_style
                   else contextlib.nullcontext())
            with ctx, optimizer.engine.autocast():
                fabric.backward(torch.nn.functional.cross_entropy(model(x), y))
            if not fabric_style or not accumulating:
                optimizer.step()
        return optimizer.engine

    a, b = run(True), run(False)
    assert a.steps == b.steps == 3
    assert all(torch.equal(p, q) for p, q in zip(a.master_params, b.master_params))
    fabric = Fabric(accelerator="cpu", devices=1)
    net = LitMLP().net
    model, optimizer = setup_fabric(fabric, net, torch.optim.SGD(net.parameters(), lr=0.1),
                                    recipe="bf16-master")
    with pytest.raises(ValueError, match="grad_accum_steps=k"):
        with fabric.no_backward_sync(model):
            pass


def test_an_overflow_under_gradient_clip_val_is_skipped_and_nothing_raises():
    """fp16 with gradient_clip_val=1.0 and an inf loss at step 1: Lightning's clip call
    reaches the engine, which skips the step (masters unchanged) instead of raising."""
    module, trainer = _fit_mlp([MixedPrecisionPlugin("fp16-master")], 1.0,
                               module=LitMLP(poison={1}))
    engine = trainer.precision_plugin.engine
    assert int(engine.skipped_steps) == 1 and engine.steps == 4
    assert all(torch.isfinite(m).all() for m in engine.master_params)


def test_model_checkpoint_files_hold_the_fp32_masters(tmp_path):
    """Lightning's own ModelCheckpoint callback under bf16-master: the .ckpt's
    state_dict loads strictly into a plain LightningModule and equals the engine's
    export (the fp32 masters) bit for bit."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3,
                         plugins=[MixedPrecisionPlugin("bf16-master")], logger=False,
                         callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3)],
                         enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(LitMLP(), torch.utils.data.DataLoader(_mlp_batches(3), batch_size=None))
    (path,) = tmp_path.glob("*.ckpt")
    saved = torch.load(path, weights_only=False)["state_dict"]
    plain = LitMLP()
    plain.load_state_dict(saved)  # strictly
    want = trainer.precision_plugin.engine.export_state_dict()
    assert saved.keys() == want.keys()
    assert all(saved[k].dtype == torch.float32 and torch.equal(saved[k], want[k])
               for k in want)
    w = trainer.precision_plugin.engine.param_state.working[0]
    assert w.dtype == torch.bfloat16 or trainer.precision_plugin.engine.emulating


@pytest.fixture(scope="module")
def sharded_records(tmp_path_factory):
    """tests/helpers/lightning_sharded.py on 2 gloo processes under ModelParallelStrategy: every
    scenario's record (rank 0's), and the checkpoint directory."""
    import os
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("sharded")
    script = HELPERS / "lightning_sharded.py"
    run = subprocess.run([sys.executable, str(script), str(out)], cwd=out,
                         env={**os.environ, "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return torch.load(out / "records.pt", weights_only=False), out


def _one_process(recipe, poison=None):
    from helpers import lightning_sharded as s

    return s.fit(1, recipe, 6, poison=poison)


def _rel(a, b):
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in b)


@pytest.mark.parametrize("recipe,tol", [
    ("fp32", 1e-5), pytest.param("fp16-master", 2e-2, marks=pytest.mark.long)])
def test_model_parallel_strategy_on_two_ranks_trains_as_one_process(sharded_records,
                                                                    recipe, tol):
    """Lightning's ModelParallelStrategy drives; the engine shards (FSDP2: each block,
    the GPT, the LightningModule). Two ranks of 4 samples end where one process of 8
    does, within the FSDP tolerance. Under fp16-master rank 1's loss is inf at step 2:
    the step is skipped on both ranks and the LR sequence is plain Lightning's with
    that step's advance removed."""
    records, _ = sharded_records
    two = records[recipe]
    assert two["world"] == 2 and two["model"] == "FSDPShardedGPT"
    assert {"FSDPBlock", "FSDPGPT"} <= set(two["units"])
    one = _one_process(recipe, poison=(2, 0) if recipe == "fp16-master" else None)
    assert _rel(two["weights"], one["weights"]) <= tol
    plain = [0.5 / (1 + s) for s in range(6)]  # LambdaLR on lr=0.5
    if recipe == "fp16-master":
        assert two["skipped"] == one["skipped"] == 1
        plain = plain[:3] + plain[2:5]  # step 2 skipped: its advance held back
    assert two["lrs"] == one["lrs"] == pytest.approx(plain, abs=0)


@pytest.mark.parametrize("kind", ["file", "distributed"])
def test_model_parallel_strategy_checkpoints_resume_bit_for_bit(sharded_records, kind):
    """``trainer.save_checkpoint`` after 3 steps (one file, or Lightning's distributed
    checkpoint: one shard file per rank), then a fresh Trainer with ``ckpt_path`` for 3
    more: the same losses, skips and fp32 weights as 6 steps in one go."""
    records, out = sharded_records
    full, part, resumed = (records["fp16-master"], records[f"{kind}-part"],
                           records[f"{kind}-resumed"])
    assert part["losses"] + resumed["losses"] == full["losses"]
    assert part["lrs"] + resumed["lrs"] == full["lrs"]
    assert resumed["steps"] == 6 and resumed["skipped"] == full["skipped"] == 1
    assert all(torch.equal(resumed["weights"][k], v) for k, v in full["weights"].items())
    if kind == "distributed":
        assert {"__0_0.distcp", "__1_0.distcp"} <= set(records["distributed-layout"])
        return
    # the file's weights are the gathered fp32 masters, keyed as the plain module's
    from helpers import lightning_sharded as s

    saved = torch.load(out / "ck.ckpt", weights_only=False)["state_dict"]
    plain = s.ShardedGPT(1, [])
    plain.configure_model()
    plain.load_state_dict(saved)  # strictly
    assert all(v.dtype == torch.float32 for v in saved.values())
    assert all(torch.equal(saved[k], v) for k, v in part["weights"].items())


def test_model_parallel_strategy_refusals_name_the_fix():
    """What the engine cannot shard is refused at set-up, naming the fix: a
    configure_model that shards itself. Lightning's FSDPStrategy (FSDP1) takes no
    precision plugin but its own FSDPPrecision: Lightning refuses, before mixprec runs."""
    import os

    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    from helpers import lightning_sharded as s

    before = dict(os.environ)  # Lightning writes MASTER_PORT and the ranks there

    class SelfSharded(s.ShardedGPT):
        def configure_model(self):
            super().configure_model()
            fully_shard(self.gpt)

    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False,
                         strategy=ModelParallelStrategy(),
                         plugins=[MixedPrecisionPlugin("bf16-master")],
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    data = s.batches(1)
    try:
        with pytest.raises(NotImplementedError, match="Remove the fully_shard calls"):
            trainer.fit(SelfSharded(1, data), torch.utils.data.DataLoader(data, batch_size=None))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(before)
    from lightning.pytorch.strategies import FSDPStrategy

    with pytest.raises(TypeError, match="FSDPPrecision"):  # the Trainer sets it so
        FSDPStrategy().precision_plugin = MixedPrecisionPlugin("bf16-master")


@pytest.mark.parametrize("recipe", ["bf16-master", "fp8"])
def test_fabric_save_of_the_model_writes_the_masters_and_fabric_load_sets_them(tmp_path,
                                                                               recipe):
    """Fabric's guide: ``fabric.save(path, {"model": model, "optimizer": optimizer,
    "step": 3})`` and ``fabric.load(path, state)``. The model's entry is the fp32
    masters (no fp8 scaling state), which load strictly into the plain GPT; loading it
    into a fresh engine sets its masters bit for bit, its working copy to their
    rounding, and the next steps run."""
    from lightning.fabric import Fabric

    from mixprec.integrations.lightning import setup_fabric

    def build():
        fabric = Fabric(accelerator="cpu", devices=1)
        torch.manual_seed(0)
        gpt = GPT(CFG)
        opt = torch.optim.AdamW(gpt.parameters(), lr=3e-3)
        return (fabric, *setup_fabric(fabric, gpt, opt, recipe=recipe))

    data = _batches(4)
    fabric, model, optimizer = build()
    for b in data[:3]:
        fabric.backward(model(b[:, :-1], b[:, 1:]))
        optimizer.step()
    engine = optimizer.engine
    path = tmp_path / "f.ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 3})
    saved = torch.load(path, weights_only=False)
    want = engine.export_state_dict()
    assert saved["model"].keys() == want.keys()
    assert all(torch.equal(saved["model"][k], v) and v.dtype == torch.float32
               for k, v in want.items())
    GPT(CFG).load_state_dict(saved["model"])  # strictly, into the plain model

    fabric2, model2, optimizer2 = build()
    state = {"model": model2, "optimizer": optimizer2, "step": 0}
    remainder = fabric2.load(path, state)
    assert state["step"] == 3 and state["model"] is model2 and remainder == {}
    fresh = optimizer2.engine
    got = fresh.export_state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())
    assert all(torch.equal(a, b) for a, b in zip(fresh.param_state.working,
                                                 engine.param_state.working))
    assert optimizer2.state_dict()["state"].keys() == optimizer.state_dict()["state"].keys()
    fabric2.backward(model2(data[3][:, :-1], data[3][:, 1:]))
    assert not optimizer2.step() and fresh.steps == 1  # the weights' writer is the engine


SCHEDULE = "nvfp4>bf16-master@0.8"


def test_a_precision_schedule_fits_as_your_own_loop_trains_it():
    """NVFP4, then bf16 with fp32 masters for the last 20% of the fit's optimizer steps
    (``estimated_stepping_batches``): the plugin's engine switches after step 4 of 5,
    and every loss equals mixprec's own loop under the same schedule."""
    batches = _batches(5)
    module, trainer = _fit(SCHEDULE, batches, 5)
    engine = trainer.precision_plugin.engine
    assert engine.phase == 1 and str(engine.recipe) == "bf16-master" and engine.steps == 5
    assert engine.schedule.starts() == (0, 4)
    # the own loop trains a LitGPT too: NVFP4's rounding streams are seeded by the
    # Linears' names, which carry the module's "gpt." prefix
    lit = LitGPT()
    opt = torch.optim.AdamW(lit.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    own = MixedPrecision(lit, opt, PrecisionSchedule.parse(SCHEDULE, total_steps=5))
    want = []
    for b in batches:
        with own.autocast():
            loss = lit.gpt(b[:, :-1], b[:, 1:])
        want.append(loss.item())
        own.backward(loss)
        if not own.step().skipped:
            sched.step()
    assert module.losses == want and own.phase == 1


@pytest.mark.long
def test_a_scheduled_fit_resumes_mid_phase_bit_for_bit(tmp_path):
    """Saved at step 2 (in the NVFP4 phase): the resumed fit switches at step 4 as the
    fit in one go does, with the same losses and fp32 weights. The schedule's length is
    given (the first fit stops early, so its own would be 2 steps)."""
    schedule = PrecisionSchedule.parse(SCHEDULE, total_steps=5)
    data = _batches(5)
    full, t_full = _fit(schedule, data, 5, module=LitGPT(by_step=data))
    part, trainer = _fit(schedule, data, 2, module=LitGPT(by_step=data))
    trainer.save_checkpoint(tmp_path / "ck.ckpt")
    resumed, t_res = _fit(schedule, data, 5, module=LitGPT(by_step=data),
                          ckpt=str(tmp_path / "ck.ckpt"))
    assert part.losses + resumed.losses == full.losses
    got = t_res.precision_plugin.engine.fp32_state_dict()
    want = t_full.precision_plugin.engine.fp32_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
