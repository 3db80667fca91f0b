"""Optimizer states stored in fewer bytes: how each format encodes a state tensor.

An optimizer state (Adam's moments, SGD's momentum) is decoded to fp32 for the update
and encoded back after it. Per block of ``n`` elements with absolute maximum ``a``, a
signed state (a first moment, a momentum) ``x`` and a non-negative one (Adam's second
moment) ``v`` are stored as:

=========  =============================================================  ==========
format     codes (``y = |x| / a``, ``z = v / a``)                          bytes
=========  =============================================================  ==========
``fp32``   the tensor itself (no copy: updates are torch's, bit for bit)  4
``bf16``   round to nearest even (no blocks)                              2
``fp8``    e4m3 of ``x / s``, ``s = a / 448``; ``v`` likewise, its zero   1 + 4/n
           code read as e4m3's smallest subnormal
``int8``   ``x``: ``sign(x) * rint(127 * y^(1/4))``, int8                 1 + 4/n
           ``v``: ``rint(256 * z^(1/4)) - 1`` in 0..255, read as
           ``a * ((k + 1) / 256)^4``, uint8
``int4``   ``x``: sign bit and the nearest of ``a * (k / 7)^3``, k 0..7    0.5 + 4/n
           ``v``: as int8's with 16 levels, ``a * ((k + 1) / 16)^4``
=========  =============================================================  ==========

**Why these maps.** Adam's update is ``m / (sqrt(v) + eps)``: what matters is the
*relative* error of each element, down to elements far below their block's maximum.

- A linear int8 grid rounds every ``|m| < a / 254`` to zero; on a small conv/embedding
  model about 1.2% of updates were then more than 50% off. The fourth root spreads 127
  levels over 1 : 10^8 (relative error ~1.6% near ``a``, ~5% at ``a / 100``) and that
  share falls to 0.00%, at most torchao's ``AdamW8bit`` (its signed dynamic map) on
  the same states, with a lower mean update error on most tensors
  (benchmarks/optim_maps.py).
- The second moment gets the same fourth root: the update sees ``sqrt(v)``, i.e. a
  square root of ``v``'s codes, whose relative error is half of ``v``'s.
- Both roots are two ``sqrt`` and both powers two squarings, all correctly rounded in
  IEEE arithmetic, so a code is the same on every device and in every piece of a step.
- A non-negative state has no zero code in int8 and int4, and fp8's zero reads as the
  smallest subnormal: an element of ``v`` stored too small would make its update
  ``m / eps``; stored too large it only shrinks. (A block whose maximum is 0 stays 0.)
- fp8 stores ``v`` itself, not ``sqrt(v)``: e4m3's relative error of ``v`` halves in
  ``sqrt(v)``, half the update error of storing the root (torchao's ``AdamWFp8`` also
  stores ``v``).
- int4's first moment rounds to the nearest value in linear terms among 8 magnitudes
  ``(k / 7)^3``, 7 exact comparisons; its cubic grid measured closest to torchao's
  ``AdamW4bit`` map on the share of far-off updates.

**Blocks lie along rows.** A state of shape ``(rows, *rest)`` is viewed as ``rows`` rows
of ``cols = prod(rest)`` elements. Each row is cut into ``max(1, cols // w)`` blocks of
``w = BLOCK`` (int4: ``BLOCK4``) elements, the last of them taking the rest of the row
(``w`` to ``2w - 1`` elements; a row narrower than ``w`` is one block). No code is
padded: the codes are stored as ``(rows, cols)`` (int4: two per byte, ``(rows,
ceil(cols / 2))``) and the fp32 scales as ``(rows, blocks)``. A dim-0 shard (FSDP2's)
holds whole rows and so encodes to exactly those rows of the whole tensor's codes and
scales: sharded states gather, reshard and resume bit for bit at any world size.

Bytes against torchao's flat blocks (which need the element count to divide by the
block): rows of 257, 384 or 576 (a 3×3 conv over 64 channels) cost 0.99x to 1.0x
torchao's in int8, fp8 and int4. Rows narrower than ``w`` pay one scale per row:
``1 + 4/cols`` bytes (an embedding of width 64: 1.0625 against 1.0156).

In the block formats (fp8, int8, int4), tensors under ``MIN_NUMEL`` elements and 1-D
tensors stay fp32 (biases, norm weights: little memory, and the most sensitive; a 1-D
shard would also cut blocks). ``bf16`` has no blocks and applies to every tensor. The
test is on the whole parameter's shape (a DTensor's global shape), never on a shard's.

``LAYOUT`` numbers this storage; ``mixprec.optim.compat`` reads the one before it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch

from mixprec.formats import elements as formats

__all__ = ["StateFormat", "STATE_FORMATS", "BLOCK", "BLOCK4", "MIN_NUMEL", "LAYOUT",
           "stored_format", "block_width", "num_blocks", "encode", "decode",
           "state_bytes"]

StateFormat = Literal["fp32", "bf16", "fp8", "int8", "int4"]
STATE_FORMATS = ("fp32", "bf16", "fp8", "int8", "int4")
#: elements per scale block (fp8, int8): torchao's width for AdamW8bit and AdamWFp8
BLOCK = 256
#: elements per scale block in int4 (torchao's AdamW4bit width)
BLOCK4 = 128
#: parameters with fewer elements keep fp32 states
MIN_NUMEL = 4096
#: the storage layout this version writes
LAYOUT = 2
_E4M3_MAX = formats.get("fp8_e4m3").max
_E4M3_TINY = formats.get("fp8_e4m3").min_subnormal  # 2^-9
_BLOCK_FORMATS = ("fp8", "int8", "int4")


def stored_format(fmt: str, shape: Sequence[int]) -> str:
    """The format a state of a parameter of ``shape`` (the whole parameter's) is
    stored in: ``fmt``, or fp32 for a block format's small or 1-D parameter."""
    if fmt not in STATE_FORMATS:
        raise ValueError(f"state format {fmt!r}; valid: {', '.join(STATE_FORMATS)}")
    if fmt in ("fp32", "bf16"):
        return fmt
    return "fp32" if len(shape) < 2 or math.prod(shape) < MIN_NUMEL else fmt


def block_width(fmt: str = "int8") -> int:
    """Elements per block (but the last of each row) in block format ``fmt``."""
    return BLOCK4 if fmt == "int4" else BLOCK


def num_blocks(cols: int, fmt: str = "int8") -> int:
    """Scale blocks in a row of ``cols`` elements: ``max(1, cols // w)``."""
    return max(1, cols // block_width(fmt))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``(rows, cols)`` (explicit: a shard may have no rows)."""
    return x.reshape(x.shape[0], math.prod(x.shape[1:])) if x.ndim else x.reshape(1, 1)


def _parts(r: torch.Tensor, w: int) -> list[torch.Tensor]:
    """The row blocks of ``r`` (``(rows, cols)``) as views ``(rows, k, width)``: one
    view where every block has ``w`` elements or a row is a single block, else the
    full-width blocks and then each row's last block (the rest of the row)."""
    rows, cols = r.shape
    nb = max(1, cols // w)
    if cols == nb * w:
        return [r.reshape(rows, nb, w)]
    if nb == 1:
        return [r.reshape(rows, 1, cols)]
    head = (nb - 1) * w
    return [r[:, :head].reshape(rows, nb - 1, w), r[:, head:].reshape(rows, 1, cols - head)]


def _amax(r: torch.Tensor, w: int) -> torch.Tensor:
    """Each row block's absolute maximum, ``(rows, blocks)``."""
    if r.shape[1] == 0:
        return r.new_zeros(r.shape[0], 1)
    return torch.cat([v.abs().amax(-1) for v in _parts(r, w)], 1)


def _scaled(r: torch.Tensor, s: torch.Tensor, w: int, fn) -> torch.Tensor:
    """``fn(block, its scale)`` over ``r``'s blocks (``s``: ``(rows, blocks)``), joined
    back to ``(rows, cols)``."""
    rows, out, k = r.shape[0], [], 0
    for v in _parts(r, w):
        out.append(fn(v, s[:, k:k + v.shape[1], None]).reshape(rows, v.shape[1] * v.shape[2]))
        k += v.shape[1]
    return out[0] if len(out) == 1 else torch.cat(out, 1)


def _root4_times(y: torch.Tensor, k: int) -> torch.Tensor:
    """``k · y^(1/4)`` in fp32 from two correctly rounded square roots, ready to round
    to a code. torch's fp32 ``sqrt`` on CPUs is not correctly rounded everywhere (on an
    AVX-512 AMD EPYC one input in five of a million came out 1 ulp off), which moves a
    code only where ``k · y^(1/4)`` lies within a few ulps of a rounding tie. There (a
    few elements in a million) the roots are taken again in float64 and rounded to fp32
    each, which is correctly rounded; on CUDA ``sqrt`` is IEEE's already. Either way
    the codes are the same on every device."""
    v = y.sqrt().sqrt_().mul_(k)
    if v.device.type == "cpu":
        flat, eps = v.view(-1), 2.0**-12  # two roots 1 ulp off move v by < 2^-14 here
        near = flat.add(0.5 + eps).frac_().lt_(2 * eps).nonzero().squeeze(1)  # |frac-.5|<eps
        if near.numel():
            ratio = y.reshape(-1)[near].double()
            flat[near] = ratio.sqrt_().float().double().sqrt_().float().mul_(k)
    return v


def _pow4(y: torch.Tensor) -> torch.Tensor:
    return y.square_().square_()


def _ratio(b: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``|b| / s`` in ``[0, 1]``, 0 where the block's scale is 0 (its elements are)."""
    return b.abs().div_(torch.where(s > 0, s, 1.0))


#: the 7 midpoints between int4's first-moment magnitudes ``(k / 7)^3``, in fp32
_MID4 = tuple(torch.tensor([((k / 7) ** 3 + ((k + 1) / 7) ** 3) / 2 for k in range(7)],
                           dtype=torch.float32).tolist())


def _pack4(k: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 of ``(rows, cols)`` as ``(rows, ceil(cols / 2))`` bytes, column
    ``2j`` in the low nibble and ``2j + 1`` in the high one."""
    if k.shape[1] % 2:
        k = torch.cat([k, k.new_zeros(k.shape[0], 1)], 1)
    return k[:, 0::2] | (k[:, 1::2] << 4)


def _unpack4(q: torch.Tensor, cols: int) -> torch.Tensor:
    return torch.stack([q & 15, q >> 4], -1).reshape(q.shape[0], 2 * q.shape[1])[:, :cols]


def encode(x: torch.Tensor, fmt: str, signed: bool = True) -> dict[str, torch.Tensor]:
    """The stored form of the fp32 state ``x``: ``{"v": x}`` for fp32, else the codes
    (``"q"``) and, for block formats, one fp32 scale per block (``"s"``). ``signed``:
    False for a non-negative state (the module docstring gives each map)."""
    if fmt == "fp32":
        return {"v": x}
    if fmt == "bf16":
        return {"q": x.to(torch.bfloat16)}
    if fmt not in _BLOCK_FORMATS:
        raise ValueError(f"state format {fmt!r}; valid: {', '.join(STATE_FORMATS)}")
    r = _rows(x)
    w = block_width(fmt)
    a = _amax(r, w)
    if fmt == "fp8":
        s = a / _E4M3_MAX
        q = _scaled(r, s, w, lambda b, sb: torch.where(sb > 0, b / sb, 0.0)
                    .to(torch.float8_e4m3fn))
        return {"q": q, "s": s}
    if fmt == "int8" and signed:
        q = _scaled(r, a, w, lambda b, sb: _root4_times(_ratio(b, sb), 127).round_()
                    .copysign_(b).to(torch.int8))
    elif fmt == "int8":
        q = _scaled(r, a, w, lambda b, sb: _root4_times(_ratio(b, sb), 256).round_()
                    .sub_(1).clamp_(0, 255).to(torch.uint8))
    elif signed:  # int4: sign bit | index of the nearest magnitude
        def code(b, sb):
            y = _ratio(b, sb)
            k = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
            for mid in _MID4:
                k += y > mid
            return k | ((b < 0).to(torch.uint8) << 3)

        q = _pack4(_scaled(r, a, w, code))
    else:
        q = _pack4(_scaled(r, a, w, lambda b, sb: _root4_times(_ratio(b, sb), 16).round_()
                           .sub_(1).clamp_(0, 15).to(torch.uint8)))
    return {"q": q, "s": a}


def decode(stored: dict[str, torch.Tensor], fmt: str, like: torch.Tensor,
           signed: bool = True) -> torch.Tensor:
    """The fp32 state ``encode`` stored, shaped like ``like``."""
    if fmt == "fp32":
        return stored["v"]
    if fmt == "bf16":
        return stored["q"].float()
    q, s = stored["q"], stored["s"]
    cols = math.prod(like.shape[1:]) if like.ndim else 1
    w = block_width(fmt)
    if fmt == "fp8":
        c = q.float()
        if not signed:
            c = c.clamp_min_(_E4M3_TINY)
        out = _scaled(c, s, w, lambda b, sb: b * sb)
    elif fmt == "int8" and signed:
        def value(b, sb):
            c = b.float()
            return _pow4(c.abs().div_(127)).mul_(sb).copysign_(c)

        out = _scaled(q, s, w, value)
    elif fmt == "int8":
        out = _scaled(q, s, w, lambda b, sb: _pow4(b.float().add_(1).div_(256)).mul_(sb))
    elif signed:  # int4: (k / 7)^3 with the sign bit
        k = _unpack4(q, cols)

        def value(b, sb):
            m = (b & 7).float()
            m = m * m * m / 343
            return torch.where(b >= 8, -m, m).mul_(sb)

        out = _scaled(k, s, w, value)
    else:
        out = _scaled(_unpack4(q, cols), s, w,
                      lambda b, sb: _pow4(b.float().add_(1).div_(16)).mul_(sb))
    return out.reshape(like.shape)


def state_bytes(fmt: str, shape: int | Sequence[int]) -> int:
    """Bytes one state of a parameter of ``shape`` takes in ``fmt`` (exact). A bare
    element count ``n`` stands for one row of ``n`` elements (whole blocks: the
    planner's model when only a count is known)."""
    if isinstance(shape, int):
        shape = (shape,) if shape < MIN_NUMEL else (1, shape)
    fmt = stored_format(fmt, shape)
    numel = math.prod(shape)
    if fmt in ("fp32", "bf16"):
        return numel * (4 if fmt == "fp32" else 2)
    rows, cols = shape[0], math.prod(shape[1:])
    codes = rows * -(-cols // 2) if fmt == "int4" else numel
    return codes + rows * num_blocks(cols, fmt) * 4
