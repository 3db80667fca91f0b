"""Accelerate's own calls on a model and optimizer prepared under a mixprec recipe.

A training loop written for Accelerate keeps calling Accelerate's methods
(``accelerator.clip_grad_norm_``, ``clip_grad_value_``, ``get_state_dict``,
``save_model``, ``unwrap_model(...).save_pretrained``) after ``prepare`` from
``mixprec.integrations.accelerate`` has handed the model and optimizer to a
``MixedPrecision`` engine. These calls act on the engine's state: the clip sees the
engine's unscaled fp32 gradients (which are not on ``.grad``) and clips the engine's
update, overflowed steps are skipped without advancing the LR schedule, and exports
write the fp32 masters, loadable strictly into the plain fp32 model.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from mixprec.integrations.accelerate import prepare  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

LR = 0.1


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Each test starts with Accelerate's process-wide state unset."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def small_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))


def batches(n: int, seed: int = 1, size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 16, generator=g), torch.randint(0, 4, (size,), generator=g))
            for _ in range(n)]


def mixprec_setup(recipe: str, seed: int = 0, scheduler_fn=None, **accel_kwargs):
    torch.manual_seed(seed)
    accelerator = Accelerator(cpu=True, **accel_kwargs)
    model = small_mlp(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    objects = [model, optimizer]
    if scheduler_fn is not None:
        objects.append(scheduler_fn(optimizer))
    prepared = prepare(accelerator, *objects, recipe=recipe)
    return (accelerator, *prepared)


def unscaled_grads(engine) -> list[torch.Tensor]:
    """The engine's gradients with the loss scale divided out, in float64."""
    scale = engine.scale.double()
    return [g.detach().double() / scale for g in engine.param_state.gradients()]


def recipe_loss(engine, model, x, y) -> torch.Tensor:
    """The loss computed under the recipe's autocast, so it is fp32 (as documented:
    an fp16 loss times the loss scale would overflow on its own)."""
    with engine.autocast():
        return F.cross_entropy(model(x), y)


def norm64(tensors) -> float:
    return math.sqrt(sum(float((t.double() ** 2).sum()) for t in tensors))


# ----------------------------------------------------------------------------- claim 1


def test_clip_grad_norm_matches_plain_accelerate_exactly_under_fp32_recipe():
    """Under ``fp32,master=fp32``, ``accelerator.clip_grad_norm_`` returns exactly the
    norm plain Accelerate returns for the same model and batch, and with a small
    ``max_norm`` (so the clip is active) the weights after ``optimizer.step()`` equal
    plain Accelerate's bit for bit, step after step."""
    max_norm = 1e-3
    data = batches(3)

    accelerator, model, optimizer = mixprec_setup("fp32,master=fp32")

    torch.manual_seed(0)
    accelerator2 = Accelerator(cpu=True)
    model2 = small_mlp(0)
    optimizer2 = torch.optim.SGD(model2.parameters(), lr=LR)
    model2, optimizer2 = accelerator2.prepare(model2, optimizer2)

    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)

    for x, y in data:
        loss = F.cross_entropy(model(x), y)
        accelerator.backward(loss)
        assert accelerator.sync_gradients
        norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)

        loss2 = F.cross_entropy(model2(x), y)
        accelerator2.backward(loss2)
        norm2 = accelerator2.clip_grad_norm_(model2.parameters(), max_norm)

        assert float(norm2) > 10 * max_norm  # the clip really acts
        assert torch.equal(torch.as_tensor(norm).float().reshape(()),
                           torch.as_tensor(norm2).float().reshape(())), (norm, norm2)

        optimizer.step()
        optimizer.zero_grad()
        optimizer2.step()
        optimizer2.zero_grad()
        assert not optimizer.step_was_skipped

        for (name, a), b in zip(model.named_parameters(), model2.parameters()):
            assert a.dtype == torch.float32
            assert torch.equal(a.detach(), b.detach()), name


@pytest.mark.parametrize("recipe", ["bf16-master", "fp16-master"])
def test_clip_grad_norm_is_true_unscaled_norm_and_clips_masters(recipe):
    """Under 16-bit recipes with fp32 masters, ``accelerator.clip_grad_norm_`` returns
    the L2 norm of the engine's unscaled fp32 gradients, and with a tiny ``max_norm``
    the SGD update of the masters is the clipped one: ``w - lr * g * min(1,
    max_norm / (norm + 1e-6))``, moving the masters by ``lr * max_norm`` in total."""
    max_norm = 1e-3
    accelerator, model, optimizer = mixprec_setup(recipe)
    engine = optimizer.engine

    for step, (x, y) in enumerate(batches(3)):
        before = [m.detach().clone() for m in engine.master_params]
        assert all(m.dtype == torch.float32 for m in before)

        loss = recipe_loss(engine, model, x, y)
        accelerator.backward(loss)
        grads = unscaled_grads(engine)
        reference = norm64(grads)
        assert reference > 10 * max_norm  # a norm of 0 would mean the gradients were missed

        norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
        assert math.isfinite(float(norm))
        assert float(norm) == pytest.approx(reference, rel=1e-5), (step, float(norm), reference)

        optimizer.step()
        optimizer.zero_grad()
        assert not optimizer.step_was_skipped

        coef = min(1.0, max_norm / (float(norm) + 1e-6))
        after = [m.detach() for m in engine.master_params]
        for w0, g, w1 in zip(before, grads, after):
            expected = w0.double() - LR * g * coef
            torch.testing.assert_close(w1.double(), expected, rtol=1e-6, atol=1e-10)
        moved = norm64([w1.double() - w0.double() for w0, w1 in zip(before, after)])
        assert moved == pytest.approx(LR * max_norm, rel=1e-2), (step, moved)


# ----------------------------------------------------------------------------- claim 2


def test_overflow_under_fp16_returns_inf_skips_step_and_keeps_lr():
    """Under ``fp16-master``, an inf gradient makes ``accelerator.clip_grad_norm_``
    return a non-finite norm without raising
    the step is skipped (masters unchanged
    bit for bit, ``step_was_skipped``) and the LR scheduler passed through ``prepare``
    does not advance: the learning rates are those of a plain run without that step."""
    data = batches(4)
    bad = 1

    def sched(opt):
        return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    accelerator, model, optimizer, scheduler = mixprec_setup("fp16-master",
                                                            scheduler_fn=sched)
    engine = optimizer.engine

    lrs, last_lrs, skipped = [], [], []
    for i, (x, y) in enumerate(data):
        before = [m.detach().clone() for m in engine.master_params]
        loss = recipe_loss(engine, model, x, y)
        if i == bad:
            loss = loss * float("inf")
        accelerator.backward(loss)
        norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        skipped.append(bool(optimizer.step_was_skipped))
        lrs.append(optimizer.param_groups[0]["lr"])
        last_lrs.append(scheduler.get_last_lr()[0])
        if i == bad:
            assert not math.isfinite(float(norm)), float(norm)
            for w0, w1 in zip(before, engine.master_params):
                assert torch.equal(w0, w1.detach())
        else:
            assert math.isfinite(float(norm))
            assert any(not torch.equal(w0, w1.detach())
                       for w0, w1 in zip(before, engine.master_params))
    assert skipped == [i == bad for i in range(len(data))]

    # the plain run, without the overflowed step
    torch.manual_seed(0)
    accelerator2 = Accelerator(cpu=True)
    model2 = small_mlp(0)
    optimizer2 = torch.optim.SGD(model2.parameters(), lr=LR)
    model2, optimizer2, scheduler2 = accelerator2.prepare(model2, optimizer2,
                                                          sched(optimizer2))
    plain_lrs, plain_last = [], []
    for i, (x, y) in enumerate(data):
        if i == bad:
            continue
        accelerator2.backward(F.cross_entropy(model2(x), y))
        accelerator2.clip_grad_norm_(model2.parameters(), 1.0)
        optimizer2.step()
        scheduler2.step()
        optimizer2.zero_grad()
        plain_lrs.append(optimizer2.param_groups[0]["lr"])
        plain_last.append(scheduler2.get_last_lr()[0])

    kept = [i for i in range(len(data)) if i != bad]
    assert [lrs[i] for i in kept] == plain_lrs
    assert [last_lrs[i] for i in kept] == plain_last
    # the skipped step left the learning rate where the step before it had put it
    assert lrs[bad] == lrs[bad - 1]
    assert last_lrs[bad] == last_lrs[bad - 1]


# ----------------------------------------------------------------------------- claim 3


def test_clip_grad_value_is_refused_naming_clip_grad_norm():
    """``accelerator.clip_grad_value_`` on an engine-managed model raises, and the
    message names ``clip_grad_norm_`` as the call to use instead."""
    accelerator, model, optimizer = mixprec_setup("bf16-master")
    x, y = batches(1)[0]
    accelerator.backward(F.cross_entropy(model(x), y))
    with pytest.raises(Exception, match="clip_grad_norm_"):
        accelerator.clip_grad_value_(model.parameters(), 0.1)


# ----------------------------------------------------------------------------- claim 4


def test_clip_grad_norm_inside_accumulation_window_raises():
    """With ``gradient_accumulation_steps=2``, ``accelerator.clip_grad_norm_`` on the
    first micro-batch of a window (``sync_gradients`` False) raises a RuntimeError
    naming ``sync_gradients``; on the window's last micro-batch it returns the norm."""
    from torch.utils.data import DataLoader, TensorDataset

    data = batches(4)
    xs = torch.cat([x for x, _ in data])
    ys = torch.cat([y for _, y in data])
    loader = DataLoader(TensorDataset(xs, ys), batch_size=8, shuffle=False)

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = small_mlp(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer, loader = prepare(accelerator, model, optimizer, loader,
                                       recipe="bf16-master")
    engine = optimizer.engine

    raised = synced = 0
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(F.cross_entropy(model(x), y))
            if not accelerator.sync_gradients:
                with pytest.raises(RuntimeError, match="sync_gradients"):
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                raised += 1
            else:
                reference = norm64(unscaled_grads(engine))
                norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
                assert float(norm) == pytest.approx(reference, rel=1e-5)
                synced += 1
            optimizer.step()
            optimizer.zero_grad()
    assert (raised, synced) == (2, 2)


# ----------------------------------------------------------------------------- claim 5


def _train_bf16(steps: int = 3):
    accelerator, model, optimizer = mixprec_setup("bf16-master")
    for x, y in batches(steps):
        accelerator.backward(F.cross_entropy(model(x), y))
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        assert not optimizer.step_was_skipped
    return accelerator, model, optimizer, optimizer.engine


def _assert_is_masters(state: dict, model: nn.Module, engine) -> None:
    names = [n for n, p in accelerator_unwrapped(model).named_parameters() if p.requires_grad]
    masters = list(engine.master_params)
    assert len(names) == len(masters)
    for name, master in zip(names, masters):
        assert state[name].dtype == torch.float32, name
        assert torch.equal(state[name].cpu(), master.detach().cpu()), name
    exported = engine.export_state_dict()
    assert set(exported) == set(state)
    for name, t in exported.items():
        assert t.dtype == torch.float32, name
        assert torch.equal(state[name].cpu(), t.detach().cpu()), name
    # really the fp32 masters, not the bf16 working copy widened
    assert any(not torch.equal(m.detach(), m.detach().bfloat16().float()) for m in masters)


def accelerator_unwrapped(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


def test_get_state_dict_gives_fp32_masters_loading_strictly():
    """``accelerator.get_state_dict(model)`` after bf16-master training holds the fp32
    masters under the model's own names, and loads with ``strict=True`` into a fresh
    plain fp32 model of the same class."""
    accelerator, model, optimizer, engine = _train_bf16()
    state = accelerator.get_state_dict(model)
    _assert_is_masters(state, model, engine)

    fresh = small_mlp(seed=123)
    fresh.load_state_dict(state, strict=True)
    for (name, p), m in zip(fresh.named_parameters(), engine.master_params):
        assert p.dtype == torch.float32
        assert torch.equal(p.detach(), m.detach()), name


def test_save_model_writes_fp32_masters(tmp_path):
    """``accelerator.save_model(model, dir)`` writes a safetensors file holding the fp32
    masters, which loads with ``strict=True`` into a fresh plain fp32 model."""
    from safetensors.torch import load_file

    accelerator, model, optimizer, engine = _train_bf16()
    accelerator.save_model(model, tmp_path)
    files = sorted(tmp_path.glob("*.safetensors"))
    assert files, list(tmp_path.iterdir())
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    _assert_is_masters(state, model, engine)

    fresh = small_mlp(seed=123)
    fresh.load_state_dict(state, strict=True)
    for (name, p), m in zip(fresh.named_parameters(), engine.master_params):
        assert torch.equal(p.detach(), m.detach()), name


# ----------------------------------------------------------------------------- claim 6


def test_hf_save_pretrained_writes_fp32_masters(tmp_path):
    """For a Hugging Face model under ``bf16-master``,
    ``accelerator.unwrap_model(model).save_pretrained(dir)`` then
    ``from_pretrained(dir)`` gives fp32 parameters equal to the engine's masters bit for
    bit (the tied ``lm_head``/``wte`` weight included)."""
    transformers = pytest.importorskip("transformers")

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64,
                                     n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    accelerator = Accelerator(cpu=True)
    model, optimizer = prepare(accelerator, model, optimizer, recipe="bf16-master")
    engine = optimizer.engine

    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        ids = torch.randint(0, 64, (4, 16), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        assert not optimizer.step_was_skipped

    exported = engine.export_state_dict()
    masters = list(engine.master_params)
    assert all(m.dtype == torch.float32 for m in masters)
    assert any(not torch.equal(m.detach(), m.detach().bfloat16().float()) for m in masters)

    accelerator.unwrap_model(model).save_pretrained(tmp_path)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)

    params = dict(loaded.named_parameters())
    assert params
    for name, p in params.items():
        assert p.dtype == torch.float32, name
        assert name in exported, name
        assert torch.equal(p.detach(), exported[name].detach().cpu()), name
    # the tied output head is the trained embedding
    assert torch.equal(loaded.lm_head.weight, loaded.transformer.wte.weight)
    assert torch.equal(loaded.lm_head.weight.detach(),
                       exported["transformer.wte.weight"].detach().cpu())
    # and the names line up with the masters, in the model's trainable-parameter order
    trainable = [n for n, p in accelerator.unwrap_model(model).named_parameters()
                 if p.requires_grad]
    assert len(trainable) == len(masters)
    for name, m in zip(trainable, masters):
        assert torch.equal(params[name].detach(), m.detach().cpu()), name


def test_a_per_epoch_scheduler_is_the_loops_own_to_step():
    """Accelerator(step_scheduler_with_optimizer=False) with a StepLR the loop steps once
    per epoch (2 epochs of 3 steps, one step skipped under fp16): the learning rates
    equal plain Accelerate's, epoch by epoch; the skip does not move them."""

    def run(ours: bool):
        accelerator = Accelerator(cpu=True, step_scheduler_with_optimizer=False)
        model = small_mlp(0)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        sched = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        if ours:
            model, optimizer, sched = prepare(accelerator, model, optimizer, sched,
                                              recipe="fp16-master")
        else:
            model, optimizer, sched = accelerator.prepare(model, optimizer, sched)
        lrs = []
        for epoch in range(2):
            for i, (x, y) in enumerate(batches(3)):
                if ours:
                    with optimizer.engine.autocast():
                        loss = F.cross_entropy(model(x), y)
                else:
                    loss = F.cross_entropy(model(x), y)
                if epoch == 0 and i == 1:
                    loss = loss * float("inf")
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                lrs.append(optimizer.param_groups[0]["lr"])
            sched.step()
        return lrs

    want = [LR] * 3 + [LR / 2] * 3
    assert run(True) == want
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    assert run(False) == want
