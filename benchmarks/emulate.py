"""Speed of exact fp16 emulation against fp32 (and real fp16) on the workbench GPT.

    python benchmarks/emulate.py [--layers 6 --d-model 512 --batch 8 --seq 256 --steps 6]

Interleaved steps, the order rotating each round; medians. Real fp16 kernels on this
CPU are so slow that they are timed on one step only (``--real-fp16-steps``).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
import warnings

import torch

from gpt_args import add_gpt_arguments, gpt_config  # benchmarks/, next to this script
from mixprec import MixedPrecision
from mixprec.workbench import GPT


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    add_gpt_arguments(ap, steps=6)
    ap.add_argument("--real-fp16-steps", type=int, default=1)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    cfg = gpt_config(args)
    idx = torch.randint(0, 256, (args.batch, args.seq + 1),
                        generator=torch.Generator().manual_seed(0))

    def make(recipe):
        torch.manual_seed(0)
        m = GPT(cfg)
        e = MixedPrecision(m, torch.optim.AdamW(m.parameters(), fused=True), recipe)

        def step():
            with e.autocast():
                loss = m(idx[:, :-1], idx[:, 1:])
            e.backward(loss)
            e.step()
        return step

    loops = {"fp32": make("fp32"), "fp16 emulated": make("fp16,emulate=true"),
             "fp16-master emulated": make("fp16-master,emulate=true")}
    times = {k: [] for k in loops}
    names = list(loops)
    for i in range(args.steps + 1):
        for k in names[i % len(names):] + names[:i % len(names)]:
            t = time.perf_counter()
            loops[k]()
            if i:
                times[k].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    if args.real_fp16_steps:
        real = make("fp16,emulate=false")
        ts = []
        for _ in range(args.real_fp16_steps):
            t = time.perf_counter()
            real()
            ts.append(time.perf_counter() - t)
        med["fp16 real kernels"] = statistics.median(ts)
    print(f"# GPT {args.layers}x{args.d_model} ({cfg.n_params / 1e6:.1f}M params), batch "
          f"{args.batch}x{args.seq}, medians, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {platform.machine()}")
    print(f"{'loop':<22} {'step (ms)':>10} {'vs fp32':>8}")
    for k, v in med.items():
        print(f"{k:<22} {v * 1e3:>10.1f} {med['fp32'] / v:>7.2f}x")


if __name__ == "__main__":
    main()
