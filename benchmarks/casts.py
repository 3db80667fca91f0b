"""Cast speed on this CPU: NVFP4, MXFP8 and fp8 block casts, per million elements.

    python benchmarks/casts.py [--rounds 15] [--shape 2048x2048]

Each round times every cast once, in turn, on the same fp32 tensor (best of 3 calls);
the table gives the median over rounds of each cast's time and of its ratio to the MX
cast in the same round (interleaved, so the ratio survives a noisy host). One thread
count (torch's default) and one process; the CPU is named in the header."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mixprec.formats.blocks import cast_mx, cast_tiles
from mixprec.formats.fp4 import cast_nvfp4
from mixprec.workbench.compare import cpu_name

CASTS = {
    "MXFP8 (e4m3, e8m0 per 32)": lambda x: cast_mx(x, 1),
    "NVFP4 1×16": lambda x: cast_nvfp4(x, 1),
    "NVFP4 16×16 (weights)": lambda x: cast_nvfp4(x, 1, square=True),
    "NVFP4 1×16, stochastic": lambda x: cast_nvfp4(x, 1, generator=torch.Generator()
                                                   .manual_seed(0)),
    "fp8 1×128 tiles": lambda x: cast_tiles(x, 1, torch.float8_e4m3fn),
}


def _best(fn, x, n: int = 3) -> float:
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--shape", default="2048x2048")
    args = ap.parse_args()
    m, n = (int(v) for v in args.shape.split("x"))
    x = torch.randn(m, n, generator=torch.Generator().manual_seed(0))
    for fn in CASTS.values():  # warm up
        fn(x)
    times: dict[str, list[float]] = {k: [] for k in CASTS}
    for _ in range(args.rounds):
        for name, fn in CASTS.items():
            times[name].append(_best(fn, x))
    mx = times[next(iter(CASTS))]
    per_m = (m * n) / 1e6
    print(f"# benchmarks/casts.py --rounds {args.rounds} --shape {args.shape}: {cpu_name()}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| cast | ms per million elements | vs MXFP8 (median of rounds) |")
    print("|---|---|---|")
    for name, ts in times.items():
        ratio = statistics.median(t / b for t, b in zip(ts, mx))
        print(f"| {name} | {statistics.median(ts) / per_m * 1e3:.2f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
