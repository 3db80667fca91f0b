"""The block-scaled casts on torch's scaled matmul (``torch.nn.functional.scaled_mm``).

torch has hardware kernels for each of mixprec's block scalings, on CUDA only (a CPU
build takes tensorwise and rowwise scales). Each block format declares its kernel's
needs as a ``KernelSpec`` (``mixprec.formats.padding``: the (M, K, N) multiples, the tile
along K, the scale layout and dtype), and ``block_scaled_mm`` lays the operands out by
that spec alone:

- ``outer_major`` scales (the 1×128 / 128×128 kernel, Hopper): fp32 tile scales in
  strides ``(1, rows)``; a 128×128 block's scales are ``(L4, N/128)`` with ``L4`` the
  K blocks rounded up to 4, also column-major. M is padded to a multiple of 4 so that
  the tile scales' leading dimension is 16-byte aligned, as cuBLASLt requires of every
  matrix (torch's meta kernel does not check it).
- ``swizzled`` scales (MXFP8, NVFP4, Blackwell): cuBLAS's ``SWIZZLE_32_4_4`` layout
  (``swizzle_32_4_4``) in the spec's scale dtype (e8m0, e4m3). fp4 codes are packed
  two per byte (``pack_e2m1``, the first element in the low nibble); a 16×16 weight
  block's scale serves each of its 16 rows, and the per-tensor descales multiply the
  fp32 output afterwards.

The padding is zero codes under unit scales, so it changes no sum; the output keeps its
first N columns. A block holding an inf or NaN has a NaN scale, so its products are NaN
and the step is skipped, as on the dequantizing route.

No call here has run on a GPU yet. ``fp8_gemm=auto`` therefore takes the kernel on a
device only after one probe per scaling (``_kernel_ok``) agrees with the exact
dequantizing route there (and is faster); otherwise it keeps the dequantizing route and
says why once. Which devices have which kernel, and the decision itself, are
``mixprec.formats.route``'s. Every call's shapes, dtypes, strides and scale layouts are
checked on any machine against torch's meta kernels (``device="meta"``).
"""

from __future__ import annotations

import time
import warnings
from functools import cache
from typing import Protocol

import torch
import torch.nn.functional as F

from mixprec.formats.padding import KernelSpec
from mixprec.formats.quantized import Quantized, expand_blocks

__all__ = ["block_scaled_mm", "swizzle_32_4_4", "pack_e2m1", "PROBE_TOKENS"]


class _BlockQuantizer(Protocol):
    """What the probe needs of a quantizer (``mixprec.recipe.linear_format``): its scaling's
    name, its kernel's ``KernelSpec`` and its cast."""

    name: str
    kernel: KernelSpec

    def cast(self, t: torch.Tensor, role: str, dim: int, state: dict) -> Quantized:
        """``t`` cast for ``role`` along ``dim``."""
        ...


def _pad(t: torch.Tensor, rows: int, cols: int, value: float = 0.0) -> torch.Tensor:
    """2-D ``t`` padded at the end to multiples of ``rows`` and ``cols`` with ``value``."""
    m, n = t.shape
    return F.pad(t, (0, (-n) % cols, 0, (-m) % rows), value=value)


def _col_major(s: torch.Tensor) -> torch.Tensor:
    """``s`` (2-D) copied into strides ``(1, rows)``, as the kernels read scales (also
    where a dim has size 1, which ``.t().contiguous().t()`` would leave row-major)."""
    out = torch.empty_strided(s.shape, (1, s.shape[0]), dtype=s.dtype, device=s.device)
    return out.copy_(s)


def swizzle_32_4_4(s: torch.Tensor, pad_value: float = 1.0) -> torch.Tensor:
    """Block scales ``s`` (rows, K blocks) in cuBLAS's ``SWIZZLE_32_4_4`` layout, flat:
    padded with ``pad_value`` to 128 × 4 tiles, tiles in row-major order, and within a
    tile element ``(r, c)`` at ``(r % 32) · 16 + (r // 32) · 4 + c``."""
    p = _pad(s, 128, 4, pad_value)
    rows, cols = p.shape
    return p.view(rows // 128, 4, 32, cols // 4, 4).permute(0, 3, 2, 1, 4).reshape(-1)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 values (held as ``float8_e4m3fn``, (R, K) with K even) as
    ``float4_e2m1fn_x2`` (R, K / 2): each value's 4-bit code (sign, 2 exponent bits, 1
    mantissa bit) read from its e4m3 bits, element ``2i`` in the low nibble of byte
    ``i``. e4m3 exponent field 6 is e2m1's subnormal 0.5."""
    b = codes.contiguous().view(torch.uint8).to(torch.int32)
    exp, man = (b >> 3) & 0xF, (b >> 2) & 1
    mag = torch.where(exp <= 6, (exp == 6).to(torch.int32), ((exp - 6) << 1) | man)
    nib = (mag | ((b >> 4) & 0x8)).to(torch.uint8)  # the sign bit 7 -> nibble bit 3
    return (nib[:, 0::2] | (nib[:, 1::2] << 4)).view(torch.float4_e2m1fn_x2)


def _block_shape(q: Quantized) -> tuple[int, int]:
    """The block shape in ``q``'s orientation."""
    return (q.cols, q.rows) if q.transposed else (q.rows, q.cols)


def _k_scales(q: Quantized, side: str, tile: int) -> torch.Tensor:
    """``q``'s scales as one row per row of ``a`` / column of ``b`` and one column per
    ``tile`` along K (a 16×16 block's scale repeated over its rows)."""
    br, bc = _block_shape(q)
    s = q.inv if side == "a" else q.inv.t()
    inner = bc if side == "a" else br
    outer = br if side == "a" else bc
    if inner != tile:
        raise ValueError(f"{side}: blocks of {br}x{bc} do not tile K by {tile}")
    if outer > 1:  # one scale per block of rows: repeated over them
        n = q.codes.shape[0] if side == "a" else q.codes.shape[1]
        s = expand_blocks(s, outer, 1, (n, s.shape[1]))
    return s


def _operands(a: Quantized, b: Quantized, kmult: int, nmult: int, mmult: int = 1):
    """Codes of ``a`` (Mp, Kp) row-major and of ``b`` as (Np, Kp) rows (the kernel's
    column-major (Kp, Np)), zero-padded."""
    ac = _pad(a.codes.contiguous().view(torch.uint8), mmult, kmult).view(a.data.dtype)
    bt = b.codes.t().contiguous().view(torch.uint8)
    bt = _pad(bt, nmult, kmult).view(b.data.dtype)
    return ac, bt


def block_scaled_mm(a: Quantized, b: Quantized, out_dtype: torch.dtype,
                    kernel: KernelSpec) -> torch.Tensor:
    """``a @ b`` on torch's block-scaled kernel that ``kernel`` describes (a block
    format's ``kernel``; see the module doc): ``a`` (M, K) and ``b`` (K, N) cast by that
    format along K, fp32 accumulation, in ``out_dtype``."""
    if not isinstance(kernel, KernelSpec) or kernel.scales == "tensor":
        raise ValueError(f"kernel={kernel!r}: block_scaled_mm takes a block format's "
                         "KernelSpec (its scales outer_major or swizzled); per-tensor "
                         "and rowwise casts go through mixprec.formats.tensor_gemm.fp8_gemm")
    m, n = a.codes.shape[0], b.codes.shape[1]
    st = F.ScalingType
    tile = kernel.tile
    mm, mk, mn = kernel.multiples
    ac, bt = _operands(a, b, mk, mn, mm)
    kb = ac.shape[1] // tile
    rows = getattr(st, f"BlockWise1x{tile}")
    if kernel.scales == "outer_major":  # M to 4: the tile scales' 16-byte rows
        sa = _pad(_k_scales(a, "a", tile), 4, kb, 1.0)
        if _block_shape(b) == (tile, tile):  # a weight: (L4, N/tile), column-major
            sb = _pad(b.inv.float(), 4, 1, 1.0)
            sb = _pad(sb, 1, bt.shape[0] // tile, 1.0)
            rb = getattr(st, f"BlockWise{tile}x{tile}")
        else:
            sb = _pad(_k_scales(b, "b", tile), bt.shape[0], kb, 1.0)
            rb = rows
        y = F.scaled_mm(ac, bt.t(), _col_major(sa.to(kernel.scale_dtype)), rows,
                        _col_major(sb.to(kernel.scale_dtype)), rb, output_dtype=out_dtype)
        return y[:m, :n]
    sa = _pad(_k_scales(a, "a", tile), 1, kb, 1.0)
    sb = _pad(_k_scales(b, "b", tile), bt.shape[0], kb, 1.0)
    sw = F.SwizzleType.SWIZZLE_32_4_4
    sa, sb = (swizzle_32_4_4(s).to(kernel.scale_dtype) for s in (sa, sb))
    if not kernel.fp4:
        y = F.scaled_mm(ac, bt.t(), sa, rows, sb, rows, swizzle_a=sw, swizzle_b=sw,
                        output_dtype=out_dtype)
        return y[:m, :n]
    y = F.scaled_mm(pack_e2m1(ac), pack_e2m1(bt).t(), sa, rows, sb, rows,
                    swizzle_a=sw, swizzle_b=sw, output_dtype=torch.float32)
    outer = torch.ones((), device=y.device)
    for q in (a, b):
        if q.outer is not None:
            outer = outer * q.outer
    return (y[:m, :n] * outer).to(out_dtype)


def _kernel_ok(device: str, quantizer: _BlockQuantizer) -> bool:
    """``_probe``'s answer. Under ``torch.compile`` dynamo calls this once while tracing
    and keeps the answer as a constant (the mark ``torch.compiler.assume_constant_result``
    sets, set directly: the decorator imports dynamo), so the probe never runs in a
    graph."""
    return _probe(device, quantizer)


_kernel_ok._dynamo_marked_constant = True


#: the token counts the probe runs a Linear's three GEMMs at: K not a multiple of the
#: tiles, and (30) an M that is not a multiple of 4, which the 1×128 route pads
PROBE_TOKENS = (200, 30)

#: the side of the square GEMM the probe times against the dequantizing GEMM
PROBE_TIMED = 4096


@cache
def _probe(device: str, quantizer: _BlockQuantizer) -> bool:
    """Whether ``block_scaled_mm`` on ``device`` agrees with the dequantizing GEMM for
    ``quantizer`` on the three GEMMs of a Linear (``PROBE_TOKENS``, bf16 and fp32
    outputs) and is faster on a ``PROBE_TIMED``² GEMM. Says why not, once."""
    kind = quantizer.kernel
    try:
        g = torch.Generator(device).manual_seed(0)
        w = torch.randn(256, 384, device=device, generator=g)
        cast = quantizer.cast
        wq, wd = cast(w, "weight", 1, {}), cast(w, "weight", 0, {})
        for tokens in PROBE_TOKENS:
            x = torch.randn(tokens, 384, device=device, generator=g)
            gy = torch.randn(tokens, 256, device=device, generator=g)
            xq, gq = cast(x, "input", 1, {}), cast(gy, "grad_output", 1, {})
            gt, xt = cast(gy, "grad_output", 0, {}), cast(x, "input", 0, {})
            for pa, pb in ((xq, wq.t()), (gq, wd), (gt.t(), xt)):
                want = pa.dequant() @ pb.dequant()
                for dt in (torch.bfloat16, torch.float32):
                    got = block_scaled_mm(pa, pb, dt, kind).float()
                    err = ((got - want).norm() / want.norm()).item()
                    if not err < 1e-2:
                        raise RuntimeError(
                            f"{dt} output off the dequantizing GEMM by {err:.3g} "
                            f"(relative; {tokens} tokens)")
        n = PROBE_TIMED
        big = torch.randn(n, n, device=device, generator=g)
        qa, qb = cast(big, "input", 1, {}), cast(big, "weight", 1, {}).t()
        fast, slow = (lambda: block_scaled_mm(qa, qb, torch.bfloat16, kind),
                      lambda: (qa.dequant() @ qb.dequant()).to(torch.bfloat16))
        t_fast, t_slow = _seconds(fast), _seconds(slow)
    except Exception as e:  # a kernel this device or build lacks, or a wrong layout
        warnings.warn(f"fp8_gemm=auto, fp8_scaling={quantizer.name}: torch's "
                      f"block-scaled kernel is not used on {device} ({type(e).__name__}: "
                      f"{e}); the exact dequantizing GEMM runs instead", stacklevel=3)
        return False
    return t_fast < t_slow


def _seconds(fn, reps: int = 5) -> float:
    """Median seconds per call of ``fn`` on CUDA (synchronized)."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return sorted(out)[reps // 2]
