"""The global gradient norm against float64, and the clip rule against torch's."""

from __future__ import annotations

import math

import pytest
import torch

from mixprec.gradnorm import BIG, clip_coef, global_norm


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
