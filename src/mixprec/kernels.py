"""How fast this device multiplies in each dtype, measured, not assumed.

``matmul_gflops(device, dtype)`` times a square matmul for about ``seconds`` and caches
the result per (device, dtype, n). ``relative_speed(device, dtype)`` is that over fp32's.
The engine uses it to decide ``emulate=auto``, and the doctor reports it. Whether fp16
is fast on a CPU depends on the chip: with AVX512-FP16 (this project's Xeon) an fp16
matmul runs at fp32's speed, and without it at a small fraction of that.
"""

from __future__ import annotations

import time
from functools import cache

import torch

__all__ = ["matmul_gflops", "relative_speed", "FAST_ENOUGH"]

#: below this fraction of fp32's matmul throughput a format counts as having no fast
#: kernel, and ``emulate=auto`` emulates it on fp32 kernels instead. Chips either have
#: units for a format (~1x fp32 or better) or emulate it in software (~0.02x), so the
#: threshold sits far from both and a busy machine cannot flip the decision.
FAST_ENOUGH = 0.2


@cache
def matmul_gflops(device: str, dtype: torch.dtype, n: int = 512, seconds: float = 0.05
                  ) -> float:
    """GFLOP/s of an n×n matmul in ``dtype`` on ``device``: the fastest single call within
    about ``seconds`` (best-of is what a busy machine distorts least). Cached."""
    dev = torch.device(device)
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=g).to(dev, dtype)
    b = torch.randn(n, n, generator=g).to(dev, dtype)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    a @ b  # warm-up
    sync()
    best, k, t_end = float("inf"), 0, time.perf_counter() + seconds
    while k < 3 or time.perf_counter() < t_end:
        t = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - t)
        k += 1
    return 2 * n**3 / best / 1e9


@cache
def relative_speed(device: torch.device | str, dtype: torch.dtype) -> float:
    """Matmul throughput in ``dtype`` over fp32's on ``device``: best-of timings of the
    two, taken alternately so that load hits both (cached)."""
    dev = str(torch.device(device))
    ratios = []
    for _ in range(3):
        fast = matmul_gflops.__wrapped__(dev, dtype, 256, 0.01)
        base = matmul_gflops.__wrapped__(dev, torch.float32, 256, 0.01)
        ratios.append(fast / base)
    return sorted(ratios)[1]
