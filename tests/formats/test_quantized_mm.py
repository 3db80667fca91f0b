"""quantized_mm: the quantized GEMM as a function of (operands, format), the same one
QuantizedLinear runs, for every format in the registry."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec.formats.gemm import FORMATS, DelayedScaling
from mixprec.formats.mm import quantized_mm
from mixprec.modules.linear import QuantizedLinear
from mixprec.recipe import Precision, Recipe


def _format(name: str):
    fields = {"fp8_gemm": "dequant_fp32"}
    if name == "nvfp4":
        fields["nvfp4_sr"] = False  # round to nearest: no generator to share
    return FORMATS[name](**fields)


@pytest.mark.parametrize("name", list(FORMATS))
def test_the_function_is_the_linears_gemm_and_the_product_of_the_casts(name):
    fmt = _format(name)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 64, generator=g, requires_grad=True)
    lin = nn.Linear(64, 32, bias=False)
    q = QuantizedLinear.from_linear(lin, Recipe(precision=Precision(compute="fp8"),
                                                linear=fmt))
    y_mod = q(x)
    y_mod.square().sum().backward()
    dx_mod, dw_mod = x.grad.clone(), q.weight.grad.clone()
    x.grad = None
    w = q.weight.detach().clone().requires_grad_(True)
    state = ({k: t for k, (t, _) in fmt.buffers("cpu").items()} if fmt.has_history
             else None)
    y = quantized_mm(x, w, fmt, state=state)
    y.square().sum().backward()
    assert torch.equal(y, y_mod)
    assert torch.equal(x.grad, dx_mod) and torch.equal(w.grad, dw_mod)
    # an independent product of the two casts, in float64
    xq = fmt.cast(x.detach(), "input", 1, state or {}).dequant().double()
    wq = fmt.cast(w.detach(), "weight", 1, state or {}).dequant().double()
    assert torch.allclose(y.double(), xq @ wq.T, rtol=1e-6, atol=1e-5)


def test_a_format_with_history_needs_its_state():
    with pytest.raises(ValueError, match="needs its state; pass state="):
        quantized_mm(torch.randn(4, 16), torch.randn(16, 16), DelayedScaling())


@pytest.mark.parametrize("code_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_dequant_routes_upcast_is_torchs_conversion_bit_for_bit(code_dtype, dtype):
    """``gemm.upcast`` (a table lookup for e4m3 to bf16, torch's ``to`` otherwise) gives every
    one of the 256 codes the bits torch's own ``to`` gives, NaNs included, in the same
    memory layout for row-major and transposed codes."""
    from mixprec.formats.tensor_gemm import upcast

    codes = torch.arange(256, dtype=torch.uint8).repeat(3, 1).view(code_dtype)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    for c in (codes, codes.t(), codes[:, ::3]):
        want, got = c.to(dtype), upcast(c, dtype)
        assert got.stride() == want.stride()
        assert torch.equal(got.view(bits), want.view(bits))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_casts_amax_is_abs_amax_bit_for_bit(dtype):
    """``scaling.abs_max`` (aminmax, no |t| copy) against ``t.abs().amax()``: the same
    bits, with an infinity, and for an all-zero tensor holding -0.0; a NaN gives a
    NaN."""
    from mixprec.formats.scaling import abs_max

    t = torch.randn(9, 40, generator=torch.Generator().manual_seed(0)).to(dtype)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    zeros = torch.zeros(3, 5, dtype=dtype)
    zeros[1, 2] = -0.0
    for case in (t, -t, zeros):
        assert torch.equal(abs_max(case).view(bits), case.abs().amax().view(bits))
    t[1, 3] = -float("inf")
    assert torch.equal(abs_max(t).view(bits), t.abs().amax().view(bits))
    t[4, 4] = float("nan")
    assert abs_max(t).isnan()
