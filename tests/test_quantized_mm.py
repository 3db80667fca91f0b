"""quantized_mm: the quantized GEMM as a function of (operands, format), the same one
QuantizedLinear runs, for every format in the registry."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec.fp8 import FORMATS, QuantizedLinear, quantized_mm
from mixprec.fp8.formats import DelayedScaling
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
