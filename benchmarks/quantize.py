"""Throughput of mixprec.formats.elements.quantize per format (M elements/s), on this machine.

    python benchmarks/quantize.py [--numel 4194304] [--repeats 9]

Runs each format in turn, round-robin, and reports the median over the rounds, so a
noisy neighbour hits every format alike. fp32 inputs; round-to-nearest unless noted.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from mixprec.formats import elements as formats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--numel", type=int, default=1 << 22)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    x = torch.randn(args.numel) * 100
    cases = [(n, "nearest") for n in formats.names()] + [("fp8_e4m3", "stochastic")]
    times: dict[tuple[str, str], list[float]] = {c: [] for c in cases}
    for _ in range(args.repeats):
        for name, rounding in cases:
            t = time.perf_counter()
            formats.quantize(x, name, rounding=rounding)
            times[(name, rounding)].append(time.perf_counter() - t)
    print(f"# quantize throughput: {args.numel} fp32 elements, median of {args.repeats}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}")
    print(f"{'format':<10} {'rounding':<10} {'M elem/s':>9}")
    for (name, rounding), ts in times.items():
        print(f"{name:<10} {rounding:<10} {args.numel / statistics.median(ts) / 1e6:>9.1f}")


if __name__ == "__main__":
    main()
