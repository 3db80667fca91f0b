"""mixprec.integrations.accelerate: Accelerate's own loop (``accumulate``, ``backward``,
``step``, ``save_state``) under a recipe trains as mixprec's own loop does, and
``accelerate launch`` on 2 CPU processes keeps the ranks in agreement."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

accelerate = pytest.importorskip("accelerate")

from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from helpers.launch import free_port  # noqa: E402
from helpers.paths import ROOT  # noqa: E402
from mixprec import MixedPrecision  # noqa: E402
from mixprec.integrations.accelerate import prepare  # noqa: E402
from mixprec.workbench import GPT, GPTConfig  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")

CFG = GPTConfig(vocab=64, seq_len=32, n_layers=2, d_model=64, n_heads=4)


@pytest.fixture(autouse=True)
def _fresh_state():
    """Accelerate's states are process-wide singletons: each test starts clean."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _batches(n: int, batch: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, CFG.vocab, (batch, CFG.seq_len + 1), generator=g)
            for _ in range(n)]


def _parts():
    torch.manual_seed(0)
    gpt = GPT(CFG)
    opt = torch.optim.AdamW(gpt.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return gpt, opt, sched


def _accelerate_loop(recipe, batches, accum=1, poison=(), resume=None, save=None,
                     skip=0):
    """Accelerate's documented loop, unchanged but for ``prepare``. ``poison``: the
    optimizer steps whose loss is multiplied by inf."""
    from accelerate import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=accum)
    gpt, opt, sched = _parts()
    loader = torch.utils.data.DataLoader(torch.cat(batches), batch_size=len(batches[0]))
    model, optimizer, loader, scheduler = prepare(
        accelerator, gpt, opt, loader, sched, recipe=recipe, max_grad_norm=1.0)
    if resume is not None:
        accelerator.load_state(resume)
        loader = accelerator.skip_first_batches(loader, skip)
    engine = optimizer.engine
    losses, lrs = [], []
    for b in loader:
        with accelerator.accumulate(model):
            loss = model(b[:, :-1], b[:, 1:])
            losses.append(loss.item())
            if engine.steps in poison:
                loss = loss * float("inf")
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            lrs.append(scheduler.get_last_lr()[0])
    if save is not None:
        accelerator.save_state(save)
    return losses, lrs, engine


def _own_loop(recipe, batches, accum=1):
    """mixprec's own loop: the window ends every ``accum`` micro-batches and at the
    last batch, where Accelerate's ``accumulate`` ends it."""
    gpt, opt, sched = _parts()
    engine = MixedPrecision(gpt, opt, recipe, grad_accum_steps=accum, max_grad_norm=1.0,
                            scheduler=sched)
    losses = []
    for i, b in enumerate(batches):
        with engine.autocast():
            loss = gpt(b[:, :-1], b[:, 1:])
        losses.append(loss.item())
        engine.backward(loss, last=True if i == len(batches) - 1 else None)
        engine.step()
    return losses, engine


@pytest.mark.parametrize("recipe", ["bf16-master", "fp16-master",
                                    pytest.param("fp8", marks=pytest.mark.long)])
def test_accelerate_loop_trains_as_mixprecs_own_loop_bit_for_bit(recipe):
    """7 micro-batches with gradient_accumulation_steps=2: windows of 2, 2, 2 and the
    short one Accelerate closes at the loader's end. Every loss and every fp32 weight
    are equal."""
    batches = _batches(7)
    losses, lrs, engine = _accelerate_loop(recipe, batches, accum=2)
    want, ref = _own_loop(recipe, batches, accum=2)
    assert losses == want
    assert engine.steps == ref.steps == 4 and len(lrs) == 4
    got, exp = engine.fp32_state_dict(), ref.fp32_state_dict()
    assert all(torch.equal(got[k], exp[k]) for k in exp)


def test_skipped_steps_do_not_advance_the_scheduler():
    losses, lrs, engine = _accelerate_loop("fp16-master", _batches(6), poison={1, 3})
    assert int(engine.skipped_steps) == 2 and engine.steps == 6
    assert lrs == [3e-3 / k for k in (2, 2, 3, 3, 4, 5)]  # held over each skipped step


@pytest.mark.paths
def test_save_state_and_load_state_resume_bit_for_bit(tmp_path):
    """3 optimizer steps (6 micro-batches), ``save_state``; a fresh Accelerator and
    model ``load_state`` and run the other 3: the losses and fp32 weights of 6 steps in
    one go. ``skip_first_batches`` is Accelerate's way back to the data position."""
    data = _batches(12)
    full, _, whole = _accelerate_loop("bf16-master", data, accum=2)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    part, _, _ = _accelerate_loop("bf16-master", data[:6], accum=2, save=tmp_path / "s")
    assert (tmp_path / "s" / "custom_checkpoint_0.pkl").exists()
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    rest, _, resumed = _accelerate_loop("bf16-master", data, accum=2,
                                        resume=tmp_path / "s", skip=6)
    assert part + rest == full
    assert resumed.steps == whole.steps == 6
    got, exp = resumed.fp32_state_dict(), whole.fp32_state_dict()
    assert all(torch.equal(got[k], exp[k]) for k in exp)


def test_a_cpu_launch_that_started_one_process_warns(monkeypatch):
    from accelerate import Accelerator

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    for k in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    gpt, opt, _ = _parts()
    with pytest.warns(UserWarning, match="--multi_gpu --num_processes N"):
        prepare(Accelerator(), gpt, opt, recipe="fp32")


def test_what_prepare_refuses_names_the_fix():
    from accelerate import Accelerator

    gpt, opt, sched = _parts()
    with pytest.raises(ValueError, match="mixed_precision='no'"):
        prepare(Accelerator(mixed_precision="bf16"), gpt, opt, recipe="bf16-master")
    AcceleratorState._reset_state(reset_partial_state=True)
    acc = Accelerator()
    with pytest.raises(ValueError, match="one nn.Module and one optimizer"):
        prepare(acc, gpt, GPT(CFG), opt, recipe="bf16")
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps="):
        prepare(acc, gpt, opt, recipe="bf16", grad_accum_steps=4)
    with pytest.raises(ValueError, match="valid: ddp, fsdp"):
        prepare(acc, gpt, opt, recipe="bf16", parallel="zero3")


@pytest.mark.parametrize("parallel", ["ddp", pytest.param("fsdp", marks=pytest.mark.long)])
def test_accelerate_launch_two_cpu_processes_agree_on_skips_and_weights(tmp_path, parallel):
    """``accelerate launch --multi_gpu --num_processes 2`` with ACCELERATE_USE_CPU=1:
    torchrun underneath, gloo, 2 ranks. (``--cpu --num_processes 2`` starts a single
    process in accelerate 1.x: its CPU launcher runs several only through mpirun.) Rank
    1's loss is inf at step 3; both ranks skip it, hold the LR, and end with the same
    fp32 weights (gathered under FSDP), which ``get_state_dict`` and ``save_model``
    write; then (FSDP) the 2-rank ``save_state`` resumes on one process. The DDP run
    also runs the ``--cpu --num_processes 2`` command."""
    out = tmp_path / "run.json"
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    script = str(ROOT / "examples" / "accelerate_train.py")
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
              "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
              "--dynamo_backend", "no", "--main_process_port", str(free_port()), script]
    args = ["--parallel", parallel, "--recipe", "fp16-master", "--accum", "2", "--steps", "6",
            "--inject-inf", "3:1", "--out", str(out), "--save-state", str(tmp_path / "st"),
            "--export", str(tmp_path / "export")]
    run = subprocess.run(launch + args, env=env, capture_output=True, text=True,
                         timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    r0, r1 = (json.loads(Path(p).read_text()) for p in (out, f"{out}.rank1"))
    assert r0["world"] == r1["world"] == 2
    assert r0["skipped"] == r1["skipped"] == [False, False, False, True, False, False]
    assert r0["lrs"] == r1["lrs"] and r0["lrs"][3] == r0["lrs"][2]
    assert r0["weights"] == r1["weights"] and r0["losses"] != r1["losses"]
    # Accelerate's exports (gathered under FSDP) are the fp32 masters, bit for bit
    assert r0["get_state_dict"] == r0["save_model"] == r0["weights"]
    if parallel == "ddp":  # `--cpu --num_processes 2`: one process, and mixprec says so
        cpu = [sys.executable, "-m", "accelerate.commands.launch", "--cpu",
               "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
               "--dynamo_backend", "no", "--main_process_port", str(free_port()), script,
               "--steps", "1", "--out", str(tmp_path / "cpu")]
        single = subprocess.run(cpu, env=env, capture_output=True, text=True, timeout=240)
        assert single.returncode == 0, single.stderr[-3000:]
        assert json.loads((tmp_path / "cpu").read_text())["world"] == 1
        assert "started a single process" in single.stderr
    if parallel == "ddp":
        return  # the resume on one process runs once, from FSDP's (gathered) state
    one = subprocess.run([sys.executable, script, "--recipe", "fp16-master", "--steps", "2",
                          "--resume", str(tmp_path / "st"), "--out", str(tmp_path / "one")],
                         env=env, capture_output=True, text=True, timeout=240)
    assert one.returncode == 0, one.stderr[-3000:]
    resumed = json.loads((tmp_path / "one").read_text())
    assert resumed["world"] == 1 and resumed["steps"] == 8
