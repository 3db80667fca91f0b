"""Linears of any dims under every fp8 / fp4 recipe: partial tiles and blocks cast from
their real elements (against float64), odd Linears trained on the CPU routes, the CUDA
routes' padded calls against torch's meta kernels, the per-GEMM fallback, the padding's
bytes in the memory planner, and Lightning's demo Transformer (d = 200)."""

from __future__ import annotations

import math
import warnings

import ml_dtypes
import numpy as np
import pytest
import torch
from torch import nn

from mixprec import MixedPrecision
from mixprec.engine.convert import convert
from mixprec.modules.linear import Float8Linear, fp8_modules
from mixprec.recipe.linear_format import quantizer_for

RECIPES = ["fp8", "fp8-current", "fp8-rowwise", "fp8-block", "mxfp8", "nvfp4"]
#: (in_features, out_features): none a multiple of 16
SHAPES = [(200, 200), (72, 200), (200, 72), (1000, 1000)]
#: the least output SQNR (dB) against fp32 of one GEMM of Gaussian operands: fp8's 3
#: mantissa bits read ~29 dB, e2m1's 1 bit ~17 dB
MIN_SQNR = {"nvfp4": 14.0}


def _sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.double(), x.double()
    return 20 * math.log10(ref.norm().item() / (ref - x).norm().item())


# --- partial tiles and blocks: scales from their real elements ------------------------

def _row(k: int, seed: int) -> np.ndarray:
    g = np.random.default_rng(seed)
    x = g.standard_normal((3, k))
    x[:, -3] *= 40.0  # the last, partial block holds the row's outlier
    return x


def test_a_partial_1x128_tile_and_128x128_block_scale_from_their_own_elements():
    """K = 200: the last 1×128 tile holds 72 elements, and a 200×200 weight's last
    block 72×72. Scale = 448 / amax of those elements (float64, then fp32)."""
    x = _row(200, 0)
    q = quantizer_for("fp8-block").cast(torch.tensor(x, dtype=torch.float32), "input", 1,
                                        {})
    xf = x.astype(np.float32).astype(np.float64)
    for r in range(3):
        for t, cols in enumerate((slice(0, 128), slice(128, 200))):
            scale = np.float32(448.0 / np.abs(xf[r, cols]).max())
            assert q.inv[r, t].item() == pytest.approx(1 / float(scale), rel=1e-6)
    w = np.random.default_rng(1).standard_normal((200, 200))
    w[150, 170] = 30.0
    qw = quantizer_for("fp8-block").cast(torch.tensor(w, dtype=torch.float32), "weight",
                                         1, {})
    wf = w.astype(np.float32).astype(np.float64)
    corner = np.abs(wf[128:, 128:]).max()
    assert corner == pytest.approx(30.0)
    assert qw.inv[1, 1].item() == pytest.approx(corner / 448.0, rel=1e-6)


def test_a_partial_mx_block_takes_the_spec_exponent_of_its_own_elements():
    """K = 200: the last 1×32 block holds 8 elements. rceil: X = 2^ceil(log2(amax /
    448)) over those 8, in float64; the codes are e4m3(x / X) (ml_dtypes)."""
    x = _row(200, 2)
    q = quantizer_for("mxfp8").cast(torch.tensor(x, dtype=torch.float32), "input", 1, {})
    xf = x.astype(np.float32).astype(np.float64)
    last = xf[:, 192:]
    want_x = 2.0 ** np.ceil(np.log2(np.abs(last).max(axis=1) / 448.0))
    assert np.array_equal(q.inv[:, -1].numpy().astype(np.float64), want_x)
    codes = (last / want_x[:, None]).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    assert np.array_equal(q.codes[:, 192:].float().numpy().astype(np.float64), codes)


def test_a_partial_nvfp4_block_scales_from_its_own_elements():
    """K = 200: the last 1×16 block holds 8 elements. s = e4m3(amax_b / 6 / G) with
    G = amax / (448 · 6) over the tensor, in float64 rounded by ml_dtypes."""
    x = _row(200, 3)
    q = quantizer_for("nvfp4").cast(torch.tensor(x, dtype=torch.float32), "input", 1, {})
    xf = x.astype(np.float32).astype(np.float64)
    g = np.abs(xf).max() / (448.0 * 6.0)
    s = (np.abs(xf[:, 192:]).max(axis=1) / 6.0 / g).astype(ml_dtypes.float8_e4m3fn)
    assert q.outer.item() == pytest.approx(g, rel=1e-6)
    assert np.array_equal(q.inv[:, -1].numpy(), s.astype(np.float32))


# --- odd Linears train on the CPU routes ----------------------------------------------

def _model(d_in: int, d_out: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d_in, d_out), nn.Tanh(), nn.Linear(d_out, 16), nn.Tanh(),
                         nn.Linear(16, 16))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("recipe", RECIPES + ["fp8-current,fp8_gemm=scaled_mm",
                                              "fp8-rowwise,fp8_gemm=scaled_mm"])
def test_an_odd_linear_converts_and_trains_under_every_recipe(recipe, shape):
    """The first Linear converts (its dims are no multiple of 16), its output is within
    the format's SQNR of fp32 on the same weights, and a few steps lower a regression
    loss (the other two Linears are kept by a filter, and are NVFP4's last two).
    ``fp8_gemm=scaled_mm``: the padded ``torch._scaled_mm`` on this CPU."""
    if "scaled_mm" in recipe:
        from helpers.speeds import require_cpu_scaled_mm

        if shape == (1000, 1000):
            pytest.skip("the CPU _scaled_mm is a slow reference kernel")
        require_cpu_scaled_mm()
    d_in, d_out = shape
    model = _model(d_in, d_out)
    ref = nn.Linear(d_in, d_out)
    ref.load_state_dict(model[0].state_dict())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(24, d_in, generator=g)
    target = torch.randn(24, 16, generator=g)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = MixedPrecision(model, opt, recipe, fp8_filter=lambda m, n: n == "0")
    assert isinstance(model[0], Float8Linear) and engine.fp8_report.converted == ("0",)
    with engine.autocast():
        y = model[0](x)
    assert y.shape == (24, d_out)
    assert _sqnr(ref(x), y.float()) >= MIN_SQNR.get(recipe, 25.0)
    losses = []
    for _ in range(5):
        with engine.autocast():
            loss = (model(x).float() - target).pow(2).mean()
        engine.backward(loss)
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0], losses


def test_float8_linear_takes_any_dims():
    """A Float8Linear built by hand of dims 10 × 3 runs forward and backward."""
    f8 = Float8Linear(10, 3, recipe="fp8-current")
    x = torch.randn(5, 10, requires_grad=True)
    f8(x).sum().backward()
    assert x.grad.shape == (5, 10) and f8.weight.grad.shape == (3, 10)


# --- the CUDA routes' padded calls against torch's meta kernels -----------------------

META = ["fp8", "fp8-current", "fp8-rowwise", "fp8,fp8_format=e4m3", "fp8-block",
        "fp8-block,block_scales=pow2", "mxfp8", "nvfp4",
        "nvfp4,nvfp4_2d=false,nvfp4_rht=false"]


@pytest.mark.parametrize("tokens", [1, 30])
@pytest.mark.parametrize("shape", SHAPES + [(17, 3)])
@pytest.mark.parametrize("recipe", META)
def test_odd_linears_pass_the_meta_kernels_padded(recipe, shape, tokens, monkeypatch):
    """Forward, dgrad and wgrad of an odd Linear on the ``scaled_mm`` route, each call
    checked by torch's meta kernel (``torch._scaled_mm`` per tensor and rowwise,
    ``scaled_mm`` block-scaled / MX / NVFP4): every operand the kernel sees is padded
    to its multiples and the outputs are sliced back to the Linear's shapes."""
    import mixprec.formats.scaled_mm as route
    import mixprec.formats.tensor_gemm as gemm
    from helpers.meta_linear import meta_linear_step

    seen = []
    real_mm, real_block = torch._scaled_mm, route.F.scaled_mm

    def spy_mm(a, b, **kw):
        seen.append(("tensor", a.shape, b.shape))
        return real_mm(a, b, **kw)

    def spy_block(a, b, *args, **kw):
        seen.append(("block", a.shape, b.shape))
        return real_block(a, b, *args, **kw)

    monkeypatch.setattr(gemm.torch, "_scaled_mm", spy_mm)
    monkeypatch.setattr(route.F, "scaled_mm", spy_block)
    f8 = meta_linear_step(recipe + ",fp8_gemm=scaled_mm", shape, tokens)
    assert len(seen) == 3  # forward, dgrad, wgrad: each on the kernel
    _, mk, mn = f8.quantizer.kernel.multiples
    fp4 = f8.quantizer.kernel.fp4  # two codes a byte: K counted in bytes
    for _, a, b in seen:
        assert a[1] * (2 if fp4 else 1) % mk == 0 and b[1] % mn == 0, (a, b)


def test_the_meta_kernels_refuse_the_unpadded_odd_calls():
    """The control: torch's meta kernels refuse K = 200 as it is, per tensor and MX,
    so the padding is what lets the calls above pass."""
    import torch.nn.functional as F

    a = torch.empty(30, 200, dtype=torch.float8_e4m3fn, device="meta")
    b = torch.empty(72, 200, dtype=torch.float8_e4m3fn, device="meta").t()
    one = torch.empty((), device="meta")
    with pytest.raises(RuntimeError, match="divisible by 16"):
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    e8 = torch.float8_e8m0fnu
    sa = torch.empty(128 * 8, dtype=e8, device="meta")  # 30 → 128 rows, 7 → 8 blocks
    sb = torch.empty(128 * 8, dtype=e8, device="meta")
    sw = F.SwizzleType.SWIZZLE_32_4_4
    with pytest.raises(RuntimeError):
        F.scaled_mm(a, b, sa, F.ScalingType.BlockWise1x32, sb, F.ScalingType.BlockWise1x32,
                    swizzle_a=sw, swizzle_b=sw, output_dtype=torch.bfloat16)


# --- a shape the kernel refuses falls back for that GEMM only -------------------------

def test_a_refused_shape_falls_back_per_gemm_with_one_warning(monkeypatch):
    """A kernel that refuses one padded shape (K = 208): that GEMM runs the dequantizing
    route, bit for bit, with one warning naming the shape and route; the same shape
    again warns no more; another shape keeps the kernel."""
    import mixprec.formats.padding as padding
    import mixprec.formats.tensor_gemm as gemm

    monkeypatch.setattr(padding, "_REFUSED", {})
    calls = []

    def kernel(a, b, scale_a, scale_b, out_dtype):
        calls.append(a.shape)
        if a.shape[1] == 208:
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
        return ((a.float() @ b.float()) * scale_a * scale_b).to(out_dtype)

    monkeypatch.setattr(gemm.torch, "_scaled_mm", kernel)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(30, 200, generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(200, 72, generator=g).to(torch.float8_e4m3fn)
    one = torch.tensor(0.5)
    with pytest.warns(UserWarning, match=r"\(30, 200\) @ \(200, 72\) on torch._scaled_mm"):
        y = gemm.fp8_gemm(a, b, one, one, torch.bfloat16, "scaled_mm")
    assert torch.equal(y, gemm.fp8_gemm(a, b, one, one, torch.bfloat16, "dequant"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gemm.fp8_gemm(a, b, one, one, torch.bfloat16, "scaled_mm")
        assert len(calls) == 1  # known refused: straight to the exact route
        c = torch.randn(30, 64, generator=g).to(torch.float8_e4m3fn)
        gemm.fp8_gemm(c, b[:64], one, one, torch.bfloat16, "scaled_mm")
    assert calls[-1] == (30, 64)


# --- the padding's bytes in the memory planner ----------------------------------------

def test_the_memory_planner_counts_the_padding_of_a_200_dim_linear():
    """On the ``scaled_mm`` route a 200 × 200 Linear's dgrad runs as a 208 × 208 one:
    the gradient's codes copied at 208 columns, the weight's copy grown to 208², the
    output's 8 padded bf16 columns. A 208 × 208 Linear pads nothing; the dequant
    routes hold no padding."""
    from mixprec.memory.transient import backward_transient
    from mixprec.recipe import PRESETS

    fp8 = PRESETS["fp8"].linear  # the memory estimate asks the format for its bytes

    t = 64

    def base(d):  # the unpadded working set, as the module doc counts it (bf16)
        return t * d * 2 * 2 + d * d * 4 + 5 * t * d

    padding = t * 208 + (208 * 208 - 200 * 200) + t * 8 * 2
    assert backward_transient(t, [(208, 208, fp8)], 2, "scaled_mm") == base(208)
    assert backward_transient(t, [(200, 200, fp8)], 2, "scaled_mm") == base(200) + padding
    assert backward_transient(t, [(200, 200, fp8)], 2, "dequant") == \
        base(200) + 2 * (t * 200 + 200 * 200)


def test_the_padding_bytes_are_what_the_route_allocates():
    """The padded operands ``torch._scaled_mm`` receives for the dgrad GEMM of a 200 ×
    200 Linear, counted from the tensors themselves, equal the planner's count."""
    import mixprec.formats.tensor_gemm as gemm
    from mixprec.formats.padding import padding_bytes

    t = 64
    g = torch.empty(t, 200, dtype=torch.float8_e4m3fn, device="meta")
    w = torch.empty(200, 200, dtype=torch.float8_e4m3fn, device="meta")
    a, b, _ = gemm._scaled_mm_operands(g, w)
    out_pad = t * (b.shape[1] - 200) * 2
    # g passed as it is when aligned; w's transpose is copied either way
    got = a.numel() + (b.numel() - w.numel()) + out_pad
    assert got == padding_bytes(t, 200, 200, a_copied=False, b_copied=True, out_bytes=2)


# --- Lightning's demo Transformer (d = 200) -------------------------------------------

@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("recipe", ["fp8", "fp8-current"])
def test_lightnings_demo_transformer_converts_its_ffn_linears_and_trains(recipe):
    """``lightning.pytorch.demos.Transformer`` (d = 200) under the plugin, fit as
    Lightning fits it: its eight FFN Linears run in fp8, the attention projections
    (a Linear subclass) and the head stay with their reasons, and the loss falls."""
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.demos import Transformer

    from mixprec.integrations.lightning import MixedPrecisionPlugin

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = Transformer(vocab_size=64, dropout=0.0)
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            inputs, target = batch
            out = self.model(inputs, target)
            loss = torch.nn.functional.nll_loss(out.float(), target.reshape(-1))
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, 64, (4, 17), generator=g)
    batch = (seq[:, :-1], seq[:, 1:])
    lit = Lit()
    plugin = MixedPrecisionPlugin(recipe)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=6, plugins=[plugin],
                         logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(lit, torch.utils.data.DataLoader([batch] * 6, batch_size=None))
    ffn = {f"transformer.{side}.layers.{i}.linear{j}" for side in ("encoder", "decoder")
           for i in (0, 1) for j in (1, 2)}
    assert {f"model.{n}" for n in ffn} == set(fp8_modules(lit))
    report = plugin.engine.fp8_report
    skipped = dict(report.skipped)
    assert "output head" in skipped["model.decoder"]
    assert all("Linear subclass" in why for n, why in skipped.items() if "out_proj" in n)
    assert all(math.isfinite(v) for v in lit.losses) and len(lit.losses) == 6
    assert lit.losses[-1] < lit.losses[0], lit.losses


def test_convert_reports_only_the_reasons_left():
    """Odd dims no longer keep a Linear; the head and a Linear subclass still do, each
    with its reason."""
    net = nn.Sequential(nn.Linear(10, 200), nn.ReLU(), nn.Linear(200, 3))
    net.add_module("mha", nn.MultiheadAttention(200, 2))
    report = convert(net, "fp8-current")
    assert report.converted == ("0", "2")
    assert dict(report.skipped) == {
        "mha.out_proj": "NonDynamicallyQuantizableLinear is a Linear subclass whose owner "
                        "may use its weight directly (e.g. nn.MultiheadAttention.out_proj)"}
