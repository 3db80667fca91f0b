"""LossScaler: the dynamic rule, hysteresis, clamps, and state round trips."""

from __future__ import annotations

import math

import pytest
import torch

from mixprec import LossScaler

INF = [torch.tensor([math.inf])]


def clean():
    return [torch.tensor([1.0])]


def run(s: LossScaler, pattern: str) -> list[float]:
    """Feed 'x' (overflow) / '.' (clean) steps; return the scale after each."""
    out = []
    for c in pattern:
        found = s.unscale_(INF if c == "x" else clean())
        s.update(found)
        out.append(float(s.scale))
    return out


def test_dynamic_backoff_and_growth():
    s = LossScaler("dynamic", init_scale=16.0, growth_interval=2)
    assert run(s, "x..x...") == [8, 8, 16, 8, 8, 16, 16]


def test_hysteresis_tolerates_overflows_until_consecutive_limit():
    s = LossScaler("dynamic", init_scale=16.0, hysteresis=3, growth_interval=100)
    # two overflows, a clean step resets the streak, then three in a row back off
    assert run(s, "xx.xxx") == [16, 16, 16, 16, 16, 8]
    assert run(s, "x") == [4]  # past the threshold, each further overflow backs off
    s1 = LossScaler("dynamic", init_scale=16.0, hysteresis=1, growth_interval=100)
    assert run(s1, "xx") == [8, 4]  # without hysteresis every overflow backs off


def test_min_scale_floor_vs_gradscaler_reaching_zero():
    s = LossScaler("dynamic", init_scale=2.0**16, min_scale=1.0)
    scales = run(s, "x" * 300)
    assert min(scales) == 1.0 and scales[-1] == 1.0
    g = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    p = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=0.1)
    for _ in range(300):
        g.scale(torch.ones(()))
        p.grad = torch.tensor([math.inf])
        g.step(opt)
        g.update()
    assert g.get_scale() == 0.0  # torch's scaler underflows and never recovers


def test_max_scale_ceiling():
    s = LossScaler("dynamic", init_scale=4.0, growth_interval=1, max_scale=32.0)
    assert run(s, "......") == [8, 16, 32, 32, 32, 32]


def test_static_and_none_never_change_but_still_detect():
    for kind, start in (("static", 512.0), ("none", 1.0)):
        s = LossScaler(kind, init_scale=512.0)
        assert run(s, "x.x") == [start] * 3
        assert int(s.skipped_total) == 2
        g = [torch.tensor([2.0 * start])]
        assert float(s.unscale_(g)) == 0.0 and g[0].item() == 2.0


def test_unscale_divides_and_flags_nan():
    s = LossScaler("dynamic", init_scale=4.0)
    g = [torch.tensor([8.0, 4.0]), torch.tensor([math.nan])]
    assert float(s.unscale_(g)) == 1.0
    assert g[0].tolist() == [2.0, 1.0]


def test_state_round_trip():
    s = LossScaler("dynamic", init_scale=64.0, growth_interval=3, hysteresis=2)
    run(s, "x..")
    t = LossScaler("dynamic", init_scale=1.0, growth_interval=3, hysteresis=2)
    t.load_state_dict(s.state_dict())
    assert run(t, ".x.") == run(s, ".x.")


def test_the_three_policies_are_classes_behind_one_constructor():
    from mixprec.engine.scaler import DynamicLossScale, NoLossScale, StaticLossScale

    kinds = {"none": NoLossScale, "static": StaticLossScale, "dynamic": DynamicLossScale}
    for kind, cls in kinds.items():
        s = LossScaler(kind, init_scale=8.0)
        assert type(s) is cls and isinstance(s, LossScaler) and s.kind == kind
        assert s.scaled is (kind != "none") and float(s.scale) == (1.0 if kind == "none" else 8.0)
    assert type(DynamicLossScale(init_scale=4.0)) is DynamicLossScale
    with pytest.raises(ValueError, match="valid: none, static, dynamic"):
        LossScaler("sometimes")


def test_a_new_loss_scale_policy_is_one_class_and_trains_through_the_engine():
    """A static schedule (2^10 for three steps, then 2^12), defined here as one subclass
    and handed to the engine: no change anywhere else. Its gradients are scaled by it,
    the state round-trips through a checkpoint, and the run learns."""
    import torch.nn.functional as F

    from helpers.models import mlp
    from mixprec import MixedPrecision

    class ScheduledScale(LossScaler):
        kind = "scheduled"

        def _next_scale(self, found):
            self.growth_tracker = self.growth_tracker + 1
            later = torch.full_like(self.scale, 2.0**12)
            self.scale = torch.where(self.growth_tracker >= 3, later, self.scale)

    def engine_for(model):
        return MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2,
                                                       fused=True),
                              "fp16-master", loss_scaler=ScheduledScale(init_scale=2.0**10))

    torch.manual_seed(0)
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
    model = mlp()
    engine = engine_for(model)
    scales, losses = [], []
    for step in range(8):
        with engine.autocast():
            loss = F.cross_entropy(model(x), y)
        engine.backward(loss)
        if step == 0:  # what reached the buffers is the scaled gradient
            scaled_norm = torch.stack([g.norm() for g in engine.param_state.gradients()]).norm()
        r = engine.step()
        if step == 0:
            assert float(scaled_norm / r.grad_norm) == pytest.approx(2.0**10, rel=1e-4)
        scales.append(float(r.scale))
        losses.append(loss.item())
    assert scales == [2.0**10] * 2 + [2.0**12] * 6
    assert losses[-1] < 0.8 * losses[0]
    fresh = engine_for(mlp())
    fresh.load_state_dict(engine.state_dict())
    assert float(fresh.scale) == 2.0**12 and int(fresh.scaler.growth_tracker) == 8
    with pytest.raises(TypeError, match="loss_scaler must be a mixprec.engine.scaler.LossScaler"):
        m = mlp()
        MixedPrecision(m, torch.optim.SGD(m.parameters(), lr=0.1), "fp16",
                       loss_scaler=torch.amp.GradScaler("cpu"))
