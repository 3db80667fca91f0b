"""Cost of the NumericsMonitor on the workbench GPT at one sampled step in ``every``.

    python benchmarks/doctor.py [--every 10 --steps 40 --layers 6 --d-model 512]

Two bf16 training loops, one with the monitor, interleaved step by step (order rotating);
mean step time over whole sampling periods (a sampled step is costlier, so a median would
hide it).
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from gpt_args import add_gpt_arguments, gpt_config  # benchmarks/, next to this script
from mixprec import MixedPrecision
from mixprec.diagnostics import NumericsMonitor
from mixprec.workbench import GPT


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    add_gpt_arguments(ap, steps=40)
    ap.add_argument("--every", type=int, default=10)
    args = ap.parse_args()
    cfg = gpt_config(args)
    idx = torch.randint(0, 256, (args.batch, args.seq + 1),
                        generator=torch.Generator().manual_seed(0))

    def make(monitored: bool):
        torch.manual_seed(0)
        m = GPT(cfg)
        e = MixedPrecision(m, torch.optim.AdamW(m.parameters(), fused=True), "bf16")
        mon = NumericsMonitor(m, every=args.every) if monitored else None

        def step(i):
            ctx = mon.sample(i) if mon else torch.autograd.profiler.record_function("step")
            with ctx:
                with e.autocast():
                    loss = m(idx[:, :-1], idx[:, 1:])
                e.backward(loss)
            e.step()
        return step

    loops = {"plain": make(False), "monitored": make(True)}
    times = {k: 0.0 for k in loops}
    names = list(loops)
    for i in range(-2, args.steps):  # two warm-up steps
        for k in names[i % 2:] + names[:i % 2]:
            t = time.perf_counter()
            loops[k](i)
            if i >= 0:
                times[k] += time.perf_counter() - t
    print(f"# GPT {args.layers}x{args.d_model}, batch {args.batch}x{args.seq}, bf16, "
          f"{args.steps} steps, monitor every {args.every}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {platform.machine()}")
    for k, v in times.items():
        print(f"{k:<10} {v / args.steps * 1e3:8.1f} ms/step")
    print(f"monitor overhead: {(times['monitored'] / times['plain'] - 1) * 100:+.1f}%")


if __name__ == "__main__":
    main()
