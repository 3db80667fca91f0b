"""keep_fp32=...+attention_backward: SDPA's backward in fp32 on the CPU, against float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mixprec import precision_context
from mixprec.formats.elements import ulp

KEEP = "keep_fp32=layer_norm+softmax+loss+attention_backward"


def _qkv(t, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, t, 64, generator=g) for _ in range(4)]


def _grads(recipe, q0, k0, v0, go):
    q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
    with precision_context(recipe, "cpu"):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(go.to(out.dtype))
    return out, q.grad, k.grad, v.grad


def test_fp32_backward_is_closer_to_float64_and_the_forward_is_unchanged():
    """T=2048: the bf16 kernel accumulates dK/dV in bf16 buffers block by block; the fp32
    backward stays near the bound that rounding float64 to bf16 sets."""
    q0, k0, v0, go = _qkv(2048)  # real kernels on any chip: they are what is compared
    out_bf, *g_bf = _grads("bf16,emulate=false", q0, k0, v0, go)
    out_32, *g_32 = _grads(f"bf16,emulate=false,{KEEP}", q0, k0, v0, go)
    assert torch.equal(out_bf, out_32)                           # same forward kernel
    qd, kd, vd = (t.to(torch.bfloat16).double().requires_grad_() for t in (q0, k0, v0))
    F.scaled_dot_product_attention(qd, kd, vd, is_causal=True).backward(
        go.to(torch.bfloat16).double())
    for a, b, ref in zip(g_bf, g_32, (qd.grad, kd.grad, vd.grad)):
        err_bf = ((a.double() - ref).norm() / ref.norm()).item()
        err_32 = ((b.double() - ref).norm() / ref.norm()).item()
        bound = ((ref.to(torch.bfloat16).double() - ref).norm() / ref.norm()).item()
        assert err_32 < 1.25 * bound < err_bf, (err_32, bound, err_bf)


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_emulation_reproduces_it(fmt):
    """Emulated (fp32 carrier) against real kernels: the backward is the same fp32 kernel
    on the same values, so what differs comes only from the forward's model
    (mixprec.engine.emulate_attention, >= 99% bit-identical): >= 99% of every gradient
    bit-identical here and >= 99.9% within 1 ulp (measured: 99.7% and 99.99%)."""
    q0, k0, v0, go = _qkv(200, seed=1)
    go = go.to(torch.bfloat16 if fmt == "bf16" else torch.float16).float()  # on the grid
    real = _grads(f"{fmt},emulate=false,{KEEP}", q0, k0, v0, go)
    emulated = _grads(f"{fmt},emulate=true,{KEEP}", q0, k0, v0, go)
    for e, r in zip(emulated, real):
        r = r.float()
        assert e.dtype == torch.float32
        assert (e == r).float().mean() >= 0.99
        assert ((e - r).abs() <= ulp(r, fmt)).float().mean() >= 0.999


def test_only_the_plain_case_is_taken_and_only_when_asked():
    q, k, v = (t.requires_grad_() for t in _qkv(64)[:3])
    mask = torch.ones(64, 64, dtype=torch.bool).tril()
    with precision_context("bf16,emulate=false", "cpu"):        # default: torch's kernel
        assert "_Attention" not in type(F.scaled_dot_product_attention(q, k, v).grad_fn).__name__
    with precision_context(f"bf16,emulate=false,{KEEP}", "cpu"):
        assert type(F.scaled_dot_product_attention(q, k, v).grad_fn).__name__ == \
            "_AttentionBackward"
        masked = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # a mask: torch's
        assert "_Attention" not in type(masked.grad_fn).__name__
        with torch.no_grad():                                    # evaluation: torch's
            assert F.scaled_dot_product_attention(q, k, v).dtype == torch.bfloat16
