"""The peak each ``mixprec bench`` row divides by: the GEMMs the recipe really runs,
under its own precision settings, on the routes its Linears take.

The GEMM timers are replaced by fixed rates (by dtype and the fp32 precision in force
when timed, or by route), so the expected peaks are exact numbers; the routes are the
ones ``engine.kernels`` reports, replaced here by an sm90 GPU's (tensorwise and rowwise
``_scaled_mm``, MX falling back to the dequantizing fp32 GEMM)."""

from __future__ import annotations

import pytest
import torch

import mixprec.engine.devices as k
from mixprec.engine.devices import EMULATE_ENV, KernelChoices
from mixprec.recipe.linear_format import quantizer_for
from mixprec.workbench import peaks
from mixprec.workbench.bench import bench, format_table
from mixprec.workbench.model import SIZES

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

FP32, TF32, BF16 = 100.0, 400.0, 1000.0


@pytest.fixture
def fp32_rate_by_precision(monkeypatch):
    """The matmul timer reads fp32 at TF32's rate where TF32 is on for cuBLAS when it
    runs, else at IEEE's; the readings' caches are emptied before and after."""
    def clear():
        for cached in (k.matmul_gflops, k._speed_reading, k._route_reading):
            cached.cache_clear()

    def rate(dev, dtype, n, seconds):
        if dtype == torch.float32:
            return TF32 if torch.backends.cuda.matmul.fp32_precision == "tf32" else FP32
        return {torch.bfloat16: BF16, torch.float16: 50.0}[dtype]

    clear()
    monkeypatch.setattr(k, "_gflops", rate)
    saved = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(saved)
    clear()


def _peaks(recipes) -> dict[str, float]:
    out = bench(recipes, size="tiny", batch=2, seq=16, steps=1, warmup=0)
    return {x["recipe"]: x["peak_gflops"] for x in out["rows"]}


def test_the_tf32_row_is_measured_with_tf32_on(fp32_rate_by_precision):
    assert _peaks(["fp32", "tf32"]) == {"fp32": FP32, "tf32": TF32}


def test_rows_follow_the_users_setting_except_where_mixprec_pins_ieee(
        fp32_rate_by_precision):
    """A script's ``set_float32_matmul_precision("high")``: fp32 runs TF32 too, while
    emulation pins IEEE fp32 for its exact GEMMs."""
    torch.set_float32_matmul_precision("high")
    assert _peaks(["fp32", "tf32", "bf16,emulate=true"]) == {
        "fp32": TF32, "tf32": TF32, "bf16,emulate=true": FP32}
    assert torch.get_float32_matmul_precision() == "high"


# an sm90 GPU's routes, as engine.kernels reports them
SM90 = {"delayed": "scaled_mm", "current": "scaled_mm", "rowwise": "scaled_mm",
        "mx": "dequant_fp32"}
ROUTE_RATE = {"scaled_mm": 5000.0, "dequant": 2000.0, "dequant_fp32": 100.0}
DENSE_RATE = {"bf16": BF16, "fp32": FP32, "ieee": FP32, "tf32": TF32}


@pytest.fixture
def sm90_routes(monkeypatch):
    """Rates by route and dense kind; engine.kernels reporting sm90's routes; the
    other layers of fp8 recipes in bf16 (MIXPREC_EMULATE=off) on any CPU."""
    timed = []

    def fp8_rate(device, quantizer, route, out_dtype):
        timed.append((quantizer.name, route, out_dtype))
        return ROUTE_RATE[route]

    monkeypatch.setenv(EMULATE_ENV, "off")
    monkeypatch.setattr(KernelChoices, "gemm_for", lambda self, scaling: SM90[scaling])
    monkeypatch.setattr(peaks, "fp8_gflops", fp8_rate)
    monkeypatch.setattr(peaks, "dense_gflops", lambda device, kind: DENSE_RATE[kind])
    return timed


def _expected(tokens: int, converted: dict[str, str]) -> float:
    """The FLOP-weighted peak of the tiny GPT's step, from its shapes: each converted
    Linear ``6·in·out`` FLOPs per token at its route's rate, the rest in bf16."""
    c = SIZES["tiny"]
    d, f = c.d_model, c.ffn_mult * c.d_model
    shapes = {"qkv": (d, 3 * d), "proj": (d, d), "fc": (d, f), "out": (f, d)}
    total = c.flops_per_token() * tokens
    time = 0.0
    linear = 0
    for i in range(c.n_layers):
        for name, (a, b) in shapes.items():
            flops = 6 * a * b * tokens
            time += flops / ROUTE_RATE[converted.get(f"blocks.{i}.{name}", converted["*"])]
            linear += flops
    return total / (time + (total - linear) / BF16)


def test_fp8_rows_are_measured_against_the_routes_their_linears_take(sm90_routes):
    out = bench(["fp8", "mxfp8", "fp8-current,layer:blocks.0.fc=mxfp8"], size="tiny",
                batch=2, seq=16, steps=1, warmup=0)
    got = {x["recipe"]: x["peak_gflops"] for x in out["rows"]}
    tokens = 2 * 16
    assert got["fp8"] == pytest.approx(_expected(tokens, {"*": "scaled_mm"}), rel=1e-12)
    assert got["mxfp8"] == pytest.approx(_expected(tokens, {"*": "dequant_fp32"}),
                                         rel=1e-12)
    assert got["fp8-current,layer:blocks.0.fc=mxfp8"] == pytest.approx(
        _expected(tokens, {"*": "scaled_mm", "blocks.0.fc": "dequant_fp32"}), rel=1e-12)
    # each GEMM timed once, its forward's output dtype (bf16 around the Linears)
    assert sorted(set(sm90_routes)) == sorted(sm90_routes) and set(sm90_routes) == {
        ("delayed", "scaled_mm", torch.bfloat16), ("mx", "dequant_fp32", torch.bfloat16),
        ("current", "scaled_mm", torch.bfloat16)}
    table = format_table(out)
    assert ("peak mxfp8: bf16 1000 GFLOP/s for 26% of the FLOPs, mx dequant_fp32 100 "
            "GFLOP/s for 74% of the FLOPs") in table.splitlines()


def test_a_recipe_alone_is_measured_on_its_own_route_on_cuda(sm90_routes):
    """Without a model, an fp8 recipe's peak is its own scaling's GEMM on the reported
    route: MX's dequantizing fp32 GEMM on sm90, not the tensorwise ``_scaled_mm``, and
    rowwise's own ``_scaled_mm`` (fp32 out where the rest runs in fp32)."""
    rest_fp32 = KernelChoices(emulate=False, fp8_gemm="unused", fp8_rest="fp32")
    rest_bf16 = KernelChoices(emulate=False, fp8_gemm="unused", fp8_rest="bf16")
    assert peaks.peak_gflops("cuda", "mxfp8", rest_bf16) == ROUTE_RATE["dequant_fp32"]
    assert peaks.peak_gflops("cuda", "fp8-rowwise", rest_fp32) == ROUTE_RATE["scaled_mm"]
    assert sm90_routes == [("mx", "dequant_fp32", torch.bfloat16),
                           ("rowwise", "scaled_mm", torch.float32)]
    assert peaks.peak_gflops("cuda", "tf32") == TF32


def test_the_route_timers_run_each_route_here():
    """The real timers (no replacement) on this CPU: the tensorwise ``_scaled_mm`` and
    MX's dequantizing fp32 GEMM, each a positive rate, the fp32 precision as it was."""
    before = (torch.get_float32_matmul_precision(),
              torch.backends.mkldnn.matmul.fp32_precision)
    for recipe, route in (("fp8", "scaled_mm"), ("mxfp8", "dequant_fp32")):
        assert peaks.fp8_gflops("cpu", quantizer_for(recipe), route, torch.bfloat16) > 0
    assert (torch.get_float32_matmul_precision(),
            torch.backends.mkldnn.matmul.fp32_precision) == before


def test_a_route_whose_gemm_fails_shows_in_its_row_and_spares_the_others(sm90_routes,
                                                                          monkeypatch):
    """A route reported as taken whose kernel this device lacks (MX's sm100 kernel on
    sm90): that row's peak reads NaN and says why; the other rows keep theirs."""
    monkeypatch.setattr(KernelChoices, "gemm_for", lambda self, scaling: "scaled_mm")

    def fp8_rate(device, quantizer, route, out_dtype):
        if quantizer.name == "mx":
            raise RuntimeError("no MXFP8 kernel on this device\nmore")
        return ROUTE_RATE[route]

    monkeypatch.setattr(peaks, "fp8_gflops", fp8_rate)
    out = bench(["mxfp8", "fp8"], size="tiny", batch=2, seq=16, steps=1, warmup=0)
    mx, fp8 = out["rows"]
    assert mx["peak_gflops"] != mx["peak_gflops"]  # NaN
    assert fp8["peak_gflops"] == pytest.approx(_expected(32, {"*": "scaled_mm"}), rel=1e-12)
    assert ("peak mxfp8: bf16 1000 GFLOP/s for 26% of the FLOPs, mx scaled_mm failed "
            "(RuntimeError: no MXFP8 kernel on this device) for 74% of the FLOPs"
            ) in format_table(out).splitlines()
