"""INT8 rowwise training: the cast against a float64 reference, the two GEMM routes bit
for bit against an int64 product, the measured route choice (both outcomes), the Linear
(int8 forward and dgrad, 16-bit wgrad), bytes, training, and the planner's choice."""

from __future__ import annotations

import types
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import mixprec
import mixprec.planner.survey as survey_mod
import mixprec.planner.timing as timing
from mixprec import Recipe
from mixprec.engine import devices as kernels
from mixprec.formats.gemm import int8 as int8_rowwise
from mixprec.formats.gemm.int8 import (
    Int8Rowwise,
    cast_int8_rowwise,
    int8_gemm,
    int_mm_refusal,
    shape_class,
)
from mixprec.memory import transient
from mixprec.modules.linear import Float8Linear
from mixprec.planner.choose import Baselines
from mixprec.planner.timing import LayerCost
from mixprec.recipe.linear_format import quantizer_for


def _reference_cast(x: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 in float64: scale = fp32(amax / 127) (1 where that is 0), codes =
    half-even of the fp32 quotient, clipped to ±127."""
    x64 = x.astype(np.float64)
    amax = np.abs(x64).max(axis=dim, keepdims=True)
    scale = (amax / 127.0).astype(np.float32)
    scale = np.where(scale > 0, scale, np.float32(1.0))
    quot = (x64 / scale.astype(np.float64)).astype(np.float32)  # the fp32 division
    return np.clip(np.rint(quot), -127, 127).astype(np.int8), scale


def _rows(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(24, 160, generator=g) * torch.logspace(-30, 6, 24).unsqueeze(1)
    x[3] = 0.0                                        # a row of zeros
    x[5] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5] + [0.0] * 155)  # exact ties
    x[7, :4] = torch.tensor([1e-44, -7e-45, 0.0, 1e-45])  # amax / 127 underflows to 0
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [0, 1])
def test_cast_is_bit_exact_against_a_float64_reference(dtype, dim):
    x = _rows().to(dtype)
    codes, scale = cast_int8_rowwise(x, dim)
    want_codes, want_scale = _reference_cast(x.float().numpy(), dim)
    assert codes.dtype == torch.int8 and scale.dtype == torch.float32
    assert np.array_equal(codes.numpy(), want_codes)
    assert np.array_equal(scale.numpy(), want_scale)
    if dim == 1:  # half-even ties, and ±127 reached
        assert codes[5, :5].tolist() == [127, 2, -4, 0, 0]
        assert codes[3].abs().max() == 0 and scale[3, 0] == 1.0


def test_a_non_finite_row_gets_a_nan_scale_and_a_nan_output_row():
    x = torch.randn(4, 32)
    x[1, 3], x[2, 0] = float("inf"), float("nan")
    codes, scale = cast_int8_rowwise(x, 1)
    assert torch.isnan(scale[1:3]).all() and torch.isfinite(scale[[0, 3]]).all()
    assert (codes[1:3] == 0).all()  # int8 has no NaN: the scale carries it
    w = torch.randn(16, 32)
    wc, ws = cast_int8_rowwise(w, 1)
    y = int8_gemm(codes, wc.t(), scale, ws.t(), torch.float32, use_int_mm=True)
    assert torch.isnan(y[1:3]).all() and torch.isfinite(y[[0, 3]]).all()
    lin = Float8Linear.from_linear(nn.Linear(32, 16), "int8-rowwise")
    assert torch.isnan(lin(x)[1]).all()  # not a saturated finite value


@pytest.mark.parametrize("m,k,n", [(37, 200, 1000), (5, 2500, 24), (33, 1040, 17)])
def test_both_routes_equal_the_int64_product_bit_for_bit(m, k, n):
    g = torch.Generator().manual_seed(1)
    a = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
    b = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8).t()  # column-major
    a[0], b[:, 0] = 127, -127  # the largest sums: 127² · K
    sa, sb = torch.rand(m, 1, generator=g) + 0.5, torch.rand(1, n, generator=g) + 0.5
    exact = (a.long() @ b.long()).float()  # int64 sums below 2^31
    want = ((exact * sa) * sb).to(torch.bfloat16)
    fast = int8_gemm(a, b, sa, sb, torch.bfloat16, use_int_mm=True)
    slow = int8_gemm(a, b, sa, sb, torch.bfloat16, use_int_mm=False)
    assert torch.equal(fast.view(torch.int16), slow.view(torch.int16))
    assert torch.equal(slow.view(torch.int16), want.view(torch.int16))


@pytest.fixture
def exact_cpu_int_mm(monkeypatch):
    """This CPU's ``torch._int_mm`` taken as exact (a VNNI/AMX chip), for the tests of
    the route logic; a chip without is checked by the saturating-CPU test below."""
    from mixprec.formats.gemm import int8 as fmt_int8

    monkeypatch.setattr(fmt_int8, "_CPU_EXACT", [True])


def test_cuda_shapes_int_mm_refuses_fall_back_per_gemm(monkeypatch, exact_cpu_int_mm):
    def operands(m, k, n):
        dev = torch.device("cuda")
        return (types.SimpleNamespace(device=dev, shape=(m, k)),
                types.SimpleNamespace(device=dev, shape=(k, n)))
    assert int_mm_refusal(*operands(32, 64, 64)) is None
    for shape in [(16, 64, 64), (32, 60, 64), (32, 64, 12)]:
        assert "M > 16 and K, N multiples of 8" in int_mm_refusal(*operands(*shape))
    assert int_mm_refusal(torch.zeros(3, 5, dtype=torch.int8),
                          torch.zeros(5, 7, dtype=torch.int8)) is None  # a CPU: any shape
    # a GEMM whose shape the kernel refuses runs the exact route: same bits
    calls = []
    monkeypatch.setattr(int8_rowwise, "int_mm_refusal", lambda a, b: "refused")
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: calls.append(1))
    a = torch.randint(-127, 128, (9, 40), dtype=torch.int8)
    b = torch.randint(-127, 128, (40, 24), dtype=torch.int8)
    y = int8_gemm(a, b, torch.ones(9, 1), torch.ones(1, 24), torch.float32, True)
    assert not calls and torch.equal(y, (a.long() @ b.long()).float())


@pytest.mark.parametrize("ratio,takes", [(2.0, True), (0.8, False)])
def test_auto_on_a_cpu_takes_int_mm_per_shape_class_only_where_measured_faster(
        monkeypatch, ratio, takes, exact_cpu_int_mm):
    read = []

    def reading(device, shape):
        read.append(shape)
        return kernels.SpeedReading(name="int_mm", base="fp32", rounds=(ratio,) * 3)
    monkeypatch.setattr(kernels, "int8_reading", reading)
    real, calls = torch._int_mm, []
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: calls.append(1) or real(a, b))
    lin = Float8Linear.from_linear(nn.Linear(64, 32), "int8-rowwise")
    assert lin.backend == "auto"
    x = torch.randn(40, 64, requires_grad=True)
    lin(x).sum().backward()
    assert read == [(64, 64, 32), (64, 32, 64)]  # forward and dgrad: 40 tokens -> 64
    assert len(calls) == (2 if takes else 0)


@pytest.mark.parametrize("ratio", [2.0, 0.8])
def test_auto_compiles_as_one_graph_and_equals_eager(monkeypatch, ratio, exact_cpu_int_mm):
    """Under ``torch.compile(fullgraph=True)`` the per-shape reading is taken while
    tracing, as a constant (it made a generator inside the graph and broke it): the
    compiled Linears equal eager bit for bit, on either outcome of ``auto``."""
    def reading(device, shape):  # as the measurement does: its operands from a generator
        torch.Generator().manual_seed(0)
        return kernels.SpeedReading(name="int_mm", base="fp32", rounds=(ratio,) * 3)

    monkeypatch.setattr(kernels, "int8_reading", reading)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 32))
    mixprec.engine.convert.convert(model, "int8-rowwise,bf16_last_layers=0")
    x = torch.randn(40, 64)
    outs = []
    for run in (model, torch.compile(model, fullgraph=True, backend="aot_eager")):
        model.zero_grad()
        run(x).square().mean().backward()
        outs.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    torch._dynamo.reset()


def test_routes_by_device_and_choice(monkeypatch, exact_cpu_int_mm):
    q = quantizer_for("int8-rowwise")
    assert isinstance(q, Int8Rowwise) and q.quantized_gemms == ("forward", "dgrad")
    assert [q.route("cpu", c) for c in ("auto", "scaled_mm", "dequant", "dequant_fp32")
            ] == ["auto", "scaled_mm", "dequant_fp32", "dequant_fp32"]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    assert q.route("cuda", "auto") == "scaled_mm"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (7, 0))
    with pytest.warns(UserWarning, match="sm75 or newer, this GPU is sm70"):
        assert q.route("cuda:0", "auto") == "dequant_fp32"
    with pytest.raises(ValueError, match="fp8_gemm=auto or fp8_gemm=dequant_fp32"):
        q.route("cuda", "scaled_mm")
    with pytest.raises(ValueError, match="fp8_gemm='fast'; valid: auto, scaled_mm"):
        q.route("cpu", "fast")
    assert shape_class(40, 1000, 1) == (64, 1024, 16)


def test_the_linear_quantizes_forward_and_dgrad_and_keeps_wgrad_in_16_bits():
    torch.manual_seed(0)
    lin = nn.Linear(64, 48, bias=False)
    f8 = Float8Linear.from_linear(lin, "int8-rowwise,fp8_gemm=dequant")
    x = torch.randn(128, 64).bfloat16()
    x[7] *= 1e4  # one outlier token: a cast along the tokens would flush the others
    x.requires_grad_(True)
    gy = torch.randn(128, 48).bfloat16()
    gy[7] = 0.0  # so the other tokens carry wgrad, and an int8 cast along them loses it
    f8(x).backward(gy)
    x64, w64, g64 = (t.detach().double() for t in (x, lin.weight, gy))
    # forward and dgrad: the int8 codes of the float64 reference cast, multiplied exactly
    xc, xs = _reference_cast(x.detach().float().numpy(), 1)
    wc, ws = _reference_cast(lin.weight.detach().numpy(), 1)
    y_ref = (xc.astype(np.float64) @ wc.T.astype(np.float64)) * xs * ws.T
    y = f8(x.detach()).detach().double().numpy()
    assert np.allclose(y, y_ref, rtol=2**-7, atol=0)  # the one bf16 rounding of y
    # wgrad: a 16-bit GEMM of the unquantized operands (int8 along the tokens would
    # lose every token but the outlier: a relative error near 1)
    dw_ref = (g64.t() @ x64).numpy()
    err = np.abs(lin.weight.grad.double().numpy() - dw_ref).max() / np.abs(dw_ref).max()
    assert err < 2**-7
    dx_ref = (g64 @ w64).numpy()
    assert np.abs(x.grad.double().numpy() - dx_ref).max() / np.abs(dx_ref).max() < 0.05


def test_int8_linears_are_shown_as_int8_in_reprs_and_reports(tmp_path):
    """An int8 recipe's Linears are ``Int8Linear`` (still ``Float8Linear`` instances,
    which the engine and its tools test for) and say their gradient's cast is int8, the
    format's own dtype; the conversion report names their format, not fp8. A saved
    model loads back as the same class; fp8 Linears stay ``Float8Linear``."""
    from mixprec.modules.linear import Int8Linear, fp8_modules

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters()),
                                        "int8-rowwise")
    mods = fp8_modules(engine.model)
    assert sorted(mods) == ["0", "2"]
    assert all(type(m) is Int8Linear and isinstance(m, Float8Linear) for m in mods.values())
    assert quantizer_for(Recipe.parse("int8-rowwise")).dtype("grad_output") == torch.int8
    assert repr(mods["0"]).startswith("Int8Linear(in_features=64, out_features=64")
    assert "grad=int8" in repr(mods["0"]) and "Float8Linear" not in repr(engine.model)
    report = str(engine.fp8_report)
    assert "  conv  0: int8-rowwise" in report and "fp8" not in report
    torch.save(engine.model, tmp_path / "m.pt")
    assert type(torch.load(tmp_path / "m.pt", weights_only=False)[0]) is Int8Linear
    f8 = Float8Linear.from_linear(nn.Linear(64, 64), "fp8-current")
    assert type(f8) is Float8Linear and "grad=e5m2" in repr(f8)


def test_recipe_bytes_and_saved_tensors():
    r = Recipe.parse("int8-rowwise")
    assert (r.compute, r.linear.name, r.fp8_name, str(r)) == ("fp8", "int8", "int8-rowwise",
                                                              "int8-rowwise")
    fmt = r.linear  # the memory estimate asks the format for its bytes
    assert transient.saved_weight_bytes([(64, 32, fmt)]) == 64 * 32
    # backward keeps the int8 weight codes and the 16-bit input (no input codes)
    lin = Float8Linear.from_linear(nn.Linear(64, 32), r)
    x = torch.randn(8, 64, dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                  lambda t: t):
        lin(x)
    dtypes = sorted(str(t.dtype) for t in saved if t.dim() == 2 and t.numel() > 64)
    assert dtypes == ["torch.bfloat16", "torch.int8"]


@pytest.mark.parametrize("use_int_mm", [True, False])
@pytest.mark.parametrize("out", [torch.bfloat16, torch.float32])
def test_the_int8_gemm_holds_12_bytes_per_output_element(use_int_mm, out):
    """Measured by the allocator: the int32 sum, its fp32 copy and the scaled product
    (on the exact route the fp32 partial sum and its int32 copy), either route."""
    from mixprec.memory.ledger import high_water

    t, k, n = 512, 128, 256
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (t, k), dtype=torch.int8, generator=g)
    b = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g).t()
    sa, sb, kept = torch.rand(t, 1, generator=g), torch.rand(1, n, generator=g), []
    got = high_water(lambda: kept.append(int8_gemm(a, b, sa, sb, out, use_int_mm)))
    assert got == 12 * t * n


@pytest.mark.parametrize("act", [torch.bfloat16, torch.float32])
def test_the_backward_working_set_priced_is_the_measured_one(act):
    """One int8 Linear's backward (T=1024 tokens, 512 -> 128: the dgrad GEMM is the
    widest term) against ``backward_transient``: the output's gradient exists before
    the backward, so it is left out of both."""
    from mixprec.memory.ledger import high_water

    r = Recipe.parse("int8-rowwise")
    t, i, o = 1024, 512, 128
    torch.manual_seed(0)
    lin = Float8Linear.from_linear(nn.Linear(i, o), r)
    x = torch.randn(t, i, dtype=act, requires_grad=True)
    y = lin(x)
    grad = torch.randn_like(y)
    got = high_water(lambda: y.backward(grad))
    b = act.itemsize
    priced = transient.backward_transient(t, [(i, o, r.linear)], float(b)) - t * o * b
    assert abs(priced / got - 1) <= 0.05, (priced / 2**20, got / 2**20)


def test_the_workbench_gpt_trains_within_2_percent_of_bf16():
    from mixprec.workbench.train import TrainConfig, train

    cfg = dict(size="tiny", batch=4, steps=30, eval_every=30, ckpt_every=1000,
               corpus_bytes=200_000, warmup=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bf16 = train(TrainConfig(recipe="bf16", **cfg), None, progress=False)
        int8 = train(TrainConfig(recipe="int8-rowwise", **cfg), None, progress=False)
    first = bf16.steps[0]["loss"]
    assert bf16.final_val_loss < 0.8 * first  # it learned something to compare
    assert abs(int8.final_val_loss / bf16.final_val_loss - 1) < 0.02


class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 512)
        self.down = nn.Linear(512, 64)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


@pytest.mark.parametrize("int8_speedup,floor,want", [
    (2.0, 20.0, "int8-rowwise"),   # faster, above the floor
    (0.7, 20.0, "fp8-current"),    # slower than fp8 (itself 1.2x bf16)
    (2.0, 60.0, "bf16"),           # faster, but below the floor (as is fp8)
])
def test_the_planner_chooses_int8_where_measured_faster_within_the_sqnr_floor(
        monkeypatch, int8_speedup, floor, want):
    def measure(shape, formats, recipe, device, seconds):
        d_in, d_out, tokens, _ = shape
        t16 = 6.0 * d_in * d_out * tokens / 100e9
        speed = {"bf16": 1.0, "fp8-current": 1.2, "int8-rowwise": int8_speedup}
        return {f: LayerCost(t16 / speed[f], 1000, "fixed") for f in formats}

    def baselines(model, b, shell, batch, loss_fn, state_formats, device):
        cost = {"fused": 1e-9, "fp32": 2e-9, "bf16": 2e-9, "int8": 3e-9, "int4": 4e-9}
        return Baselines(1e-3, 1e8, 1e-3, 1e8, cost)

    timing.clear_cache()
    monkeypatch.setattr(timing, "_measure", measure)
    monkeypatch.setattr(survey_mod, "_baselines", baselines)
    monkeypatch.setattr(survey_mod, "_time_scales", lambda *a: {})
    torch.manual_seed(0)
    x = torch.randn(256, 64)
    try:
        p = mixprec.plan(_Two(), x, loss_fn=lambda m, b: m(b).float().pow(2).mean(),
                         formats=("bf16", "fp8-current", "int8-rowwise"), min_sqnr=floor,
                         max_loss=None)
    finally:
        timing.clear_cache()
    rows = {r.layer: r for r in p.rows}
    assert rows["up"].choice == want, p.table()
    if want == "int8-rowwise":
        assert rows["up"].sqnr > 30  # int8's 127 levels per row: above e4m3's ~28 dB
        assert p.recipe.layer_format("up") == "int8-rowwise"
    if want == "bf16":
        assert "SQNR" in rows["up"].reason


def test_a_cpu_whose_int_mm_saturates_takes_the_exact_route(monkeypatch):
    """Without VNNI/AMX, oneDNN sums int8 product pairs in saturating int16: there
    ``auto`` and a per-GEMM ``_int_mm`` take the exact route (probed, said once)."""
    from mixprec.formats.gemm import int8 as fmt_int8

    monkeypatch.setattr(fmt_int8, "_CPU_EXACT", [False])
    monkeypatch.setattr(fmt_int8, "_SAID", set())
    calls = []
    monkeypatch.setattr(torch, "_int_mm", lambda *a: calls.append(a))
    q = Recipe.parse("int8-rowwise").linear
    with pytest.warns(UserWarning, match="saturates"):
        assert q.route("cpu") == "dequant_fp32"
    with pytest.raises(ValueError, match="saturates"):
        q.route("cpu", "scaled_mm")
    a = torch.full((3, 64), 127, dtype=torch.int8)
    b = torch.full((64, 2), -127, dtype=torch.int8)
    one = torch.ones(3, 1), torch.ones(1, 2)
    got = int8_gemm(a, b, *one, torch.float32, use_int_mm=True)
    assert calls == [] and torch.equal(got, torch.full((3, 2), -127.0 * 127 * 64))


def test_the_probe_reads_this_cpus_kernel():
    from mixprec.formats.gemm.int8 import cpu_int_mm_exact

    a = torch.full((17, 64), 127, dtype=torch.int8)
    b = torch.full((64, 8), -127, dtype=torch.int8)
    exact = torch.equal(torch._int_mm(a, b), (a.long() @ b.long()).int())
    assert cpu_int_mm_exact() == exact or not exact  # an inexact kernel is never trusted
