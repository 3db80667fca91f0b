"""Optimizer states stored in fewer bytes: the formats' names, the small-tensor rule and
the storage layout, by name.

Each format (``fp32``, ``bf16``, ``fp8``, ``int8``, ``int4``) is an object in
``mixprec.formats.state_formats``, which gives its codes, its maps and why, its blocks
along rows and its bytes. The functions here take a format's name and ask that
registry; ``STATE_FORMATS`` is its list of names.

In the block formats (fp8, int8, int4), tensors under ``MIN_NUMEL`` elements and 1-D
tensors stay fp32 (``stored_format``); ``bf16`` applies to every tensor. The test is on
the whole parameter's shape (a DTensor's global shape), never on a shard's.

``LAYOUT`` numbers this storage; ``mixprec.optim.compat`` reads the one before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from mixprec.formats import state_formats
from mixprec.formats.state_formats import BLOCK, BLOCK4, MIN_NUMEL, lookup, state_bytes

__all__ = ["StateFormat", "STATE_FORMATS", "BLOCK", "BLOCK4", "MIN_NUMEL", "LAYOUT",
           "stored_format", "block_width", "num_blocks", "encode", "decode",
           "state_bytes"]

StateFormat = Literal["fp32", "bf16", "fp8", "int8", "int4"]
#: every optimizer-state format's name (``mixprec.formats.state_formats.STATE_CODECS``)
STATE_FORMATS = state_formats.names()
#: the storage layout this version writes
LAYOUT = 2


def stored_format(fmt: str, shape: Sequence[int]) -> str:
    """The format a state of a parameter of ``shape`` (the whole parameter's) is
    stored in: ``fmt``, or fp32 for a block format's small or 1-D parameter."""
    return lookup(fmt).stored_as(shape).name


def block_width(fmt: str = "int8") -> int:
    """Elements per block (but the last of each row) in block format ``fmt``."""
    codec = state_formats.STATE_CODECS.get(fmt)
    return codec.block if codec is not None and codec.blocked else BLOCK


def num_blocks(cols: int, fmt: str = "int8") -> int:
    """Scale blocks in a row of ``cols`` elements: ``max(1, cols // w)``."""
    return max(1, cols // block_width(fmt))


def encode(x: torch.Tensor, fmt: str, signed: bool = True) -> dict[str, torch.Tensor]:
    """The stored form of the fp32 state ``x``: ``{"v": x}`` for fp32, else the codes
    (``"q"``) and, for block formats, one fp32 scale per block (``"s"``). ``signed``:
    False for a non-negative state (``mixprec.formats.state_formats`` gives each map)."""
    return lookup(fmt).encode(x, signed)


def decode(stored: dict[str, torch.Tensor], fmt: str, like: torch.Tensor,
           signed: bool = True) -> torch.Tensor:
    """The fp32 state ``encode`` stored, shaped like ``like``."""
    return lookup(fmt).decode(stored, like, signed)
