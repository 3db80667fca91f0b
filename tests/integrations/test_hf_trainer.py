"""mixprec.integrations.transformers: a GPT2LMHeadModel from a small config (nothing
downloaded) trains through MixedPrecisionTrainer as mixprec's own loop trains it."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers.Trainer needs it

from helpers import hf_sharded  # noqa: E402  (the model and data its torchrun run trains)
from helpers.paths import HELPERS  # noqa: E402
from mixprec import MixedPrecision, PrecisionSchedule  # noqa: E402
from mixprec.integrations.transformers import MixedPrecisionTrainer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")


def _model():
    """A GPT2LMHeadModel from a small config (the one tests/helpers/hf_sharded.py trains)."""
    return hf_sharded.model()


def _data(n: int):
    return hf_sharded.data(n)


class _Recording(MixedPrecisionTrainer):
    """Records each micro-batch's loss; data in order (no shuffling)."""

    losses: list

    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        self.losses.append(loss.item())
        return loss


def _train(recipe, steps, accum, out, save_steps=None, resume=None, n=32):
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=2,
        gradient_accumulation_steps=accum, learning_rate=3e-3, max_grad_norm=1.0,
        lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0, logging_steps=1000,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        report_to=[], use_cpu=True, seed=0, data_seed=0, dataloader_num_workers=0,
        optim="adamw_torch", disable_tqdm=True)
    t = _Recording(model=_model(), args=args, train_dataset=_data(n), recipe=recipe)
    t.model_accepts_loss_kwargs = False  # the loss of each micro-batch, / accum by Trainer
    t.losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t.train(resume_from_checkpoint=resume)
    return t


def _own_loop(recipe, steps, accum, n=32, decay=()):
    """The same model, data, AdamW (in Trainer's two groups and their order: with decay,
    then without, which orders the clipping norm's sum) and linear schedule."""
    model = _model()
    named = list(model.named_parameters())
    groups = [[p for k, p in named if k in decay], [p for k, p in named if k not in decay]]
    opt = torch.optim.AdamW([{"params": g} for g in groups if g], lr=3e-3, weight_decay=0.0)
    sched = transformers.get_linear_schedule_with_warmup(opt, 0, steps)
    engine = MixedPrecision(model, opt, recipe, grad_accum_steps=accum)
    data = _data(n)
    losses, i = [], 0
    for _ in range(steps):
        for j in range(accum):
            ids = torch.stack([data[(i + k) % n]["input_ids"] for k in range(2)])
            i += 2
            with engine.autocast():  # no KV cache, as Trainer trains (README: emulation)
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            losses.append(loss.item())
            engine.backward(loss)
            if j == accum - 1:  # Trainer's clip to max_grad_norm, at the window's end
                engine.clip_grad_norm_(1.0)
            out = engine.step()
        if not out.skipped:
            sched.step()
    return losses


@pytest.mark.parametrize("recipe", ["bf16-master", "fp16-master",
                                    pytest.param("fp8", marks=pytest.mark.long)])
def test_trainer_with_accumulation_4_trains_as_the_engine_bit_for_bit(recipe, tmp_path):
    t = _train(recipe, 3, 4, tmp_path)
    decay = set(t.get_decay_parameter_names(t.model))
    assert t.losses == _own_loop(recipe, 3, 4, decay=decay)
    assert t.engine.steps == 3 and t.engine.grad_accum_steps == 4


def test_the_short_window_at_an_epochs_end_updates(tmp_path):
    """One epoch of 7 micro-batches (14 samples, batch 2) with accumulation 2: Trainer
    steps after 2, 4, 6 and 7, dividing the last loss by 1 (its window's length). The
    engine updates at each: losses and fp32 weights equal mixprec's own loop ending its
    last window with ``backward(last=True)``."""
    t = _train("bf16-master", 4, 2, tmp_path, n=14)
    assert t.engine.steps == 4 and t.state.global_step == 4
    decay = set(t.get_decay_parameter_names(t.model))
    model = _model()
    named = list(model.named_parameters())
    groups = [[p for k, p in named if k in decay], [p for k, p in named if k not in decay]]
    opt = torch.optim.AdamW([{"params": g} for g in groups if g], lr=3e-3, weight_decay=0.0)
    sched = transformers.get_linear_schedule_with_warmup(opt, 0, 4)
    engine = MixedPrecision(model, opt, "bf16-master", grad_accum_steps=2, scheduler=sched)
    data, losses = _data(14), []
    for i in range(7):
        ids = torch.stack([data[2 * i + k]["input_ids"] for k in range(2)])
        with engine.autocast():
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        losses.append(loss.item())
        if i < 6:
            engine.backward(loss)
        else:  # the window of one, as Trainer divides it (by 1)
            engine.backward(loss, divided=True, last=True)
        if i % 2 == 1 or i == 6:  # Trainer's clip to max_grad_norm, at each window's end
            engine.clip_grad_norm_(1.0)
        engine.step()
    assert t.losses == losses
    got, want = t.engine.fp32_state_dict(), engine.fp32_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.paths
def test_resume_from_checkpoint_continues_bit_identically(tmp_path):
    full = _train("fp16-master", 6, 1, tmp_path / "full")
    part = _train("fp16-master", 6, 1, tmp_path / "part", save_steps=3)
    ckpt = tmp_path / "part" / "checkpoint-3"
    assert (ckpt / "mixprec_engine.pt").exists()
    loaded = transformers.GPT2LMHeadModel.from_pretrained(ckpt)  # fp32 weights, strictly
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
    resumed = _train("fp16-master", 6, 1, tmp_path / "part", resume=str(ckpt))
    assert part.losses == full.losses
    assert resumed.losses == full.losses[3:]


def test_bf16_arguments_are_refused_with_the_fix(tmp_path):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), bf16=True, use_cpu=True,
                                          report_to=[])
    with pytest.raises(ValueError, match="leave them False"):
        MixedPrecisionTrainer(model=_model(), args=args, train_dataset=_data(4),
                              recipe="bf16-master")


def test_trainer_ddp_on_two_cpu_processes_agrees_on_skips_and_weights(tmp_path):
    """``torchrun --nproc-per-node 2 examples/hf_trainer_train.py``: Trainer runs the
    engine's own DDP (Accelerate wraps only the optimizer and the data), each rank on
    its shard of the data, accumulation 2, rank 1's fp16 loss inf at step 3. Both ranks
    skip it and end with the same fp32 weights (sha256), which only a gradient reduction
    gives from different data."""
    import sys

    from helpers.launch import free_port, two_rank_records
    from helpers.paths import EXAMPLES

    rec = tmp_path / "run.json"
    r0, r1 = two_rank_records(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), str(EXAMPLES / "hf_trainer_train.py"),
         "--recipe", "fp16-master", "--steps", "6", "--accumulate", "2", "--inject-inf",
         "3:1", "--out", str(tmp_path / "o"), "--record", str(rec)], rec, tmp_path)
    assert r0["model"] == "DistributedDataParallel"
    assert r0["steps"] == r1["steps"] == 6 and r0["skipped"] == r1["skipped"] == 1
    assert r0["weights"] == r1["weights"]


class _Norms(transformers.TrainerCallback):
    """Trainer's logged ``grad_norm`` of each step (logging_steps=1), and before each
    optimizer step the float64 norm of the engine's gradients over its loss scale."""

    def __init__(self):
        self.norms, self.true = [], []
        self.trainer = None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        engine = getattr(self.trainer, "engine", None)
        if engine is not None:
            scale = engine.scale.double()
            sq = sum(((g.double() / scale) ** 2).sum() for g in
                     engine.param_state.gradients())
            self.true.append(float(sq.sqrt()))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "grad_norm" in logs:
            self.norms.append(logs["grad_norm"])


def _logged_norms(trainer_cls, steps, out, **kw):
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=2,
        learning_rate=3e-3, max_grad_norm=1e-3, logging_steps=1, report_to=[],
        use_cpu=True, seed=0, data_seed=0, save_strategy="no", disable_tqdm=True,
        optim="adamw_torch", weight_decay=0.0)
    norms = _Norms()
    t = trainer_cls(model=_model(), args=args, train_dataset=_data(8), callbacks=[norms],
                    **kw)
    norms.trainer = t
    t._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(
        t.train_dataset)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t.train()
    return t, norms


def test_trainer_logs_the_true_grad_norm_and_clips_to_max_grad_norm(tmp_path):
    """Trainer's own ``max_grad_norm`` clip and its logged ``grad_norm``: under
    ``fp32,master=fp32`` the logged norms and the trained weights equal plain Trainer's
    exactly (max_grad_norm=1e-3, so every update is clipped); under ``fp16-master`` the
    logged norm is the norm of the unscaled gradients (the loss scale divided out)."""
    plain, want = _logged_norms(transformers.Trainer, 3, tmp_path / "plain")
    ours, got = _logged_norms(MixedPrecisionTrainer, 3, tmp_path / "ours",
                              recipe="fp32,master=fp32")
    assert len(want.norms) == 3 and got.norms == want.norms
    plain_sd = plain.model.state_dict()
    assert all(torch.equal(v, plain_sd[k]) for k, v in ours.engine.export_state_dict().items())
    for recipe in ("bf16-master", "fp16-master"):
        half, got = _logged_norms(MixedPrecisionTrainer, 3, tmp_path / recipe, recipe=recipe)
        assert len(got.norms) == len(got.true) == 3
        for n, t in zip(got.norms, got.true):
            assert abs(n / t - 1) <= 1e-5, (recipe, n, t)
    assert float(half.engine.scale) > 1  # fp16: the gradients were scaled


def test_load_best_model_at_end_restores_the_best_checkpoints_masters(tmp_path):
    """load_best_model_at_end with the highest eval loss as "best" (an early
    checkpoint, not the last): after train(), save_model writes that checkpoint's
    fp32 masters, bit for bit, as plain Trainer writes its best weights."""
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "run"), max_steps=3, per_device_train_batch_size=2,
        learning_rate=3e-2, eval_strategy="steps", eval_steps=1, save_strategy="steps",
        save_steps=1, load_best_model_at_end=True, metric_for_best_model="eval_loss",
        greater_is_better=True, report_to=[], use_cpu=True, disable_tqdm=True, seed=0)
    t = MixedPrecisionTrainer(model=_model(), args=args, train_dataset=_data(8),
                              eval_dataset=_data(4), recipe="bf16-master")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t.train()
    best = t.state.best_model_checkpoint
    assert best is not None and not best.endswith("checkpoint-3")  # not the last
    state = torch.load(f"{best}/mixprec_engine.pt", weights_only=True)
    t.save_model(str(tmp_path / "final"))
    final = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "final")
    names = [n for n, p in t.model.named_parameters() if p.requires_grad]
    got = dict(final.named_parameters())
    for name, master in zip(names, state["engine"]["masters"], strict=True):
        assert torch.equal(got[name].detach(), master), name


def test_a_second_train_on_the_same_trainer_goes_on_with_the_same_engine(tmp_path):
    """trainer.train() twice, as plain Trainer allows: the second call keeps the engine
    (and its masters) and trains max_steps more, with evaluate() and predict() between."""
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2,
        report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0)
    t = MixedPrecisionTrainer(model=_model(), args=args, train_dataset=_data(8),
                              eval_dataset=_data(4), recipe="bf16-master")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t.train()
        engine, first = t.engine, [m.detach().clone() for m in t.engine.master_params]
        assert "eval_loss" in t.evaluate()
        assert t.predict(_data(2)).predictions is not None
        t.train()
    assert t.engine is engine and engine.steps == 4 and t.state.global_step == 2
    assert not all(torch.equal(a, b) for a, b in zip(first, engine.master_params))


class _Poisoned(MixedPrecisionTrainer):
    """The loss of global step 1 is multiplied by inf (an overflow to skip)."""

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        return loss * float("inf") if self.state.global_step == 1 else loss


def test_an_overflow_under_max_grad_norm_is_skipped_and_nothing_raises(tmp_path):
    """fp16-master with max_grad_norm=1e-3 and an inf loss at step 1: Trainer's clip call
    returns a non-finite norm (logged as such), the step is skipped, nothing raises."""
    t, got = _logged_norms(_Poisoned, 3, tmp_path, recipe="fp16-master")
    assert int(t.engine.skipped_steps) == 1 and t.engine.steps == 3
    assert len(got.norms) == 3 and not math.isfinite(got.norms[1])
    assert all(math.isfinite(n) for i, n in enumerate(got.norms) if i != 1)


def test_trainers_logs_carry_the_loss_scale_and_the_skipped_steps(tmp_path):
    """Beside ``loss`` and ``grad_norm`` in Trainer's own log history (what its reporting
    callbacks receive): the loss scale, halved by the skip as torch's GradScaler backs
    off, and the running count of skipped updates."""
    t, _ = _logged_norms(_Poisoned, 3, tmp_path, recipe="fp16-master")
    logs = [h for h in t.state.log_history if "loss" in h]
    assert [h["skipped_steps"] for h in logs] == [0, 1, 1]
    scaler = torch.amp.GradScaler("cpu", init_scale=logs[0]["loss_scale"])
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    found = torch.ones(())
    torch._amp_update_scale_(scaler._scale, scaler._growth_tracker, found,
                             scaler._growth_factor, scaler._backoff_factor,
                             scaler._growth_interval)
    assert logs[1]["loss_scale"] == logs[2]["loss_scale"] == float(scaler._scale)
    assert all(isinstance(h["loss_scale"], float) for h in logs)


def test_resume_from_checkpoint_true_takes_the_latest_checkpoint(tmp_path):
    """resume_from_checkpoint=True (Trainer finds the latest checkpoint in output_dir):
    the resumed losses equal the uninterrupted run's."""
    full = _train("fp16-master", 4, 1, tmp_path / "full")
    _train("fp16-master", 4, 1, tmp_path / "part", save_steps=2)
    import shutil

    shutil.rmtree(tmp_path / "part" / "checkpoint-4")  # as if it stopped after step 2
    resumed = _train("fp16-master", 4, 1, tmp_path / "part", resume=True)
    assert resumed.losses == full.losses[2:]


@pytest.fixture(scope="module")
def sharded_records(tmp_path_factory):
    """tests/helpers/hf_sharded.py under ``torchrun --nproc-per-node 2`` (gloo):
    ``TrainingArguments(fsdp="full_shard")``, every scenario's record (rank 0's)."""
    import os
    import subprocess
    import sys

    from helpers.launch import free_port

    out = tmp_path_factory.mktemp("hf-sharded")
    script = HELPERS / "hf_sharded.py"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                          "2", "--master-port", str(free_port()), str(script), str(out)],
                         cwd=out, env={**os.environ, "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return torch.load(out / "records.pt", weights_only=False), out


def _rel(a, b):
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in b)


@pytest.mark.parametrize("recipe,tol", [
    ("fp32", 1e-5), pytest.param("fp16-master", 2e-2, marks=pytest.mark.long)])
def test_trainer_fsdp_on_two_ranks_trains_as_one_process(sharded_records, recipe, tol,
                                                        tmp_path):
    """``fsdp="full_shard"`` with ``transformer_layer_cls_to_wrap``: the engine shards
    (each GPT2Block, then the model) and Trainer drives. Two ranks of 4 sequences end
    where one process of 8 does, within FSDP's tolerance; Trainer logs the same LR and
    grad_norm sequences. Under fp16-master rank 1's loss is inf at step 2: both ranks
    skip it and the linear schedule holds for exactly that step."""
    from helpers import hf_sharded

    records, _ = sharded_records
    two = records[recipe]
    assert two["parallel"] == "fsdp" and two["wrapped"] == "_Sharded"
    assert two["units"] == ["FSDPGPT2Block", "FSDPGPT2LMHeadModel"]
    one = hf_sharded.train(recipe, 6, str(tmp_path), fsdp=False,
                           poison=(2, 0) if recipe == "fp16-master" else None)
    assert _rel(two["weights"], one["weights"]) <= tol
    assert two["lrs"] == one["lrs"]
    plain = [0.5 * (6 - s) / 6 for s in range(6)]  # linear decay from 0.5 over 6 steps
    if recipe == "fp16-master":
        assert two["skipped"] == one["skipped"] == 1
        assert math.isnan(two["grad_norms"][2])
        plain = plain[:3] + plain[2:5]
    assert two["lrs"] == pytest.approx(plain, rel=1e-12)
    finite = [(a, b) for a, b in zip(two["grad_norms"], one["grad_norms"]) if a == a]
    assert all(abs(a - b) <= 2 * tol * b for a, b in finite)  # the true, reduced norm


def test_trainer_fsdp_checkpoints_resume_and_export_the_masters(sharded_records):
    """``resume_from_checkpoint`` of the step-3 checkpoint (a fresh Trainer, both ranks)
    ends bit for bit where the uninterrupted run does. ``save_model`` called on every
    rank writes the gathered fp32 masters, which ``from_pretrained`` loads strictly into
    the plain model."""
    records, out = sharded_records
    full, resumed = records["fp16-master"], records["resumed"]
    assert resumed["steps"] == 6 and resumed["skipped"] == 1
    assert all(torch.equal(resumed["weights"][k], v) for k, v in full["weights"].items())
    plain = transformers.GPT2LMHeadModel.from_pretrained(out / "exported")
    got = plain.state_dict()
    assert all(got[k].dtype == torch.float32 and torch.equal(got[k], v)
               for k, v in full["weights"].items())


def test_fsdp_settings_the_engine_does_not_do_are_refused_naming_them():
    from mixprec.integrations.transformers import _engine_fsdp

    with pytest.raises(NotImplementedError, match="FSDP2 only"):
        _engine_fsdp({"fsdp_version": 1})
    with pytest.raises(NotImplementedError, match="cpu_offload.*Remove it"):
        _engine_fsdp({"fsdp_version": 2, "cpu_offload": True})
    with pytest.raises(NotImplementedError, match="SHARDED_STATE_DICT"):
        _engine_fsdp({"fsdp_version": 2, "state_dict_type": "SHARDED_STATE_DICT"})
    units = _engine_fsdp({"fsdp_version": 2, "transformer_cls_names_to_wrap": "GPT2Block",
                          "reshard_after_forward": False})
    assert units["parallel_kwargs"] == {"reshard_after_forward": False}
    model = _model()
    assert [type(m).__name__ for m in model.modules() if units["fsdp_units"](m)] == [
        "GPT2Block", "GPT2Block"]


@pytest.mark.long
def test_save_model_quantized_writes_the_format_trained_in(tmp_path):
    """save_model(quantized=True) writes what engine.save_pretrained writes: a tiny Llama
    trained under fp8-block loads in transformers with each projection its cast."""
    from safetensors.torch import load_file

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=64, head_dim=16)
    torch.manual_seed(0)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2,
        learning_rate=3e-3, save_strategy="no", report_to=[], use_cpu=True, seed=0,
        disable_tqdm=True)
    t = MixedPrecisionTrainer(model=transformers.LlamaForCausalLM(cfg), args=args,
                              train_dataset=_data(8), recipe="fp8-block")
    with pytest.raises(ValueError, match="before train"):
        t.save_model(str(tmp_path / "early"), quantized=True)
    t.train()
    t.save_model(str(tmp_path / "q"), quantized=True)
    q = load_file(tmp_path / "q" / "model.safetensors")
    w = q["model.layers.0.mlp.down_proj.weight"]
    assert w.dtype == torch.float8_e4m3fn and w.shape == (64, 128)
    master = t.engine.export_state_dict()["model.layers.0.mlp.down_proj.weight"]
    cast = t.engine.module.model.layers[0].mlp.down_proj.quantizer.cast(master, "weight", 1, {})
    assert torch.equal(w, cast.data)
    assert torch.equal(q["model.layers.0.mlp.down_proj.weight_scale_inv"], cast.scale_inv)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "q",
                                                               dtype=torch.float32)
    assert torch.equal(loaded.model.layers[0].mlp.down_proj.weight, cast.dequant())


SCHEDULE = "nvfp4>bf16-master@0.8"


def test_a_precision_schedule_trains_in_trainer_as_in_your_own_loop(tmp_path):
    """NVFP4, then bf16 with fp32 masters for the last 20% of ``max_steps`` (the
    fractions are Trainer's steps): the engine switches after step 4 of 5, and every
    micro-batch's loss equals mixprec's own loop under the same schedule."""
    t = _train(SCHEDULE, 5, 1, tmp_path)
    assert t.engine.phase == 1 and str(t.engine.recipe) == "bf16-master"
    assert t.engine.schedule.starts() == (0, 4)
    decay = set(t.get_decay_parameter_names(t.model))
    schedule = PrecisionSchedule.parse(SCHEDULE, total_steps=5)
    assert t.losses == _own_loop(schedule, 5, 1, decay=decay)


@pytest.mark.long
def test_a_scheduled_trainer_resumes_mid_phase_bit_for_bit(tmp_path):
    full = _train(SCHEDULE, 5, 1, tmp_path / "full")
    _train(SCHEDULE, 5, 1, tmp_path / "part", save_steps=2)
    resumed = _train(SCHEDULE, 5, 1, tmp_path / "part",
                     resume=str(tmp_path / "part" / "checkpoint-2"))
    assert resumed.engine.phase == 1
    got, want = resumed.engine.fp32_state_dict(), full.engine.fp32_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
