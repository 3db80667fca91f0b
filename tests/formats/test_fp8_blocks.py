"""Block-scaled fp8 (DeepSeek-V3's tiles and blocks) and MXFP8: the casts against
float64 / ml_dtypes references and torchao's ``to_mx``, SQNR in torchao's own setup,
outliers, non-finite inputs, and the recipes through the engine."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from helpers.models import pattern_losses, tiny_gpt
from mixprec import MixedPrecision, Recipe
from mixprec.engine.emulate import mx_quantize
from mixprec.formats.blocks import MX_ROUNDINGS, cast_blocks, cast_mx, cast_tiles
from mixprec.modules.linear import Float8Linear

E4M3 = torch.float8_e4m3fn


def _sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.double(), x.double()
    return 20 * math.log10(ref.norm().item() / (ref - x).norm().item())


def _ref_block_dequant(x: torch.Tensor, rows: int, cols: int, pow2: bool = False):
    """The documented block cast, one block at a time: scale = 448 * fp32(1 / amax)
    (torch's scalar / tensor), or its power of two at or below; code =
    e4m3(fp32(x * scale)) saturated (ml_dtypes); value = fp32(code * fp32(1 / scale))."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    import numpy as np

    out = torch.empty_like(x)
    for i in range(0, x.shape[0], rows):
        for j in range(0, x.shape[1], cols):
            b = x[i:i + rows, j:j + cols]
            amax = b.abs().max()
            scale = torch.reciprocal(amax) * 448.0 if amax > 0 else torch.tensor(1.0)
            if pow2:
                scale = torch.tensor(2.0 ** math.floor(math.log2(scale.item())))
            prod = (b.double() * scale.double()).float().clamp(-448, 448)  # fp32 product
            code = prod.numpy().astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
            inv = torch.reciprocal(scale.float())
            out[i:i + rows, j:j + cols] = (torch.from_numpy(code).double()
                                           * inv.double()).float()
    return out


@pytest.mark.parametrize("pow2", [False, True])
def test_tiles_and_blocks_equal_the_float64_reference(pow2):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 300, generator=g) * torch.logspace(-4, 4, 300)  # ragged edges
    x[:128, :128] = 0  # an all-zero block
    x[5, 260] = 3e4  # an outlier in a partial tile
    for cast, rows, cols in ((cast_tiles(x, 1, E4M3, pow2=pow2), 1, 128),
                             (cast_tiles(x, 0, E4M3, pow2=pow2), 128, 1),
                             (cast_blocks(x, E4M3, pow2=pow2), 128, 128)):
        assert cast.codes.dtype == E4M3 and cast.codes.shape == x.shape
        assert torch.equal(cast.dequant(), _ref_block_dequant(x, rows, cols, pow2))
    if pow2:  # power-of-two scales: every inverse scale is exact, so is the dequant
        inv = cast_blocks(x, E4M3, pow2=True).inv
        assert torch.equal(torch.exp2(torch.log2(inv).round()), inv)


def test_a_weight_block_serves_its_transpose():
    w = torch.randn(256, 384)
    a, b = cast_blocks(w, E4M3), cast_blocks(w.t(), E4M3)
    assert torch.equal(a.dequant().t(), b.dequant())


@pytest.mark.parametrize("rounding", MX_ROUNDINGS)
def test_mx_equals_torchaos_to_mx_bit_for_bit(rounding):
    """torchao's ``to_mx`` (its CPU path) on the same tensors: a range of 10^±20, zero
    blocks, an outlier, amaxes at and just past e4m3's max. Both scale by the same
    power of two and round the elements alike."""
    pytest.importorskip("torchao")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_mx
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-20, 20, 64)[:, None]
    x[3] = 0
    x[5, 7] = 1e5 * x[5].abs().max()
    x[9, :32] = 448.0
    x[10, :32] = 448.0 * 1.03
    x[11, :32] = 2.0**-100  # tiny, but above where torchao clamps its scale
    scale, data = to_mx(x, E4M3, 32, getattr(ScaleCalculationMode, rounding.upper()))
    exp = scale.view(torch.uint8).to(torch.int32) - 127
    theirs = (data.float().view(64, 8, 32) * torch.exp2(exp.float()).view(64, 8, 1))
    ours = cast_mx(x, 1, rounding=rounding).dequant()
    assert torch.equal(ours, theirs.view(64, 256))


def test_mx_floor_is_the_ocp_spec_of_mixprec_emulate():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(96, 128, generator=g) * torch.logspace(-8, 8, 128)
    for dim in (0, 1):
        assert torch.equal(cast_mx(x, dim, rounding="floor").dequant(),
                           mx_quantize(x, "fp8_e4m3", dim))


def test_a_nonfinite_tile_is_nan_and_only_that_tile():
    """A saturating cast would turn an inf into 448 and hide it (torchao's to_mx gives
    448 * 2^120 for it): mixprec makes the tile NaN, so the step is skipped."""
    x = torch.randn(4, 256)
    x[1, 3] = float("inf")
    x[2, 200] = float("nan")
    for cast in (cast_tiles(x, 1, E4M3), cast_mx(x, 1)):
        d = cast.dequant()
        width = 128 if cast.cols == 128 else 32
        start = 192 if width == 32 else 128  # the tile that holds column 200
        assert d[1, :width].isnan().all() and d[2, start:start + width].isnan().all()
        assert torch.isfinite(d[0]).all() and torch.isfinite(d[1, width:]).all()


def _linear_sqnr(recipe: str, gaussian_grad: bool, m=1024, k=512, n=256):
    """torchao's setup: x ~ N(0, 1), the output gradient of ``y.sum()`` (or Gaussian),
    Float8Linear against the fp32 Linear: (output, dgrad, wgrad) SQNR in dB."""
    torch.manual_seed(0)
    lin = nn.Linear(k, n, bias=False)
    f8 = Float8Linear.from_linear(nn.Linear(k, n, bias=False), recipe)
    f8.weight = nn.Parameter(lin.weight.detach().clone())
    x = torch.randn(m, k)
    go = torch.randn(m, n) if gaussian_grad else torch.ones(m, n)
    out = []
    for mod in (lin, f8):
        xi = x.clone().requires_grad_()
        y = mod(xi)
        y.backward(go)
        out.append((y.detach(), xi.grad, mod.weight.grad))
    return [_sqnr(a, b) for a, b in zip(*out)]


@pytest.mark.parametrize("recipe", ["fp8-block", "fp8-block,block_scales=pow2"])
def test_block_fp8_sqnr_meets_torchaos_thresholds(recipe):
    out, dgrad, wgrad = _linear_sqnr(recipe, gaussian_grad=False)
    assert out >= 25 and dgrad >= 30 and wgrad >= 30, (out, dgrad, wgrad)
    # Gaussian output gradients: e4m3 tiles beat per-tensor with e5m2 (hybrid) gradients
    blk = _linear_sqnr(recipe, gaussian_grad=True)
    per_tensor = _linear_sqnr("fp8-current", gaussian_grad=True)
    assert min(blk) >= 28 and blk[1] > per_tensor[1] + 3 and blk[2] > per_tensor[2] + 3


def test_mx_quantization_sqnr_is_at_least_torchaos():
    x = torch.randn(1024, 512, generator=torch.Generator().manual_seed(3))
    for rounding in MX_ROUNDINGS:
        assert _sqnr(x, cast_mx(x, 1, rounding=rounding).dequant()) >= 18
    out, dgrad, wgrad = _linear_sqnr("mxfp8", gaussian_grad=True)
    assert min(out, dgrad, wgrad) >= 25


@pytest.mark.parametrize("recipe", ["fp8-block", "mxfp8"])
def test_an_outlier_token_costs_only_its_own_tiles(recipe):
    """One token 10^5 times the others: per-tensor e4m3 puts the others among its
    subnormals (7.6 dB, the README's table); tiles along the contracted dim keep them."""
    torch.manual_seed(0)
    lin = nn.Linear(1024, 512, bias=False)
    x = torch.randn(256, 1024)
    x[7] *= 1e5
    rest = [i for i in range(256) if i != 7]
    ref = (x.double() @ lin.weight.detach().double().t())[rest]

    def others(r):
        with torch.no_grad():
            return _sqnr(ref, Float8Linear.from_linear(lin, r)(x)[rest])

    assert others(recipe) > 25
    assert others("fp8-current,fp8_format=e4m3") < 10
    if recipe == "mxfp8":  # the OCP floor rule saturates blocks' largest elements
        assert 24 < others("mxfp8,mx_rounding=floor") < others(recipe) - 3


@pytest.mark.parametrize("recipe", ["fp8-block,block_scales=pow2", "mxfp8,mx_rounding=floor"])
def test_block_recipe_variants_convert_and_step(recipe):
    """The presets train a small GPT in tests/engine/test_engine.py; here their variants convert
    with their settings and take applied steps."""
    torch.manual_seed(0)
    model = tiny_gpt(d_model=128, n_heads=4)
    engine = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=3e-3), recipe)
    r = Recipe.parse(recipe)
    mods = engine.fp8_modules
    assert {(m.scaling, m.block_pow2, m.mx_rounding) for m in mods} == {
        (r.linear.name, getattr(r.linear, "block_scales", None) == "pow2",
         getattr(r.linear, "mx_rounding", None))}
    losses = pattern_losses(engine, model, 5, check_applied=True)
    assert all(math.isfinite(v) for v in losses)


def test_an_inf_input_under_block_scaling_skips_the_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 16))
    engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp8-block")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(8, 128)
    x[2, 5] = float("inf")
    with engine.autocast():
        loss = model(x).float().pow(2).mean()
    engine.backward(loss)
    assert bool(engine.step().skipped)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_block_recipe_errors_and_warnings_name_the_fix():
    from mixprec.modules.linear import Float8Linear

    lin = Float8Linear.from_linear(nn.Linear(128, 128), Recipe.parse(
        "fp8-block,fp8_gemm=scaled_mm"))  # torch's block-scaled kernels: CUDA only
    with pytest.raises(ValueError, match="block-scaled kernels run on CUDA only.*auto"):
        lin(torch.randn(4, 128))
    # a field the format does not have does not exist: refused, no longer a warning
    with pytest.raises(ValueError, match="mx_rounding with fp8_scaling='block'"):
        Recipe.parse("fp8-block,mx_rounding=ceil")
    with pytest.raises(ValueError, match="margin with fp8_scaling='mx'"):
        Recipe.parse("mxfp8,margin=1")
    with pytest.raises(ValueError, match="mx_rounding.*valid: rceil, floor, ceil, even"):
        Recipe.parse("mxfp8,mx_rounding=up")


# --- NVFP4 --------------------------------------------------------------------------

def test_nvfp4_equals_torchaos_to_nvfp4_bit_for_bit():
    """torchao's ``NVFP4Tensor.to_nvfp4`` with its per-tensor scale (CPU path): a range
    of 10^±3, zero rows, an outlier, values on e2m1 ties."""
    pytest.importorskip("torchao")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.prototype.mx_formats.nvfp4_tensor import (
            NVFP4Tensor,
            per_tensor_amax_to_scale,
        )
    from mixprec.formats.fp4 import cast_nvfp4

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-3, 3, 64)[:, None]
    x[3] = 0
    x[5, 7] = 1e3 * x[5].abs().max()
    x[9, :16] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 2)  # ties
    t = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor_amax_to_scale(x.abs().amax()))
    ours = cast_nvfp4(x, 1)
    assert torch.equal(ours.dequant(), t.dequantize(torch.float32))
    assert _sqnr(x, ours.dequant()) >= 8  # torchao's reconstruction threshold
    y = torch.randn(1024, 512, generator=g)
    ty = NVFP4Tensor.to_nvfp4(y, per_tensor_scale=per_tensor_amax_to_scale(y.abs().amax()))
    assert _sqnr(y, cast_nvfp4(y, 1).dequant()) >= _sqnr(y, ty.dequantize(torch.float32))


def test_nvfp4_element_rounding_equals_formats_e2m1_on_every_binade():
    """The cast's bit-level e2m1 rounding (exponent bits give the grid's step) against
    ``formats.quantize``'s general rounding: every representable fp32 pattern in
    [0, 6] at a stride, the ties, ±0 and subnormals; and the stochastic path's
    probability is the distance to the lower neighbour, as the generic rounding's."""
    from mixprec.formats import elements as formats
    from mixprec.formats.fp4 import _round_e2m1

    bits = torch.arange(0, 0x40C00001, 97, dtype=torch.int64).to(torch.int32)  # 0 .. 6
    a = bits.view(torch.float32)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 1e-40, 0.0])
    v = torch.cat([a, -a, ties, -ties])
    want = formats.quantize(v, "fp4_e2m1")
    assert torch.equal(_round_e2m1(v, None).view(torch.int32), want.view(torch.int32))
    g1, g2 = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    u = torch.rand(v.shape, generator=g2)
    got = _round_e2m1(v, g1)
    assert torch.equal(got, formats.quantize(v, "fp4_e2m1", "stochastic", noise=u))


def test_nvfp4_stochastic_rounding_is_unbiased_and_2d_blocks_serve_the_transpose():
    from mixprec.formats.fp4 import cast_nvfp4

    x = torch.full((1, 16), 2.5)  # between e2m1's 2 and 3 at the block scale's grid
    x[0, 0] = 6.0 * 448 / 448  # sets the block amax: scale 1
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack([cast_nvfp4(x, 1, generator=gen).dequant()[0, 1:]
                         for _ in range(4000)])
    exact, p = 2.5, 0.5  # halfway: 2 or 3, each with probability 1/2
    sigma = 1.0 * (p * (1 - p) / draws.numel()) ** 0.5
    assert abs(draws.mean().item() - exact) < 4 * sigma
    assert set(draws.unique().tolist()) == {2.0, 3.0}
    w = torch.randn(64, 96)
    a, b = cast_nvfp4(w, square=True), cast_nvfp4(w.t().contiguous(), square=True)
    assert torch.equal(a.dequant().t(), b.dequant())


def test_mx_exponents_match_exact_arithmetic_down_to_fp32_subnormals():
    """The e8m0 exponents, read from the float bits, against exact Python arithmetic
    (``math.frexp`` on the float32 values and quotients) for every rounding and element
    format: powers of two and their neighbours from 2^-149 to 2^127, random magnitudes,
    0, inf and NaN. A block whose amax / max underflows fp32 takes -127 (the true ceil
    of its log2 is below the clamp)."""
    import math

    import numpy as np

    from mixprec.formats import elements as formats
    from mixprec.formats.blocks import MX_ROUNDINGS, mx_exponents

    p2 = torch.exp2(torch.arange(-149, 128).float())
    g = torch.Generator().manual_seed(0)
    rand = torch.rand(500, generator=g) * torch.exp2(torch.randint(-149, 127, (500,),
                                                                   generator=g).float())
    a = torch.cat([p2, p2 * (1 - 2**-24), p2[:-1] * (1 + 2**-23), rand,
                   torch.tensor([0.0, 1.75, 1.875, 1.9375, float("inf"), float("nan")])])

    def exact(x: float, f, rounding: str) -> float:
        if math.isnan(x) or math.isinf(x):
            return math.nan
        if x == 0:
            return -127.0
        if rounding == "rceil":
            q = float(np.float32(x) / np.float32(f.max))  # the fp32 quotient
            if q == 0:
                return -127.0
            m, e = math.frexp(q)
            k = e - 1 if m == 0.5 else e
        else:
            m, e = math.frexp(x)
            k = e - 1
            if rounding == "ceil" and m != 0.5:
                k += 1
            if rounding == "even" and 2 * m + 2.0 ** -(f.mantissa_bits + 1) >= 2:
                k += 1
            k -= f.emax
        return float(min(max(k, -127), 127))

    for name in ("fp8_e4m3", "fp8_e5m2", "fp6_e2m3", "fp6_e3m2", "fp4_e2m1"):
        f = formats.get(name)
        for rounding in MX_ROUNDINGS:
            got = mx_exponents(a, f, rounding).tolist()
            want = [exact(x, f, rounding) for x in a.tolist()]
            assert all(g_ == w or (math.isnan(g_) and math.isnan(w))
                       for g_, w in zip(got, want)), (name, rounding)


def test_the_counter_stream_is_uniform_keyed_and_rounds_without_bias():
    """The compiled graphs' stochastic rounding draws ``counter_uniform``: 24-bit
    uniforms whose 64-bin histogram over 2^20 draws is flat to 5 sigma, independent of
    the neighbouring key (correlation), repeatable, and unbiased through the e2m1
    rounding. Against a float64 reference: the mean of the rounded values."""
    from mixprec.formats.fp4 import _round_e2m1, counter_uniform

    n = 1 << 20
    u = counter_uniform(torch.tensor(7), (n,))
    assert u.dtype == torch.float32 and 0 <= u.min() and u.max() < 1
    assert torch.equal(u, counter_uniform(torch.tensor(7), (n,)))
    counts = torch.histc(u.double(), bins=64, min=0, max=1)
    expect = n / 64
    assert ((counts - expect).abs() < 5 * expect**0.5).all()
    w = counter_uniform(torch.tensor(8), (n,))
    r = torch.corrcoef(torch.stack([u, w]).double())[0, 1]
    assert abs(r) < 5 / n**0.5
    assert (torch.stack([u[:-1], u[1:]]).double().corrcoef()[0, 1]).abs() < 5 / n**0.5
    v = torch.full((n,), 2.25)  # between 2 and 3: up with probability 1/4
    got = _round_e2m1(v.clone(), torch.tensor(3))
    assert set(got.unique().tolist()) == {2.0, 3.0}
    sigma = (0.25 * 0.75 / n) ** 0.5
    assert abs(got.double().mean().item() - 2.25) < 5 * sigma


def test_the_hadamard_transform_is_orthonormal_and_keeps_the_wgrad_product():
    from mixprec.formats.fp4 import apply_hadamard, hadamard_16

    h = hadamard_16(0).double()
    assert torch.allclose(h @ h.t(), torch.eye(16, dtype=torch.float64), atol=1e-15)
    g, x = torch.randn(40, 8, dtype=torch.float64), torch.randn(40, 12, dtype=torch.float64)
    hg = apply_hadamard(g.float(), h.float()).double()
    hx = apply_hadamard(x.float(), h.float()).double()
    assert torch.allclose(hg.t() @ hx, g.t() @ x, atol=1e-5)  # rows padded to 48


def test_nvfp4_keeps_the_last_layers_in_bf16_and_each_part_switches():
    from mixprec.engine.convert import convert

    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(5)])
    report = convert(model, "nvfp4")  # the last 2 Linears stay, the head among them
    assert report.converted == ("0", "1", "2")
    assert [f for f, why in report.skipped if "bf16_last_layers" in why] == ["3"]
    assert dict(report.skipped)["4"] == "output head: the last Linear"
    deep = nn.Sequential(*[nn.Linear(32, 32) for _ in range(5)])
    report = convert(deep, "nvfp4,bf16_last_layers=4")
    assert report.converted == ("0",) and len(report.skipped) == 4
    r = Recipe.parse("nvfp4,nvfp4_2d=false,nvfp4_rht=off,nvfp4_sr=0,bf16_last_layers=0")
    q = r.linear
    assert (q.nvfp4_2d, q.nvfp4_rht, q.nvfp4_sr, r.last_layers.bf16_last_layers) == \
        (False,) * 3 + (0,)
    assert Recipe.parse(str(r)) == r
    with pytest.raises(ValueError, match="nvfp4_sr.*use true or false"):
        Recipe.parse("nvfp4,nvfp4_sr=maybe")


def test_bf16_last_fraction_keeps_that_share_of_the_linears_rounded_up():
    """15% of 20 Linears is 3 (the head among them); the larger of the two rules wins;
    the planner prices the same split; bad shares name the field and the valid range."""
    from mixprec.engine.convert import convert
    from mixprec.memory import estimate

    def model():
        return nn.Sequential(*[nn.Linear(32, 32) for _ in range(20)])

    report = convert(model(), "nvfp4,bf16_last_layers=0,bf16_last_fraction=0.15")
    assert report.converted == tuple(str(i) for i in range(17))
    assert [f for f, w in report.skipped if "bf16_last_fraction=0.15" in w] == ["17", "18"]
    assert len(convert(model(), "nvfp4,bf16_last_layers=5,bf16_last_fraction=0.15"
                       ).converted) == 15
    assert len(convert(model(), "nvfp4,bf16_last_layers=2,bf16_last_fraction=0.1"
                       ).converted) == 18  # ceil(2.0) = 2: the rules tie
    r = Recipe.parse("nvfp4,bf16_last_fraction=0.15")
    assert Recipe.parse(str(r)) == r
    m = model()
    by_share = estimate(m, "nvfp4,bf16_last_layers=0,bf16_last_fraction=0.15").total
    assert by_share == estimate(m, "nvfp4,bf16_last_layers=3").total
    assert by_share != estimate(m, "nvfp4,bf16_last_layers=0").total
    for bad in ("1.0", "-0.1", "x"):
        with pytest.raises(ValueError, match="bf16_last_fraction"):
            Recipe.parse(f"nvfp4,bf16_last_fraction={bad}")


@pytest.mark.parametrize("recipe", ["nvfp4", "nvfp4,nvfp4_rht=false,nvfp4_sr=false"])
def test_nvfp4_trains_and_resumes_bit_for_bit(recipe, tmp_path):
    """Stochastic rounding draws from each module's checkpointed (seed, calls), the seed
    fixed by the module's name: a run resumed at step 10 repeats the uninterrupted run's
    losses exactly, and the module names give the same streams in a new engine."""
    g = torch.Generator().manual_seed(0)
    pattern = torch.randint(0, 64, (5,), generator=g)
    batches = []
    for _ in range(20):
        off = torch.randint(0, 5, (8,), generator=g)
        batches.append(pattern[(torch.arange(33)[None] + off[:, None]) % 5])

    def run(part, load=None, save=None):
        torch.manual_seed(0)
        model = tiny_gpt(d_model=64, n_heads=4)
        e = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=3e-3), recipe)
        if load:
            e.load(load)
        losses = []
        for idx in part:
            with e.autocast():
                loss = model(idx[:, :-1], idx[:, 1:])
            e.backward(loss)
            assert not bool(e.step().skipped)
            losses.append(loss.item())
        if save:
            e.save(save)
        return losses

    full = run(batches)
    assert full[-1] < 0.7 * full[0]
    ckpt = tmp_path / "ck.pt"
    assert run(batches[:10], save=ckpt) == full[:10]
    torch.manual_seed(123)  # the global generator plays no part
    assert run(batches[10:], load=ckpt) == full[10:]
