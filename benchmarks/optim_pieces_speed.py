"""Step time of mixprec.optim in pieces (the default) against one piece per tensor.

    python benchmarks/optim_pieces_speed.py [--shape 4096x4096] [--rounds 10]

For each state format and write rule: two optimizers over two copies of one parameter,
one stepping in pieces of ``mixprec.optim.pieces.CHUNK`` elements, one with a piece the
size of the tensor, stepped alternately; the table gives each one's median step and the
median of the per-round ratio (pieces / whole) with its quartiles. No figure is
asserted."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import mixprec.optim.pieces as chunking
from mixprec.optim import AdamW
from mixprec.workbench.compare import cpu_name

CASES = [("int8", "stochastic", torch.bfloat16), ("fp32", "stochastic", torch.bfloat16),
         ("fp32", "kahan", torch.bfloat16), ("fp32", "remainder", torch.bfloat16),
         ("int8", "nearest", torch.float32), ("fp8", "nearest", torch.float32),
         ("fp32", "nearest", torch.float32)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="4096x4096")
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    shape = tuple(int(x) for x in args.shape.split("x"))
    pieces = chunking.CHUNK
    print(f"# {cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"shape {args.shape}, CHUNK {pieces}")
    print("| states, write, weights | pieces (ms) | whole (ms) | pieces / whole (IQR) |")
    print("|---|---|---|---|")
    for states, write, dtype in CASES:
        opts = []
        for _ in range(2):
            torch.manual_seed(0)
            p = torch.nn.Parameter(torch.randn(shape).to(dtype))
            p.grad = (torch.randn(shape) * 1e-3).to(dtype)
            opts.append(AdamW([p], states=states, write=write))
        times: list[list[float]] = [[], []]
        for r in range(args.rounds + 1):
            for i in ((0, 1) if r % 2 else (1, 0)):
                chunking.CHUNK = pieces if i == 0 else 1 << 62
                t = time.perf_counter()
                opts[i].step()
                if r:  # the first round creates the states
                    times[i].append(time.perf_counter() - t)
        chunking.CHUNK = pieces
        ratios = sorted(a / b for a, b in zip(*times))
        q = statistics.quantiles(ratios, n=4)
        print(f"| {states}, {write}, {str(dtype).split('.')[-1]} | "
              f"{statistics.median(times[0]) * 1e3:.0f} | "
              f"{statistics.median(times[1]) * 1e3:.0f} | "
              f"{statistics.median(ratios):.2f} ({q[0]:.2f}..{q[2]:.2f}) |", flush=True)


if __name__ == "__main__":
    main()
