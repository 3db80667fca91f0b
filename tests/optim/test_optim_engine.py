"""mixprec.optim under the engine: the recipes that need it, exact resumption, poisoned
steps, and the memory planner's prices for the new states."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import mixprec.optim as mo
from helpers.models import mlp, pattern_losses, tiny_gpt
from mixprec import MixedPrecision, Recipe
from mixprec.memory import estimate, measure
from mixprec.optim.writes import join_remainder

LEAN = {  # recipe -> the optimizer it needs
    "bf16-sr": dict(write="stochastic"),
    "bf16-kahan": dict(write="kahan"),
    "bf16-remainder": dict(write="remainder"),
    "bf16-lean": dict(write="stochastic", states="int8"),
    "bf16-master,states=int8": dict(states="int8"),
    "bf16-master,states=fp8": dict(states="fp8"),
    "bf16-sr,states=bf16": dict(write="stochastic", states="bf16"),
}


def _engine(model, recipe, lr=3e-3, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = mo.AdamW(model.parameters(), lr=lr, **{**LEAN.get(recipe, {}), **kw})
        return MixedPrecision(model, opt, recipe)


def test_a_torch_optimizer_with_a_lean_recipe_is_refused_with_the_fix():
    model = mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"torch's AdamW cannot.*mixprec\.optim\.AdamW"
                                         r"\(params, \.\.\., states='int8'"):
        MixedPrecision(model, torch.optim.AdamW(model.parameters()), "bf16-lean")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="has states='fp32', write='nearest', but recipe"):
        MixedPrecision(model, mo.AdamW(model.parameters()), "bf16-sr")
    with pytest.raises(ValueError, match="write rules are for 16-bit weights"):
        Recipe.parse("bf16-master,write=stochastic")


@pytest.mark.parametrize("recipe", ["bf16-kahan", "bf16-remainder", "bf16-lean",
                                    "bf16-master,states=fp8"])
def test_every_lean_recipe_trains(recipe):
    model = tiny_gpt(0, d_model=64, vocab=128)
    losses = pattern_losses(_engine(model, recipe, lr=1e-2), model, 30)
    assert losses[-1] < 0.5 * losses[0], (recipe, losses[0], losses[-1])


def test_remainder_training_equals_bf16_master_bit_for_bit():
    """50 steps on an MLP. The working copy of ``remainder`` rounds ties away from zero
    (``mixprec.optim.writes``), so this holds where no master lands on a tie towards an
    even bf16 value (1 in 2^17 roundings): none does in this run."""
    def run(recipe, make_opt):
        model = mlp(seed=3, d_in=16, hidden=32, d_out=4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = MixedPrecision(model, make_opt(model.parameters()), recipe)
        g = torch.Generator().manual_seed(0)
        out = []
        for _ in range(50):
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            with engine.autocast():
                loss = nn.functional.mse_loss(model(x).float(), y)
            engine.backward(loss)
            engine.step()
            out.append(loss.detach())
        return out, engine

    ref, e_ref = run("bf16-master", lambda p: torch.optim.AdamW(p, lr=1e-2))
    got, e_got = run("bf16-remainder", lambda p: mo.AdamW(p, lr=1e-2, write="remainder"))
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    opt = e_got.optimizers[0]
    for m, w in zip(e_ref.master_params, e_got.param_state.working):
        master = join_remainder(w.detach().to(torch.bfloat16), opt.state[w]["remainder"])
        assert torch.equal(master, m.detach())  # the fp32 master, bit for bit


@pytest.mark.parametrize("recipe, poison", [
    ("bf16-lean", "loss"), ("bf16-lean", "grad"), ("bf16-lean", "input"),  # sr + int8
    ("bf16-kahan", "grad"), ("bf16-remainder", "input"), ("bf16-master,states=int8", "loss")])
def test_a_poisoned_step_leaves_every_state_bit_identical(recipe, poison):
    model = tiny_gpt(0, d_model=64, vocab=128)
    engine = _engine(model, recipe)
    pattern_losses(engine, model, 2)  # states exist
    opt = engine.optimizers[0]
    before = ([p.detach().clone() for p in engine.param_state.working],
              [{k: v.clone() for k, v in st.items()} for st in opt.state.values()],
              opt._sr_step(torch.device("cpu")).clone())
    idx = torch.randint(0, 128, (4, 33), generator=torch.Generator().manual_seed(5))
    hooks = []
    if poison == "input":  # an inf in one embedding output: the forward's input poisoned
        hooks.append(model.tok.register_forward_hook(
            lambda m, args, out: out.index_fill(1, torch.tensor([0]), float("inf"))))
    if poison == "grad":  # one gradient, in the backward of one block's MLP
        hooks.append(model.blocks[0].out.register_full_backward_pre_hook(
            lambda m, go: (go[0] * float("inf"),)))
    with engine.autocast():
        loss = model(idx[:, :-1], idx[:, 1:])
        if poison == "loss":
            loss = loss * float("inf")
    engine.backward(loss)
    assert bool(engine.step().skipped)
    for h in hooks:
        h.remove()
    assert all(torch.equal(a, b) for a, b in zip(before[0], engine.param_state.working))
    for st, old in zip(opt.state.values(), before[1]):
        assert st.keys() == old.keys() and all(torch.equal(st[k], old[k]) for k in old)
    assert torch.equal(opt._sr_step(torch.device("cpu")), before[2])


@pytest.mark.paths
@pytest.mark.parametrize("recipe", ["bf16-sr", "bf16-lean", "bf16-remainder"])
def test_checkpoints_resume_bit_for_bit(recipe, tmp_path):
    def fresh():
        model = tiny_gpt(0, d_model=64, vocab=128)
        return model, _engine(model, recipe)

    model, engine = fresh()
    pattern_losses(engine, model, 3)
    engine.save(tmp_path / "ck.pt", step=3)
    want = pattern_losses(engine, model, 4)
    model2, engine2 = fresh()
    assert engine2.load(tmp_path / "ck.pt") == {"step": 3}
    assert pattern_losses(engine2, model2, 4) == want
    assert all(torch.equal(a, b) for a, b in zip(engine.param_state.working,
                                                 engine2.param_state.working))


@pytest.mark.parametrize("recipe", ["bf16-sr", "bf16-kahan", "bf16-remainder", "bf16-lean",
                                    "bf16-master,states=int8", "bf16-master,states=fp8",
                                    "bf16-sr,states=bf16"])
def test_measure_equals_estimate_for_the_new_states(recipe):
    model = tiny_gpt(0, d_model=64, vocab=128)
    predicted = estimate(model, recipe)
    engine = _engine(model, recipe)
    pattern_losses(engine, model, 1)
    got = measure(model, engine)
    for item in ("params", "master", "optimizer"):
        assert got[item] == predicted[item], (recipe, item, got[item], predicted[item])


def test_the_doctor_knows_each_write_rule():
    """AdamW at lr 1e-4 on bf16 weights near 1: nearest writes lose most updates; Kahan
    and remainder keep them beside the weight (not vanished); stochastic writes keep
    them in expectation and are never counted as lost."""
    from helpers.doctor_models import batches, mlp_factory
    from mixprec import doctor

    shares = {}
    for recipe in ("bf16,params=bf16", "bf16-kahan", "bf16-remainder", "bf16-sr"):
        report = doctor(mlp_factory(), batches(), recipe, steps=2, lr=1e-4,
                        reference_steps=0)
        rows = report.facts["vanished_updates"]
        shares[recipe] = sum(v["vanished"] for v in rows) / sum(v["updated"] for v in rows)
        assert ("update-vanish" in report.codes()) == (recipe == "bf16,params=bf16"), recipe
    assert shares["bf16,params=bf16"] > 0.8
    assert shares["bf16-kahan"] < 0.01 and shares["bf16-remainder"] < 0.01
    assert shares["bf16-sr"] > 0.5  # unmoved this step, kept in expectation
