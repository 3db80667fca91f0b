"""Optimizer states stored in fewer bytes: how each format encodes a state tensor.

An optimizer state (Adam's moments, SGD's momentum) is decoded to fp32 for the update
and encoded back after it. Formats, per element:

=========  =====================================================================  ======
format     encoding                                                               bytes
=========  =====================================================================  ======
``fp32``   the tensor itself (no copy: updates are torch's, bit for bit)          4
``bf16``   round to nearest even                                                  2
``fp8``    e4m3 per block of ``BLOCK`` elements, scale = block amax / 448 (fp32)  1 + 4/128
``int8``   per block: signed states linear, q = rint(x / s), s = amax / 127;      1 + 4/128
           non-negative states (Adam's second moment) as their square root,
           k = rint(sqrt(v) / s) - 1 in 0..255, s = max sqrt(v) / 256
=========  =====================================================================  ======

Why the second moment is stored as its square root in ``fp8`` and ``int8``: Adam
divides by ``sqrt(v) + eps``, and ``v`` spans twice the binades of ``sqrt(v)``; a
block of ``v`` stored linearly or in e4m3 flushes its small entries to zero, and a zero
``v`` makes the update ``m / eps``. The int8 grid for ``sqrt(v)`` has no zero: its
smallest code is ``s``, so small entries are stored too large, which only shrinks
their update. Quotients are computed in fp32 and rounded half to even (``torch.round``).

Tensors under ``MIN_NUMEL`` elements stay fp32 whatever the format (biases, norm
weights: little memory, and the most sensitive); the test is on the whole parameter's
size (a DTensor's global ``numel``), never on a shard's.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

__all__ = ["StateFormat", "STATE_FORMATS", "BLOCK", "MIN_NUMEL", "stored_format",
           "encode", "decode", "state_bytes"]

StateFormat = Literal["fp32", "bf16", "fp8", "int8"]
STATE_FORMATS = ("fp32", "bf16", "fp8", "int8")
#: elements per scale block (fp8, int8)
BLOCK = 128
#: parameters with fewer elements keep fp32 states
MIN_NUMEL = 4096
_E4M3_MAX = 448.0


def stored_format(fmt: str, numel: int) -> str:
    """The format a state of a ``numel``-element parameter is stored in."""
    if fmt not in STATE_FORMATS:
        raise ValueError(f"state format {fmt!r}; valid: {', '.join(STATE_FORMATS)}")
    return "fp32" if numel < MIN_NUMEL else fmt


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """``x`` flattened and zero-padded into rows of ``BLOCK``."""
    flat = x.reshape(-1)
    pad = (-flat.numel()) % BLOCK
    return F.pad(flat, (0, pad)).view(-1, BLOCK)


def encode(x: torch.Tensor, fmt: str, signed: bool = True) -> dict[str, torch.Tensor]:
    """The stored form of the fp32 state ``x``: ``{"v": x}`` for fp32, else the codes
    (``"q"``) and, for block formats, one fp32 scale per block (``"s"``). ``signed``:
    False for a non-negative state (stored as its square root in fp8 and int8)."""
    if fmt == "fp32":
        return {"v": x}
    if fmt == "bf16":
        return {"q": x.to(torch.bfloat16)}
    b = _blocks(x if signed else x.sqrt())
    amax = b.abs().amax(dim=1, keepdim=True)
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
    x = b.reshape(-1)[:like.numel()].view(like.shape)
    return x if signed else x.square()


def state_bytes(fmt: str, numel: int) -> int:
    """Bytes one state of a ``numel``-element parameter takes in ``fmt`` (exact)."""
    fmt = stored_format(fmt, numel)
    if fmt in ("fp32", "bf16"):
        return numel * (4 if fmt == "fp32" else 2)
    blocks = -(-numel // BLOCK)
    return blocks * BLOCK + blocks * 4
