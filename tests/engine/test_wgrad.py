"""wgrad=fp32: weight gradients reach the fp32 buffers unrounded (against float64)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers.models import TiedLM, mlp, tiny_gpt
from mixprec import MixedPrecision, Recipe
from mixprec.engine.wgrad import Fp32WeightGrads


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm()).item()


def test_linear_keeps_autocast_forward_and_input_grad_and_gives_fp32_weight_grads():
    torch.manual_seed(0)
    lin = nn.Linear(256, 64)
    x = torch.randn(4, 512, 256)
    gy = torch.randn(4, 512, 64).bfloat16()
    got = {}
    for name, fp32_wgrad in (("autocast", False), ("fp32", True)):
        lin.zero_grad()
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if fp32_wgrad:
                with Fp32WeightGrads("cpu"):
                    out = lin(xi)
            else:
                out = lin(xi)
        out.backward(gy)
        got[name] = (out, xi.grad, lin.weight.grad.clone(), lin.bias.grad.clone())
    (o1, dx1, dw1, db1), (o2, dx2, dw2, db2) = got["autocast"], got["fp32"]
    assert o2.dtype == torch.bfloat16 and torch.equal(o1, o2)      # the same bf16 GEMM
    assert torch.equal(dx1, dx2)                                    # input grad unchanged
    # reference: the same bf16 operands, products and sums in float64
    xb = x.bfloat16().double().reshape(-1, 256)
    g64 = gy.double().reshape(-1, 64)
    dw_ref, db_ref = g64.t() @ xb, g64.sum(0)
    assert _rel(dw2, dw_ref) < 1e-6 and _rel(db2, db_ref) < 1e-6   # fp32 summation only
    assert _rel(dw1, dw_ref) > 3e-4 and _rel(db1, db_ref) > 3e-4   # rounded to bf16


def test_embedding_rows_add_up_in_fp32():
    """4096 lookups of one row of a bf16 table: the bf16 path rounds the row's sum.

    wgrad=fp32 is checked on real bf16 kernels and under emulate=auto (emulated where
    this CPU has no fast bf16). ``gy`` holds bf16 values, so the test's own
    ``gy.to(e.dtype)`` is exact either way (under emulation ``e.dtype`` is fp32)."""
    torch.manual_seed(0)
    model = nn.Embedding(8, 4)
    idx = torch.zeros(4096, dtype=torch.long)
    idx[::7] = 3
    gy = (torch.full((4096, 4), 1e-3) * torch.linspace(1, 2, 4096)[:, None]).bfloat16().float()
    ref = torch.zeros(8, 4, dtype=torch.float64)
    ref.index_add_(0, idx, gy.double())
    out = {}
    for recipe in ("bf16-master,emulate=false", "bf16-master,wgrad=fp32,emulate=false",
                   "bf16-master,wgrad=fp32"):
        m = nn.Embedding(8, 4)
        m.load_state_dict(model.state_dict())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # which kernels this chip has fast
            engine = MixedPrecision(m, torch.optim.SGD(m.parameters(), lr=0.0), recipe)
        with engine.autocast():
            e = m(idx)
        engine.backward((e * gy.to(e.dtype)).sum().float())
        out[recipe] = engine.param_state.gradients()[0]
    assert _rel(out["bf16-master,wgrad=fp32,emulate=false"], ref) < 1e-6
    assert _rel(out["bf16-master,wgrad=fp32"], ref) < 1e-6
    assert _rel(out["bf16-master,emulate=false"], ref) > 1e-3


def test_embedding_padding_row_gets_no_gradient():
    m = nn.Embedding(6, 3, padding_idx=-1)
    engine = MixedPrecision(m, torch.optim.SGD(m.parameters(), lr=0.0),
                            "bf16-master,wgrad=fp32")
    with engine.autocast():
        loss = m(torch.tensor([0, 5, 5, 2])).float().sum()
    engine.backward(loss)
    g = engine.param_state.gradients()[0]
    assert g[5].abs().sum() == 0 and g[0].abs().sum() > 0


@pytest.mark.parametrize("recipe", ["bf16-master,wgrad=fp32",
                                    "bf16-master,wgrad=fp32,grad_accum=kahan",
                                    "bf16,wgrad=fp32"])
def test_accumulation_equals_one_big_batch_to_fp32_tolerance(recipe):
    """The Done-when line for bf16-master: 4 micro-batches of 8 = 1 batch of 32."""
    torch.manual_seed(0)
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))

    def grads(accum):
        model = mlp(seed=3)
        engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.0), recipe,
                                grad_accum_steps=accum)
        n = 32 // accum
        for i in range(0, 32, n):
            with engine.autocast():
                loss = F.cross_entropy(model(x[i:i + n]), y[i:i + n])
            engine.backward(loss)
        return [g.clone() for g in engine.param_state.gradients()]

    for a, b in zip(grads(4), grads(1)):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_gpt_grads_fp32_except_where_the_model_itself_reduces_in_bf16():
    """Tied embedding/head, LayerNorms, every Linear: fp32 tolerance. The learned
    positions are added to the batch in bf16, so their gradient is a bf16 sum over the
    batch before it reaches any parameter: that one keeps bf16 precision."""
    torch.manual_seed(0)
    idx = torch.randint(0, 64, (8, 33))
    x, y = idx[:, :-1], idx[:, 1:]

    def grads(recipe, accum):
        model = tiny_gpt(seed=3)
        engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.0), recipe,
                                grad_accum_steps=accum)
        for i in range(0, 8, 8 // accum):
            with engine.autocast():
                loss = model(x[i:i + 8 // accum], y[i:i + 8 // accum])
            engine.backward(loss)
        names = [n for n, _ in model.named_parameters()]
        return dict(zip(names, (g.clone() for g in engine.param_state.gradients()), strict=True))

    fused = {k: _rel(a, b.double()) for (k, a), b in
             zip(grads("bf16-master,wgrad=fp32", 4).items(),
                 grads("bf16-master,wgrad=fp32", 1).values())}
    plain = {k: _rel(a, b.double()) for (k, a), b in
             zip(grads("bf16-master", 4).items(), grads("bf16-master", 1).values())}
    assert fused.pop("pos.weight") > 1e-4
    assert max(fused.values()) < 1e-6
    assert plain["tok.weight"] > 1e-4 and plain["blocks.0.fc.weight"] > 1e-4


def test_tied_weight_keeps_one_fp32_gradient():
    torch.manual_seed(0)
    idx = torch.randint(0, 32, (4, 64))
    ref = TiedLM().double()
    model = TiedLM()
    model.load_state_dict({k: v.float() for k, v in ref.state_dict().items()})
    engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.0),
                            "bf16-master,wgrad=fp32")
    with engine.autocast():
        loss = model(idx).float().square().mean()
    engine.backward(loss)
    assert len(engine.param_state.buffers) == 2 + 1  # emb/head shared, mix weight + bias
    ref(idx).square().mean().backward()
    # bf16 forward: agreement to bf16's precision, but every contribution arrived
    assert _rel(engine.param_state.gradients()[0], ref.emb.weight.grad) < 2e-2


def test_a_skipped_step_leaves_masters_bit_identical():
    model = mlp(seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = MixedPrecision(model, opt, "bf16-master,wgrad=fp32")
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    for bad in (False, True, False):
        before = [m.detach().clone() for m in engine.master_params]
        state = {k: v.clone() for s in opt.state.values() for k, v in s.items()}
        with engine.autocast():
            loss = F.cross_entropy(model(x * (float("inf") if bad else 1.0)), y)
        engine.backward(loss)
        res = engine.step()
        assert bool(res.skipped) is bad
        if bad:
            assert all(torch.equal(a, b) for a, b in zip(before, engine.master_params))
            after = {k: v for s in opt.state.values() for k, v in s.items()}
            assert all(torch.equal(state[k], after[k]) for k in state)
    assert all(torch.isfinite(m).all() for m in engine.master_params)


def test_training_with_fp32_weight_grads_learns():
    torch.manual_seed(0)
    x = torch.randn(64, 16)
    y = (x[:, :4].argmax(1))
    model = mlp(seed=2)
    engine = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                            "bf16-master,wgrad=fp32", grad_accum_steps=2)
    losses = []
    for _ in range(60):
        for i in (0, 32):
            with engine.autocast():
                loss = F.cross_entropy(model(x[i:i + 32]), y[i:i + 32])
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_bad_combinations_say_what_to_change():
    with pytest.raises(ValueError, match="wgrad='fp32' with grads='bf16'.*grads=fp32"):
        Recipe.parse("bf16,grads=bf16,wgrad=fp32")
    with pytest.warns(UserWarning, match="wgrad='fp32' with compute='fp32'"):
        Recipe.parse("fp32,wgrad=fp32")
    with pytest.raises(ValueError, match="valid: compute, fp32"):
        Recipe.parse("bf16,wgrad=fp64")
    model = mlp()
    with pytest.raises(NotImplementedError, match="MX compute format fp4_e2m1.*drop wgrad"):
        MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1),
                       "bf16,compute=fp4_e2m1,wgrad=fp32")
    with pytest.raises(NotImplementedError, match="parallel='fsdp'.*parallel='ddp'"):
        MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1),
                       "bf16,wgrad=fp32", parallel="fsdp")


def test_recipe_string_round_trips():
    r = Recipe.parse("bf16-master,wgrad=fp32")
    assert r.wgrad == "fp32" and Recipe.parse(str(r)) == r


@pytest.mark.parametrize("recipe", ["bf16", "bf16-master"])
def test_memory_measure_counts_the_same_bytes_in_the_same_places(recipe):
    """wgrad=fp32 saves the same tensors for backward; measure() must still tell the
    weight casts from the activations."""
    from mixprec.memory import measure

    idx = torch.randint(0, 64, (4, 33))
    items = {}
    for r in (recipe, recipe + ",wgrad=fp32"):
        model = tiny_gpt()
        engine = MixedPrecision(model, torch.optim.AdamW(model.parameters()), r)
        items[r] = measure(model, engine, (idx[:, :-1], idx[:, 1:])).items
    plain, fused = items.values()
    assert plain == fused and plain["weight_casts"] > 0
