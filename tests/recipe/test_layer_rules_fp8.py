"""A recipe's ``layer:`` rules in the fp8 rooms: each Linear converts to its rule's
format (or stays bf16), exactly as a Float8Linear of that preset alone would compute;
the engine, its kernel routes and its checkpoints follow the rules."""

from __future__ import annotations

import copy
import math
import warnings
import zlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers.speeds import set_speeds
from mixprec import MixedPrecision, Recipe
from mixprec.diagnostics import fp8_ranges
from mixprec.engine.convert import convert, layer_formats
from mixprec.modules.linear import Float8Linear

#: every format a rule can pick, one Linear each; ``inp`` follows the recipe's own
RULES = ("fp8-current,layer:blocks.0.fc=fp8-block,layer:blocks.*.fc=mxfp8,"
         "layer:blocks.0.proj=nvfp4,layer:blocks.1.proj=fp8-rowwise,layer:out=bf16,"
         "layer:mid=fp8")
WANT = {"inp": "fp8-current", "blocks.0.fc": "fp8-block", "blocks.0.proj": "nvfp4",
        "blocks.1.fc": "mxfp8", "blocks.1.proj": "fp8-rowwise", "mid": "fp8",
        "out": "bf16", "head": "bf16"}
SCALING = {"fp8": "delayed", "fp8-current": "current", "fp8-rowwise": "rowwise",
           "fp8-block": "block", "mxfp8": "mx", "nvfp4": "nvfp4"}


class Block(nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(x)))


class Net(nn.Module):
    """Linears of several roles: an input, two blocks, a middle, an output and a head."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(32, 64)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.mid = nn.Linear(64, 64)
        self.out = nn.Linear(64, 32)
        self.head = nn.Linear(32, 16)

    def forward(self, x):
        x = F.gelu(self.inp(x))
        for b in self.blocks:
            x = b(x)
        return self.head(F.gelu(self.out(F.gelu(self.mid(x)))))


def _engine(recipe: str = RULES, seed: int = 0, **kw):
    model = Net(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the kernel choices this CPU made, said
        engine = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                                recipe, **kw)
    return model, engine


def _train(engine, model, steps: int, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x, y = torch.randn(8, 32, generator=g), torch.randint(0, 16, (8,), generator=g)
        with engine.autocast():
            loss = F.cross_entropy(model(x), y)
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


# --- convert ---------------------------------------------------------------------------

def test_rules_pick_each_linears_format_first_match_wins():
    model = Net()
    report = convert(model, RULES)
    got = {n: (type(m).__name__, getattr(m, "scaling", None))
           for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    want = {n: ("Linear", None) if f == "bf16" else ("Float8Linear", SCALING[f])
            for n, f in WANT.items()}
    assert got == want
    assert dict(report.formats) == WANT
    assert set(report.converted) == {n for n, f in WANT.items() if f != "bf16"}
    assert dict(report.skipped) == {"out": "rule layer:out=bf16",
                                    "head": "output head: the last Linear"}
    assert "  conv  blocks.1.fc: mxfp8" in str(report)
    assert "kept  out: rule layer:out=bf16" in str(report)
    # each layer's recipe is the recipe's, with its rule's scaling and element format
    assert model.blocks[1].fc.fp8_recipe == Recipe.parse("mxfp8")
    assert model.inp.fp8_recipe == Recipe.parse("fp8-current")
    assert model.blocks[0].proj.grad_dtype == torch.float8_e5m2  # nvfp4: hybrid
    assert model.blocks[0].fc.grad_dtype == torch.float8_e4m3fn  # fp8-block: e4m3


def test_each_converted_layer_computes_as_its_preset_alone():
    """Forward and both gradients of every converted Linear equal, bit for bit, those
    of a Float8Linear built alone from a copy of the same weights with its preset."""
    model = Net()
    plain = copy.deepcopy(model)
    convert(model, RULES)
    g = torch.Generator().manual_seed(3)
    for name, fmt in WANT.items():
        if fmt == "bf16":
            continue
        mine = model.get_submodule(name)
        ref = Float8Linear.from_linear(copy.deepcopy(plain.get_submodule(name)),
                                       Recipe.parse(fmt), seed=zlib.crc32(name.encode()))
        x = torch.randn(48, mine.in_features, generator=g)
        gy = torch.randn(48, mine.out_features, generator=g)
        outs = []
        for mod in (mine, ref):
            xi = x.clone().requires_grad_()
            y = mod(xi)
            y.backward(gy)
            outs.append((y.detach(), xi.grad, mod.weight.grad.clone(), mod.bias.grad.clone()))
            mod.weight.grad = mod.bias.grad = None
        for a, b in zip(*outs):
            assert torch.equal(a, b), name


def test_a_rule_overrides_the_head_the_last_layers_and_the_filter():
    model = Net()
    report = convert(model, "nvfp4,layer:head=fp8-current,layer:mid=mxfp8")
    # nvfp4 keeps its last 2 Linears (out, head) in bf16: the head's rule wins, out stays
    assert model.head.scaling == "current" and type(model.out) is nn.Linear
    assert dict(report.skipped)["out"] == "one of the last 2 Linears (bf16_last_layers)"
    assert model.mid.scaling == "mx" and model.inp.scaling == "nvfp4"
    model = Net()
    report = convert(model, "fp8-current,layer:blocks.*.fc=mxfp8",
                     filter=lambda m, fqn: False)
    assert report.converted == ("blocks.0.fc", "blocks.1.fc")
    assert dict(report.skipped)["inp"] == "filter returned False"


def test_a_rule_never_breaks_the_hardware_limits():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.narrow = nn.Linear(32, 17)
            self.attn = nn.MultiheadAttention(32, 2)
            self.fc = nn.Linear(32, 32)
            self.head = nn.Linear(32, 16)

    model = Odd()
    report = convert(model, "fp8,layer:narrow=mxfp8,layer:attn.*=fp8-current")
    why = dict(report.skipped)
    assert type(model.attn.out_proj) is not Float8Linear
    assert model.narrow.scaling == "mx"  # any dims: the routes pad
    assert "Linear subclass" in why["attn.out_proj"]
    assert "rule layer:attn.*=fp8-current" in why["attn.out_proj"]
    assert report.formats["narrow"] == "mxfp8" and report.converted == ("narrow", "fc")


def test_a_rule_that_decides_for_no_linear_warns_with_the_names():
    with pytest.warns(UserWarning, match=r"layer:blocks\.0=mxfp8.*match no Linear.*"
                                         r"named inp, blocks\.0\.fc, blocks\.0\.proj"):
        convert(Net(), "fp8,layer:blocks.0=mxfp8")
    # one that every Linear it matches was taken from by an earlier rule
    with pytest.warns(UserWarning, match=r"layer:blocks\.1\.fc=nvfp4.*taken by an "
                                         "earlier rule; the first match wins"):
        convert(Net(), "fp8,layer:blocks.*=mxfp8,layer:blocks.1.fc=nvfp4")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert(Net(), RULES)  # every rule decides for some Linear: nothing to say


@pytest.mark.parametrize("recipe", ["fp8", "nvfp4", "fp8-current,bf16_last_fraction=0.3",
                                    RULES, "mxfp8,layer:head=fp8,layer:inp=bf16"])
@pytest.mark.parametrize("keep_inp", [False, True])
def test_layer_formats_says_what_convert_does(recipe, keep_inp):
    filt = (lambda m, fqn: fqn != "inp") if keep_inp else None
    model = Net()
    said = layer_formats(model, recipe, filt)
    assert not any(isinstance(m, Float8Linear) for m in model.modules())  # no change
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = convert(model, recipe, filter=filt)
    assert dict(report.formats) == said
    done = {n: ("bf16" if type(m) is nn.Linear else m.scaling)
            for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert done == {n: f if f == "bf16" else SCALING[f] for n, f in said.items()}
    assert layer_formats(model, recipe, filt) == said  # the converted model reads the same


def test_layer_formats_of_a_recipe_without_fp8():
    assert set(layer_formats(Net(), "bf16-master").values()) == {"bf16"}
    assert set(layer_formats(Net(), "fp32").values()) == {"fp32"}


# --- the engine ------------------------------------------------------------------------

def test_the_engine_converts_per_rule_and_trains():
    model, engine = _engine()
    scalings = {n: m.scaling for n, m in model.named_modules()
                if isinstance(m, Float8Linear)}
    assert scalings == {n: SCALING[f] for n, f in WANT.items() if f != "bf16"}
    assert dict(engine.fp8_report.formats) == WANT
    for m in engine.fp8_modules:  # each on the route chosen for its scaling
        assert m.gemm_choice == engine.kernels.gemm_for(m.scaling)
    losses = _train(engine, model, 3, seed=0)
    assert all(math.isfinite(v) for v in losses)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.usefixtures("measured")
def test_each_scaling_gets_its_own_route_where_scaled_mm_wins(monkeypatch):
    """On a CPU whose _scaled_mm is measured fastest the per-tensor layers take it; the
    block-scaled ones, which have no CPU kernel, the exact dequantizing GEMM."""
    set_speeds(monkeypatch, {torch.float32: 45.0, torch.bfloat16: 0.5, torch.float16: 0.5},
               scaled_mm=66.0)
    model, engine = _engine()
    assert engine.kernels.fp8_gemm == "scaled_mm"
    assert engine.kernels.fp8_gemm_routes == {
        "current": "scaled_mm", "block": "dequant_fp32", "mx": "dequant_fp32",
        "nvfp4": "dequant_fp32", "rowwise": "scaled_mm", "delayed": "scaled_mm"}
    assert model.blocks[1].fc.backend == "dequant_fp32" and model.inp.backend == "scaled_mm"
    assert "fp8_gemm=scaled_mm (block: dequant_fp32, mx: dequant_fp32, nvfp4: " \
           "dequant_fp32)" in engine.kernels.describe()
    assert engine.kernels.as_dict()["fp8_gemm_routes"]["mx"] == "dequant_fp32"
    _, plain = _engine("fp8-current")  # no rules: the choices read as before
    assert plain.kernels.fp8_gemm_routes == {} and "fp8_gemm_routes" not in \
        plain.kernels.as_dict()


def test_a_model_converted_by_hand_as_the_rules_say_is_kept_quietly():
    model = Net()
    convert(model, RULES)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*converted by hand")
        warnings.filterwarnings("ignore", message="(?!.*converted by hand)")
        MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), RULES)
    model = Net()
    convert(model, RULES)
    other = RULES.replace("layer:blocks.*.fc=mxfp8", "layer:blocks.*.fc=nvfp4")
    with pytest.warns(UserWarning, match=r"1 of the model's Float8Linears \(converted by "
                                         r"hand\).*blocks\.1\.fc: mx, the recipe says "
                                         "nvfp4"):
        MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), other)


def test_fp8_all_gather_refuses_a_rule_that_gives_a_linear_int8():
    model = Net()
    bad = "fp8-current,fp8_all_gather=true,layer:blocks.*.fc=int8-rowwise"
    with pytest.raises(NotImplementedError, match=r"fp8_all_gather.*blocks\.0\.fc "
                                                  r"\(int8-rowwise\), blocks\.1\.fc "
                                                  r"\(int8-rowwise\).*cannot carry.*"
                                                  "drop fp8_all_gather"):
        MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), bad)
    assert not any(isinstance(m, Float8Linear) for m in model.modules())  # untouched
    # rules of formats with gathered casts are fine
    _, engine = _engine("fp8-current,fp8_all_gather=true,layer:mid=fp8,"
                        "layer:blocks.*.fc=mxfp8,layer:out=bf16,layer:head=bf16")
    assert {m.scaling for m in engine.fp8_modules} == {"current", "delayed", "mx"}


# --- checkpoints -----------------------------------------------------------------------

def test_a_run_with_rules_resumes_bit_identically(tmp_path):
    recipe = "fp8,layer:blocks.*.fc=mxfp8,layer:blocks.0.proj=nvfp4,layer:out=bf16"
    m1, e1 = _engine(recipe, seed=5)
    _train(e1, m1, 4, seed=0)
    e1.save(tmp_path / "ckpt.pt", step=4)
    tail1 = _train(e1, m1, 4, seed=1)
    m2, e2 = _engine(recipe, seed=9)  # other initial weights: the checkpoint sets them
    assert e2.load(tmp_path / "ckpt.pt") == {"step": 4}
    assert _train(e2, m2, 4, seed=1) == tail1
    s1, s2 = m1.state_dict(), m2.state_dict()
    assert s1.keys() == s2.keys()
    assert any("fp8_amax_history" in key for key in s1)  # delayed layers' state too
    assert any("nvfp4_rng" in key for key in s1)
    assert all(torch.equal(s1[key], s2[key]) for key in s1)
    for p, q in zip(e1.master_params, e2.master_params):
        assert torch.equal(p, q)


def test_a_checkpoint_with_other_rules_is_refused(tmp_path):
    saved = "fp8-current,layer:blocks.*.fc=mxfp8"
    m1, e1 = _engine(saved)
    _train(e1, m1, 1, seed=0)
    e1.save(tmp_path / "ckpt.pt")
    m2, e2 = _engine("fp8-current,layer:blocks.*.fc=nvfp4")
    before = [p.detach().clone() for p in m2.parameters()]
    with pytest.raises(ValueError, match=r"saved with recipe 'fp8-current,layer:blocks\.\*"
                                         r"\.fc=mxfp8' but this engine runs .*=nvfp4'"):
        e2.load(tmp_path / "ckpt.pt")
    assert all(torch.equal(a, b) for a, b in zip(before, m2.parameters()))
    m3, e3 = _engine("fp8-current")  # the rules are part of the recipe
    with pytest.raises(ValueError, match="build the engine with the checkpoint's recipe"):
        e3.load(tmp_path / "ckpt.pt")


# --- diagnostics -----------------------------------------------------------------------

def test_fp8_ranges_follow_each_linears_rule():
    model = Net()
    ranges = fp8_ranges(model, lambda m: m(torch.randn(8, 32, requires_grad=True)).square()
                        .mean(), RULES)
    seen = {(x.layer, x.scaling) for x in ranges if x.tensor == "input"}
    # the rules' Linears with their own scaling; out (bf16 by rule) is not judged
    assert seen == {(n, SCALING[f]) for n, f in WANT.items() if f != "bf16"}
    grads = {x.layer: x.fmt for x in ranges if x.tensor == "grad_output"}
    assert grads["blocks.1.fc"] == "fp8_e4m3" and grads["inp"] == "fp8_e5m2"
