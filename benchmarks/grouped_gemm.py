"""The experts' grouped GEMM per route and format, forward + backward, on this machine.

    python benchmarks/grouped_gemm.py [--tokens 2048] [--experts 8] [--k 512] [--n 1024]
                                      [--repeats 5]

Tokens are routed to the experts unevenly (one expert gets none). Baselines: the bf16
grouped GEMM (``torch._grouped_mm`` on bf16 operands) and a bf16 per-expert loop of
``torch.mm``; then ``mixprec.experts.grouped_mm`` on its ``loop`` and ``grouped``
routes for each linear format. Every case runs in turn, round-robin, and the table
reports the median over the rounds, so a noisy neighbour hits every case alike. Never
asserted anywhere: timings on a shared host are noisy.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from mixprec.experts import ExpertsFormat, grouped_mm

FORMATS = ["fp8", "fp8-current", "fp8-rowwise", "fp8-block", "mxfp8", "nvfp4"]


def _bf16_grouped(x, w, offs):
    x, w = x.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    torch._grouped_mm(x, w.transpose(1, 2), offs=offs).float().sum().backward()


def _bf16_loop(x, w, offs):
    x, w = x.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    start, outs = 0, []
    for e, end in enumerate(offs.tolist()):
        outs.append(x[start:end] @ w[e].t())
        start = end
    torch.cat(outs).float().sum().backward()


def _mixprec(fmt, route):
    def run(x, w, offs):
        x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
        grouped_mm(x, w, offs, fmt, route=route, out_dtype=torch.bfloat16
                   ).float().sum().backward()
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--k", type=int, default=512)
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.tokens, args.k, generator=g)
    w = torch.randn(args.experts, args.n, args.k, generator=g) / args.k ** 0.5
    share = torch.rand(args.experts, generator=g)
    share[1] = 0  # an expert without tokens
    counts = (share / share.sum() * args.tokens).floor().long()
    counts[0] += args.tokens - counts.sum()
    offs = counts.cumsum(0).to(torch.int32)
    cases = {("bf16", "torch._grouped_mm"): _bf16_grouped, ("bf16", "loop"): _bf16_loop}
    for name in FORMATS:
        fmt = ExpertsFormat(name)
        for route in ("loop", "grouped"):
            cases[(name, route)] = _mixprec(fmt, route)
    times: dict = {c: [] for c in cases}
    for fn in cases.values():  # warm-up: the route measurements, first-call costs
        fn(x, w, offs)
    for _ in range(args.repeats):
        for c, fn in cases.items():
            t = time.perf_counter()
            fn(x, w, offs)
            times[c].append(time.perf_counter() - t)
    flops = 3 * 2 * args.tokens * args.k * args.n  # forward, dgrad, wgrad
    print(f"# grouped GEMM fwd+bwd: {args.tokens} tokens, {args.experts} experts, "
          f"K={args.k}, N={args.n}; median of {args.repeats}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    base = statistics.median(times[("bf16", "torch._grouped_mm")])
    print(f"| {'format':<12} | {'route':<18} | {'ms':>8} | {'GFLOP/s':>8} | "
          f"{'vs bf16 grouped':>15} |")
    print(f"|{'-' * 14}|{'-' * 20}|{'-' * 10}|{'-' * 10}|{'-' * 17}|")
    for (name, route), ts in times.items():
        t = statistics.median(ts)
        print(f"| {name:<12} | {route:<18} | {t * 1e3:>8.1f} | {flops / t / 1e9:>8.1f} | "
              f"{t / base:>14.2f}x |")


if __name__ == "__main__":
    main()
