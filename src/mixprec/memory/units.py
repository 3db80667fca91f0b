"""Parameter counts and byte sizes as people write them (``70B``, ``24GiB``), and what
this rank stores of a tensor."""

from __future__ import annotations

import math
import re

import torch
from torch import nn

__all__ = ["parse_count", "parse_bytes", "rank_local"]


_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(params: int | float | str | nn.Module) -> int:
    """A parameter count from ``70B``, ``7.5e9``, ``350M``, an int, or a module."""
    if isinstance(params, nn.Module):
        return sum(rank_local(p).numel() for p in params.parameters())
    if isinstance(params, (int, float)) and not isinstance(params, bool):
        if params <= 0 or not math.isfinite(params):
            raise ValueError(f"parameter count must be > 0, got {params!r}")
        return int(params)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmbgt]?)\s*",
                     str(params).lower())
    if not m:
        raise ValueError(f"parameter count {params!r}: expected a number with an optional "
                         "K/M/B/T suffix, e.g. '70B', '7.5e9', '350M'")
    return parse_count(float(m.group(1)) * _SUFFIX[m.group(2)])


def parse_bytes(size: int | float | str, what: str = "size") -> float:
    """Bytes from ``80GB``, ``80G``, ``512MB``, ``24GiB``, ``141e9`` or a number;
    ``what`` names the argument in the error (``--device-memory``, ``memory``).

    >>> parse_bytes("24GiB"), parse_bytes("512MB"), parse_bytes(2e9)
    (25769803776.0, 512000000.0, 2000000000.0)
    """
    if isinstance(size, (int, float)) and not isinstance(size, bool):
        if size > 0 and math.isfinite(size):
            return float(size)
        raise ValueError(f"{what}={size!r}: a positive number of bytes, or e.g. 2GB")
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*"
                     r"(gib|gb|g|mib|mb|m|kib|kb|k|tib|tb|t|b)?\s*", str(size).lower())
    if not m:
        raise ValueError(f"{what}={size!r}: expected e.g. 80GB, 512MB, 24GiB or 141e9")
    return float(m.group(1)) * _UNITS[m.group(2)]


_UNITS = {None: 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6,
          "mib": 2**20, "g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12,
          "tib": 2**40}


def rank_local(p: torch.Tensor) -> torch.Tensor:
    """What this rank stores of ``p``: a DTensor's local shard (a tensor-parallel plan's
    or FSDP's), else ``p``; so a module's counts are per rank, replicated tensors whole."""
    return p.to_local() if hasattr(p, "to_local") else p
