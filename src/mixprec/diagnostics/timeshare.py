"""Where a step's time goes, and what lower precision can buy at most (Amdahl's law).

Lower precision speeds up matrix multiplies (and, with fused kernels, attention). Every
other op (norms, activations, casts, the optimizer) reads and writes memory at the same
speed whatever the matmul dtype. If matmuls take a share ``m`` of a step, then even
infinitely fast matmuls leave ``1 - m`` of the step, so the whole step gets at most
``1 / (1 - m)`` times faster. With ``m`` = 40%, that is 1.67x.

``time_shares(step, steps)`` profiles ``step()`` with torch.profiler (self time per op,
CPU and CUDA kernels), one round per call, and sorts each op into ``matmul``,
``attention`` or ``other``. Rounds whose totals disagree (``diagnostics.noise``) give
no bound: ``audit_time_shares`` then says they disagree, and by how much.
``audit_time_shares`` turns a small matmul share into an ``info`` finding that names the
biggest other ops, with the bound for matmuls alone and with attention kernels too
(fused attention is matmul work that low precision speeds up on GPUs; on this
project's CPU torch's bf16 flash backward is slower than its fp32 one).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable

import torch

from mixprec.diagnostics.findings import Finding
from mixprec.diagnostics.noise import agreement

__all__ = ["MATMUL_OPS", "classify", "time_shares", "audit_time_shares", "MATMUL_FLAG"]

#: ops whose time lower precision cuts by its matmul speed-up (self time, aten names)
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm",
              "aten::mkldnn_convolution", "aten::convolution_backward",
              "aten::_convolution", "aten::cudnn_convolution", "aten::_int_mm")
#: below this share of a step in matmuls the doctor says what bounds the speed-up
MATMUL_FLAG = 0.5


def classify(op: str) -> str:
    """``"matmul"``, ``"attention"`` (fused attention kernels) or ``"other"``."""
    if op in MATMUL_OPS:
        return "matmul"
    if "scaled_dot_product" in op or "flash_attention" in op or "efficient_attention" in op:
        return "attention"
    return "other"


#: what torch's profiler (kineto) writes to stderr at every start and stop, from C++
_CHATTER = b"USDT:"


@contextlib.contextmanager
def _without_profiler_chatter():
    """Hold stderr's file descriptor in a temporary file while the profiler runs, then
    write back every line of it but kineto's ``USDT: ... profiler_start/stop`` lines
    (no setting silences them; a user's own warnings and errors pass through)."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # stderr replaced (pytest, a notebook)
        yield
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), fd)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, fd)
            os.close(saved)
            tmp.seek(0)
            kept = [line for line in tmp.read().splitlines(keepends=True)
                    if not line.startswith(_CHATTER)]
            if kept:
                os.write(fd, b"".join(kept))


def _profile(step: Callable[[], None]) -> dict[str, float]:
    """One call of ``step`` under torch.profiler: each aten op's self time in ms
    (device time where the op ran a kernel, else host time)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(ProfilerActivity.CUDA)
    with profile(activities=acts) as prof:
        step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    per_op: dict[str, float] = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0) or e.self_cpu_time_total
        if e.key.startswith("aten::") and us > 0:
            per_op[e.key] = per_op.get(e.key, 0.0) + us / 1e3
    return per_op


def time_shares(step: Callable[[], None], steps: int = 3) -> dict:
    """Profile ``steps`` calls of ``step``, each its own round: total milliseconds per
    step, the share of each class, every op's self time per step (ms), largest first,
    and whether the rounds agree (``mixprec.diagnostics.noise``: ``rounds_ms``, the
    rounds' ``spread`` and ``noisy``)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    with _without_profiler_chatter():
        rounds = [_profile(step) for _ in range(steps)]
    per_op: dict[str, float] = {}
    for r in rounds:
        for op, ms in r.items():
            per_op[op] = per_op.get(op, 0.0) + ms / steps
    total = sum(per_op.values()) or 1.0
    shares = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    for op, ms in per_op.items():
        shares[classify(op)] += ms / total
    ops = sorted(per_op.items(), key=lambda kv: -kv[1])
    agreed = agreement("the profiled steps' time", [sum(r.values()) for r in rounds], "ms")
    return {"total_ms": total, "shares": shares, "ops": ops,
            "rounds_ms": list(agreed.values), "spread": agreed.spread,
            "noisy": agreed.noisy}


def audit_time_shares(facts: dict, recipe_name: str) -> list[Finding]:
    """An ``info`` finding when matmuls take less than ``MATMUL_FLAG`` of the step: the
    Amdahl bound on what a lower-precision recipe can gain, and the biggest other ops."""
    share = facts["shares"]["matmul"]
    if facts.get("noisy"):
        agreed = agreement("the profiled steps' time", facts["rounds_ms"], "ms")
        return [Finding(
            "info", "timing-noisy",
            f"the profiled steps under {recipe_name} disagree: no speed-up bound is drawn "
            "from them", str(agreed),
            "the machine was busy (other processes held the cores): rerun on an idle "
            "machine to see where a step's time goes", {"spread": agreed.spread})]
    if share >= MATMUL_FLAG:
        return []
    bound = 1 / (1 - share) if share < 1 else float("inf")
    other = facts["shares"]["other"]
    with_attention = 1 / other if other > 0 else float("inf")
    total = facts["total_ms"]
    top = [(op, ms) for op, ms in facts["ops"] if classify(op) != "matmul"][:4]
    evidence = (f"under {recipe_name}: matmuls {share:.0%}, attention kernels "
                f"{facts['shares']['attention']:.0%}, other ops "
                f"{facts['shares']['other']:.0%} of {total:.0f} ms per step; largest: "
                + ", ".join(f"{op.removeprefix('aten::')} {ms / total:.0%}" for op, ms in top))
    return [Finding(
        "info", "time-share",
        f"{share:.0%} of a step is matmuls: faster matmuls alone can make it at most "
        f"{bound:.2f}x faster ({with_attention:.2f}x with the attention kernels)", evidence,
        "lower precision speeds up matmuls only; raise their share (a larger batch or "
        "hidden size per step), fuse the elementwise ops (torch.compile), and check that "
        "the largest ops above are needed",
        {"matmul_share": share, "bound": bound, "bound_with_attention": with_attention})]
