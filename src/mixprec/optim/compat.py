"""Optimizer checkpoints of mixprec 0.2: their block-state storage (layout 1), read
and converted.

mixprec 0.2 padded each row of a block state to blocks of 256, coded int8 linearly and
fp8's second moment as its square root (``states.LAYOUT`` numbers the storage; 0.2's
``extra_state`` recorded none, which reads as 1). A full checkpoint of that layout is
decoded as 0.2 wrote it and re-encoded once, with a warning; a reshardable one, whose
entries load in place, is refused naming the way to convert it.
"""

from __future__ import annotations

import math
import warnings

import torch

from mixprec.optim.sharding import is_dtensor
from mixprec.optim.states import LAYOUT, encode, stored_format

__all__ = ["saved_layout", "check_reshardable_layout", "decode_layout1",
           "convert_layout1"]


def saved_layout(extra: dict) -> int:
    """The storage layout an optimizer's ``extra_state`` was saved in."""
    return int(extra.get("layout", 1))


def check_reshardable_layout(extra: dict, formats: list[str]) -> None:
    """Refuse a reshardable checkpoint whose block states (of ``formats``, each
    parameter's) are in another layout than this version's."""
    layout = saved_layout(extra)
    block = sorted({f for f in formats if f in ("fp8", "int8")})
    if layout != LAYOUT and block:
        raise ValueError(
            f"this reshardable checkpoint holds {'/'.join(block)} optimizer states in "
            f"storage layout {layout} (mixprec 0.2); this version reads layout "
            f"{LAYOUT} in place. Load it once with mixprec 0.2 and save it with "
            "save(path, full=True): this version converts full checkpoints")


def decode_layout1(stored: dict[str, torch.Tensor], fmt: str, like: torch.Tensor,
                   signed: bool = True) -> torch.Tensor:
    """The fp32 state mixprec 0.2 (layout 1) stored: codes ``(rows, blocks, w)`` of
    each row zero-padded to 256-element blocks, scales ``(rows, blocks, 1)``; int8
    signed states linear (``q * s``), non-negative ones as square roots
    (``((k + 1) * s)^2``), fp8 ones ``q * s`` (non-negative: squared)."""
    q, s = stored["q"], stored["s"]
    if q.ndim != 3 or s.shape != (*q.shape[:2], 1):
        raise ValueError(f"not a layout-1 {fmt} state: codes {tuple(q.shape)}, scales "
                         f"{tuple(s.shape)}")
    b = q.float() * s if (fmt == "fp8" or signed) else (q.float() + 1) * s
    cols = math.prod(like.shape[1:])
    x = b.reshape(b.shape[0], -1)[:, :cols].reshape(like.shape)
    return x if signed else x.square()


def convert_layout1(opt: torch.optim.Optimizer, extra: dict) -> None:
    """Re-encode the block states ``opt`` (a ``LowPrecisionOptimizer``) just loaded
    from a checkpoint whose ``extra_state`` is ``extra``, if it is of layout 1, in this
    version's maps and blocks, once, with a warning (the decoded values move by at
    most one step of the new grid)."""
    if saved_layout(extra) == LAYOUT:
        return
    converted, formats = 0, set()
    for p, own in zip(opt._params(), opt.state_formats()):
        state = opt.state.get(p, {})
        fmt = stored_format(own, tuple(p.shape))
        for name, signed in opt._STATES:
            if fmt in ("fp32", "bf16") or f"{name}.q" not in state:
                continue
            if is_dtensor(p):
                raise NotImplementedError(
                    "converting mixprec 0.2 block states of a sharded parameter: load "
                    "the checkpoint unsharded (or with mixprec 0.2, then save it "
                    "full) before sharding")
            old = {k: state.pop(f"{name}.{k}") for k in ("q", "s")}
            value = decode_layout1(old, fmt, p, signed)
            for k, v in encode(value, fmt, signed).items():
                state[f"{name}.{k}"] = v
            converted += 1
            formats.add(fmt)
    if converted:
        warnings.warn(
            f"optimizer checkpoint from mixprec 0.2: {converted} "
            f"{'/'.join(sorted(formats))} state(s) "
            "re-encoded in this version's storage (finer maps, unpadded blocks); "
            "save again to keep the new form", stacklevel=3)
