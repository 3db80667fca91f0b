"""Outside in: tiny transformers mixture-of-experts models trained by Hugging Face's
`Trainer` and Lightning's `Trainer` under low-precision recipes, through each
framework's own calls (its train loop, clip, schedulers, checkpoints and best-model
reload), checked against references computed here: an e4m3 cast by torch's own
float8 dtype, float64 norms, the scheduler's formula, and uninterrupted runs."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers.Trainer needs it

from mixprec.integrations.transformers import MixedPrecisionTrainer  # noqa: E402

V, SEQ = 128, 32
E4M3_MAX = 448.0


def LONG(value):  # noqa: N802  (a parametrize case for CI's long pass: many steps)
    return pytest.param(value, marks=pytest.mark.long)


def _mixtral(seed=0):
    torch.manual_seed(seed)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=V,
        max_position_embeddings=SEQ))


def _qwen3(seed=0):
    torch.manual_seed(seed)
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, vocab_size=V, max_position_embeddings=SEQ))


MODELS = {"mixtral": _mixtral, "qwen3_moe": _qwen3}


def _tokens(n, seed=1):
    """Arithmetic sequences mod V: each next token follows from the two before it, so a
    model that learns shows it in its loss within a few dozen steps."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, V, (n, 1), generator=g)
    stride = torch.randint(1, 8, (n, 1), generator=g)
    return (start + stride * torch.arange(SEQ)) % V


def _rows(coverage, kind):
    return {r.name: r.format for r in coverage.rows if r.kind == kind}


def _flat(state):
    return torch.cat([state[k].detach().double().reshape(-1) for k in sorted(state)])


def _assert_equal_states(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _e4m3(x):
    """fp8-current's cast as the docs define it, by torch's float8 dtype: one scale
    448 / amax per tensor, saturating; returned dequantized in float64."""
    x = x.double()
    s = E4M3_MAX / x.abs().max()
    return (x * s).clamp(-E4M3_MAX, E4M3_MAX).float().to(torch.float8_e4m3fn).double() / s


def _experts_reference(x, idx, w, gate_up, down, quantize):
    """Mixtral's experts forward (transformers' own eager loop) in float64, with each
    expert's GEMM operands passed through `quantize` on that expert's slice only."""
    q = quantize or (lambda t: t.double())
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e in range(gate_up.shape[0]):
        tok, pos = torch.where(idx == e)
        if tok.numel() == 0:
            continue
        g, u = (q(x[tok]) @ q(gate_up[e]).T).chunk(2, dim=-1)
        h = F.silu(g) * u
        y = q(h) @ q(down[e]).T
        out.index_add_(0, tok, y * w[tok, pos, None].double())
    return out


# -- Hugging Face Trainer ----------------------------------------------------------------

def _ds(n, seed=1):
    return [{"input_ids": t, "labels": t} for t in _tokens(n, seed)]


def _args(out, steps, **kw):
    base = dict(output_dir=str(out), max_steps=steps, per_device_train_batch_size=4,
                learning_rate=3e-3, logging_steps=1, report_to=[], use_cpu=True,
                save_strategy="no", disable_tqdm=True, seed=0, max_grad_norm=1.0)
    base.update(kw)
    return transformers.TrainingArguments(**base)


def _losses(trainer):
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


class _Capture:
    """Records the inputs and output of a module's first call."""

    def __init__(self, module):
        self.args = self.out = None
        self.handle = module.register_forward_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs, out):
        if self.args is None:
            self.args = [a.detach().clone() for a in args]
            self.out = (out[0] if isinstance(out, tuple) else out).detach().clone()


def test_hf_trainer_runs_the_experts_in_fp8_and_keeps_the_router_high(tmp_path):
    model = _mixtral()
    w0 = {k: v.detach().clone() for k, v in model.state_dict().items()}
    mlp = model.model.layers[0].mlp
    experts, router = _Capture(mlp.experts), _Capture(mlp.gate)
    trainer = MixedPrecisionTrainer(model=model, args=_args(tmp_path, 2),
                                    train_dataset=_ds(8), recipe="fp8-current")
    trainer.train()

    cov = trainer.engine.coverage
    assert set(_rows(cov, "experts").values()) == {"fp8-current"}
    assert len(_rows(cov, "experts")) == 4  # gate_up and down of both layers
    assert _rows(cov, "router") == {"model.layers.0.mlp.gate": "bf16",
                                    "model.layers.1.mlp.gate": "bf16"}

    # the experts' output of the first training step, against transformers' own experts
    # loop in float64 on e4m3 casts of each expert's tokens and weights: it carries that
    # cast's error (a bf16 run does not), and that error is the same one (an
    # e4m3 cast on other scales or other slices would be as far again). Under autocast
    # the products come out in bf16, whose rounding before the next cast moves some
    # elements to the neighbouring e4m3 value: what is left is a third of the error.
    x, idx, w = experts.args
    gate_up, down = (w0[f"model.layers.0.mlp.experts.{p}"] for p in ("gate_up_proj", "down_proj"))
    fp8 = _experts_reference(x, idx, w, gate_up, down, _e4m3)
    exact = _experts_reference(x, idx, w, gate_up, down, None)
    got = experts.out.double()
    fp8_error = (fp8 - exact).norm()
    assert fp8_error > 0.03 * exact.norm()  # e4m3's 3 mantissa bits, visible at this size
    assert (got - exact).norm() > 0.7 * fp8_error
    assert (got - fp8).norm() < 0.5 * fp8_error

    # the router's logits: a bf16 product at most, nowhere near an e4m3 one
    (h,) = router.args
    ref = h.double().reshape(-1, 64) @ w0["model.layers.0.mlp.gate.weight"].double().T
    err = (router.out.double() - ref).norm()
    fp8_err = (_e4m3(h.reshape(-1, 64)) @ _e4m3(w0["model.layers.0.mlp.gate.weight"]).T
               - ref).norm()
    assert err <= 2 ** -8 * ref.norm()
    assert err < 0.25 * fp8_err

    # FLOPs: a router 2 · tokens · params, an experts projection 2 · (token, expert)
    # pairs · params per expert, counted here from the config
    ids = _tokens(4, seed=5)
    with trainer.engine.autocast():
        flops = trainer.engine.coverage_flops(lambda: model(input_ids=ids, labels=ids))
    tokens, pairs = ids.numel(), ids.numel() * 2  # top-2
    want = {"router": 2 * tokens * 4 * 64, "experts.gate_up_proj": 2 * pairs * 2 * 128 * 64,
            "experts.down_proj": 2 * pairs * 64 * 128}
    for r in flops.rows:
        if r.kind in ("router", "experts"):
            assert r.params == want["router" if r.kind == "router" else
                                    "experts." + r.name.rsplit(".", 1)[1]], r


@pytest.mark.parametrize("recipe", ["fp8-current", LONG("mxfp8"), LONG("nvfp4")])
def test_hf_trainer_trains_a_moe_model_in_each_low_precision_format(recipe, tmp_path):
    trainer = MixedPrecisionTrainer(model=_mixtral(), args=_args(tmp_path, 30),
                                    train_dataset=_ds(64), recipe=recipe)
    trainer.train()
    losses = list(_losses(trainer).values())
    assert len(losses) == 30 and all(math.isfinite(v) for v in losses)
    assert sum(losses[-5:]) / 5 < 0.8 * losses[0]  # ln(128) = 4.85 at the start
    assert trainer.engine.skipped_steps == 0
    assert set(_rows(trainer.engine.coverage, "experts").values()) == {recipe}


class _Masters(transformers.TrainerCallback):
    """The engine's fp32 masters before and after each optimizer step."""

    def __init__(self):
        self.trainer, self.before, self.after = None, [], []

    def _flat(self):
        return _flat(self.trainer.engine.export_state_dict())

    def on_step_begin(self, args, state, control, **kw):
        self.before.append(self._flat())

    def on_step_end(self, args, state, control, **kw):
        self.after.append(self._flat())


def test_hf_max_grad_norm_and_the_lr_schedule_set_each_moe_update(tmp_path):
    """SGD: each update is lr · the clipped gradient, so its float64 norm over the
    masters is the scheduled lr times torch's clip (max_norm / (norm + 1e-6) when below
    1) of the logged true norm."""
    steps, lr, clip = 6, 0.5, 1e-2
    masters = _Masters()
    trainer = MixedPrecisionTrainer(
        model=_mixtral(), args=_args(tmp_path, steps, optim="sgd", learning_rate=lr,
                                     max_grad_norm=clip, lr_scheduler_type="linear"),
        train_dataset=_ds(32), recipe="fp8-current", callbacks=[masters])
    masters.trainer = trainer
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == len(masters.after) == steps
    for t, log in enumerate(logs):
        scheduled = lr * (steps - t) / steps  # linear decay, no warmup
        norm = log["grad_norm"]
        assert log["learning_rate"] == pytest.approx(scheduled, rel=1e-12)
        assert norm > clip  # every update clipped
        update = (masters.after[t] - masters.before[t]).norm().item()
        assert update == pytest.approx(scheduled * clip * norm / (norm + 1e-6), rel=1e-4)


@pytest.mark.parametrize("recipe", ["fp8", LONG("nvfp4")])
def test_hf_gradient_checkpointing_and_evaluations_leave_a_moe_run_unchanged(recipe, tmp_path):
    """Delayed scaling's amax histories and NVFP4's rounding stream are experts state:
    a recomputed forward and an evaluation pass between steps must not move them."""
    def run(out, **kw):
        trainer = MixedPrecisionTrainer(model=_mixtral(), args=_args(out, 4, **kw),
                                        train_dataset=_ds(16), eval_dataset=_ds(8, seed=2),
                                        recipe=recipe)
        trainer.train()
        return _losses(trainer), trainer.engine.export_state_dict()

    losses, weights = run(tmp_path / "plain")
    for kw in ({"gradient_checkpointing": True}, {"eval_strategy": "steps", "eval_steps": 1}):
        other_losses, other_weights = run(tmp_path / next(iter(kw)), **kw)
        assert other_losses == losses, kw
        _assert_equal_states(other_weights, weights)


@pytest.mark.parametrize("recipe", ["fp8-current", "fp8", LONG("nvfp4")])
def test_hf_resume_from_checkpoint_continues_a_moe_run_bit_for_bit(recipe, tmp_path):
    def run(out, resume=None):
        trainer = MixedPrecisionTrainer(
            model=_mixtral(), args=_args(out, 6, save_strategy="steps", save_steps=3),
            train_dataset=_ds(48), recipe=recipe)
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    whole = run(tmp_path / "whole")
    resumed = run(tmp_path / "resumed", resume=str(tmp_path / "whole" / "checkpoint-3"))
    want, got = _losses(whole), _losses(resumed)  # the first 3 come from the checkpoint
    assert [got[s] for s in (4, 5, 6)] == [want[s] for s in (4, 5, 6)]
    _assert_equal_states(resumed.engine.export_state_dict(), whole.engine.export_state_dict())


def test_hf_load_best_model_at_end_restores_the_best_moe_checkpoint(tmp_path):
    """The metric is the eval loss with greater_is_better, so the best checkpoint is the
    earliest one as long as the eval loss falls."""
    trainer = MixedPrecisionTrainer(
        model=_mixtral(),
        args=_args(tmp_path, 6, save_strategy="steps", save_steps=2, eval_strategy="steps",
                   eval_steps=2, load_best_model_at_end=True, metric_for_best_model="loss",
                   greater_is_better=True, per_device_eval_batch_size=8),
        train_dataset=_ds(48), eval_dataset=_ds(8, seed=2), recipe="fp8-current")
    trainer.train()
    evals = {h["step"]: h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h}
    assert sorted(evals) == [2, 4, 6] and evals[2] > evals[4] > evals[6]
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-2")
    best = transformers.MixtralForCausalLM.from_pretrained(trainer.state.best_model_checkpoint)
    _assert_equal_states(trainer.engine.export_state_dict(), best.state_dict())
    assert trainer.evaluate()["eval_loss"] == evals[2]  # the working copy is step 2's too


@pytest.mark.parametrize("recipe", ["fp8-current", "fp8", "nvfp4"])
def test_hf_saved_moe_model_loads_into_plain_transformers(recipe, tmp_path):
    """Strictly: the experts' scaling state (fp8's amax histories, NVFP4's rounding
    stream) stays out of the model files."""
    trainer = MixedPrecisionTrainer(model=_mixtral(), args=_args(tmp_path, 3),
                                    train_dataset=_ds(12), recipe=recipe)
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    config = json.loads((tmp_path / "final" / "config.json").read_text())
    assert "mixprec" not in json.dumps(config)  # a process without mixprec can load it
    plain, info = transformers.MixtralForCausalLM.from_pretrained(
        str(tmp_path / "final"), output_loading_info=True)
    assert not any(info.values()), info
    assert plain.config._experts_implementation != "mixprec"
    _assert_equal_states(plain.state_dict(), trainer.engine.export_state_dict())
    assert next(plain.parameters()).dtype == torch.float32
    ids = _tokens(2, seed=3)
    assert math.isfinite(plain(input_ids=ids, labels=ids).loss.item())


def test_hf_layer_rules_pick_the_experts_format_inside_the_trainer(tmp_path):
    kept = None

    def coverage(recipe, capture=False):
        nonlocal kept
        model = _mixtral()
        if capture:
            kept = _Capture(model.model.layers[0].mlp.experts)
        trainer = MixedPrecisionTrainer(model=model, args=_args(tmp_path, 2),
                                        train_dataset=_ds(8), recipe=recipe)
        trainer.train()
        assert all(math.isfinite(v) for v in _losses(trainer).values())
        return trainer.engine.coverage

    cov = coverage("fp8-current,layer:*.experts=mxfp8")
    assert set(_rows(cov, "experts").values()) == {"mxfp8"}
    assert set(_rows(cov, "attention").values()) == {"fp8-current"}
    plain = _mixtral()  # never converted: transformers' own experts implementation
    cov = coverage("fp8-current,layer:model.layers.0.mlp.experts=bf16", capture=True)
    assert _rows(cov, "experts") == {
        "model.layers.0.mlp.experts.gate_up_proj": "bf16",
        "model.layers.0.mlp.experts.down_proj": "bf16",
        "model.layers.1.mlp.experts.gate_up_proj": "fp8-current",
        "model.layers.1.mlp.experts.down_proj": "fp8-current"}
    # the experts kept in bf16 run the implementation the config had, as plain
    # transformers runs it under bf16 autocast
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = plain.model.layers[0].mlp.experts(*kept.args)
    assert torch.equal(kept.out, want)
    with pytest.warns(UserWarning, match=r"\*\.expert\b"):
        coverage("fp8-current,layer:*.expert=mxfp8")  # no module is called that


@pytest.mark.long
@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_hf_other_moe_families_resume_bit_for_bit_and_reload_plainly(family, tmp_path):
    """DeepSeek-V3 (a shared expert, grouped routing) and GPT-OSS (in x out weights,
    biases per expert, interleaved gate-up) under mxfp8."""
    from helpers import moe_models

    def run(out, resume=None):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(moe_models.config(family))
        trainer = MixedPrecisionTrainer(
            model=model, args=_args(out, 4, save_strategy="steps", save_steps=2),
            train_dataset=_ds(16), recipe="mxfp8")
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    whole = run(tmp_path / "whole")
    assert set(_rows(whole.engine.coverage, "experts").values()) == {"mxfp8"}
    resumed = run(tmp_path / "resumed", resume=str(tmp_path / "whole" / "checkpoint-2"))
    want, got = _losses(whole), _losses(resumed)
    assert [got[s] for s in (3, 4)] == [want[s] for s in (3, 4)]
    masters = whole.engine.export_state_dict()
    _assert_equal_states(resumed.engine.export_state_dict(), masters)
    whole.save_model(str(tmp_path / "final"))
    plain, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "final"), output_loading_info=True)
    assert not any(info.values()), info
    _assert_equal_states(plain.state_dict(), masters)


@pytest.mark.parametrize("how", ["close", "drop"])
def test_hf_closing_or_dropping_the_engine_hands_the_experts_back(how, tmp_path):
    import gc

    model = _mixtral()
    before = model.config._experts_implementation
    trainer = MixedPrecisionTrainer(model=model, args=_args(tmp_path, 2),
                                    train_dataset=_ds(8), recipe="fp8")
    trainer.train()
    assert model.config._experts_implementation == "mixprec"
    masters = trainer.engine.export_state_dict()
    if how == "close":
        trainer.engine.close()
    else:
        del trainer
        gc.collect()
    assert model.config._experts_implementation == before
    plain = _mixtral(seed=1)
    plain.load_state_dict(masters)
    g = torch.Generator().manual_seed(4)
    args = (torch.randn(16, 64, generator=g), torch.randint(0, 4, (16, 2), generator=g),
            torch.rand(16, 2, generator=g))
    with torch.no_grad():  # the experts run transformers' own implementation, in fp32
        got = model.model.layers[0].mlp.experts(*args)
        want = plain.model.layers[0].mlp.experts(*args)
    assert torch.equal(got, want)


# -- Lightning Trainer -------------------------------------------------------------------

def _pl():
    pl = pytest.importorskip("lightning.pytorch")
    from mixprec.integrations.lightning import MixedPrecisionPlugin

    class LitMoE(pl.LightningModule):
        """A plain LightningModule around a transformers MoE model; `losses` holds each
        step's loss by global step."""

        def __init__(self, model, lr=3e-3, optim="adamw", decay=None):
            super().__init__()
            self.model, self.lr, self.optim, self.decay = model, lr, optim, decay
            self.losses = {}

        def training_step(self, batch, batch_idx):
            loss = self.model(input_ids=batch, labels=batch).loss
            self.losses[self.global_step] = loss.item()
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            cls = torch.optim.SGD if self.optim == "sgd" else torch.optim.AdamW
            opt = cls(self.parameters(), lr=self.lr)
            if self.decay is None:
                return opt
            sched = torch.optim.lr_scheduler.LambdaLR(opt, self.decay)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return pl, LitMoE, MixedPrecisionPlugin


def _fit(module, recipe, steps, *, batches=12, ckpt_path=None, callbacks=(), val=None, **kw):
    pl, _, Plugin = _pl()
    loader = torch.utils.data.DataLoader(_tokens(4 * batches), batch_size=4)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, plugins=[Plugin(recipe)],
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=any(isinstance(c, pl.callbacks.ModelCheckpoint)
                                 for c in callbacks),
        callbacks=list(callbacks), **kw)
    trainer.fit(module, loader, val, ckpt_path=ckpt_path)
    return trainer


@pytest.mark.long
@pytest.mark.parametrize("recipe", ["fp8-current", "mxfp8"])
def test_lightning_trains_a_moe_model_with_its_experts_in_the_format(recipe):
    _, LitMoE, _ = _pl()
    module = LitMoE(_qwen3())
    trainer = _fit(module, recipe, 30, gradient_clip_val=1.0)
    losses = [module.losses[s] for s in range(30)]
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-5:]) / 5 < 0.8 * losses[0]
    engine = trainer.precision_plugin.engine
    assert engine.skipped_steps == 0
    cov = engine.coverage
    assert set(_rows(cov, "experts").values()) == {recipe}
    assert len(_rows(cov, "experts")) == 4
    assert set(_rows(cov, "router").values()) == {"bf16"}


def test_lightning_gradient_clip_val_and_its_scheduler_set_each_moe_update():
    """SGD: each update's float64 norm over the masters is the lr the scheduler set for
    that step times gradient_clip_val (every gradient's norm is far above it)."""
    pl, LitMoE, _ = _pl()
    lr, clip, steps = 0.5, 1e-3, 5
    seen = {"lr": [], "before": [], "after": []}

    class Record(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, i):
            seen["lr"].append(trainer.optimizers[0].param_groups[0]["lr"])
            seen["before"].append(_flat(trainer.precision_plugin.engine.export_state_dict()))

        def on_train_batch_end(self, trainer, module, outputs, batch, i):
            seen["after"].append(_flat(trainer.precision_plugin.engine.export_state_dict()))

    module = LitMoE(_mixtral(), lr=lr, optim="sgd", decay=lambda s: 1 / (1 + s))
    _fit(module, "fp8-current", steps, gradient_clip_val=clip, callbacks=[Record()])
    assert seen["lr"] == [lr / (1 + t) for t in range(steps)]
    for t in range(steps):
        update = (seen["after"][t] - seen["before"][t]).norm().item()
        assert update == pytest.approx(seen["lr"][t] * clip, rel=1e-4)


@pytest.mark.parametrize("recipe", ["fp8-current", "fp8", LONG("nvfp4")])
def test_lightning_ckpt_path_resume_continues_a_moe_run_bit_for_bit(recipe, tmp_path):
    """Epochs of 3 batches and a checkpoint at each epoch's end: the resumed run starts
    the second epoch from its first batch, as the uninterrupted run does."""
    pl, LitMoE, _ = _pl()
    whole = LitMoE(_mixtral())
    every3 = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3,
                                          save_top_k=-1, filename="{step}")
    first = _fit(whole, recipe, 6, batches=3, callbacks=[every3])
    resumed = LitMoE(_mixtral(seed=1))  # other weights: the checkpoint must set them
    second = _fit(resumed, recipe, 6, batches=3, ckpt_path=str(tmp_path / "step=3.ckpt"))
    assert sorted(resumed.losses) == [3, 4, 5]
    assert [resumed.losses[s] for s in (3, 4, 5)] == [whole.losses[s] for s in (3, 4, 5)]
    _assert_equal_states(second.precision_plugin.engine.export_state_dict(),
                         first.precision_plugin.engine.export_state_dict())


@pytest.mark.parametrize("recipe", ["fp8-current", "fp8"])
def test_lightning_best_moe_checkpoint_loads_strictly_into_the_plain_module(recipe, tmp_path):
    """The monitored loss in mode "max": the best checkpoint is the step whose loss was
    highest. Its state_dict is that step's masters and loads into an unconverted model."""
    pl, LitMoE, _ = _pl()
    masters = {}

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, i):
            masters[trainer.global_step] = trainer.precision_plugin.engine.export_state_dict()

    module = LitMoE(_mixtral())
    best = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, monitor="train_loss", mode="max",
                                        save_top_k=1, every_n_train_steps=1)
    _fit(module, recipe, 5, callbacks=[best, Record()])
    step = max(module.losses, key=module.losses.get) + 1  # global_step after that update
    ckpt = torch.load(best.best_model_path, weights_only=False)
    assert ckpt["global_step"] == step
    plain = LitMoE(_mixtral(seed=1))
    plain.load_state_dict(ckpt["state_dict"], strict=True)
    _assert_equal_states(plain.state_dict(), masters[step])  # keys as the module names them


def test_lightning_layer_rules_name_the_experts_under_the_lightning_module():
    """The engine is built over the LightningModule, so a rule's full name starts with
    the attribute that holds the model; a `*.` pattern matches either way."""
    _, LitMoE, _ = _pl()

    def experts(recipe):
        trainer = _fit(LitMoE(_mixtral()), recipe, 1)
        return _rows(trainer.precision_plugin.engine.coverage, "experts")

    assert set(experts("fp8-current,layer:*.experts=mxfp8").values()) == {"mxfp8"}
    kept = experts("fp8-current,layer:model.model.layers.0.mlp.experts=bf16")
    assert {k: v for k, v in kept.items() if v == "bf16"} == {
        "model.model.layers.0.mlp.experts.gate_up_proj": "bf16",
        "model.model.layers.0.mlp.experts.down_proj": "bf16"}
    with pytest.warns(UserWarning, match="model.model.layers.0.mlp.experts"):
        experts("fp8-current,layer:model.layers.0.mlp.experts=bf16")  # the model's own name


@pytest.mark.parametrize("recipe", ["fp8-current", "fp8", "bf16-master"])
def test_lightning_validate_best_after_fit_evaluates_the_best_moe_checkpoint(recipe, tmp_path):
    """`trainer.validate(ckpt_path="best")` after `fit` loads the checkpoint into the
    module the engine has cast: the masters, the working copy and the fp8 scaling state
    must be that step's, so the loss equals the one validation logged at that step."""
    pl, LitMoE, _ = _pl()

    class LitVal(LitMoE):
        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self.model(input_ids=batch, labels=batch).loss)

    seen, masters = {}, {}

    class Record(pl.Callback):
        def on_validation_end(self, trainer, module):
            if trainer.state.fn == "fit":
                seen[trainer.global_step] = trainer.callback_metrics["val_loss"].item()
                masters[trainer.global_step] = (
                    trainer.precision_plugin.engine.export_state_dict())

    val = torch.utils.data.DataLoader(_tokens(8, seed=2), batch_size=8)
    module = LitVal(_mixtral())
    best = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", mode="max",
                                        save_top_k=1, save_on_train_epoch_end=False)
    trainer = _fit(module, recipe, 4, callbacks=[best, Record()], val=val,
                   val_check_interval=1, num_sanity_val_steps=0)
    step = torch.load(best.best_model_path, weights_only=False)["global_step"]
    assert sorted(seen) == [1, 2, 3, 4] and step == max(seen, key=seen.get) != 4
    (out,) = trainer.validate(module, val, ckpt_path="best", verbose=False)
    _assert_equal_states(trainer.precision_plugin.engine.export_state_dict(), masters[step])
    assert out["val_loss"] == seen[step]


def test_lightning_validate_and_test_after_fit_keep_the_engine_and_the_experts_in_fp8():
    """Lightning keeps the fit's optimizers on its strategy: a later validate or test
    must run the module under the engine fit built, not a new one (whose predecessor,
    dropped, would hand the experts back to high precision)."""
    pl, LitMoE, _ = _pl()

    class LitVal(LitMoE):
        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self.model(input_ids=batch, labels=batch).loss)

        def test_step(self, batch, batch_idx):
            self.log("test_loss", self.model(input_ids=batch, labels=batch).loss)

    val = torch.utils.data.DataLoader(_tokens(8, seed=2), batch_size=8)
    module = LitVal(_mixtral())
    trainer = _fit(module, "fp8-current", 2, val=val, val_check_interval=2,
                   num_sanity_val_steps=0)
    engine, in_fit = trainer.precision_plugin.engine, trainer.callback_metrics["val_loss"].item()
    losses = [trainer.validate(module, val, verbose=False)[0]["val_loss"] for _ in range(2)]
    losses.append(trainer.test(module, val, verbose=False)[0]["test_loss"])
    assert trainer.precision_plugin.engine is engine
    assert module.model.config._experts_implementation == "mixprec"
    assert losses == [in_fit] * 3
