"""MixedPrecision against torch's GradScaler, float64 sums and plain fp32 training."""

from __future__ import annotations

import contextlib
import io
import math
import random
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec.optim
from helpers.models import TiedLM, cnn, mlp, pattern_losses, tiny_gpt
from helpers.speeds import set_speeds
from mixprec import PRESETS, MixedPrecision, Recipe, SkipLimitError

pytestmark = pytest.mark.filterwarnings("ignore:fp16 compute on the CPU:UserWarning",
                                        "ignore:fp16 has no fast kernels:UserWarning",
                                        "ignore:recipe. loss_scale:UserWarning",
                                        "ignore:recipe. params=.fp16. with master:UserWarning")


def relu_mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 1))


# --- differential test against torch.amp.GradScaler ------------------------------------

def test_matches_torch_gradscaler_decisions_scales_and_params():
    """Same model, data and injected faults: identical skips and scales, same params."""
    steps, inject_loss, inject_grad = 40, {5, 6, 19}, {11, 30}
    kw = dict(init_scale=2.0**20, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    recipe = Recipe.parse("fp16,init_scale=1048576,growth_interval=3,hysteresis=1,"
                          "min_scale=1e-30,max_scale=1e30,emulate=false")
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen) * 1e3)
            for _ in range(steps)]

    def loss_fn(model, x, y, i):
        out = model(x).float()
        loss = ((out - y) ** 2).mean()
        return loss * math.inf if i in inject_loss else loss

    def poison_hook(step_ref):
        def hook(g):
            return g * math.nan if step_ref[0] in inject_grad else g
        return hook

    # reference: torch.autocast + GradScaler + SGD(momentum)
    ref = relu_mlp()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-4, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", **kw)
    ref_step = [0]
    ref[2].weight.register_hook(poison_hook(ref_step))
    ref_log = []
    for i, (x, y) in enumerate(data):
        ref_step[0] = i
        with torch.autocast("cpu", dtype=torch.float16):
            out = ref(x)
        loss = ((out.float() - y) ** 2).mean() * (math.inf if i in inject_loss else 1)
        ref_opt.zero_grad()
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(ref_opt)
        scaler.update()
        ref_log.append((scaler.get_scale() < before, scaler.get_scale()))

    model = relu_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    engine = MixedPrecision(model, opt, recipe)
    step = [0]
    model[2].weight.register_hook(poison_hook(step))
    log = []
    for i, (x, y) in enumerate(data):
        step[0] = i
        with engine.autocast():
            out = model(x)
        loss = ((out.float() - y) ** 2).mean() * (math.inf if i in inject_loss else 1)
        engine.backward(loss)
        r = engine.step()
        log.append((bool(r.skipped), float(r.scale)))

    assert [s for s, _ in log] == [s for s, _ in ref_log]
    assert [c for _, c in log] == [c for _, c in ref_log]
    assert sum(s for s, _ in log) >= len(inject_loss | inject_grad)  # natural ones too
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


# --- fault injection -------------------------------------------------------------------

def _snapshot(engine):
    opt_state = [{k: v.clone() for k, v in s.items()}
                 for o in engine.optimizers for s in o.state.values()]
    return ([p.detach().clone() for p in engine.master_params],
            [p.detach().clone() for p in engine.model.parameters()], opt_state)


def _identical(a, b):
    return (all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
            and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
            and all(all(torch.equal(s[k], t[k]) for k in s) for s, t in zip(a[2], b[2])))


@pytest.mark.parametrize("recipe", ["bf16", "bf16-master", "fp16-master"])
def test_fault_injection_skips_and_leaves_state_bit_identical(recipe):
    rng = random.Random(recipe)
    faults = dict.fromkeys(rng.sample(range(20, 200), 15))
    kinds = ["loss", "grad", "input"]
    for k in faults:
        faults[k] = rng.choice(kinds)
    torch.manual_seed(0)
    model = mlp(d_in=8, d_out=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    engine = MixedPrecision(model, opt, f"{recipe},growth_interval=10")
    bad = {"step": -1}
    model[3].weight.register_hook(lambda g: g * math.nan if faults.get(bad["step"]) == "grad"
                                  else g)
    w_true = torch.randn(8, 1)
    losses = []
    for i in range(200):
        bad["step"] = i
        x = torch.randn(32, 8)
        y = x @ w_true
        if faults.get(i) == "input":
            x = x.clone()
            x[3, 2] = math.inf
        with engine.autocast():
            loss = F.mse_loss(model(x).float(), y)
        if faults.get(i) == "loss":
            loss = loss * math.nan
        before = _snapshot(engine)
        engine.backward(loss)
        r = engine.step()
        if i in faults:
            assert bool(r.skipped), (i, faults[i])
            assert _identical(before, _snapshot(engine)), (i, faults[i])
        else:
            losses.append(loss.item())
    assert int(engine.skipped_steps) >= len(faults)
    assert sum(losses[-10:]) < 0.1 * sum(losses[:10])  # still converges (>10x lower)


# --- FP32 accumulation ------------------------------------------------------------------

def _accumulate(recipe: str, n: int = 4096, g: float = 1e-7) -> float:
    w = nn.Linear(1, 1, bias=False)
    nn.init.zeros_(w.weight)
    engine = MixedPrecision(w, torch.optim.SGD(w.parameters(), lr=0.0), recipe,
                            grad_accum_steps=n)
    x = torch.ones(1, 1)
    for _ in range(n):
        # backward divides by n, so each micro-batch contributes exactly g to the sum
        with engine.autocast():
            out = w(x)
        engine.backward((out.float() * (g * n)).sum())
        if _ < n - 1:
            engine.step()
    return engine.param_state.gradients()[0].double().item() / max(float(engine.scale), 1.0)


def test_accumulation_of_4096_tiny_gradients():
    want = 4096 * 1e-7
    kahan = _accumulate("fp32,grad_accum=kahan")
    plain = _accumulate("fp32")
    fp16 = _accumulate("fp16-master,grads=fp16,loss_scale=static,init_scale=1")
    assert abs(kahan - want) / want < 1e-6       # the published figure, to 1e-6
    assert abs(plain - want) / want < 1e-4       # plain fp32: n·2^-24 growth, ~7e-6
    assert abs(plain - want) / want > 1e-6
    assert abs(fp16 - want) / want > 0.3         # fp16 .grad stalls near 2.44e-4
    assert fp16 == 2.0**-12


# --- master weights --------------------------------------------------------------------

def _nudge(recipe: str, w0: float, steps: int = 1000, update: float = 1e-4) -> float:
    lin = nn.Linear(1, 1, bias=False)
    nn.init.constant_(lin.weight, w0)
    engine = MixedPrecision(lin, torch.optim.SGD(lin.parameters(), lr=update), recipe)
    x = torch.ones(1, 1)
    for _ in range(steps):
        with engine.autocast():
            out = lin(x)
        engine.backward(-out.float().sum())  # gradient -1: each step adds `update`
        engine.step()
    return engine.master_params[0].double().item()


def test_master_weights_keep_updates_that_bf16_weights_lose():
    assert abs(_nudge("bf16-master", 1.0) - 1.1) < 1e-4           # fp32 master keeps them
    assert _nudge("bf16,params=bf16", 1.0) == 1.0                  # pure bf16: all vanish
    # The common example uses a weight of 2048: there fp32's spacing is 2^-12 ~ 2.44e-4, so an
    # update of 1e-4 vanishes in the fp32 master as well (a correction to the seed).
    assert _nudge("bf16-master", 2048.0, steps=50) == 2048.0
    # just below 2048 the fp32 master keeps them (rounded to its 2^-13 spacing)
    assert _nudge("bf16-master", 1024.0, steps=50) > 1024.0


# --- gradient accumulation equals a big batch ------------------------------------------

def _grads_after(recipe, batches, accum):
    model = mlp(seed=3)
    engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.0), recipe,
                            grad_accum_steps=accum)
    micro = []
    for x, y in batches:
        with engine.autocast():
            loss = F.cross_entropy(model(x), y)
        engine.backward(loss)
        micro.append([p.grad.clone() if p.grad is not None else None
                      for p in engine.param_state.working])
    return [g.clone() for g in engine.param_state.gradients()], micro


@pytest.mark.parametrize("recipe", ["fp32", "bf16-master"])
def test_grad_accumulation_equals_one_big_batch(recipe):
    torch.manual_seed(0)
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
    big, _ = _grads_after(recipe, [(x, y)], 1)
    acc, _ = _grads_after(recipe, [(x[i:i + 8], y[i:i + 8]) for i in range(0, 32, 8)], 4)
    for a, b in zip(acc, big):
        assert a.dtype == torch.float32
        if recipe == "fp32":
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        else:
            # the working grads are bf16 (one rounding per micro-batch vs one for the
            # whole batch): agreement to bf16's precision, relative to the tensor's norm
            assert (a - b).norm() <= 2**-7 * b.norm() + 1e-7


def test_last_true_ends_a_short_window_as_a_dividing_loop_does():
    """10 micro-batches, grad_accum_steps=4 and ``last=True`` on the 10th: windows of
    4, 4 and 2, each update that of torch summing ``loss / 4`` (as Accelerate's
    ``accumulate`` does at an epoch's end), bit for bit in fp32."""
    torch.manual_seed(0)
    data = [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(10)]
    ref = mlp(seed=2)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for w in (data[0:4], data[4:8], data[8:10]):
        ref_opt.zero_grad()
        for x, y in w:
            (F.cross_entropy(ref(x), y) / 4).backward()
        ref_opt.step()
    model = mlp(seed=2)
    engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                            "fp32", grad_accum_steps=4)
    applied = []
    for i, (x, y) in enumerate(data):
        with engine.autocast():
            loss = F.cross_entropy(model(x), y)
        engine.backward(loss, last=True if i == 9 else None)
        applied.append(not engine.step().accumulating)
    assert applied == [False, False, False, True] * 2 + [False, True]
    assert engine.steps == 3
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_last_is_checked():
    model = mlp(seed=2)
    engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32",
                            grad_accum_steps=2)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    engine.backward(F.cross_entropy(model(x), y), last=True)
    with pytest.raises(RuntimeError, match=r"after backward\(last=True\).*call step\(\)"):
        engine.backward(F.cross_entropy(model(x), y))
    engine.step()
    engine.backward(F.cross_entropy(model(x), y), last=False)
    with pytest.raises(ValueError, match="cannot grow past grad_accum_steps"):
        engine.backward(F.cross_entropy(model(x), y), last=False)
    with pytest.raises(TypeError, match="expected True, False or None"):
        engine.backward(F.cross_entropy(model(x), y), last=1)


def test_fp32_buffers_sum_bf16_micro_grads_exactly():
    """bf16-master: the buffer equals the float64 sum of the four bf16 micro-gradients."""
    torch.manual_seed(0)
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
    model = mlp(seed=3)
    engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.0), "bf16-master",
                            grad_accum_steps=4)
    want = [torch.zeros_like(p, dtype=torch.float64) for p in engine.param_state.working]
    emu = engine.emulation_mode or contextlib.nullcontext()  # backward rounds as it would
    for i in range(0, 32, 8):
        with engine.autocast():
            loss = F.cross_entropy(model(x[i:i + 8]), y[i:i + 8])
        with emu:
            engine.scaler.scale_loss(loss, 4).backward()
        for w, p in zip(want, engine.param_state.working):
            w += p.grad.double()
        engine.param_state.accumulate()
        engine.counters.micro += 1
    for a, w in zip(engine.param_state.gradients(), want):
        torch.testing.assert_close(a.double(), w, rtol=2e-7, atol=1e-12)


# --- clipping happens on the true gradients --------------------------------------------

def test_clipping_under_scale_2_16_matches_fp32_clipping():
    torch.manual_seed(0)
    data = [(torch.randn(16, 16), torch.randint(0, 4, (16,))) for _ in range(10)]
    ref = mlp(seed=1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_norms = []
    for x, y in data:
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05).item())
        ref_opt.step()
    model = mlp(seed=1)
    engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            "fp32,loss_scale=static,init_scale=65536", max_grad_norm=0.05)
    norms = []
    for x, y in data:
        engine.backward(F.cross_entropy(model(x), y))
        norms.append(float(engine.step().grad_norm))
    assert norms == pytest.approx(ref_norms, rel=1e-6)
    assert max(ref_norms) > 0.05  # clipping was active
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_clipping_under_fp16_scaling_close_to_fp32():
    torch.manual_seed(0)
    data = [(torch.randn(16, 16), torch.randint(0, 4, (16,))) for _ in range(5)]
    runs = {}
    for recipe in ("fp32", "fp16"):
        model = mlp(seed=1)
        engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), recipe,
                                max_grad_norm=0.05)
        norms = []
        for x, y in data:
            with engine.autocast():
                loss = F.cross_entropy(model(x), y)
            engine.backward(loss)
            norms.append(float(engine.step().grad_norm))
        runs[recipe] = norms
    assert runs["fp16"] == pytest.approx(runs["fp32"], rel=2e-2)  # not 65536x


def test_grad_norm_is_exact_to_fp32_on_large_tensors():
    # the norm is the non-finite check and the clipping input; on the CPU it is a sum of
    # per-tensor dots (torch's _foreach_norm is 2e-5 off float64 on a 1M-element tensor)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 8))
    engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.0), "fp32")
    x = torch.randn(64, 1024)
    with engine.autocast():
        loss = model(x).square().mean()
    engine.backward(loss)
    want = math.sqrt(sum((p.grad.double() ** 2).sum().item() for p in model.parameters()))
    got = float(engine.step().grad_norm)
    assert got == pytest.approx(want, rel=1e-6)


# --- every preset trains a small GPT ---------------------------------------------------

@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_trains_a_small_gpt(preset):
    small = preset.startswith("fp16")  # CPU fp16 kernels are slow: tiny shapes
    model = tiny_gpt(d_model=16 if small else 32, seq_len=16 if small else 32)
    r = PRESETS[preset]
    if r.states == "fp32" and r.write == "nearest":
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    else:  # the presets that store states or write weights by a rule: mixprec.optim
        opt = mixprec.optim.AdamW(model.parameters(), lr=3e-3, states=r.states,
                                  write=r.write)
    engine = MixedPrecision(model, opt, preset)
    losses = pattern_losses(engine, model, 40 if small else 60, check_applied=True)
    assert losses[-1] < 0.5 * losses[0], losses[::10]


# --- any nn.Module ---------------------------------------------------------------------

@pytest.mark.paths
def test_tied_embedding_keeps_one_shared_master():
    model = TiedLM()
    engine = MixedPrecision(model, torch.optim.AdamW(model.parameters(), fused=True),
                            "bf16-master")
    assert model.head.weight is model.emb.weight
    # bf16 storage (under emulation: fp32 tensors holding bf16 values)
    assert model.emb.weight.dtype == (torch.float32 if engine.emulating else torch.bfloat16)
    assert len(engine.master_params) == len(list(model.parameters())) == 3
    idx = torch.randint(0, 32, (4, 8))
    for _ in range(3):
        with engine.autocast():
            loss = F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
        engine.backward(loss)
        engine.step()
    assert model.head.weight is model.emb.weight
    master = engine.master_params[0]
    assert torch.equal(model.emb.weight.float(), master.to(torch.bfloat16).float())


@pytest.mark.paths
def test_cnn_with_batchnorm_keeps_buffers_fp32():
    model = cnn()
    engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9,
                                                   fused=True), "bf16-master")
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 4, (8,))
    before = model[1].running_mean.clone()
    for _ in range(3):
        with engine.autocast():
            loss = F.cross_entropy(model(x), y)
        engine.backward(loss)
        engine.step()
    bn = model[1]
    assert bn.running_mean.dtype == bn.running_var.dtype == torch.float32
    assert bn.weight.dtype == (torch.float32 if engine.emulating else torch.bfloat16)
    assert torch.equal(bn.weight, bn.weight.bfloat16().to(bn.weight.dtype))  # bf16 values
    assert not torch.equal(bn.running_mean, before)
    assert all(s["momentum_buffer"].dtype == torch.float32
               for s in engine.optimizers[0].state.values())


def test_several_param_groups_and_optimizers():
    model = mlp()
    o1 = torch.optim.AdamW([{"params": model[0].parameters(), "lr": 1e-2},
                            {"params": model[1].parameters(), "lr": 0.0}], fused=True)
    o2 = torch.optim.SGD(model[3].parameters(), lr=0.1, fused=True)
    engine = MixedPrecision(model, [o1, o2], "bf16-master")
    ln_before = model[1].weight.detach().clone()
    lin_before = model[3].weight.detach().clone()
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    with engine.autocast():
        loss = F.cross_entropy(model(x), y)
    engine.backward(loss)
    engine.step()
    assert torch.equal(model[1].weight, ln_before)          # lr 0 group untouched
    assert not torch.equal(model[3].weight, lin_before)     # second optimizer stepped
    assert all(p.dtype == torch.float32 for g in o1.param_groups for p in g["params"])


# --- scheduler, skip limit -------------------------------------------------------------

def test_scheduler_does_not_advance_on_skipped_steps():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    engine = MixedPrecision(model, opt, "bf16", scheduler=sched)
    x, y = torch.randn(4, 16), torch.randint(0, 4, (4,))
    for bad in (False, True, True, False):
        with engine.autocast():
            loss = F.cross_entropy(model(x), y) * (math.nan if bad else 1.0)
        engine.backward(loss)
        engine.step()
    assert opt.param_groups[0]["lr"] == 0.25  # two applied steps, not four


@pytest.mark.parametrize("mode", ["warn", "raise"])
def test_long_skip_streak_is_not_silent(mode):
    model = mlp()
    engine = MixedPrecision(model, torch.optim.AdamW(model.parameters(), fused=True),
                            f"fp16,skip_limit=5,on_skip_limit={mode}")
    x, y = torch.randn(4, 16), torch.randint(0, 4, (4,))

    def bad_step():
        with engine.autocast():
            loss = F.cross_entropy(model(x), y) * math.inf
        engine.backward(loss)
        engine.step()

    for _ in range(4):
        bad_step()
    if mode == "warn":
        with pytest.warns(RuntimeWarning, match="5 consecutive steps skipped.*loss scale"):
            bad_step()
    else:
        with pytest.raises(SkipLimitError, match="5 consecutive steps skipped"):
            bad_step()


# --- checkpoints -----------------------------------------------------------------------

def _train(engine, model, steps, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        with engine.autocast():
            loss = F.cross_entropy(model(x), y)
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


@pytest.mark.paths
@pytest.mark.parametrize("recipe", ["bf16", "fp16-master"])
def test_state_dict_resumes_bit_identically(recipe):
    def fresh():
        m = mlp(seed=5)
        return m, MixedPrecision(m, torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True),
                                 f"{recipe},growth_interval=3" if "fp16" in recipe else recipe)

    m1, e1 = fresh()
    _train(e1, m1, 5, seed=0)
    buf = io.BytesIO()
    torch.save(e1.state_dict(), buf)
    tail1 = _train(e1, m1, 5, seed=1)
    buf.seek(0)
    m2, e2 = fresh()
    e2.load_state_dict(torch.load(buf, weights_only=True))
    assert _train(e2, m2, 5, seed=1) == tail1
    assert float(e2.scale) == float(e1.scale)
    for p, q in zip(e1.master_params, e2.master_params):
        assert torch.equal(p, q)


def test_loading_another_recipes_state_is_an_error():
    m = mlp()
    state = MixedPrecision(m, torch.optim.AdamW(m.parameters()), "bf16").state_dict()
    m2 = mlp()
    e2 = MixedPrecision(m2, torch.optim.AdamW(m2.parameters()), "bf16-master")
    with pytest.raises(ValueError, match="saved with recipe 'bf16'.*runs 'bf16-master'"):
        e2.load_state_dict(state)


def test_loading_a_state_of_other_param_groups_changes_nothing():
    """torch's optimizer load checks its groups, but only after the engine had loaded
    the model and masters: a refused checkpoint left them overwritten."""
    m = mlp()
    e = MixedPrecision(m, torch.optim.AdamW(m.parameters()), "bf16-master")
    state = e.state_dict()
    m2 = mlp(seed=3)
    decay = [p for p in m2.parameters() if p.dim() > 1]
    rest = [p for p in m2.parameters() if p.dim() <= 1]
    e2 = MixedPrecision(m2, torch.optim.AdamW([{"params": decay}, {"params": rest,
                                                "weight_decay": 0.0}]), "bf16-master")
    before = [p.clone() for p in (*m2.parameters(), *e2.master_params)]
    with pytest.raises(ValueError, match=r"param groups of \[6\] parameters.*has \[2, 4\]"):
        e2.load_state_dict(state)
    after = [*m2.parameters(), *e2.master_params]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


# --- misuse is loud --------------------------------------------------------------------

def test_step_without_backward_and_double_step_raise():
    m = mlp()
    e = MixedPrecision(m, torch.optim.AdamW(m.parameters()), "bf16")
    with pytest.raises(RuntimeError, match="without backward"):
        e.step()
    with e.autocast():
        loss = m(torch.randn(2, 16)).sum()
    e.backward(loss)
    e.step()
    with pytest.raises(RuntimeError, match="twice for the same gradients"):
        e.step()


def test_model_already_half_with_master_recipe_raises():
    m = mlp().to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"already torch.bfloat16.*before model.half"):
        MixedPrecision(m, torch.optim.AdamW(m.parameters()), "bf16-master")


def test_device_that_cannot_run_the_recipe(monkeypatch):
    import mixprec.engine.checks as checks
    monkeypatch.setattr(checks, "device_supports", lambda dev, dt: dt != torch.bfloat16)
    m = mlp()
    with pytest.raises(ValueError, match="needs torch.bfloat16 but device cpu"):
        MixedPrecision(m, torch.optim.AdamW(m.parameters()), "bf16,emulate=false")
    # emulated, bf16 needs no bf16 kernels: the device's fp32 ones do
    MixedPrecision(m, torch.optim.AdamW(m.parameters()), "bf16,emulate=true")


def test_bad_arguments():
    m = mlp()
    opt = torch.optim.AdamW(m.parameters())
    with pytest.raises(ValueError, match="grad_accum_steps"):
        MixedPrecision(m, opt, "bf16", grad_accum_steps=0)
    with pytest.raises(ValueError, match="unknown preset"):
        MixedPrecision(m, opt, "bf17")
    other = torch.optim.AdamW(mlp().parameters())
    with pytest.raises(ValueError, match="not a parameter of the model"):
        MixedPrecision(m, other, "bf16")
    e = MixedPrecision(m, opt, "bf16")
    with pytest.raises(ValueError, match="scalar"):
        e.backward(m(torch.randn(2, 16)))
    with pytest.raises(ValueError, match="does not require grad"):
        e.backward(torch.tensor(1.0))


def test_slow_fp16_is_emulated_by_itself_and_says_so(monkeypatch, measured):
    set_speeds(monkeypatch, bf16=0.02, fp16=0.02)  # a CPU without fp16
    m = mlp()
    with pytest.warns(UserWarning, match="fp16 has no fast kernels on cpu.*emulates it"):
        e = MixedPrecision(m, torch.optim.AdamW(m.parameters()), "fp16")
    assert e.emulating
    m = mlp()
    with pytest.warns(UserWarning, match="emulate=false on cpu: this device has no fast"):
        e = MixedPrecision(m, torch.optim.AdamW(m.parameters()), "fp16,emulate=false")
    assert not e.emulating


def test_fast_fp16_runs_real_kernels(monkeypatch, measured):
    set_speeds(monkeypatch, bf16=1.0, fp16=1.0)  # AVX512-FP16, say
    m = mlp()
    assert not MixedPrecision(m, torch.optim.AdamW(m.parameters()), "fp16").emulating


@pytest.mark.parametrize("recipe,opt", [
    ("bf16,grads=bf16", "adamw"),             # bf16 accumulation buffers on fp32 params
    ("fp16,params=fp16,grads=fp16", "sgd"),   # pure fp16 with dynamic scaling, no master
    ("bf16-master,grad_accum=kahan", "adamw"),  # compensated fp32 buffers
    ("tf32", "adamw"),
    ("fp16-master,loss_scale=static,init_scale=1024", "adamw"),
    ("bf16-master,comm=bf16,keep_fp32=layer_norm+loss", "adamw"),
])
def test_non_preset_recipes_train(recipe, opt):
    model = mlp(seed=2)
    optim = (torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True) if opt == "adamw"
             else torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9))
    engine = MixedPrecision(model, optim, recipe, grad_accum_steps=2, max_grad_norm=1.0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g)
    losses = []
    for _ in range(30):
        for xs, ys in zip(x.chunk(2), y.chunk(2)):
            with engine.autocast():
                loss = F.cross_entropy(model(xs), ys)
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses[::5]
    assert int(engine.skipped_steps) == 0


def test_pure_fp16_with_adam_warns_and_why():
    with pytest.warns(UserWarning, match="second moment underflows.*fp16-master"):
        Recipe.parse("fp16,params=fp16,grads=fp16")


def test_fused_sgd_on_half_params_is_refused_when_torch_cannot_update_them():
    """torch 2.13's fused CPU SGD leaves fp16/bf16 parameters untouched; the engine probes
    for that and refuses, instead of a run that silently never learns."""
    from mixprec.engine.checks import fused_updates as _fused_updates

    p = torch.nn.Parameter(torch.ones(32, dtype=torch.float16))
    p.grad = torch.ones_like(p)
    torch.optim.SGD([p], lr=0.1, fused=True).step()
    broken = bool((p.detach() == 1).all())
    assert _fused_updates(torch.optim.SGD, torch.float16, "cpu") is (not broken)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    if broken:
        with pytest.raises(ValueError, match="does not update torch.float16.*fused=False"):
            MixedPrecision(model, opt, "fp16,params=fp16,grads=fp16,emulate=false")
    model = mlp()  # emulated fp16 params are fp32 tensors: allowed
    MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1, fused=True),
                   "fp16,params=fp16,grads=fp16,emulate=true")
    model = mlp()  # fp32 masters are unaffected: allowed
    MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1, fused=True),
                   "fp16-master")


def test_engine_keeps_no_reference_to_the_loss_or_its_graph():
    """Nothing the engine holds may keep a step's loss (and with it the autograd graph's
    nodes) alive: a cache on the backward helper once did."""
    import gc
    import weakref

    model = mlp()
    engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16")
    refs = []
    for _ in range(3):
        with engine.autocast():
            loss = F.cross_entropy(model(torch.randn(4, 16)), torch.randint(0, 4, (4,)))
        refs.append(weakref.ref(loss))
        engine.backward(loss)
        engine.step()
        del loss
    gc.collect()
    assert all(r() is None for r in refs)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("recipe,make_opt,match", [
    # a fused optimizer torch cannot run on the bf16 working copy (when torch has the bug)
    ("bf16,params=bf16,emulate=false",
     lambda m: torch.optim.SGD(m.parameters(), lr=0.1, fused=True),
     "does not update"),
    # an optimizer over another model's parameters, under fp8 (which swaps Linears)
    ("fp8", lambda m: torch.optim.AdamW(mlp(d_in=32, hidden=32).parameters()),
     "not a parameter of the model"),
    # a model partly in bf16 already, under a -master recipe (which casts weights)
    ("bf16-master", None, "are already torch.bfloat16"),
])
def test_a_refused_engine_leaves_the_model_untouched(recipe, make_opt, match):
    """Nothing lost on failure: every check runs before the model is converted to fp8,
    sharded or cast to its working dtype."""
    from mixprec.engine.checks import fused_updates as _fused_updates

    if match == "does not update" and _fused_updates(torch.optim.SGD, torch.bfloat16, "cpu"):
        pytest.skip("this torch's fused SGD updates bf16 parameters")
    model = mlp(d_in=32, hidden=32)
    if make_opt is None:
        model[3].bfloat16()
        opt = torch.optim.AdamW(model.parameters())
    else:
        opt = make_opt(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kinds = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=match):
        MixedPrecision(model, opt, recipe)
    assert [type(m) for m in model.modules()] == kinds          # no Float8Linear swap
    after = model.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v)
               for k, v in before.items())                        # no cast, same bits


@pytest.mark.parametrize("clip", [None, 1.0])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("recipe", ["fp32", "bf16-master", "fp32,loss_scale=static"])
def test_a_gradient_norm_that_overflows_fp32_is_skipped_on_every_path(recipe, fused, clip):
    """Finite gradients whose global norm overflows fp32: 4096 elements of 2^66 (bf16 and
    fp32 hold them; the sum of squares, 2^144, does not). The fused path counted the
    norm as inf and skipped. The unfused path found no inf element, clipped by
    max_norm / inf = 0 (or not at all) and applied the step: AdamW's moments and step
    count moved. Now both skip, leaving masters and optimizer state bit-identical."""
    torch.manual_seed(0)
    model = nn.Linear(64, 64, bias=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # which kernels this chip has fast
        engine = MixedPrecision(model, opt, recipe, max_grad_norm=clip)
    with engine.autocast():
        loss = model(torch.randn(8, 64)).float().square().mean()
    engine.backward(loss)
    assert not bool(engine.step().skipped)  # an ordinary step: AdamW has state now
    masters = [p.detach().clone() for p in engine.master_params]
    state = {k: v.clone() for k, v in opt.state[engine.master_params[0]].items()}
    with engine.autocast():
        loss = (model.weight * 2.0**66).sum()  # every gradient element is 2^66
    engine.backward(loss)
    result = engine.step()
    assert bool(result.skipped)
    assert all(torch.equal(a, b) for a, b in zip(masters, engine.master_params))
    after = opt.state[engine.master_params[0]]
    assert all(torch.equal(v, after[k]) for k, v in state.items())  # moments, step
    assert engine.skipped_steps.item() == 1


@pytest.mark.paths
@pytest.mark.parametrize("recipe,dtype,skips", [("fp16-master", torch.float16, True),
                                                ("bf16-master", torch.bfloat16, False)])
def test_a_16_bit_loss_is_named_with_the_fix(recipe, dtype, skips):
    """A loss computed outside engine.autocast() on a -master recipe's 16-bit logits
    reaches backward in 16 bits: the engine says so once, with the fix. Under fp16 loss
    scaling its first step overflows (the scale, 65536, enters a fp16 node) and is
    skipped, which the warning names."""
    model = mlp()
    engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), recipe)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    if engine.emulating:
        pytest.skip("emulated 16-bit weights are fp32 tensors: their logits, and a loss "
                    "computed outside the context, are fp32")
    loss = F.cross_entropy(model(x.to(dtype)), y)  # outside the context: 16-bit
    assert loss.dtype == dtype
    with pytest.warns(UserWarning, match="outside engine.autocast.*logits.float") as w:
        engine.backward(loss)
    assert ("first steps are skipped" in str(w[0].message)) is skips
    assert bool(engine.step().skipped) is skips
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per engine
        engine.backward(F.cross_entropy(model(x.to(dtype)), y))


def test_clip_grad_norm_is_torchs_norm_and_clips_only_that_update():
    """engine.clip_grad_norm_ after the window's last backward: under fp32 the norm and
    the clipped update equal torch.nn.utils.clip_grad_norm_'s bit for bit; the next
    update falls back to max_grad_norm (here none). Mid-window, another norm_type or a
    bad max_norm raise, naming the fix."""
    import copy

    model = mlp()
    plain = copy.deepcopy(model)
    engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp32",
                            grad_accum_steps=2)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    x, y = torch.randn(16, 16), torch.randint(0, 4, (16,))
    for step in range(2):
        for xs, ys in zip(x.chunk(2), y.chunk(2)):
            with engine.autocast():
                engine.backward(F.cross_entropy(model(xs), ys))
            (F.cross_entropy(plain(xs), ys) / 2).backward()
            if engine.counters.micro == 1:
                with pytest.raises(RuntimeError, match="after 1 of 2 micro-batches"):
                    engine.clip_grad_norm_(1e-3)
                continue
            if step == 0:
                got = engine.clip_grad_norm_(1e-3)
                want = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e-3)
                assert torch.equal(got, want)
                with pytest.raises(NotImplementedError, match="norm_type=2"):
                    engine.clip_grad_norm_(1e-3, norm_type=1.0)
                with pytest.raises(ValueError, match="max_norm must be > 0"):
                    engine.clip_grad_norm_(0.0)
            engine.step()
            opt.step()
            opt.zero_grad()
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))
