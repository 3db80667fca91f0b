"""The quantized grouped GEMM of mixture-of-experts (``mixprec.experts.grouped_mm``):
the exact route is, expert by expert, bit for bit what a Float8Linear holding that
expert's weight computes (forward, dgrad, wgrad), jagged groups and an expert without
tokens included; the grouped route matches it to fp32 rounding; each format's error
against a float64 product is that format's; torch's fp8 grouped kernel takes the
operands as its meta kernel requires."""

from __future__ import annotations

import pytest
import torch

from helpers.paths import ROOT
from mixprec.experts import ExpertsFormat, grouped_mm
from mixprec.experts import scaled_grouped as sg
from mixprec.modules.linear import Float8Linear

#: the linear formats, NVFP4 rounded to nearest (bitwise comparisons draw no random bits)
FORMATS = ["fp8", "fp8-current", "fp8-rowwise", "fp8-block", "mxfp8", "int8-rowwise",
           "nvfp4,nvfp4_sr=false", "mxfp6"]
COUNTS = [5, 0, 9, 3]  # expert 1 receives no token; one row (17) is routed elsewhere
T, K, N = 18, 64, 32


def _operands(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g)
    w = torch.randn(len(COUNTS), N, K, generator=g) / 8
    gy = torch.randn(T, N, generator=g)
    offs = torch.tensor(COUNTS).cumsum(0)
    return x, w, gy, offs


def _bounds():
    ends = torch.tensor(COUNTS).cumsum(0).tolist()
    return list(zip([0, *ends[:-1]], ends))


def _grouped(recipe, route, x, w, gy, offs):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = grouped_mm(x, w, offs, ExpertsFormat(recipe), route=route)
    y.backward(gy)
    return y.detach(), x.grad, w.grad


def sqnr_db(ref: torch.Tensor, y: torch.Tensor) -> float:
    return (10 * torch.log10(ref.pow(2).sum() / (ref - y).pow(2).sum())).item()


@pytest.mark.parametrize("recipe", FORMATS)
def test_loop_route_is_float8linear_per_expert_bit_for_bit(recipe):
    x, w, gy, offs = _operands()
    y, dx, dw = _grouped(recipe, "loop", x, w, gy, offs)
    for e, (s, end) in enumerate(_bounds()):
        if s == end:
            assert torch.equal(dw[e], torch.zeros_like(dw[e]))  # no token: no gradient
            continue
        lin = Float8Linear(K, N, bias=False, recipe=recipe)
        with torch.no_grad():
            lin.weight.copy_(w[e])
        xe = x[s:end].clone().requires_grad_()
        ye = lin(xe)
        ye.backward(gy[s:end])
        assert torch.equal(y[s:end], ye.detach()), e
        assert torch.equal(dx[s:end], xe.grad), e
        assert torch.equal(dw[e], lin.weight.grad), e
    assert torch.equal(y[17:], torch.zeros(1, N)) and torch.equal(dx[17:], torch.zeros(1, K))


@pytest.mark.parametrize("recipe", FORMATS)
def test_grouped_route_matches_the_loop(recipe):
    x, w, gy, offs = _operands(1)
    loop = _grouped(recipe, "loop", x, w, gy, offs)
    grouped = _grouped(recipe, "grouped", x, w, gy, offs)
    for a, b in zip(loop, grouped):  # the same products; one fp32 rounding apart
        torch.testing.assert_close(b, a, rtol=2e-5, atol=2e-5 * a.abs().max().item())
    assert torch.equal(grouped[2][1], torch.zeros(N, K))


@pytest.mark.parametrize("recipe", FORMATS)
def test_grouped_route_keeps_every_row_past_a_whole_stride_of_expert_rows(recipe):
    """16 rows go to the experts (a multiple of the 4-row stride) and 2 elsewhere: the
    output and the input gradient keep all 18 rows, the last two zero, as the loop's."""
    x, w, gy, _ = _operands(5)
    offs = torch.tensor([4, 4, 12, 16])
    loop = _grouped(recipe, "loop", x, w, gy, offs)
    grouped = _grouped(recipe, "grouped", x, w, gy, offs)
    for a, b in zip(loop[:2], grouped[:2]):
        assert b.shape == (T, a.shape[1]) and torch.equal(b[16:], torch.zeros_like(b[16:]))
        torch.testing.assert_close(b, a, rtol=2e-5, atol=2e-5 * a.abs().max().item())


@pytest.mark.parametrize("recipe,lo,hi", [
    ("fp8", 24, 38), ("fp8-current", 24, 38), ("fp8-rowwise", 24, 38),
    ("fp8-block", 24, 38), ("mxfp8", 24, 38), ("nvfp4", 12, 30), ("mxfp6", 18, 26)])
def test_each_format_has_its_own_error(recipe, lo, hi):
    """Against a float64 product: e4m3's ~3 significant bits give ~28 dB, e3m2's ~23,
    e2m1's ~17 dB (more on a few rows); bf16 (~50 dB here) would fail the upper bound
    (and e4m3 MXFP8's, 27 dB and more, MXFP6's)."""
    x, w, gy, offs = _operands(2)
    y, dx, dw = _grouped(recipe, "auto", x, w, gy, offs)
    xd, wd, gd = x.double(), w.double(), gy.double()
    for e, (s, end) in enumerate(_bounds()):
        if s == end:
            continue
        assert lo <= sqnr_db(xd[s:end] @ wd[e].T, y[s:end].double()) <= hi, e
        assert lo - 3 <= sqnr_db(gd[s:end] @ wd[e], dx[s:end].double()) <= hi, e
        assert lo - 3 <= sqnr_db(gd[s:end].T @ xd[s:end], dw[e].double()) <= hi, e


def test_per_tensor_scales_are_per_expert():
    """fp8-current scales each expert's slice on its own: an expert whose tokens are
    1000x smaller keeps its precision (one scale for all would flush it)."""
    x, w, gy, offs = _operands(3)
    x[14:17] *= 1e-3  # expert 3's rows
    y, _, _ = _grouped("fp8-current", "loop", x, w, gy, offs)
    ref = x[14:17].double() @ w[3].double().T
    assert sqnr_db(ref, y[14:17].double()) > 24


def test_delayed_scaling_records_one_history_per_projection():
    x, w, gy, offs = _operands(4)
    fmt = ExpertsFormat("fp8")
    xg = x.clone().requires_grad_()
    grouped_mm(xg, w, offs, fmt).backward(gy)
    hist = fmt.fp8_amax_history[:, 0]
    rows = [slice(s, e) for s, e in _bounds() if s != e]
    want_x = max(x[r].abs().max() for r in rows)  # max over the experts' own rows
    want_w = max(w[e].abs().max() for e, (s, end) in enumerate(_bounds()) if s != end)
    want_g = max(gy[r].abs().max() for r in rows)
    assert torch.equal(hist, torch.stack([want_x, want_w, want_g]))
    with torch.no_grad():  # an evaluation records nothing
        grouped_mm(x * 10, w, offs, fmt)
    assert torch.equal(fmt.fp8_amax_history[:, 0], hist)


def test_bad_operands_are_named():
    x, w, _, offs = _operands()
    with pytest.raises(ValueError, match="weight.transpose"):
        grouped_mm(x, w.transpose(1, 2)[:, :, :N], offs, ExpertsFormat("fp8"))
    with pytest.raises(ValueError, match="non-decreasing"):
        grouped_mm(x, w, torch.tensor([5, 3, 9, 12]), ExpertsFormat("fp8"))
    with pytest.raises(ValueError, match="route='fast'"):
        grouped_mm(x, w, offs, ExpertsFormat("fp8"), route="fast")


@pytest.mark.parametrize("recipe", ["fp8", "fp8-current", "fp8-rowwise"])
def test_scaled_grouped_route_against_torch_meta_kernel(recipe):
    """The CUDA route's call (codes, per-row and per-column scales, column-major
    weights, int32 offsets) checked by torch's own meta kernel for _scaled_grouped_mm."""
    fmt = ExpertsFormat(recipe, device="meta")
    x = torch.empty(T, K, device="meta")
    w = torch.empty(len(COUNTS), N, K, device="meta")
    y = grouped_mm(x, w, torch.tensor(COUNTS).cumsum(0), fmt, route="scaled_grouped",
                   out_dtype=torch.bfloat16)
    assert y.shape == (T, N) and y.dtype == torch.bfloat16 and y.device.type == "meta"


@pytest.mark.parametrize("recipe", ["fp8", "fp8-current", "fp8-rowwise"])
def test_grouped_route_on_cuda_passes_bf16_codes_as_torch_meta_kernel_requires(
        recipe, monkeypatch):
    """Forward, dgrad and wgrad of the grouped route on a device whose grouped kernel
    takes bf16 only (torch's meta kernel mirrors the CUDA one and refuses fp32)."""
    calls = []
    real = torch._grouped_mm

    def spy(a, b, **kw):
        calls.append((a.dtype, b.dtype))
        return real(a, b, **kw)

    monkeypatch.setattr(torch, "_grouped_mm", spy)
    fmt = ExpertsFormat(recipe, device="meta")
    x = torch.empty(T, K, device="meta", requires_grad=True)
    w = torch.empty(len(COUNTS), N, K, device="meta", requires_grad=True)
    y = grouped_mm(x, w, torch.tensor(COUNTS).cumsum(0), fmt, route="grouped",
                   out_dtype=torch.bfloat16)
    y.backward(torch.empty(T, N, device="meta", dtype=torch.bfloat16))
    assert calls == [(torch.bfloat16, torch.bfloat16)] * 3
    assert x.grad.shape == (T, K) and w.grad.shape == (len(COUNTS), N, K)


@pytest.mark.parametrize("recipe", ["fp8", "fp8-current", "fp8-rowwise"])
def test_grouped_route_on_bf16_codes_is_the_dequant_loop(recipe, monkeypatch):
    """The bf16-codes grouped GEMM, run on the CPU, against the loop on the ``dequant``
    route (bf16 GEMM of the codes, scales after): forward and dgrad bit for bit; wgrad,
    which the loop accumulates into fp32, within one bf16 rounding."""
    from mixprec.experts import grouped as gr

    x, w, gy, offs = (t.bfloat16() if t.is_floating_point() else t for t in _operands(2))
    r = f"{recipe},fp8_gemm=dequant"
    loop = _grouped(r, "loop", x, w, gy, offs)
    monkeypatch.setattr(gr, "bf16_only", lambda d: True)
    grouped = _grouped(r, "grouped", x, w, gy, offs)
    assert torch.equal(grouped[0], loop[0]) and torch.equal(grouped[1], loop[1])
    torch.testing.assert_close(grouped[2].float(), loop[2].float(), rtol=2 ** -7,
                               atol=2 ** -8 * loop[2].abs().max().item())
    assert torch.equal(grouped[2][1], torch.zeros(N, K, dtype=torch.bfloat16))


def test_auto_route_per_device(monkeypatch):
    from mixprec.experts.grouped import _route

    fmt = ExpertsFormat("mxfp8")
    assert _route("auto", fmt, torch.device("cpu"), 64, 32) == "loop"
    assert _route("grouped", fmt, torch.device("cpu"), 64, 32) == "grouped"
    with pytest.warns(UserWarning, match="N=30 must be multiples of 4"):  # strides
        assert _route("grouped", fmt, torch.device("cpu"), 64, 30) == "loop"
    # on CUDA the grouped kernel takes bf16 only: block formats loop, and K, N need 8
    with pytest.warns(UserWarning, match="bf16 operands only"):
        assert _route("grouped", fmt, torch.device("cuda"), 64, 32) == "loop"
    assert _route("auto", fmt, torch.device("cuda"), 64, 32) == "loop"
    monkeypatch.setattr(sg, "_capability", lambda d: (8, 0))
    rowwise = ExpertsFormat("fp8-rowwise")
    assert _route("auto", rowwise, torch.device("cuda"), 64, 32) == "grouped"
    assert _route("auto", rowwise, torch.device("cuda"), 64, 36) == "loop"
    monkeypatch.setattr(sg, "_capability", lambda d: (9, 0))
    monkeypatch.setattr(ExpertsFormat, "backend", lambda self, d: "scaled_mm")
    assert _route("auto", ExpertsFormat("fp8"), torch.device("cuda"), 64, 32) == \
        "scaled_grouped"


def test_scaled_grouped_applies_only_where_torch_has_the_kernel(monkeypatch):
    monkeypatch.setattr(sg, "_capability", lambda d: (9, 0))
    monkeypatch.setattr(ExpertsFormat, "backend", lambda self, d: "scaled_mm")
    assert sg.scaled_grouped_applies(ExpertsFormat("fp8-rowwise"), "cuda", 64, 32)
    assert not sg.scaled_grouped_applies(ExpertsFormat("fp8-rowwise"), "cuda", 64, 24)
    assert not sg.scaled_grouped_applies(ExpertsFormat("mxfp8"), "cuda", 64, 32)
    assert sg.scaled_grouped_applies(ExpertsFormat("fp8"), "cuda", 64, 32)
    # torch builds the kernel for majors 9 and 10 only (GroupedBlas.cpp's
    # _scaled_mm_allowed_device(sm90_only, sm100_only)): sm89 and sm120 fall back
    for cap, ok in [((8, 9), False), ((9, 0), True), ((10, 0), True), ((10, 3), True),
                    ((12, 0), False), ((11, 0), False)]:
        monkeypatch.setattr(sg, "_capability", lambda d, cap=cap: cap)
        assert sg.scaled_grouped_applies(ExpertsFormat("fp8"), "cuda", 64, 32) is ok, cap
    monkeypatch.setattr(sg, "_capability", lambda d: (12, 0))
    assert "9.x and 10.x only, not compute capability 12.0" in sg.scaled_grouped_refusal(
        ExpertsFormat("fp8"), "cuda", 64, 32)
    monkeypatch.undo()
    assert sg._capability(torch.device("cpu")) is None  # off CUDA: no capability
    assert not sg.scaled_grouped_applies(ExpertsFormat("fp8"), "cpu", 64, 32)


def test_sm120_falls_back_to_the_grouped_route(monkeypatch):
    """On compute capability 12.0, where torch refuses its fp8 grouped kernel, ``auto``
    takes ``grouped``; an explicit ``scaled_grouped`` says why, once, and does too."""
    import warnings

    from mixprec.experts.grouped import _route

    monkeypatch.setattr(sg, "_capability", lambda d: (12, 0))
    monkeypatch.setattr(ExpertsFormat, "backend", lambda self, d: "scaled_mm")
    fmt = ExpertsFormat("fp8-current")
    assert _route("auto", fmt, torch.device("cuda"), 64, 32) == "grouped"
    with pytest.warns(UserWarning, match="scaled_grouped.*cannot apply.*12.0.*the "
                                         "grouped route runs instead"):
        assert _route("scaled_grouped", fmt, torch.device("cuda"), 64, 48) == "grouped"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the second call says nothing
        assert _route("scaled_grouped", fmt, torch.device("cuda"), 64, 48) == "grouped"


def test_the_guides_own_moe_example_runs_and_trains_under_the_engine():
    """docs/guides/moe.md's module, as a user copies it, under an engine whose step
    updates its delayed scaling like a Float8Linear's."""
    import re

    from mixprec import MixedPrecision

    page = (ROOT / "docs" / "guides" / "moe.md").read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", page, re.S) if "class MoE" in b)
    ns: dict = {}
    exec(code, ns)
    moe = ns["moe"]
    assert moe.up.grad is not None and moe.up.grad.abs().sum() > 0
    model = ns["MoE"](recipe="fp8")
    engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp8")
    assert model.up_fmt in engine.fp8_modules and model.down_fmt in engine.fp8_modules
    assert engine.coverage.shares("experts") == {"fp8": 1.0}
    assert engine.coverage.low_precision_share > 0.9
    x = torch.randn(32, 64)
    with engine.autocast():
        loss = model(x).float().square().mean()
    engine.backward(loss)
    engine.step()
    assert model.up_fmt.fp8_scale[0] != 1  # the step turned the recorded amax into a scale


def test_fp32_weights_leave_the_experts_scaling_state_out():
    from mixprec import MixedPrecision

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 32, 64))
            self.w_fmt = ExpertsFormat("fp8")

    model = Holder()
    engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp8")
    assert set(engine.fp32_state_dict()) == {"w"}
    assert "w_fmt.fp8_amax_history" in model.state_dict()


@pytest.mark.parametrize("route", ["loop", "grouped", "auto"])
@pytest.mark.parametrize("recipe", FORMATS)
def test_a_dispatch_that_reaches_no_expert_gives_zeros(recipe, route):
    """No token at all, or every token routed past the last expert (as expert
    parallelism leaves a rank): the output and the input's gradient are zero rows, every
    expert's weight gradient zero. The CUDA routes are checked in
    ``test_experts_cuda_layouts`` (routings "all elsewhere" and "no tokens")."""
    for t in (0, 3):
        x = torch.randn(t, K, requires_grad=True)
        w = torch.randn(len(COUNTS), N, K, requires_grad=True)
        y = grouped_mm(x, w, torch.zeros(len(COUNTS), dtype=torch.int64),
                       ExpertsFormat(recipe), route=route)
        y.backward(torch.ones_like(y))
        assert y.shape == (t, N) and torch.equal(y, torch.zeros(t, N))
        assert torch.equal(x.grad, torch.zeros(t, K))
        assert torch.equal(w.grad, torch.zeros_like(w))


def test_the_scaled_grouped_forward_of_no_token_passes_the_meta_kernel():
    fmt = ExpertsFormat("fp8-current", device="meta")
    x = torch.empty(0, K, device="meta")
    w = torch.empty(len(COUNTS), N, K, device="meta")
    y = grouped_mm(x, w, torch.zeros(len(COUNTS), dtype=torch.int32), fmt,
                   route="scaled_grouped", out_dtype=torch.bfloat16)
    assert y.shape == (0, N) and y.dtype == torch.bfloat16
