"""A numerical model of torch's CPU flash-attention kernel in half precision.

A real bf16/fp16 ``scaled_dot_product_attention`` on the CPU does not compute in fp32
and round once at the end: it rounds *inside*. Emulating it as one fp32 attention with
a rounded output disagrees with it by more than 1 ulp in about a quarter of the
gradient elements of a small GPT. This module reproduces where the kernel rounds, in
fp32 arithmetic on values that already hold the format's numbers:

forward, per key block of 512 (online softmax across blocks):
  ``S = (q @ kᵀ) · scale`` in fp32; ``E = exp(S − rowmax)`` with the kernel's fast
  exponential (below); row sums from the fp32 ``E``; ``P = round(E)`` to the format
  *before* ``P @ v``; ``out = round(Σ P v · (1 / Σ E))``; ``lse = max + log Σ E``.
backward, per query block (32, 64 or 256 rows by sequence length) and key block:
  ``A = exp(scale · q kᵀ − lse)`` (accurate exp); ``dV += round(A)ᵀ dO``;
  ``dS = A ⊙ (dO vᵀ − rowsum(dO ⊙ out))`` rounded to the format; ``dQ += scale · dS k``,
  ``dK += scale · dSᵀ q``. The three gradients are half-precision buffers, so every
  ``+=`` rounds: dK and dV once per query block, dQ once per key block.

The fast exponential is the kernel's degree-3 polynomial bit trick (Malossi et al.,
"Fast exponential computation on SIMD architectures"), applied to the vectorized
multiple-of-16 prefix of each row block (8 on AVX2 builds); the rest of the row uses
an accurate exp. Its error is ~1e-4 relative (``fast_exp(0) = 0.99994659``), far above
fp32 rounding, so it decides where ``P`` rounds; without it only ~90% of outputs match
exactly. Measured against torch 2.13's kernel on an AVX-512 CPU: >= 99% of outputs and
gradients bit-identical, >= 99.5% within 1 ulp, bf16 and fp16, sequences of 40 to 1100
(tests/engine/test_emulate_attention.py). Other torch versions may round elsewhere.

Modelled: causal or not, additive masks (bool masks reach the kernel as 0 / -inf).
Dropout and unequal head counts (GQA) fall back to EmulationMode's generic rule
(output rounded once).
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import torch

__all__ = ["fast_exp", "flash_attention_forward", "flash_attention_backward", "modelled"]

_KV_SPLIT = 512
# fp32 lanes of the vector unit torch's kernels were dispatched for: the stride of the
# kernel's vectorized loop, which uses the fast exp; 0 where the fast exp is not the
# x86 one modelled here (other CPUs: accurate exp everywhere, as far as modelled).
_VEC = {"AVX512": 16, "AVX2": 8}.get(torch.backends.cpu.get_cpu_capability(), 0)


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


_LOG2E = _f32(0x3FB8AA3B)  # log2(e) in fp32
_LN_FLT_MIN = _f32(0xC2AEAC50)  # ln(FLT_MIN) ≈ -87.34
_LN_FLT_MAX = _f32(0x42B17218)  # ln(FLT_MAX) ≈ 88.72
# 2^frac ≈ 1 + frac - p(frac): the polynomial's coefficients, rounded to fp32
_P = [float(torch.tensor(c, dtype=torch.float32)) for c in
      (1.0703434948458272e-4, 0.30354260500649682, -0.22433836478672356,
       -0.079204240219773236)]


def fast_exp(x: torch.Tensor) -> torch.Tensor:
    """The kernel's fast ``exp`` for fp32 ``x``.

    ``y = x·log2(e)``; with ``f = y − floor(y)``, ``2^y ≈ 2^(y − p(f))`` where the
    float's bit pattern *is* ``2^23·(127 + y − p(f))`` truncated to an integer. That sum
    is ~1.07e9, where fp32's spacing is 64, so the result keeps ~17 significant bits.
    Below ln(FLT_MIN) the result is 0, above ln(FLT_MAX) it is inf.

    The kernel evaluates ``p`` with fused multiply-adds; here it is plain fp32 mul and
    add (an exact fma costs a float64 round trip, 7x the time). ``p`` may then differ
    by an ulp, which moves the result by one step of 2^-17 in ~0.1% of elements, and
    moves a bf16/fp16 rounding of it in about one element in 10^5. The last step,
    ``2^23·(y − p) + 2^23·127``, is exact either way: the product is a power-of-two scaling.
    """
    x = x.float()
    out = _fast_exp_(x.clone())
    return out.masked_fill_(x > _LN_FLT_MAX, float("inf"))


def _fast_exp_(x: torch.Tensor) -> torch.Tensor:
    """fast_exp for ``x <= ln(FLT_MAX)`` (softmax arguments are <= 0), reusing ``x``."""
    small = x < _LN_FLT_MIN
    y = x.mul_(_LOG2E)
    f = y - y.floor()
    p = f * _P[3]
    p.add_(_P[2]).mul_(f).add_(_P[1]).mul_(f).add_(_P[0])
    bits = y.sub_(p).mul_(2.0 ** 23).add_(2.0 ** 23 * 127).masked_fill_(small, 0.0)
    return bits.to(torch.int32).view(torch.float32)  # the conversion truncates


def _kernel_exp_(x: torch.Tensor, block: int) -> torch.Tensor:
    """In place: exp of a row block of ``block`` keys (``x`` may hold only its first
    columns) as the kernel does it, fast on the block's multiple-of-16 prefix."""
    n = min(_VEC * (block // _VEC), x.shape[-1]) if _VEC else 0
    if n == x.shape[-1]:
        return _fast_exp_(x)
    if n:
        x[..., :n] = _fast_exp_(x[..., :n].clone())
    x[..., n:].exp_()
    return x


def modelled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
             attn_mask: torch.Tensor | None = None) -> bool:
    """Whether this call takes the kernel path the model reproduces: no dropout, equal
    head counts, and a mask (if any) that broadcasts to (B, H, Tq, Tk)."""
    if dropout_p or q.dim() != 4 or not q.shape[:2] == k.shape[:2] == v.shape[:2]:
        return False
    if attn_mask is None:
        return True
    try:
        torch.broadcast_shapes(attn_mask.shape, (*q.shape[:-1], k.shape[-2]))
    except RuntimeError:
        return False
    return attn_mask.is_floating_point()


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return float(scale) if scale is not None else q.shape[-1] ** -0.5


def _causal_(s: torch.Tensor, r0: int, c0: int, fill: float) -> torch.Tensor:
    """In place: keys after each query (top-left aligned, as the kernel) get ``fill``."""
    r = torch.arange(r0, r0 + s.shape[-2], device=s.device)[:, None]
    c = torch.arange(c0, c0 + s.shape[-1], device=s.device)[None]
    return s.masked_fill_(c > r, fill)


_ROWS = 64  # query rows per chunk: rows are independent, chunks only bound memory


def flash_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            is_causal: bool, scale: float | None,
                            rnd: Callable[[torch.Tensor], torch.Tensor],
                            attn_mask: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, logsumexp)`` of the kernel for (B, H, T, D) inputs holding format values.

    ``rnd`` rounds an fp32 tensor to the format. ``out`` is rounded; ``lse`` is fp32.
    ``attn_mask`` is additive (the kernel gets bool masks as 0 / -inf), added after the
    scale. Causal chunks skip keys every row of the chunk masks (their ``exp`` is 0).
    """
    sc = _scale(q, scale)
    tq, tk = q.shape[-2], k.shape[-2]
    kt = k.transpose(-2, -1).contiguous()  # bmm on a transposed view is 3x slower
    q, v = q.contiguous(), v.contiguous()
    mask = _full_mask(attn_mask, q, k)
    outs, lses = [], []
    for r0 in range(0, tq, _ROWS):
        r1 = min(r0 + _ROWS, tq)
        keys = min(r1, tk) if is_causal else tk
        rows_mask = None if mask is None else mask[..., r0:r1, :]
        o, lse = _forward_rows(q[..., r0:r1, :], kt, v, r0, keys, is_causal, sc, rnd,
                               rows_mask)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, -2), torch.cat(lses, -1)


def _full_mask(attn_mask, q, k):
    if attn_mask is None:
        return None
    return attn_mask.float().expand(*q.shape[:-1], k.shape[-2])


def _forward_rows(q, kt, v, r0, keys, is_causal, sc, rnd, mask):
    tk = kt.shape[-1]
    row_max = row_sum = acc = None
    for n in range(0, keys, _KV_SPLIT):
        block = min(_KV_SPLIT, tk - n)
        c1 = min(n + block, keys)
        s = (q @ kt[..., n:c1]).mul_(sc)
        if is_causal:
            _causal_(s, r0, n, float("-inf"))
        if mask is not None:
            s.add_(mask[..., n:c1])
        new_max = s.amax(-1, keepdim=True)
        if row_max is not None:
            new_max = torch.maximum(row_max, new_max)
        live = new_max > float("-inf")  # a row with no key yet stays untouched
        e = _kernel_exp_(s.sub_(torch.where(live, new_max, 0.0)), block)
        pv = rnd(e) @ v[..., n:c1, :]
        if row_max is None:
            row_sum, acc = e.sum(-1, keepdim=True), pv
        else:
            corr = torch.exp(row_max - torch.where(live, new_max, 0.0))
            row_sum = torch.where(live, e.sum(-1, keepdim=True) + corr * row_sum, row_sum)
            acc = torch.where(live, acc * corr + pv, acc)
        row_max = new_max
    row_sum = torch.where(row_sum == 0, 1.0, row_sum)
    row_max = torch.where(row_max == float("-inf"), 0.0, row_max)
    return rnd(acc * (1.0 / row_sum)), (row_max + torch.log(row_sum)).squeeze(-1)


def _q_split(tq: int) -> int:
    return 256 if tq >= 768 else 64 if tq >= 192 else 32


def flash_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                             v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                             is_causal: bool, scale: float | None,
                             rnd: Callable[[torch.Tensor], torch.Tensor],
                             attn_mask: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of the kernel, each rounded as its half-precision buffer is."""
    sc = _scale(q, scale)
    tq, tk = q.shape[-2], k.shape[-2]
    q, k, grad_out = q.contiguous(), k.contiguous(), grad_out.contiguous()
    kt, vt = (t.transpose(-2, -1).contiguous() for t in (k, v))
    dq = torch.empty(q.shape, device=q.device)  # each query block is written first at c0=0
    dk, dv = (torch.zeros(t.shape, device=t.device) for t in (k, v))
    dsum = (grad_out * out).sum(-1, keepdim=True)
    lse = lse.unsqueeze(-1)
    mask = _full_mask(attn_mask, q, k)
    step = _q_split(tq)
    for r0 in range(0, tq, step):
        r1 = min(r0 + step, tq)
        keys = min(r1, tk) if is_causal else tk
        q_b, do_b = q[..., r0:r1, :], grad_out[..., r0:r1, :]
        for c0 in range(0, keys, _KV_SPLIT):
            c1 = min(c0 + _KV_SPLIT, keys)  # masked keys add exact zeros: skipped
            a = (q_b @ kt[..., c0:c1]).mul_(sc)
            if mask is not None:
                a.add_(mask[..., r0:r1, c0:c1])
            a = a.sub_(lse[..., r0:r1, :]).exp_()
            if is_causal:
                _causal_(a, r0, c0, 0.0)
            # each += rounds: the gradients live in half-precision buffers
            dv_c = dv[..., c0:c1, :]
            dv_c.copy_(rnd((rnd(a).transpose(-2, -1) @ do_b).add_(dv_c)))
            ds = rnd(a.mul_((do_b @ vt[..., c0:c1]).sub_(dsum[..., r0:r1, :])))
            dq_r = (ds @ k[..., c0:c1, :]).mul_(sc)
            dq[..., r0:r1, :] = rnd(dq_r.add_(dq[..., r0:r1, :]) if c0 else dq_r)
            dk_c = dk[..., c0:c1, :]
            dk_c.copy_(rnd((ds.transpose(-2, -1) @ q_b).mul_(sc).add_(dk_c)))
    return dq, dk, dv
