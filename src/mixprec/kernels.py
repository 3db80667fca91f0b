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
#: kernel, and ``emulate=auto`` emulates it on fp32 kernels instead.
FAST_ENOUGH = 0.5


@cache
def matmul_gflops(device: str, dtype: torch.dtype, n: int = 512, seconds: float = 0.05
                  ) -> float:
    """Measured GFLOP/s of an n×n matmul in ``dtype`` on ``device`` (cached)."""
    dev = torch.device(device)
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=g).to(dev, dtype)
    b = torch.randn(n, n, generator=g).to(dev, dtype)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    a @ b  # warm-up
    sync()
    k, t0 = 0, time.perf_counter()
    while True:
        a @ b
        k += 1
        sync()
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds and k >= 2:
            break
    return k * 2 * n**3 / elapsed / 1e9


def relative_speed(device: torch.device | str, dtype: torch.dtype) -> float:
    """Matmul throughput in ``dtype`` divided by fp32's, on ``device``."""
    dev = str(torch.device(device))
    return matmul_gflops(dev, dtype) / matmul_gflops(dev, torch.float32)
