"""What users bring besides a model: every torch optimizer, frozen parameters, optimizer
state that exists before the engine, parametrizations, sparse embeddings."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers.models import mlp
from mixprec import MixedPrecision

X = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
Y = torch.randint(0, 4, (64,), generator=torch.Generator().manual_seed(2))

OPTIMIZERS = {
    "SGD-nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05),  # builds state in __init__
    "Adadelta": lambda ps: torch.optim.Adadelta(ps, lr=1.0),
    "RMSprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5, centered=True),
    "Adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2),
    "NAdam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
    "RAdam": lambda ps: torch.optim.RAdam(ps, lr=1e-2, decoupled_weight_decay=True),
    "ASGD": lambda ps: torch.optim.ASGD(ps, lr=0.05),
    "Rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-3),
    "Adam-amsgrad-fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, fused=True),
    "AdamW-tensor-lr": lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(1e-2), fused=True),
}


def _backward(model, engine):
    """One micro-batch's forward and backward, stopping short of step()."""
    with engine.autocast():
        loss = F.cross_entropy(model(X), Y)
    engine.backward(loss)


def _train(model, engine, steps):
    losses = []
    for _ in range(steps):
        with engine.autocast():
            loss = F.cross_entropy(model(X), Y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_torch_optimizer_under_fp32_masters_equals_plain_torch(name):
    """fp32 compute with fp32 masters must reproduce plain torch to the bit: the param
    groups are re-pointed at the masters, state included (Adagrad has state at birth)."""
    ref, model = mlp(), mlp()
    ref_opt, opt = OPTIMIZERS[name](ref.parameters()), OPTIMIZERS[name](model.parameters())
    with pytest.warns(UserWarning, match="second fp32 copy"):
        engine = MixedPrecision(model, opt, "fp32,master=fp32")
    for _ in range(6):
        F.cross_entropy(ref(X), Y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    _train(model, engine, 6)
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)


def _plain_fp32(model, opt, steps):
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(X), Y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("recipe", ["bf16", "bf16-master", "fp16-master"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_torch_optimizer_trains_under_low_precision(name, recipe):
    """The loss curve follows plain fp32 torch's with the same optimizer."""
    ref = mlp()
    want = _plain_fp32(ref, OPTIMIZERS[name](ref.parameters()), 30)
    model = mlp()
    opt = OPTIMIZERS[name](model.parameters())
    engine = MixedPrecision(model, opt, recipe)
    losses = _train(model, engine, 30)
    assert want[-1] < 0.9 * want[0]
    assert abs(losses[-1] - want[-1]) < 0.05 * want[-1] + 0.01 * want[0], (losses[::5],
                                                                         want[::5])
    states = [t for s in opt.state.values() for t in s.values()
              if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() > 0]
    if recipe.endswith("-master"):  # optimizer states live on the fp32 masters
        assert set(map(id, opt.state)) <= set(map(id, engine.param_state.masters))
        assert states and all(t.dtype == torch.float32 for t in states)


def test_state_of_an_optimizer_stepped_before_the_engine_carries_over():
    """A run begun in plain fp32 torch and continued under a -master recipe keeps its
    Adam moments and step count (they move to the masters, which copy the weights)."""
    ref, model = mlp(), mlp()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for m, o in ((ref, ref_opt), (model, opt)):
        for _ in range(3):
            F.cross_entropy(m(X), Y).backward()
            o.step()
            o.zero_grad()
    moments = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    with pytest.warns(UserWarning, match="second fp32 copy"):
        engine = MixedPrecision(model, opt, "fp32,master=fp32")
    for mom, q in zip(moments, engine.param_state.masters):
        assert float(opt.state[q]["step"]) == 3 and torch.equal(opt.state[q]["exp_avg"], mom)
    assert len(opt.state) == len(moments)   # nothing left keyed by the old parameters
    F.cross_entropy(ref(X), Y).backward()
    ref_opt.step()
    _train(model, engine, 1)
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)            # the 4th step continues the same run
    bf = mlp()
    bf_opt = torch.optim.Adam(bf.parameters(), lr=1e-2)
    F.cross_entropy(bf(X), Y).backward()
    bf_opt.step()
    MixedPrecision(bf, bf_opt, "bf16-master")  # and under bf16 working weights
    assert all(float(s["step"]) == 1 for s in bf_opt.state.values())


@pytest.mark.parametrize("recipe", ["bf16", "bf16-master", "fp16-master"])
def test_frozen_parameters_may_sit_in_the_optimizer(recipe):
    """torch optimizers accept frozen parameters (they never get a gradient); so does the
    engine. They stay bit-identical; unfreezing one later is refused, not trained wrongly."""
    model = mlp()
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    engine = MixedPrecision(model, opt, recipe)
    losses = _train(model, engine, 20)
    assert losses[-1] < losses[0]
    assert torch.equal(model[0].weight, frozen)
    assert any(p is model[0].weight for g in opt.param_groups for p in g["params"])
    model[0].weight.requires_grad_(True)
    _backward(model, engine)
    with pytest.raises(RuntimeError, match="requires_grad=False when MixedPrecision was "
                                           "created"):
        engine.step()


def test_parametrizations_compute_the_weight_in_fp32():
    """spectral_norm keeps fp32 u/v buffers; against a bf16 working weight its power
    iteration raised ("addmv input tensors must have the same dtype"). The parametrization
    now runs as an fp32 island: fp32 weight out, cast down at the matmul."""
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Linear(16, 32)),
                             nn.ReLU(),
                             nn.utils.parametrizations.weight_norm(nn.Linear(32, 4)))

    ref = make()
    want = _plain_fp32(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), 20)
    for recipe in ("bf16", "bf16-master", "fp16-master"):
        model = make()
        engine = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                recipe)
        losses = _train(model, engine, 20)
        assert abs(losses[-1] - want[-1]) < 0.05 * want[-1], (recipe, losses[::5], want[::5])
        sn = model[0].parametrizations.weight
        model.eval()  # no power iteration: the weight is original / (u . W v)
        with engine.autocast():
            w = model[0].weight
        orig = sn.original.detach().float()
        u, v = sn[0]._u, sn[0]._v
        want_w = orig / torch.dot(u, torch.mv(orig, v))  # by hand, in fp32
        assert w.dtype == torch.float32 and torch.allclose(w, want_w, rtol=1e-6, atol=0)
    model = make()  # without the island, on real bf16 kernels: the failure this fixes
    engine = MixedPrecision(model, torch.optim.AdamW(model.parameters()),
                            "bf16-master,keep_fp32=layer_norm,emulate=false")
    with pytest.raises(RuntimeError, match="same dtype"), engine.autocast():
        model(X)


def test_sparse_embeddings_are_refused_before_the_model_is_touched():
    model = nn.Sequential(nn.Embedding(50, 8, sparse=True), nn.Linear(8, 4))
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(NotImplementedError, match=r"0 is Embedding\(sparse=True\).*"
                                                  "sparse=False"):
        MixedPrecision(model, torch.optim.AdamW(model.parameters()), "bf16-master")
    assert all(torch.equal(v, model.state_dict()[k]) and v.dtype == torch.float32
               for k, v in before.items())


@pytest.mark.filterwarnings("ignore:Lazy modules")
def test_lazy_modules_must_be_materialized_first():
    model = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="'0.weight' .* uninitialized.*dummy batch"):
        MixedPrecision(model, opt, "bf16-master")
    model(torch.randn(2, 16))  # the fix the error names
    engine = MixedPrecision(model, torch.optim.AdamW(model.parameters()), "bf16-master")
    assert _train(model, engine, 2)


@pytest.mark.parametrize("recipe", ["bf16", "bf16-master", "fp16-master",
                                    "bf16-master,grad_accum=kahan"])
def test_the_zero_grad_habit_changes_nothing(recipe):
    """``optimizer.zero_grad()`` before each forward or after each step, the habit of
    every torch loop, must not change training. Under -master recipes it set the
    masters' .grad (which is the fp32 buffer) to None, and the optimizer then skipped
    every parameter from the second step on: training silently stopped."""
    def run(habit):
        model = mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        engine = MixedPrecision(model, opt, recipe)
        for _ in range(6):
            if habit == "before":
                opt.zero_grad()
            with engine.autocast():
                loss = F.cross_entropy(model(X), Y)
            engine.backward(loss)
            engine.step()
            if habit == "after":
                opt.zero_grad()
                model.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    want = run(None)
    for habit in ("before", "after"):
        assert all(torch.equal(a, b) for a, b in zip(want, run(habit))), habit


def test_closure_optimizers_and_late_param_groups_are_refused():
    model = mlp()
    with pytest.raises(NotImplementedError, match="LBFGS.step needs a closure"):
        MixedPrecision(model, torch.optim.LBFGS(model.parameters()), "bf16")
    model = mlp()
    opt = torch.optim.AdamW(model[0].parameters(), lr=1e-2)
    engine = MixedPrecision(model, opt, "bf16-master")
    _train(model, engine, 1)
    opt.add_param_group({"params": list(model[3].parameters())})  # bf16 working copies
    _backward(model, engine)
    with pytest.raises(RuntimeError, match=r"param groups changed.*\[2\] then, \[4\] now"):
        engine.step()


@pytest.mark.paths
@pytest.mark.parametrize("recipe", ["bf16", "bf16-master", "fp16-master", "fp8",
                                    "bf16,params=bf16"])
def test_fp32_state_dict_loads_into_a_fresh_fp32_model(recipe):
    """After training, the fp32 weights (the masters, not their bf16 rounding) load
    strictly into an unconverted fp32 copy of the model; tied weights stay tied."""
    from helpers.models import TiedLM

    torch.manual_seed(0)
    model = TiedLM(vocab=64, d=32)
    idx = torch.randint(0, 64, (8, 16))
    engine = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), recipe)
    for _ in range(3):
        with engine.autocast():
            loss = F.cross_entropy(model(idx).flatten(0, 1).float(), idx.flatten())
        engine.backward(loss)
        engine.step()
    state = engine.fp32_state_dict()
    fresh = TiedLM(vocab=64, d=32)
    fresh.load_state_dict(state)  # strict: no fp8 buffers, no missing keys
    assert all(v.dtype == torch.float32 for v in state.values())
    trained = engine.master_params
    assert all(any(torch.equal(p, q.float()) for q in trained) for p in fresh.parameters())
    if engine.param_state.has_master:  # the masters, not their rounding to the working dtype
        assert not torch.equal(state["mix.weight"], model.mix.weight.float())
    assert fresh.head.weight is fresh.emb.weight
    assert torch.equal(state["head.weight"], state["emb.weight"])


@pytest.mark.parametrize("write", ["load_state_dict", "no_grad in-place"])
def test_weights_written_behind_the_engine_are_refused_not_lost(write):
    """Under master weights the working copy is rewritten from the masters at every
    step, so a checkpoint loaded into the model after the engine exists (or a WGAN-style
    in-place clamp) would silently vanish. The next step raises instead; writing to
    engine.master_params is the supported way, and it keeps the write."""
    model = mlp()
    engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.0), "bf16-master")
    _train(model, engine, 1)
    if write == "load_state_dict":
        model.load_state_dict({k: v * 0 for k, v in model.state_dict().items()})
    else:
        with torch.no_grad():
            model[0].weight.clamp_(-0.01, 0.01)
    _backward(model, engine)
    with pytest.raises(RuntimeError, match="written in place outside the engine.*"
                                           "engine.master_params"):
        engine.step()
    model = mlp()  # the supported way: write the masters (lr=0 keeps them as written)
    engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.0), "bf16-master")
    with torch.no_grad():
        engine.master_params[0].clamp_(-0.01, 0.01)
    _train(model, engine, 1)
    bound = torch.tensor(0.01).bfloat16().item()  # the clamp's bound in the working format
    assert model[0].weight.abs().max() <= bound


@pytest.mark.parametrize("recipe", ["fp32", "fp32,master=fp32", "bf16-master"])
def test_a_gan_with_two_engines_trains_like_plain_torch(recipe):
    """Two engines, two optimizers: the generator's loss runs backward through the
    discriminator and leaves gradients on its weights. Plain torch clears them with
    D's zero_grad(); the engine drops gradients its own backward did not make, so D's
    next update holds only D's loss. Under fp32 both equal plain torch bit for bit."""
    import warnings

    def make():
        torch.manual_seed(0)
        g = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
        d = nn.Sequential(nn.Linear(16, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
        return g, d

    def batches():
        gen = torch.Generator().manual_seed(3)
        return [(torch.randn(32, 16, generator=gen) + 2, torch.randn(32, 8, generator=gen))
                for _ in range(8)]

    bce = F.binary_cross_entropy_with_logits
    g, d = make()
    og, od = (torch.optim.Adam(m.parameters(), lr=1e-3) for m in (g, d))
    for real, z in batches():  # plain torch, the textbook loop
        od.zero_grad()
        fake = g(z)
        loss_d = bce(d(real), torch.ones(32, 1)) + bce(d(fake.detach()), torch.zeros(32, 1))
        loss_d.backward()
        od.step()
        og.zero_grad()
        bce(d(fake), torch.ones(32, 1)).backward()
        og.step()
    want = [p.detach().clone() for p in (*g.parameters(), *d.parameters())]

    g, d = make()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp32 masters under fp32: "for nothing"
        eg = MixedPrecision(g, torch.optim.Adam(g.parameters(), lr=1e-3), recipe)
        ed = MixedPrecision(d, torch.optim.Adam(d.parameters(), lr=1e-3), recipe)
    for real, z in batches():  # the same loop through the engines, no zero_grad at all
        with ed.autocast():
            fake = g(z)
            loss_d = bce(d(real), torch.ones(32, 1)) + bce(d(fake.detach()),
                                                           torch.zeros(32, 1))
        ed.backward(loss_d)
        ed.step()
        with eg.autocast():
            loss_g = bce(d(fake), torch.ones(32, 1))
        eg.backward(loss_g)
        eg.step()
    got = [p.detach().float() for p in (*eg.master_params, *ed.master_params)]
    if recipe.startswith("fp32"):
        assert all(torch.equal(a, b) for a, b in zip(want, got))
    else:
        assert max(((a - b).abs().max() / b.abs().max()).item()
                   for a, b in zip(got, want)) < 0.05


@pytest.mark.paths
def test_save_and_load_are_atomic_and_resume_exactly(tmp_path):
    """engine.save / engine.load: resuming equals not stopping; a torn or foreign file
    raises before anything changes."""
    from mixprec.checkpoint.core import CheckpointError

    def run(model, engine, n):
        _train(model, engine, n)
        return [p.detach().clone() for p in engine.master_params]

    model = mlp()
    engine = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                            "fp16-master")
    run(model, engine, 3)
    path = tmp_path / "ckpt.pt"
    engine.save(path, step=3)
    want = run(model, engine, 3)

    model2 = mlp(seed=9)
    engine2 = MixedPrecision(model2, torch.optim.AdamW(model2.parameters(), lr=1e-2),
                             "fp16-master")
    assert engine2.load(path) == {"step": 3}
    assert all(torch.equal(a, b) for a, b in zip(want, run(model2, engine2, 3)))
    assert not (tmp_path / "ckpt.pt.tmp").exists()

    before = [p.detach().clone() for p in engine2.master_params]
    (tmp_path / "torn.pt").write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="truncated or corrupt.*Nothing was changed"):
        engine2.load(tmp_path / "torn.pt")
    other = nn.Sequential(nn.Linear(16, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 4))
    eng_o = MixedPrecision(other, torch.optim.AdamW(other.parameters()), "fp16-master")
    eng_o.save(tmp_path / "other.pt")
    with pytest.raises(ValueError, match="does not match this model.*nothing was loaded"):
        engine2.load(tmp_path / "other.pt")
    assert all(torch.equal(a, b) for a, b in zip(before, engine2.master_params))
    assert all(torch.equal(p, q.half()) for p, q in zip(model2.parameters(), before))


@pytest.mark.parametrize("recipe", ["bf16", "bf16-master", "fp16-master"])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_zeroing_between_micro_batches_is_refused_where_it_drops_them(recipe, set_to_none):
    """With grad_accum_steps=4, optimizer.zero_grad() after each step() (the habit) would
    keep only the last micro-batch: in bf16 the model's .grad is the accumulator, and
    under -master recipes zeroing in place clears the fp32 buffers. The next backward
    raises instead. Dropping the masters' .grad to None loses nothing (the buffers are
    re-attached at the update), so that one is let through."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = MixedPrecision(model, opt, recipe, grad_accum_steps=4)
    _backward(model, engine)
    assert engine.step().accumulating
    opt.zero_grad(set_to_none=set_to_none)
    if recipe.endswith("-master") and set_to_none:
        for _ in range(3):
            _backward(model, engine)
            engine.step()
        return
    with pytest.raises(RuntimeError, match="1 micro-batch.*cleared outside the engine.*"
                                           "zero nothing in between"):
        _backward(model, engine)


def test_norm_modules_from_other_libraries_are_unpatched_when_the_engine_goes():
    """The engine runs a third-party norm (matched by class name) whole in fp32 by
    patching its ``forward``; that patch belonged to the engine but outlived it, so the
    model kept running that norm with autocast off. close() and collection undo it."""
    import gc

    from helpers.models import LlamaRMSNorm

    model = nn.Sequential(nn.Linear(16, 16), LlamaRMSNorm(16))
    engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16-master")
    assert "forward" in model[1].__dict__           # patched while the engine lives
    del engine
    gc.collect()
    assert "forward" not in model[1].__dict__       # collected: the class forward again
    model = nn.Sequential(nn.Linear(16, 16), LlamaRMSNorm(16))
    engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16")
    engine.close()
    engine.close()                                  # twice: harmless
    assert "forward" not in model[1].__dict__
