"""The CUDA GEMM calls, checked on any machine against torch's own meta kernels
(``device="meta"``): the shapes, dtypes, strides and scale layouts that
``torch._scaled_mm`` accepts, for token counts that are not multiples of 16. A GPU runs
the same calls; here only their signatures are checked, not their numbers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec.fp8 import Float8Linear
from mixprec.fp8.gemm import fp8_gemm

ROUTES = ["fp8,fp8_gemm=scaled_mm", "fp8-current,fp8_gemm=scaled_mm",
          "fp8-rowwise,fp8_gemm=scaled_mm", "fp8,fp8_format=e4m3,fp8_gemm=scaled_mm"]


def test_the_meta_kernel_refuses_a_contraction_of_30():
    """The control: torch's checks run on meta tensors, so these tests can fail."""
    a = torch.empty(64, 30, dtype=torch.float8_e4m3fn, device="meta")
    b = torch.empty(48, 30, dtype=torch.float8_e4m3fn, device="meta").t()
    one = torch.empty((), device="meta")
    with pytest.raises(RuntimeError, match="divisible by 16"):
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


@pytest.mark.parametrize("tokens", [1, 30, 1000])
@pytest.mark.parametrize("recipe", ROUTES)
def test_float8_linear_forward_and_backward_pass_the_meta_kernels(recipe, tokens):
    """Forward ``x @ wᵀ`` (K = in), dgrad ``g @ w`` (K = out) and wgrad ``gᵀ @ x``
    (K = tokens: padded with zero rows to a multiple of 16)."""
    f8 = Float8Linear.from_linear(nn.Linear(64, 48), recipe).to("meta")
    assert f8.backend == "scaled_mm"
    x = torch.empty(tokens, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    y = f8(x)
    y.sum().backward()
    assert (y.shape, y.dtype) == ((tokens, 48), torch.bfloat16)
    assert (x.grad.shape, x.grad.dtype) == ((tokens, 64), torch.bfloat16)
    assert (f8.weight.grad.shape, f8.weight.grad.dtype) == ((48, 64), torch.float32)


@pytest.mark.parametrize("m, k, n", [(30, 64, 48), (48, 30, 64), (64, 1000, 40), (1, 17, 1)])
@pytest.mark.parametrize("rowwise", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_fp8_gemm_pads_any_shape_for_the_meta_kernel(m, k, n, rowwise, out_dtype):
    a = torch.empty(m, k, dtype=torch.float8_e4m3fn, device="meta")
    b = torch.empty(k, n, dtype=torch.float8_e5m2, device="meta")
    ia = torch.empty(m, 1, device="meta") if rowwise else torch.empty((), device="meta")
    ib = torch.empty(1, n, device="meta") if rowwise else torch.empty((), device="meta")
    y = fp8_gemm(a, b, ia, ib, out_dtype, "scaled_mm")
    assert (y.shape, y.dtype) == ((m, n), out_dtype)


def test_padding_changes_no_number_on_the_cpu_reference_kernel():
    """The same padded call on CPU ``_scaled_mm`` (a slow reference kernel) against the
    dequantizing fp32 route: K = 30 tokens, N = 40."""
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(24, 30, generator=g) * 8).to(torch.float8_e4m3fn)
    b = (torch.randn(30, 40, generator=g) * 8).to(torch.float8_e4m3fn)
    ia, ib = torch.tensor(0.5), torch.tensor(0.25)
    try:
        got = fp8_gemm(a, b, ia, ib, torch.float32, "scaled_mm")
    except (RuntimeError, NotImplementedError) as e:  # a build without the CPU kernel
        pytest.skip(f"no CPU _scaled_mm here: {e}")
    want = fp8_gemm(a, b, ia, ib, torch.float32, "dequant_fp32")
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-5)
