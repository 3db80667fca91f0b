"""Optimizer step time: mixprec.optim against torch's AdamW and torchao's low-bit AdamWs.

    python benchmarks/optim_speed.py [--size medium] [--rounds 20] [--skip-torchao]

The parameters of the workbench GPT (the compare default size), fp32, with fixed random
gradients. Each round times one step of every optimizer, in rotating order, so load
hits them alike; the table gives the median step and, for each one, the median of its
per-round ratio to torch's fused AdamW (paired rounds) with quartiles. torchao's
``AdamW8bit`` compiles its step with ``torch.compile`` (a C++ compiler is needed on the
CPU); its first steps, the compilation, are not timed. No figure is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import mixprec.optim as mo
from mixprec.workbench.compare import cpu_name
from mixprec.workbench.model import GPT, SIZES


def _params(cfg):
    torch.manual_seed(0)
    model = GPT(cfg)
    ps = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    g = torch.Generator().manual_seed(1)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    return ps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", default="medium", choices=list(SIZES))
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--skip-torchao", action="store_true")
    args = ap.parse_args()
    cfg = SIZES[args.size]
    makers = {
        "torch AdamW(fused=True)": lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
        "torch AdamW (default)": lambda p: torch.optim.AdamW(p, lr=1e-3),
        "mixprec AdamW fp32": lambda p: mo.AdamW(p, lr=1e-3),
        "mixprec AdamW fp32 fused": lambda p: mo.AdamW(p, lr=1e-3, fused=True),
        "mixprec AdamW bf16": lambda p: mo.AdamW(p, lr=1e-3, states="bf16"),
        "mixprec AdamW fp8": lambda p: mo.AdamW(p, lr=1e-3, states="fp8"),
        "mixprec AdamW int8": lambda p: mo.AdamW(p, lr=1e-3, states="int8"),
        "mixprec AdamW int8 fused": lambda p: mo.AdamW(p, lr=1e-3, states="int8", fused=True),
        "mixprec AdamW int4": lambda p: mo.AdamW(p, lr=1e-3, states="int4"),
    }
    if not args.skip_torchao:
        try:
            from torchao.optim import AdamW4bit, AdamW8bit, AdamWFp8

            makers["torchao AdamW8bit"] = lambda p: AdamW8bit(p, lr=1e-3)
            makers["torchao AdamWFp8"] = lambda p: AdamWFp8(p, lr=1e-3)
            makers["torchao AdamW4bit"] = lambda p: AdamW4bit(p, lr=1e-3)
        except ImportError:
            pass
    opts = {k: make(_params(cfg)) for k, make in makers.items()}
    for o in opts.values():  # warm-up (torchao compiles here)
        for _ in range(3):
            o.step()
    names = list(opts)
    times = {k: [] for k in names}
    for i in range(args.rounds):
        for k in names[i % len(names):] + names[:i % len(names)]:
            t = time.perf_counter()
            opts[k].step()
            times[k].append(time.perf_counter() - t)
    base = "torch AdamW(fused=True)"
    print(f"# benchmarks/optim_speed.py: workbench GPT {args.size} parameters "
          f"({cfg.n_params / 1e6:.1f}M in {len(list(opts[base].param_groups[0]['params']))} "
          f"tensors), {args.rounds} rounds, {cpu_name()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'optimizer':<26}{'step ms':>9}{'vs fused':>10}{'(IQR)':>18}")
    for k in names:
        ratios = sorted(a / b for a, b in zip(times[k], times[base]))
        q = statistics.quantiles(ratios, n=4)
        print(f"{k:<26}{statistics.median(times[k]) * 1e3:>9.2f}"
              f"{statistics.median(ratios):>9.2f}x  ({q[0]:.2f}..{q[2]:.2f}x)")


if __name__ == "__main__":
    main()
