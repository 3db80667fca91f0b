"""The global gradient norm against float64 (16-bit gradients in fp32, in pieces), and
the clip rule against torch's."""

from __future__ import annotations

import math

import pytest
import torch

from mixprec.engine.gradnorm import BIG, PIECE, clip_coef, global_norm, torch_norm
from mixprec.memory import high_water


@pytest.mark.parametrize("cpu_fp32", [True, False])
def test_global_norm_against_float64(cpu_fp32):
    """Large tensors (own dot) and small ones (one _foreach_norm) together."""
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(BIG + 5, generator=g) * 3, torch.randn(7, 9, generator=g),
             torch.randn(BIG * 2, generator=g) * 1e-3] + [torch.randn(3, generator=g)] * 40
    want = math.sqrt(sum(float((t.double() ** 2).sum()) for t in grads))
    got = global_norm(grads, torch.device("cpu"), cpu_fp32)
    assert got.dtype == torch.float32 and got.item() == pytest.approx(want, rel=1e-6)
    assert global_norm([], torch.device("cpu"), cpu_fp32).item() == 0.0


@pytest.mark.parametrize("bad", [math.inf, math.nan, 1e30])  # 1e30² overflows fp32
def test_global_norm_is_not_finite_for_any_bad_gradient(bad):
    grads = [torch.ones(BIG + 1), torch.ones(5)]
    grads[1][2] = bad
    for cpu_fp32 in (True, False):
        assert not torch.isfinite(global_norm(grads, torch.device("cpu"), cpu_fp32))


def test_clip_coef_matches_torch_clip_grad_norm():
    g = torch.Generator().manual_seed(1)
    for max_norm in (0.1, 1.0, 1e3):
        params = [torch.nn.Parameter(torch.zeros(50, 3)), torch.nn.Parameter(torch.zeros(4))]
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        ours = [p.grad.clone() for p in params]
        norm = global_norm(ours, torch.device("cpu"), True)
        torch._foreach_mul_(ours, clip_coef(norm, max_norm))
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        for a, p in zip(ours, params):
            torch.testing.assert_close(a, p.grad, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_cpu_gradients_are_normed_in_fp32_pieces(dtype):
    """A 16-bit gradient of 40.5 pieces (an embedding's, say) beside small ones: both
    norms within 1e-5 of float64, holding at most one piece's fp32 copy (256 KiB), not
    the whole tensor's (10 MiB here; 128 MiB for an embedding of 32M). The whole
    tensor's fp32 norm also erred by 6e-5 at this size."""
    g = torch.Generator().manual_seed(2)
    grads = [(torch.randn(PIECE * 81 // 2 + 7, generator=g) * 3).to(dtype),
             torch.randn(7, 9, generator=g).to(dtype), torch.randn(3, generator=g)]
    want = math.sqrt(sum(float((t.double() ** 2).sum()) for t in grads))
    for norm in (lambda: global_norm(grads, torch.device("cpu")), lambda: torch_norm(grads)):
        got = norm()
        assert got.dtype == torch.float32 and got.item() == pytest.approx(want, rel=1e-5)
        assert high_water(norm) <= 4 * PIECE + 4096
