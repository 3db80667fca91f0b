"""mixprec.engine.switch: a recipe switch at a step boundary keeps the fp32 truth (masters,
optimizer state) bit for bit, and a schedule's run resumes from a checkpoint exactly."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from mixprec import MixedPrecision, PrecisionSchedule
from mixprec.modules.linear import Float8Linear, fp8_modules

pytestmark = pytest.mark.filterwarnings("ignore")

NVFP4_THEN_BF16 = "nvfp4>bf16-master@0.8"


def _model(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Dropout(dropout), nn.Linear(32, 32),
                         nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 8))


def _engine(recipe, dropout: float = 0.0, **kw):
    m = _model(dropout)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return m, opt, MixedPrecision(m, opt, recipe, **kw)


def _train(engine, model, first: int, last: int) -> None:
    for i in range(first, last):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
        with engine.autocast():
            loss = (model(x).float() - y).square().mean()
        engine.backward(loss)
        engine.step()


def _state_of(opt, params):
    return [{k: v.clone() for k, v in opt.state[p].items()} for p in params]


@pytest.mark.parametrize("before, after", [("nvfp4", "bf16-master"),
                                           ("bf16-master", "nvfp4"),
                                           ("fp16-master", "fp8")])
def test_a_switch_keeps_masters_and_optimizer_state_bit_for_bit(before, after):
    model, opt, engine = _engine(before)
    _train(engine, model, 0, 3)
    values = [p.detach().clone() for p in engine.master_params]  # fp32 either way
    states = _state_of(opt, engine.master_params)
    engine.set_recipe(after)
    assert str(engine.recipe) == after
    ours = engine.master_params
    assert all(p.dtype == torch.float32 for p in ours)
    assert all(torch.equal(a, b) for a, b in zip(values, ours))
    assert [p for g in opt.param_groups for p in g["params"]] == ours
    for s, p in zip(states, ours):
        assert s.keys() == opt.state[p].keys()
        assert all(torch.equal(s[k], opt.state[p][k]) for k in s)
    working = dict(model.named_parameters())
    # the working copy: the recipe's 16 bits, or fp32 tensors where the engine emulates
    want = torch.float32 if engine.emulating else engine.recipe.param_dtype
    assert all(p.dtype == want for p in working.values())
    assert bool(fp8_modules(model)) == (engine.recipe.linear is not None)


def test_the_next_phase_trains_as_a_fresh_engine_over_the_switched_weights():
    """After the switch, steps equal a new bf16-master engine built over a model holding
    the fp32 weights at the switch and an AdamW holding the same state: the optimizer
    points at the right tensors, nothing was rounded on the way."""
    model, opt, engine = _engine(PrecisionSchedule([(0, "nvfp4"), (3, "bf16-master")]))
    _train(engine, model, 0, 3)
    assert engine.phase == 1 and str(engine.recipe) == "bf16-master"
    ref_model = _model()
    ref_model.load_state_dict(engine.fp32_state_dict())
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # torch would share tensors
    ref = MixedPrecision(ref_model, ref_opt, "bf16-master")
    _train(engine, model, 3, 6)
    _train(ref, ref_model, 3, 6)
    got, want = engine.fp32_state_dict(), ref.fp32_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_schedule_in_your_own_loop_switches_at_its_step_and_coverage_follows():
    model, opt, engine = _engine(NVFP4_THEN_BF16)
    engine.set_total_steps(5)
    assert engine.schedule.starts() == (0, 4)
    assert engine.coverage.low_precision_share > 0
    _train(engine, model, 0, 4)
    assert engine.phase == 1 and engine.steps == 4
    assert engine.coverage.low_precision_share == 0  # every Linear in bf16 now
    assert not fp8_modules(model)
    bf16 = torch.float32 if engine.emulating else torch.bfloat16  # emulated: fp32 tensors
    assert model[0].weight.dtype == bf16 and type(model[0]) is nn.Linear
    _train(engine, model, 4, 5)


def test_a_switch_between_backward_and_step_is_refused():
    model, opt, engine = _engine("nvfp4", grad_accum_steps=2)
    with engine.autocast():
        loss = model(torch.randn(4, 32)).float().square().mean()
    engine.backward(loss)
    w = model[0].weight.detach().clone()
    with pytest.raises(RuntimeError, match="without their step"):
        engine.set_recipe("bf16-master")
    assert str(engine.recipe) == "nvfp4" and torch.equal(model[0].weight, w)


def test_delayed_scaling_history_is_kept_or_reset_as_the_schedule_says():
    """``fp8_state="keep"``: a Linear in delayed scaling on both sides keeps its amax
    history and scales; ``"reset"``: they are a fresh module's (zeros, ones)."""
    for mode in ("keep", "reset"):
        s = PrecisionSchedule([(0, "fp8"), (3, "fp8,layer:3=bf16")], fp8_state=mode)
        model, opt, engine = _engine(s)
        _train(engine, model, 0, 2)
        _train(engine, model, 2, 3)  # the switch runs right after this step
        assert engine.phase == 1 and type(model[3]) is nn.Linear
        for i in (0, 5):
            m = model[i]
            assert isinstance(m, Float8Linear) and m.scaling == "delayed"
            hist, scale = m.fp8_amax_history, m.fp8_scale
            if mode == "keep":
                assert hist.abs().sum() > 0 and not torch.equal(scale, torch.ones(3))
            else:
                assert torch.equal(hist, torch.zeros_like(hist))
                assert torch.equal(scale, torch.ones(3))


def test_keep_carries_the_amax_history_exactly():
    model, opt, engine = _engine("fp8")
    _train(engine, model, 0, 3)
    before = {n: {k: v.clone() for k, v in m.scaling_state().items()}
              for n, m in fp8_modules(model).items()}
    engine.set_recipe("fp8,layer:3=bf16")
    after = fp8_modules(model)
    assert set(after) == {"0", "5"}
    for n, m in after.items():
        assert all(torch.equal(before[n][k], v) for k, v in m.scaling_state().items())


def test_the_loss_scale_carries_over_when_the_recipes_scale_alike():
    model, opt, engine = _engine("fp16-master,init_scale=1024")
    _train(engine, model, 0, 2)
    scaler = engine.scaler
    engine.set_recipe("fp16,init_scale=1024")  # same loss scaling: the same scaler
    assert engine.scaler is scaler
    engine.set_recipe("bf16-master")  # no scaling: a new scaler, the skip count kept
    assert engine.scaler is not scaler and float(engine.scale) == 1.0
    assert torch.equal(engine.skipped_steps, scaler.skipped_total)


@pytest.mark.parametrize("save_at", [pytest.param(2, marks=pytest.mark.long), 4])
def test_a_scheduled_run_resumes_mid_phase_bit_for_bit(save_at, tmp_path):
    """Five steps straight vs. a save at step ``save_at`` (inside the nvfp4 phase, or
    the bf16-master one), a fresh engine, a load and the rest: identical weights, with
    dropout and NVFP4's stochastic rounding drawing from the restored streams."""
    def build():
        m, opt, e = _engine(NVFP4_THEN_BF16, dropout=0.1)
        e.set_total_steps(5)
        return m, e

    model, engine = build()
    _train(engine, model, 0, 5)
    want = engine.fp32_state_dict()
    model, engine = build()
    _train(engine, model, 0, save_at)
    engine.save(tmp_path / "c.pt")
    torch.manual_seed(123)  # the restore must bring the streams back
    model, engine = build()
    engine.load(tmp_path / "c.pt")
    assert engine.phase == (1 if save_at >= 4 else 0) and engine.steps == save_at
    _train(engine, model, save_at, 5)
    assert engine.phase == 1
    got = engine.fp32_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_checkpoint_of_another_schedule_is_refused(tmp_path):
    model, opt, engine = _engine("bf16-master>fp8@2")
    _train(engine, model, 0, 3)
    engine.save(tmp_path / "c.pt")
    _, _, other = _engine("bf16-master>nvfp4@2")
    with pytest.raises(ValueError, match="precision schedule"):
        other.load(tmp_path / "c.pt")
    _, _, plain = _engine("bf16-master")
    with pytest.raises(ValueError, match="has none"):
        plain.load(tmp_path / "c.pt")


def test_two_schedules_and_parallel_switches_are_refused():
    with pytest.raises(ValueError, match="two schedules"):
        _engine("nvfp4>bf16-master@0.8", schedule="bf16>fp8@3")
    model, opt, engine = _engine("bf16-master")
    with pytest.raises(NotImplementedError, match="write rule"):
        engine.set_recipe("bf16-sr")
    assert str(engine.recipe) == "bf16-master"


def test_a_recipe_that_refuses_the_model_leaves_the_engine_as_it_was():
    """``fp8,bf16_last_layers=4`` keeps every Linear of this model in bf16, so fp8
    converts none and raises: the engine trains on in its recipe, from the same values."""
    model, opt, engine = _engine("bf16-master")
    _train(engine, model, 0, 2)
    values = [p.detach().clone() for p in engine.master_params]
    states = _state_of(opt, engine.master_params)
    with pytest.raises(ValueError, match="converts no Linear"):
        engine.set_recipe("fp8,bf16_last_layers=4")
    assert str(engine.recipe) == "bf16-master" and not fp8_modules(model)
    assert all(torch.equal(a, b) for a, b in zip(values, engine.master_params))
    for s, p in zip(states, engine.master_params):
        assert all(torch.equal(s[k], opt.state[p][k]) for k in s)
    _train(engine, model, 2, 3)
