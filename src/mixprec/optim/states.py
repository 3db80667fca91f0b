"""Optimizer states stored in fewer bytes: how each format encodes a state tensor.

An optimizer state (Adam's moments, SGD's momentum) is decoded to fp32 for the update
and encoded back after it. Formats, per element:

=========  =====================================================================  ======
format     encoding                                                               bytes
=========  =====================================================================  ======
``fp32``   the tensor itself (no copy: updates are torch's, bit for bit)          4
``bf16``   round to nearest even                                                  2
``fp8``    e4m3 per block, scale = block amax / 448 (fp32)                        1 + 4/w
``int8``   per block: signed states linear, q = rint(x / s), s = amax / 127;      1 + 4/w
           non-negative states (Adam's second moment) as their square root,
           k = rint(sqrt(v) / s) - 1 in 0..255, s = max sqrt(v) / 256
=========  =====================================================================  ======

**Blocks lie along rows.** A state of shape ``(rows, *rest)`` is viewed as ``rows`` rows
of ``cols = prod(rest)`` elements; each row is cut into blocks of ``w = min(BLOCK,
cols)`` elements (the last one zero-padded when ``w`` does not divide ``cols``), one
fp32 scale per block. A dim-0 shard (FSDP2's) therefore holds whole blocks and encodes
to exactly the same codes and scales as those rows of the whole tensor: sharded states
gather, reshard and resume bit for bit at any world size. The codes are stored as
``(rows, blocks, w)`` and the scales as ``(rows, blocks, 1)``, sharded with the rows.

Why the second moment is stored as its square root in ``fp8`` and ``int8``: Adam
divides by ``sqrt(v) + eps``, and ``v`` spans twice the binades of ``sqrt(v)``; a
block of ``v`` stored linearly or in e4m3 flushes its small entries to zero, and a zero
``v`` makes the update ``m / eps``. The int8 grid for ``sqrt(v)`` has no zero: its
smallest code is ``s``, so small entries are stored too large, which only shrinks
their update. Quotients are computed in fp32 and rounded half to even (``torch.round``).

``BLOCK`` is 256, torchao's width for ``AdamW8bit`` and ``AdamWFp8``: the scales cost
4/256 byte per element (2.03 bytes per parameter for two moments).

In the block formats (fp8, int8), tensors under ``MIN_NUMEL`` elements and 1-D tensors
stay fp32 (biases, norm weights: little memory, and the most sensitive; a 1-D shard
would also cut blocks). ``bf16`` has no blocks and applies to every tensor. The test is
on the whole parameter's shape (a DTensor's global shape), never on a shard's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F

__all__ = ["StateFormat", "STATE_FORMATS", "BLOCK", "MIN_NUMEL", "stored_format",
           "block_width", "encode", "decode", "state_bytes"]

StateFormat = Literal["fp32", "bf16", "fp8", "int8"]
STATE_FORMATS = ("fp32", "bf16", "fp8", "int8")
#: the widest scale block (fp8, int8): elements of one row per scale
BLOCK = 256
#: parameters with fewer elements keep fp32 states
MIN_NUMEL = 4096
_E4M3_MAX = 448.0


def stored_format(fmt: str, shape: Sequence[int]) -> str:
    """The format a state of a parameter of ``shape`` (the whole parameter's) is
    stored in: ``fmt``, or fp32 for a block format's small or 1-D parameter."""
    if fmt not in STATE_FORMATS:
        raise ValueError(f"state format {fmt!r}; valid: {', '.join(STATE_FORMATS)}")
    if fmt in ("fp32", "bf16"):
        return fmt
    return "fp32" if len(shape) < 2 or math.prod(shape) < MIN_NUMEL else fmt


def block_width(shape: Sequence[int]) -> int:
    """Elements per scale block for a state of ``shape``: ``min(BLOCK, cols)``."""
    return max(1, min(BLOCK, math.prod(shape[1:])))


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``(rows, blocks, w)``, each row zero-padded to whole blocks."""
    w, cols = block_width(x.shape), math.prod(x.shape[1:])
    rows = x.reshape(x.shape[0], cols)  # explicit: a shard may have no rows
    return F.pad(rows, (0, (-cols) % w)).view(x.shape[0], -(-cols // w), w)


def encode(x: torch.Tensor, fmt: str, signed: bool = True) -> dict[str, torch.Tensor]:
    """The stored form of the fp32 state ``x``: ``{"v": x}`` for fp32, else the codes
    (``"q"``) and, for block formats, one fp32 scale per block (``"s"``). ``signed``:
    False for a non-negative state (stored as its square root in fp8 and int8)."""
    if fmt == "fp32":
        return {"v": x}
    if fmt == "bf16":
        return {"q": x.to(torch.bfloat16)}
    b = _blocks(x if signed else x.sqrt())
    amax = b.abs().amax(dim=-1, keepdim=True)
    if fmt == "fp8":
        s = amax / _E4M3_MAX
        q = torch.where(s > 0, b / s, 0.0).to(torch.float8_e4m3fn)
        return {"q": q, "s": s}
    if signed:
        s = amax / 127
        q = torch.where(s > 0, b / s, 0.0).round_().clamp_(-127, 127).to(torch.int8)
        return {"q": q, "s": s}
    s = amax / 256
    k = torch.where(s > 0, b / s, 1.0).round_().sub_(1).clamp_(0, 255).to(torch.uint8)
    return {"q": k, "s": s}


def decode(stored: dict[str, torch.Tensor], fmt: str, like: torch.Tensor,
           signed: bool = True) -> torch.Tensor:
    """The fp32 state ``encode`` stored, shaped like ``like``."""
    if fmt == "fp32":
        return stored["v"]
    if fmt == "bf16":
        return stored["q"].float()
    q, s = stored["q"], stored["s"]
    if fmt == "fp8" or signed:
        b = q.float() * s
    else:
        b = (q.float() + 1) * s
    cols = math.prod(like.shape[1:])
    x = b.reshape(b.shape[0], b.shape[1] * b.shape[2])[:, :cols].reshape(like.shape)
    return x if signed else x.square()


def state_bytes(fmt: str, shape: int | Sequence[int]) -> int:
    """Bytes one state of a parameter of ``shape`` takes in ``fmt`` (exact). A bare
    element count ``n`` stands for a matrix of ``n`` elements whose rows are whole
    blocks (no padding), the planner's model when only a count is known."""
    if isinstance(shape, int):
        shape = (shape,) if shape < MIN_NUMEL else (-(-shape // BLOCK), BLOCK)
    fmt = stored_format(fmt, shape)
    numel = math.prod(shape)
    if fmt in ("fp32", "bf16"):
        return numel * (4 if fmt == "fp32" else 2)
    w = block_width(shape)
    blocks = shape[0] * -(-math.prod(shape[1:]) // w)
    return blocks * w + blocks * 4
