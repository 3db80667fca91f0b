"""FP8: scaling arithmetic by hand, GEMM backends against torch._scaled_mm, SQNR against
a bf16 nn.Linear, the module swap and its report, and fp8 training in the engine."""

from __future__ import annotations

import io
import math

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers.models import TiedLM, tiny_gpt
from helpers.speeds import require_cpu_scaled_mm
from mixprec import MixedPrecision
from mixprec.engine.convert import convert
from mixprec.formats import elements as formats
from mixprec.formats.scaling import cast_rowwise, cast_to_fp8, update_delayed_scales
from mixprec.formats.tensor_gemm import fp8_gemm
from mixprec.modules.linear import Float8Linear

E4M3, E5M2 = 448.0, 57344.0
FP8_MAX_OF = {"fp8_e4m3": E4M3, "fp8_e5m2": E5M2}


def sqnr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.double(), x.double()
    return 20 * math.log10(ref.norm().item() / (ref - x).norm().item())


# --- scaling ---------------------------------------------------------------------------

def test_delayed_scaling_against_hand_computation():
    """A known amax sequence, with a 0 and an inf, through history length 3."""
    hist = torch.zeros(1, 3)
    scale = torch.ones(1)
    fmax = torch.tensor([E4M3])
    seq = [2.0, 4.0, 0.0, 1.0, math.inf, 0.5, 0.25, 0.125]
    want_hist, h, s = [], [0.0, 0.0, 0.0], 1.0
    for a in seq:
        h[0] = a
        m = max(h)
        if 0 < m < math.inf:
            s = E4M3 / m
        h = [0.0, h[0], h[1]]
        want_hist.append((list(h), s))
    for a, (wh, ws) in zip(seq, want_hist):
        hist[0, 0] = a
        update_delayed_scales(hist, scale, fmax, algo="max", margin=0)
        assert hist[0].tolist() == wh
        assert scale.item() == pytest.approx(ws, rel=1e-7)
    # the inf stayed in the window for 3 steps and the scale was kept meanwhile; the 0
    # changed nothing (the max over the window was still 4)
    assert [s for _, s in want_hist] == [E4M3 / 2, *[E4M3 / 4] * 6, E4M3 / 0.5]


def test_most_recent_algo_and_margin():
    hist, scale = torch.zeros(1, 4), torch.ones(1)
    for a in (8.0, 1.0):
        hist[0, 0] = a
        update_delayed_scales(hist, scale, torch.tensor([E4M3]), algo="most_recent", margin=2)
    assert scale.item() == E4M3 / 1.0 / 4


def test_skipped_step_drops_its_amax_and_keeps_the_scale():
    hist, scale = torch.zeros(1, 3), torch.ones(1)
    hist[0, 0] = 2.0
    update_delayed_scales(hist, scale, torch.tensor([E4M3]))
    before = (hist.clone(), scale.clone())
    hist[0, 0] = math.inf
    update_delayed_scales(hist, scale, torch.tensor([E4M3]), found_inf=torch.tensor(1.0))
    assert torch.equal(scale, before[1])
    assert hist[0].tolist() == [0.0, 2.0, 0.0]
    assert torch.isfinite(hist).all()


def test_margin_prevents_overflow_while_amax_grows_slower_than_2_pow_m():
    m = 2
    hist, scale = torch.zeros(1, 4), torch.ones(1)
    amax = 1.0
    g = torch.Generator().manual_seed(0)
    for step in range(30):
        x = torch.randn(4096, generator=g)
        x = x / x.abs().max() * amax
        if step > 0:  # from the second step on, the scale comes from the history
            assert (x * scale).abs().max().item() < E4M3
        hist[0, 0] = max(hist[0, 0].item(), x.abs().max().item())
        update_delayed_scales(hist, scale, torch.tensor([E4M3]), margin=m)
        amax *= 2**m * 0.99  # grows by just under 2^m per step
    # without the margin the same growth saturates at once
    hist, scale = torch.zeros(1, 4), torch.ones(1)
    hist[0, 0] = 1.0
    update_delayed_scales(hist, scale, torch.tensor([E4M3]), margin=0)
    assert (torch.tensor(1.0 * 2**m * 0.99) * scale).item() > E4M3


def test_cast_saturates_and_rounds_like_formats_quantize():
    x = torch.randn(10_000) * 300
    x[0] = 1e9
    q = cast_to_fp8(x, torch.tensor(1.0), torch.float8_e4m3fn).float()
    assert torch.equal(q, formats.quantize(x, "fp8_e4m3", saturate=True))
    q = cast_to_fp8(x, torch.tensor(2.0), torch.float8_e5m2).float()
    assert torch.equal(q, formats.quantize(x * 2, "fp8_e5m2", saturate=True))


# --- GEMM backends ---------------------------------------------------------------------

@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_gemm_backends_against_float64(out_dtype):
    require_cpu_scaled_mm()
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(32, 64, generator=g) * 50).to(torch.float8_e4m3fn)
    b = (torch.randn(48, 64, generator=g) * 3000).to(torch.float8_e5m2)
    ia, ib = torch.tensor(0.37), torch.tensor(1.9e-3)
    exact = (a.double() @ b.double().t()) * (ia.double() * ib.double())
    real = fp8_gemm(a, b.t(), ia, ib, out_dtype, "scaled_mm").double()
    deq = fp8_gemm(a, b.t(), ia, ib, out_dtype, "dequant").double()
    top = exact.abs().max()
    if out_dtype == torch.float32:
        # dequant: fp32 accumulation of exact products; torch's CPU _scaled_mm (a
        # reference kernel) is looser, ~2e-4 of the largest output here
        assert (deq - exact).abs().max() <= 1e-6 * top
        assert (real - exact).abs().max() <= 1e-3 * top
    else:  # each is within 1 bf16 ulp of the correctly rounded result, and of each other
        want = formats.quantize(exact, "bf16")
        ulp = formats.ulp(want, "bf16")
        assert ((deq - want).abs() <= ulp).all()
        assert ((deq - real).abs() <= ulp).all()


# --- rowwise scaling --------------------------------------------------------------------

def _ref_rowwise(t: torch.Tensor, dim: int, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference rowwise cast, rounded by ml_dtypes: the fp8 values (float64) and the
    inverse scales (fp32 reciprocals, as a GEMM applies them)."""
    fmax = FP8_MAX_OF[fmt]
    amax = t.abs().amax(dim=dim, keepdim=True).float()
    scale = torch.where(amax > 0, fmax / amax, torch.ones_like(amax))
    mld = {"fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2}[fmt]
    v = (t.float() * scale).clamp(-fmax, fmax).numpy().astype(mld).astype(np.float64)
    return torch.from_numpy(v), torch.reciprocal(scale)


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_rowwise_cast_against_ml_dtypes(dim, fmt):
    """Each slice along the other axis gets its own scale: its amax lands on the format's
    max, and every element rounds as ml_dtypes rounds it. A zero slice keeps scale 1, a
    slice with an inf gets NaN (so the step is skipped, not trained on a saturated max)."""
    dtype = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[fmt]
    g = torch.Generator().manual_seed(0)
    t = torch.randn(24, 40, generator=g) * torch.logspace(-6, 6, 24).reshape(24, 1)
    t = t if dim == 1 else t.t().contiguous()
    t8, inv = cast_rowwise(t, dim, dtype)
    assert inv.shape == ((24, 1) if dim == 1 else (1, 24))
    assert torch.equal(t8.float().abs().amax(dim=dim), torch.full((24,), FP8_MAX_OF[fmt]))
    want, want_inv = _ref_rowwise(t, dim, fmt)
    assert torch.equal(t8.double(), want) and torch.equal(inv, want_inv)
    m8, _ = cast_rowwise(t, dim, dtype, margin=2)  # amax lands on max / 2^2
    assert torch.equal(m8.float().abs().amax(dim=dim), torch.full((24,), FP8_MAX_OF[fmt] / 4))
    z = t.clone()
    z.select(1 - dim, 3).zero_()
    z.select(1 - dim, 5)[7] = math.inf
    z8, zinv = cast_rowwise(z, dim, dtype)
    assert zinv.flatten()[3] == 1 and (z8.select(1 - dim, 3).float() == 0).all()
    assert zinv.flatten()[5].isnan() and z8.select(1 - dim, 5).float().isnan().all()
    others = [i for i in range(24) if i not in (3, 5)]
    assert torch.isfinite(zinv.flatten()[others]).all()


@pytest.mark.parametrize("gemm", ["dequant", "scaled_mm"])
def test_rowwise_gemms_equal_float64_products_of_the_quantized_operands(gemm):
    """Forward, dgrad and wgrad of a rowwise Float8Linear against float64 GEMMs of the
    reference-quantized operands, each cast along the axis its GEMM contracts: x per
    token and per feature, w per output and per input channel, g per token and per
    output channel. fp32 outputs, so only the summation order differs."""
    if gemm == "scaled_mm":
        require_cpu_scaled_mm()
    torch.manual_seed(0)
    lin = nn.Linear(128, 96, bias=False)
    f8 = Float8Linear.from_linear(lin, f"fp8-rowwise,fp8_gemm={gemm}")
    x = torch.randn(64, 128) * torch.logspace(-3, 3, 64).reshape(64, 1)
    gy = torch.randn(64, 96) * torch.logspace(2, -2, 64).reshape(64, 1)
    xi = x.clone().requires_grad_()
    y = f8(xi)  # fp32 in, no autocast: fp32 outputs
    y.backward(gy)
    w = lin.weight.detach()

    def ref(a, a_dim, a_fmt, b, b_dim, b_fmt):  # (a / sa) @ (b / sb), a (M, K), b (K, N)
        (va, ia), (vb, ib) = _ref_rowwise(a, a_dim, a_fmt), _ref_rowwise(b, b_dim, b_fmt)
        exact = (va @ vb) * (ia.double() * ib.double())
        bound = (va.abs() @ vb.abs()) * (ia.double() * ib.double())  # sum of |products|
        return exact, bound

    tol = 1e-6 if gemm == "dequant" else 1e-3  # torch's CPU _scaled_mm: see above
    for got, (want, bound) in (
            (y, ref(x, 1, "fp8_e4m3", w.t(), 0, "fp8_e4m3")),
            (xi.grad, ref(gy, 1, "fp8_e5m2", w, 0, "fp8_e4m3")),
            (lin.weight.grad, ref(gy.t(), 1, "fp8_e5m2", x, 0, "fp8_e4m3"))):
        assert ((got.double() - want).abs() <= tol * bound).all()


def test_rowwise_forward_is_bit_identical_to_torchao_rowwise():
    """An independent implementation: torchao's rowwise recipe (e4m3 everywhere; its
    power-of-2 scale rounding off, which mixprec does not do) gives the same bf16 output
    bit for bit on the same ``_scaled_mm`` kernel. Without bias: mixprec adds it in fp32
    and rounds once, torchao adds it in bf16. (Skipped without torchao.)"""
    import copy
    import dataclasses

    float8 = pytest.importorskip("torchao.float8")
    cfg = dataclasses.replace(float8.Float8LinearConfig.from_recipe_name("rowwise"),
                              round_scales_to_power_of_2=False)
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(128, 96, bias=False))
    ao = copy.deepcopy(base)
    float8.convert_to_float8_training(ao, config=cfg)
    ours = copy.deepcopy(base)
    ours[0] = Float8Linear.from_linear(ours[0], "fp8-rowwise,fp8_format=e4m3,fp8_gemm=scaled_mm")
    x = torch.randn(64, 128) * torch.logspace(-2, 2, 64).reshape(64, 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(ours(x), ao(x))


def test_rowwise_keeps_precision_next_to_an_outlier_token():
    """One token 1e5 times larger than the rest: a per-tensor scale pushes the other
    tokens into e4m3's subnormals, a per-token scale does not (a per-tensor
    scaling, and the case rowwise scaling exists for)."""
    torch.manual_seed(0)
    lin = nn.Linear(128, 96)
    x = torch.randn(64, 128)
    x[5] *= 1e5
    gy = torch.randn(64, 96)
    gy[9] *= 1e5
    rest_x = [i for i in range(64) if i != 5]
    rest_g = [i for i in range(64) if i != 9]
    want_y = x.double() @ lin.weight.double().t()
    want_dx = gy.double() @ lin.weight.double()

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    errs = {}
    for scaling in ("current", "rowwise"):  # e4m3 gradients too: e5m2's range would
        # hold a 1e5 spread even per tensor
        f8 = Float8Linear.from_linear(lin, f"fp8,fp8_scaling={scaling},fp8_format=e4m3")
        xi = x.clone().requires_grad_()
        y = f8(xi) - lin.bias.detach()
        y.backward(gy)
        lin.weight.grad = lin.bias.grad = None
        errs[scaling] = (rel(y[rest_x], want_y[rest_x]), rel(xi.grad[rest_g], want_dx[rest_g]))
    assert errs["rowwise"][0] < 0.05 and errs["rowwise"][1] < 0.05  # e4m3 noise
    assert errs["current"][0] > 0.2 and errs["current"][1] > 0.2    # mostly flushed to 0


# --- numerics against a bf16 nn.Linear -------------------------------------------------

SHAPES = [(16, 16, 16), (256, 512, 128), (512, 4096, 64), (64, 256, 4096)]


@pytest.mark.parametrize("scaling", ["delayed", "current"])
@pytest.mark.parametrize("mkn", SHAPES)
def test_sqnr_against_bf16_linear(scaling, mkn):
    m, k, n = mkn
    torch.manual_seed(0)
    ref = nn.Linear(k, n)
    f8 = Float8Linear.from_linear(nn.Linear(k, n), f"fp8,fp8_scaling={scaling}")
    f8.load_state_dict(ref.state_dict(), strict=False)
    x = torch.randn(m, k)
    gy = torch.randn(m, n)

    def run(mod):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = mod(xi)
        y.backward(gy.to(y.dtype))
        w_grad = mod.weight.grad.clone()
        mod.weight.grad = None
        mod.bias.grad = None
        return y.float(), xi.grad.float(), w_grad

    if scaling == "delayed":  # one step to fill the history, as in training
        run(f8)
        f8.update_scales()
    y8, dx8, dw8 = run(f8)
    y, dx, dw = run(ref)
    assert sqnr_db(y, y8) >= 25
    assert sqnr_db(dx, dx8) >= 20
    assert sqnr_db(dw, dw8) >= 20


# --- convert ---------------------------------------------------------------------------

def test_convert_report_lists_everything():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(32, 64)
            self.odd = nn.Linear(64, 10)
            self.b = nn.Linear(10, 32)
            self.attn = nn.MultiheadAttention(32, 2)
            self.head = nn.Linear(32, 16)

    net = Net()
    w = net.a.weight
    report = convert(net)
    assert report.converted == ("a", "odd", "b")  # any dims: the routes pad
    assert isinstance(net.a, Float8Linear) and net.a.weight is w
    reasons = dict(report.skipped)
    assert "out_proj" in reasons["attn.out_proj"]
    assert reasons["head"] == "output head: the last Linear"
    assert "kept  head" in str(report)


def test_convert_tied_head_and_filter():
    model = TiedLM(vocab=32, d=16)
    report = convert(model)
    assert dict(report.skipped)["head"] == "output head: weight tied to an embedding"
    model = TiedLM(vocab=32, d=16)
    report = convert(model, filter=lambda mod, fqn: fqn == "head")
    assert report.converted == ("head",)
    assert dict(report.skipped)["mix"] == "filter returned False"


def test_a_recipe_that_converts_nothing_raises_unless_allowed():
    def model():
        return nn.Sequential(nn.MultiheadAttention(10, 2), nn.Linear(10, 3))

    with pytest.raises(ValueError, match=r"converts no Linear.*0.out_proj: .*Linear "
                                         r"subclass.*1: output head.*allow_none=True"):
        convert(model())
    with pytest.warns(UserWarning, match="no Linear was converted"):
        convert(model(), allow_none=True)
    # a 2-Linear MLP under nvfp4: both are among the last 2 Linears (the head too)
    mlp2 = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    with pytest.raises(ValueError, match="0: one of the last 2 Linears"):
        MixedPrecision(mlp2, torch.optim.SGD(mlp2.parameters(), lr=0.1), "nvfp4")
    with pytest.warns(UserWarning, match="no Linear was converted"):  # the user's choice
        MixedPrecision(mlp2, torch.optim.SGD(mlp2.parameters(), lr=0.1), "nvfp4",
                       fp8_filter=lambda m, fqn: False)


def test_the_refusal_names_arguments_that_exist_and_its_advice_works():
    import inspect
    import re

    mlp2 = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    with pytest.raises(ValueError) as info:
        MixedPrecision(mlp2, torch.optim.SGD(mlp2.parameters(), lr=0.1), "nvfp4")
    msg = str(info.value)
    for call, fn in (("MixedPrecision", MixedPrecision.__init__), ("fp8.convert", convert)):
        named = re.search(rf"{re.escape(call)}\(\.\.\., (\w+)=", msg)
        assert named and named.group(1) in inspect.signature(fn).parameters, (call, msg)
    advice = re.search(r"fp8_filter=(lambda module, name: True)", msg).group(1)
    with pytest.warns(UserWarning, match="no Linear was converted"):
        MixedPrecision(mlp2, torch.optim.SGD(mlp2.parameters(), lr=0.1), "nvfp4",
                       fp8_filter=eval(advice))  # the message's own words


def test_float8linear_takes_dims_no_multiple_of_16():
    f8 = Float8Linear(10, 32)
    assert f8(torch.randn(3, 10)).shape == (3, 32)


# --- in the engine ---------------------------------------------------------------------

def _fp8_engine(recipe="fp8", seed=0):
    model = tiny_gpt(seed=seed, d_model=32, seq_len=32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    return model, MixedPrecision(model, opt, recipe)


def _batches(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (4, 33), generator=g) for _ in range(n)]


def _train(model, engine, batches, bad=()):
    losses = []
    for i, idx in enumerate(batches):
        with engine.autocast():
            loss = model(idx[:, :-1], idx[:, 1:])
        engine.backward(loss * math.inf if i in bad else loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_engine_converts_and_updates_delayed_scales():
    model, engine = _fp8_engine()
    assert len(engine.fp8_modules) == 8
    mod = engine.fp8_modules[0]
    _train(model, engine, _batches(3, 0))
    assert (mod.fp8_scale != 1).all()          # scales moved off their initial value
    assert (mod.fp8_amax_history[:, 1] > 0).all()


def test_skipped_step_does_not_pollute_amax_history():
    model, engine = _fp8_engine()
    _train(model, engine, _batches(3, 0))
    hist = [m.fp8_amax_history.clone() for m in engine.fp8_modules]
    scales = [m.fp8_scale.clone() for m in engine.fp8_modules]
    _train(model, engine, _batches(1, 1), bad={0})
    for m, h, s in zip(engine.fp8_modules, hist, scales):
        assert torch.isfinite(m.fp8_amax_history).all()
        assert torch.equal(m.fp8_scale, s)
        assert torch.equal(m.fp8_amax_history[:, 1:], h[:, 1:])


@pytest.mark.parametrize("recipe", ["fp8", "fp8-current", "fp8-rowwise"])
def test_inf_reaching_an_fp8_cast_skips_the_step(recipe):
    """A saturating cast would turn an inf into ±max: an inf in the input batch (straight
    into an fp8 Linear) or in a gradient entering one (a layer without bias, so nothing
    else sees it) would train as a finite value. Each such step must be skipped with
    masters, optimizer states and the fp8 buffers bit-identical, and the run converge."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32, bias=False),
                          nn.GELU(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    engine = MixedPrecision(model, opt, recipe)
    assert len(engine.fp8_modules) == 2
    faults = {7: "input", 19: "grad_output", 23: "input", 41: "grad_output", 55: "input"}
    step = {"i": -1}

    def poison(mod, grad_output):
        if faults.get(step["i"]) != "grad_output":
            return None
        g = grad_output[0].clone()
        g[0, 0] = math.inf
        return (g,)

    model[2].register_full_backward_pre_hook(poison)
    w_true = torch.randn(16, 1)
    losses = []
    for i in range(80):
        step["i"] = i
        x = torch.randn(32, 16)
        y = x @ w_true
        if faults.get(i) == "input":
            x[3, 2] = math.inf
        fp8_before = [b.clone() for m in engine.fp8_modules for b in m.buffers()]
        with engine.autocast():
            loss = F.mse_loss(model(x).float(), y)
        before = [p.detach().clone() for p in model.parameters()]
        states = [{k: v.clone() for k, v in s.items()} for s in opt.state.values()]
        engine.backward(loss)
        r = engine.step()
        if i in faults:
            assert bool(r.skipped), (i, faults[i])
            assert all(torch.equal(p, q) for p, q in zip(before, model.parameters()))
            assert all(torch.equal(s[k], t[k]) for s, t in zip(states, opt.state.values())
                       for k in s)
            fp8_after = [b for m in engine.fp8_modules for b in m.buffers()]
            assert all(torch.equal(a, b) for a, b in zip(fp8_before, fp8_after))
        else:
            assert not bool(r.skipped), i
            losses.append(loss.item())
    assert sum(losses[-5:]) < 0.1 * sum(losses[:5])


@pytest.mark.paths
def test_fp8_state_resumes_bit_identically():
    model, engine = _fp8_engine()
    _train(model, engine, _batches(4, 0))
    buf = io.BytesIO()
    torch.save(engine.state_dict(), buf)
    assert any("fp8_amax_history" in k for k in engine.state_dict()["model"])
    tail = _train(model, engine, _batches(4, 1))
    buf.seek(0)
    model2, engine2 = _fp8_engine(seed=9)
    engine2.load_state_dict(torch.load(buf, weights_only=True))
    assert _train(model2, engine2, _batches(4, 1)) == tail


def test_fp8_trains_close_to_bf16():
    """Short version of the 300-step comparison in benchmarks/fp8.py."""
    finals = {}
    for recipe in ("bf16", "fp8", "fp8-current", "fp8-rowwise"):
        model, engine = _fp8_engine(recipe)
        losses = _train(model, engine, [b for b in _batches(8, 0)] * 8)
        finals[recipe] = sum(losses[-8:]) / 8
    for recipe in ("fp8", "fp8-current", "fp8-rowwise"):
        assert finals[recipe] == pytest.approx(finals["bf16"], rel=0.05), finals


def test_device_without_fp8_is_a_clear_error(monkeypatch):
    import mixprec.engine.checks as checks
    monkeypatch.setattr(checks, "device_supports", lambda d, dt: dt != torch.float8_e4m3fn)
    model = tiny_gpt()
    with pytest.raises(ValueError, match="has no fp8 GEMM"):
        MixedPrecision(model, torch.optim.AdamW(model.parameters()), "fp8")


def test_float8_output_dtype_follows_autocast_or_input():
    lin = Float8Linear.from_linear(nn.Linear(32, 16))
    x = torch.randn(4, 32)
    assert lin(x).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert lin(x).dtype == torch.bfloat16
    assert F.mse_loss(lin(x), torch.zeros(4, 16)).requires_grad


def test_evaluation_forward_leaves_the_delayed_scaling_state_alone():
    """An eval pass between steps (no_grad) must not write its activations' amax into the
    training history: it did, so a run resumed from a checkpoint taken after an eval
    diverged from the uninterrupted run (found with `mixprec train --resume`)."""
    model, engine = _fp8_engine()
    _train(model, engine, _batches(2, 0))
    state = [(m.fp8_amax_history.clone(), m.fp8_scale.clone()) for m in engine.fp8_modules]
    (idx,) = _batches(1, 5)
    with torch.no_grad(), engine.autocast():
        model(idx[:, :-1])  # after a step the current slot is 0: any amax would land
    for m, (h, s) in zip(engine.fp8_modules, state):
        assert torch.equal(m.fp8_amax_history, h) and torch.equal(m.fp8_scale, s)


class Conv1D(nn.Module):
    """The layout of transformers' GPT-2 ``Conv1D``: y = x @ weight + bias, weight (in, out)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.05)
        self.bias = nn.Parameter(torch.randn(nf) * 0.05)

    def forward(self, x):
        out = torch.addmm(self.bias, x.reshape(-1, x.size(-1)), self.weight)
        return out.view(*x.shape[:-1], self.nf)


class _GPT2Block(nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.c_fc, self.c_proj, self.head = Conv1D(4 * d, d), Conv1D(d, 4 * d), nn.Linear(d, 8)

    def forward(self, x):
        return self.head(x + self.c_proj(F.gelu(self.c_fc(x))))


@pytest.mark.parametrize("recipe", ["fp8-current", "fp8-rowwise"])
def test_gpt2_style_conv1d_layers_run_in_fp8(recipe):
    """transformers' GPT-2 family uses Conv1D, not nn.Linear: fp8 converted nothing and
    said so. Now they convert, keep their (in, out) weight layout and state-dict keys,
    and match bf16 to fp8 precision; an optimizer built before still trains them."""
    torch.manual_seed(0)
    model = _GPT2Block()
    keys = {k: v.shape for k, v in model.state_dict().items()}
    ref = _GPT2Block()
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = MixedPrecision(model, opt, recipe)
    assert engine.fp8_report.converted == ("c_fc", "c_proj")
    assert all(m.transposed for m in engine.fp8_modules)
    x = torch.randn(8, 16, 64)
    with engine.autocast():
        y8 = model(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ref(x)
    assert sqnr_db(y.float(), y8.float()) >= 25
    before = model.c_fc.weight.detach().clone()
    engine.backward(y8.float().square().mean())
    engine.step()
    assert model.c_fc.weight.shape == (64, 256) and not torch.equal(model.c_fc.weight, before)
    sd = {k: v for k, v in model.state_dict().items() if not k.split(".")[-1].startswith("fp8")}
    assert {k: v.shape for k, v in sd.items()} == keys
    _GPT2Block().load_state_dict(sd)  # still loads into the original model
    from mixprec.memory import measure

    items = measure(model, engine, x, loss_fn=lambda out: out.float().square().mean()).items
    # the fp8 weight copies backward keeps, one byte each, for dgrad only: c_fc's input
    # needs no gradient, so only c_proj's weight is kept (per tensor and rowwise alike)
    assert 64 * 256 <= items["weight_casts"] < 2 * 64 * 256


def test_engine_fp8_filter_and_a_model_converted_by_hand():
    """``fp8_filter`` picks the Linears; a model the user converted by hand (with their own
    filter) is left as it is, not converted further behind their back."""
    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(),
                             nn.Linear(32, 16), nn.Linear(16, 1))

    def keep_first(m, fqn):
        return fqn != "0"

    m = net()
    engine = MixedPrecision(m, torch.optim.SGD(m.parameters(), lr=0.1), "fp8",
                            fp8_filter=keep_first)
    assert [type(x).__name__ for x in m[::2]] == ["Linear", "Float8Linear", "Float8Linear"]
    assert engine.fp8_report.skipped[0] == ("0", "filter returned False")
    m = net()
    convert(m, "fp8", filter=keep_first)
    with pytest.warns(UserWarning, match="fp8_scaling=delayed, the recipe says rowwise"):
        engine = MixedPrecision(m, torch.optim.SGD(m.parameters(), lr=0.1), "fp8-rowwise")
    assert type(m[0]) is nn.Linear and engine.fp8_report is None
    assert len(engine.fp8_modules) == 3  # 32 → 32, 32 → 16 and 16 → 1 (any dims)
    with pytest.raises(ValueError, match="not both"):
        MixedPrecision(m, torch.optim.SGD(m.parameters(), lr=0.1), "fp8", fp8_filter=keep_first)
    m = net()
    with pytest.raises(ValueError, match="no fp8"):
        MixedPrecision(m, torch.optim.SGD(m.parameters(), lr=0.1), "bf16", fp8_filter=keep_first)
    with pytest.raises(TypeError, match="callable"):
        MixedPrecision(m, torch.optim.SGD(m.parameters(), lr=0.1), "fp8", fp8_filter="0")
    assert not any(isinstance(x, Float8Linear) for x in m.modules())  # refused: untouched


def test_fp8_all_gather_takes_every_format_but_int8():
    from mixprec import Recipe

    for scaling in ("delayed", "current", "rowwise", "block", "mx", "nvfp4"):
        r = Recipe.parse(f"fp8,fp8_scaling={scaling},fp8_all_gather=true")
        assert r.layout.fp8_all_gather is True
    with pytest.raises(NotImplementedError, match="fp8_scaling=int8: this format's weight "
                                                  "casts cannot be gathered.*drop "
                                                  "fp8_all_gather"):
        Recipe.parse("fp8,fp8_scaling=int8,fp8_all_gather=true")


def test_fp8_weight_is_its_codes_to_float8linear_and_its_value_to_anything_else():
    """``Fp8Weight`` (what FSDP2's fp8 all-gather hands a Float8Linear): views keep the
    codes and scale; any other op sees codes / scale; the Linear's cast takes the codes
    as they are and records the shard amax it carries."""
    from mixprec.formats.scaling import cast_to_fp8
    from mixprec.modules.linear import Float8Linear
    from mixprec.parallel.gather import Fp8Weight

    torch.manual_seed(0)
    w = torch.randn(32, 16)
    scale = torch.tensor(448.0) / w.abs().amax()
    codes = cast_to_fp8(w, scale, torch.float8_e4m3fn)
    fw = Fp8Weight(codes, scale, torch.tensor(0.5), torch.float32)
    assert fw.shape == (32, 16) and fw.dtype == torch.float32
    t = fw.t()
    assert isinstance(t, Fp8Weight) and torch.equal(t._codes.view(torch.uint8),
                                                    codes.t().view(torch.uint8))
    value = codes.float() * torch.reciprocal(scale)
    assert torch.equal(fw + 0, value) and type(fw + 0) is torch.Tensor
    lin = Float8Linear(16, 32, bias=False, recipe="fp8")
    cast = lin.quantize(fw, "weight", 1, record=True)
    got, inv = cast.codes, cast.inv
    assert torch.equal(got.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(inv, torch.reciprocal(scale))
    assert lin.fp8_amax_history[1, 0] == 0.5  # the shard amax, for the step's all-reduce
