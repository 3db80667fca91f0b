"""Per-parameter optimizer-state formats: ``set_state_formats`` in ``mixprec.optim``, the
recipe's ``states:`` rules applied by the engine, ``adamw_for`` and the doctor, and the
memory planner pricing each parameter (and each Linear) at its own format."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch import nn

import mixprec.optim as mo
from helpers.models import tiny_gpt
from mixprec import MixedPrecision, Recipe
from mixprec.memory import TransformerSpec, estimate, measure
from mixprec.optim.states import state_bytes, stored_format

# (shape, format): quantized matrices, a matrix too small to quantize, a 1-D bias
# whose block format stays fp32 by stored_format's rule, and fp32 / bf16 ones
MIXED = [((64, 128), "int8"), ((80, 96), "int4"), ((72, 100), "fp8"), ((64, 128), "fp32"),
         ((16, 16), "int8"), ((128,), "int4"), ((40, 130), "bf16"), ((33, 7), "fp32")]


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g)) for s, _ in MIXED]


def _grads(params, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=g) for p in params] for _ in range(steps)]


def _run(opt, params, grads):
    for step in grads:
        for p, gr in zip(params, step):
            p.grad = gr.clone()
        opt.step()


def _make(kind, params, **kw):
    if kind == "sgd":
        return mo.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3, **kw)
    return mo.AdamW(params, lr=1e-2, weight_decay=0.1, **kw)


@pytest.mark.parametrize("kind, fused", [("adamw", False), ("adamw", True), ("sgd", False)])
def test_mixed_formats_equal_one_optimizer_per_parameter(kind, fused, monkeypatch):
    """Each parameter's update uses its own format: the mixed optimizer equals, bit for
    bit, an optimizer of that single format run on that parameter alone; the fp32 ones
    equal torch's own optimizer (fused where asked), and only those go fused."""
    kw = {"fused": True} if fused else {}
    params, grads = _params(), _grads(_params(), 5)
    opt = _make(kind, params, **kw)
    opt.set_state_formats({p: f for p, (_, f) in zip(params, MIXED)})
    fused_ids = []
    if fused:
        real = torch._fused_adamw_
        monkeypatch.setattr(torch, "_fused_adamw_", lambda ps, *a, **k: (
            fused_ids.extend(id(p) for p in ps), real(ps, *a, **k))[1])
    _run(opt, params, grads)
    went_fused = set(fused_ids)
    for i, (p, (shape, fmt)) in enumerate(zip(params, MIXED)):
        alone = _params()[i]
        one = _make(kind, [alone], states=fmt, **kw)
        _run(one, [alone], [[s[i]] for s in grads])
        assert torch.equal(p, alone), (shape, fmt)
        mine, theirs = opt.state[p], one.state[alone]
        assert mine.keys() == theirs.keys(), (shape, fmt)
        assert all(torch.equal(mine[k], theirs[k]) for k in mine), (shape, fmt)
        if stored_format(fmt, shape) == "fp32":  # an independent reference: torch's
            ref = _params()[i]
            cls = torch.optim.SGD if kind == "sgd" else torch.optim.AdamW
            args = (dict(lr=0.05, momentum=0.9, weight_decay=1e-3) if kind == "sgd"
                    else dict(lr=1e-2, weight_decay=0.1))
            topt = cls([ref], **args, **(kw or {"foreach": False}))
            _run(topt, [ref], [[s[i]] for s in grads])
            assert torch.equal(p, ref), (shape, fmt)
            assert "exp_avg.q" not in mine and "momentum_buffer.q" not in mine
        else:
            assert any(k.endswith(".q") for k in mine) or fmt == "bf16", (shape, fmt)
    if fused:
        want = {id(p) for p, (s, f) in zip(params, MIXED) if stored_format(f, s) == "fp32"}
        assert went_fused == want


def test_a_state_dict_round_trip_resumes_bit_for_bit():
    params, grads = _params(), _grads(_params(), 6)
    formats = {i: f for i, (_, f) in enumerate(MIXED)}
    opt = mo.AdamW(params, lr=1e-2)
    opt.set_state_formats({params[i]: f for i, f in formats.items()})
    _run(opt, params, grads[:3])
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    weights = [p.detach().clone() for p in params]
    _run(opt, params, grads[3:])  # uninterrupted

    again = [nn.Parameter(w.clone()) for w in weights]
    opt2 = mo.AdamW(again, lr=1e-2)
    opt2.set_state_formats({again[i]: f for i, f in formats.items()})
    buf.seek(0)
    opt2.load_state_dict(torch.load(buf, weights_only=True))
    _run(opt2, again, grads[3:])
    for p, q in zip(params, again):
        assert torch.equal(p, q)
        st, st2 = opt.state[p], opt2.state[q]
        assert st.keys() == st2.keys()
        assert all(torch.equal(st[k], st2[k]) and st[k].dtype == st2[k].dtype for k in st)


def test_loading_checks_each_parameters_own_format():
    params = _params()
    opt = mo.AdamW(params)
    opt.set_state_formats({params[0]: "int8"})
    _run(opt, params, _grads(params, 1))
    sd = opt.state_dict()
    assert sd["mixprec"]["formats"][:2] == ["int8", "fp32"]

    plain = mo.AdamW(_params())  # every parameter fp32: refused, naming parameter 0
    with pytest.raises(ValueError, match=r"saved with int8 states for parameter 0 \(shape "
                                         r"\(64, 128\)\).*keeps fp32.*set_state_formats"):
        plain.load_state_dict(sd)
    assert not plain.state
    other = _params()
    wrong = mo.AdamW(other)
    wrong.set_state_formats({other[0]: "fp8"})  # coded too, but another code
    with pytest.raises(ValueError, match="saved with int8 states for parameter 0"):
        wrong.load_state_dict(sd)
    # without the settings beside it, the stored form is checked per parameter
    bare = {k: v for k, v in sd.items() if k != "mixprec"}
    with pytest.raises(ValueError, match=r"coded states \('exp_avg\.q'\).*states='fp32' "
                                         "for it"):
        mo.AdamW(_params()).load_state_dict(bare)
    same = _params()
    ok = mo.AdamW(same)
    ok.set_state_formats({same[0]: "int8"})
    ok.load_state_dict(bare)
    assert ok.state[same[0]]["exp_avg.q"].dtype == torch.int8


def test_changing_a_format_after_steps_reencodes_the_states():
    params = _params()
    opt = mo.AdamW(params)
    _run(opt, params, _grads(params, 2))
    m = opt.state[params[0]]["exp_avg"].clone()
    opt.set_state_formats({params[0]: "int8"})
    st = opt.state[params[0]]
    assert "exp_avg" not in st and st["exp_avg.q"].dtype == torch.int8
    from mixprec.optim.states import decode, encode

    assert torch.equal(decode({k: st[f"exp_avg.{k}"] for k in "qs"}, "int8", params[0]),
                       decode(encode(m, "int8"), "int8", params[0]))
    with pytest.raises(ValueError, match=r"state format 'int7'.*valid: fp32, bf16"):
        opt.set_state_formats({params[1]: "int7"})
    with pytest.raises(ValueError, match="not a parameter of this optimizer"):
        opt.set_state_formats({nn.Parameter(torch.ones(3)): "int8"})


# --- the engine -------------------------------------------------------------------------

def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.GELU(),
                         nn.Linear(64, 8))


def _engine(model, recipe, **kw):
    r = Recipe.coerce(recipe)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = mo.AdamW(model.parameters(), lr=3e-3, states=r.states, write=r.write, **kw)
        return MixedPrecision(model, opt, r)


def _train(engine, model, steps, seed=3):
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 64, generator=g)
        with engine.autocast():
            loss = (model(x).float() - x[:, :8]).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


RULES = "bf16-master,states:0=int8,states:4=int4"


def test_the_engine_stores_each_parameter_in_its_rules_format():
    model = _model()
    engine = _engine(model, RULES)
    losses = _train(engine, model, 12)
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    opt, ps = engine.optimizers[0], engine.param_state
    names = [n for n, _ in model.named_parameters()]
    for name, master in zip(names, ps.opt_params):
        st, fmt = opt.state[master], Recipe.coerce(RULES).state_format(name)
        assert opt.state_format(master) == fmt, name
        stored = stored_format(fmt, tuple(master.shape))
        # the states live on the masters, whatever the working copy holds
        assert master.dtype == torch.float32
        got = sum(v.numel() * v.element_size() for k, v in st.items() if k != "step")
        assert got == 2 * state_bytes(fmt, tuple(master.shape)), name
        if stored == "int8":
            assert (st["exp_avg.q"].dtype, st["exp_avg_sq.q"].dtype) == (torch.int8,
                                                                          torch.uint8)
        elif stored == "int4":
            assert st["exp_avg.q"].dtype == torch.uint8
            assert st["exp_avg.q"].shape == (master.shape[0], master.shape[1] // 2)
        else:
            assert st["exp_avg"].dtype == torch.float32, name
    # int8 only for layer 0's weight (its bias stays fp32: 1-D), int4 for none (4's
    # weight has 512 elements: fp32 by stored_format's rule) -> one coded parameter
    coded = [n for n, q in zip(names, ps.opt_params) if "exp_avg.q" in opt.state[q]]
    assert coded == ["0.weight"]


def test_the_engine_with_rules_resumes_bit_for_bit(tmp_path):
    recipe = "bf16-master,states=int8,states:2=fp32,states:0=int4"
    model, engine = _model(), None
    engine = _engine(model, recipe)
    _train(engine, model, 3)
    engine.save(tmp_path / "ck.pt", step=3)
    want = _train(engine, model, 4, seed=9)
    model2 = _model(seed=5)  # other initial weights: everything comes from the file
    engine2 = _engine(model2, recipe)
    assert engine2.load(tmp_path / "ck.pt") == {"step": 3}
    assert _train(engine2, model2, 4, seed=9) == want
    o1, o2 = engine.optimizers[0], engine2.optimizers[0]
    for a, b in zip(engine.param_state.opt_params, engine2.param_state.opt_params):
        assert torch.equal(a, b)
        assert all(torch.equal(v, o2.state[b][k]) for k, v in o1.state[a].items())
    assert "exp_avg.q" in o1.state[engine.param_state.opt_params[0]]
    # a checkpoint of other rules is refused before anything loads
    engine3 = _engine(_model(), "bf16-master,states=int8")
    with pytest.raises(ValueError, match=r"saved with recipe '.*states:0=int4' but this "
                                         "engine runs 'bf16-master,states=int8'"):
        engine3.load(tmp_path / "ck.pt")


def test_a_rule_that_matches_nothing_warns_naming_it():
    with pytest.warns(UserWarning, match=r"recipe rule states:blocks\.\*=int8 matches the "
                                         r"module of no trained parameter.*'0', '2', '4'"):
        model = _model()
        MixedPrecision(model, mo.AdamW(model.parameters()),
                       "bf16-master,states:0=int8,states:blocks.*=int8")


def test_a_torch_optimizer_is_refused_naming_the_rule():
    model = _model()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"rule states:0=int8 stores the matched parameters"
                                         r"'.*torch's AdamW cannot.*mixprec\.optim\.AdamW"):
        MixedPrecision(model, torch.optim.AdamW(model.parameters()),
                       "bf16-master,states:0=int8")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_format_set_by_hand_that_the_recipe_contradicts_warns():
    model = _model()
    opt = mo.AdamW(model.parameters())
    opt.set_state_formats({model[2].weight: "fp8"})
    with pytest.warns(UserWarning, match=r"keeps fp8 states for '2.weight' \(set by hand\)"
                                         r".*states:2=fp8"):
        engine = MixedPrecision(model, opt, "bf16-master,states:0=int8")
    masters = engine.param_state.opt_params
    assert [opt.state_format(q) for q in masters[:4]] == ["int8", "int8", "fp32", "fp32"]


# --- adamw_for and the doctor ------------------------------------------------------------

def test_adamw_for_applies_the_rules_by_name():
    model = _model()
    opt = mo.adamw_for("bf16-master,states:0=int8", model.named_parameters(), lr=1e-3)
    assert isinstance(opt, mo.AdamW) and opt.param_groups[0]["lr"] == 1e-3
    assert [opt.state_format(p) for p in model.parameters()] == ["int8", "int8"] + [
        "fp32"] * 4
    assert "param_names" not in opt.param_groups[0]  # as built over model.parameters()
    groups = [{"params": list(model[0].named_parameters(prefix="0")), "lr": 1e-2},
              {"params": list(model[2].named_parameters(prefix="2"))}]
    opt = mo.adamw_for("bf16-master,states=int8,states:2=fp32", groups)
    assert [opt.state_format(p) for g in opt.param_groups for p in g["params"]] == [
        "int8", "int8", "fp32", "fp32"]
    assert opt.param_groups[0]["lr"] == 1e-2
    with pytest.raises(ValueError, match=r"states:0=int8.*without names: pass "
                                         r"model\.named_parameters\(\)"):
        mo.adamw_for("bf16-master,states:0=int8", model.parameters())
    # rules that agree with the recipe's states need no names; fp32 everywhere: torch's
    assert isinstance(mo.adamw_for("bf16-lean,states:0=int8", model.parameters()),
                      mo.AdamW)
    fused = mo.adamw_for("bf16-master,states:0=fp32", model.named_parameters())
    assert type(fused) is torch.optim.AdamW and fused.param_groups[0]["fused"]


def test_the_doctors_optimizer_honours_the_rules():
    from mixprec.diagnostics.doctor import _optimizer

    model = _model()
    for kind in ("adamw", "sgd"):
        opt = _optimizer(model, Recipe.coerce("bf16-master,states:4=bf16"), kind, 1e-3)
        assert [opt.state_format(p) for p in model.parameters()] == ["fp32"] * 4 + [
            "bf16"] * 2


# --- memory ------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", [RULES, "bf16-master,states=int8,states:blocks.0.*=fp32",
                                    "bf16-lean,states:tok=int4,states:blocks.1.*=fp32",
                                    "bf16-master,states:blocks.*.fc=fp8,states:*.out=bf16"])
def test_estimate_prices_each_parameter_at_its_format_as_measured(recipe):
    """The optimizer item of ``estimate`` equals the bytes ``measure`` finds in the
    engine's optimizer after one step (a transformer, whose embeddings, attention and
    MLP matrices the rules split)."""
    model = tiny_gpt(0, d_model=64, vocab=128) if "blocks" in recipe or "tok" in recipe \
        else _model()
    predicted = estimate(model, recipe)
    plain = estimate(model, Recipe.coerce(recipe).base)
    engine = _engine(model, recipe)
    if isinstance(model, nn.Sequential):
        _train(engine, model, 1)
    else:
        from helpers.models import pattern_losses

        pattern_losses(engine, model, 1)
    got = measure(model, engine)
    assert got["optimizer"] == predicted["optimizer"], (got["optimizer"],
                                                        predicted["optimizer"])
    assert predicted["optimizer"] != plain["optimizer"]  # the rules change the price
    for item in ("params", "master"):
        assert got[item] == predicted[item]


def test_the_activation_estimate_counts_each_linear_at_its_own_format():
    """An fp8 recipe whose layer: rules keep one block's Linears in bf16: activations
    and saved weight copies sit between the all-fp8 and the all-bf16 figures."""
    pytest.importorskip("mixprec.engine.convert").layer_formats  # noqa: B018
    model = tiny_gpt(0, d_model=64, vocab=128, n_layers=2)
    spec = TransformerSpec(layers=2, hidden=64, heads=2, seq_len=32, micro_batch=4,
                           vocab=128)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fp8 = estimate(model, "fp8-current", activations=spec)
        mixed = estimate(model, "fp8-current,layer:blocks.0.*=bf16", activations=spec)
        kept = estimate(model, "fp8-current,layer:*=bf16", activations=spec)
    for item in ("activations", "weight_casts"):
        lo, hi = sorted((fp8[item], kept[item]))
        assert lo < mixed[item] < hi, (item, fp8[item], mixed[item], kept[item])
    assert fp8["activations"] < kept["activations"]


def test_measuring_a_step_of_an_engine_with_rules_changes_nothing():
    """``measure(..., peak=True)`` runs a step and restores the engine from its state
    dict: the per-parameter formats load back, and every state is as it was."""
    model = _model()
    engine = _engine(model, RULES)
    _train(engine, model, 2)
    opt = engine.optimizers[0]
    before = [{k: v.clone() for k, v in opt.state[q].items()}
              for q in engine.param_state.opt_params]
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(4))
    got = measure(model, engine, x, loss_fn=lambda out: out.float().pow(2).mean(),
                  peak=True)
    assert got.peak > got["params"] + got["optimizer"]
    assert got["optimizer"] == estimate(model, RULES)["optimizer"]
    for q, old in zip(engine.param_state.opt_params, before):
        assert opt.state[q].keys() == old.keys()
        assert all(torch.equal(opt.state[q][k], v) for k, v in old.items())
    assert opt.state_format(engine.param_state.opt_params[0]) == "int8"


@pytest.mark.parametrize("sync_free", [False, True])
def test_a_skipped_step_leaves_mixed_format_states_bit_identical(sync_free):
    """An inf in the loss: every state of every format, and every master, unchanged (the
    CPU's early return, and the device path's ``torch.where`` forced on the CPU)."""
    model = _model()
    engine = _engine(model, RULES)
    opt = engine.optimizers[0]
    opt.sync_free = sync_free
    _train(engine, model, 2)
    masters = engine.param_state.opt_params
    before = ([q.detach().clone() for q in masters],
              [{k: v.clone() for k, v in opt.state[q].items()} for q in masters])
    with engine.autocast():
        loss = model(torch.randn(16, 64)).float().mean() * float("inf")
    engine.backward(loss)
    assert bool(engine.step().skipped)
    assert all(torch.equal(a, b) for a, b in zip(before[0], masters))
    for q, old in zip(masters, before[1]):
        assert opt.state[q].keys() == old.keys()
        assert all(torch.equal(opt.state[q][k], v) for k, v in old.items())
    assert "exp_avg.q" in opt.state[masters[0]]
