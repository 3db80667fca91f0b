"""torch's CPU flash attention at the workbench GPT's shape: bf16 against fp32, by pass.

    python benchmarks/attention.py [--batch 8 --heads 8 --seq 256 --head-dim 64 --rounds 25]

Causal self-attention, q/k/v laid out as the GPT makes them (views of one qkv tensor),
timed interleaved, round by round, in one process (medians):
- forward and backward kernels in bf16 and in fp32 (inputs already in the dtype);
- ``fp32 route``: what ``keep_fp32=...+attention_backward`` runs for bf16 inputs
  (upcast, the fp32 backward kernel, downcast of dQ/dK/dV).
GFLOP/s counts the causal half: forward 2 GEMMs, backward 5 (recomputing the scores).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=25)
    a = ap.parse_args()
    b, h, s, d = a.batch, a.heads, a.seq, a.head_dim
    g = torch.Generator().manual_seed(0)
    scale = d**-0.5
    qkv16 = torch.randn(b, s, 3, h, d, generator=g).bfloat16()
    do16 = torch.randn(b, s, h, d, generator=g).bfloat16().transpose(1, 2)
    q16, k16, v16 = qkv16.permute(2, 0, 3, 1, 4).unbind(0)  # (b, h, s, d) views
    q32, k32, v32, do32 = (t.float() for t in (q16, k16, v16, do16))
    o16, lse16 = FWD(q16, k16, v16, 0.0, True, scale=scale)
    o32, lse32 = FWD(q32, k32, v32, 0.0, True, scale=scale)

    def route():  # bf16 in, fp32 backward kernel, bf16 out
        up = [t.float() for t in (do16, q16, k16, v16, o16)]
        return [t.bfloat16() for t in BWD(*up, lse16, 0.0, True, scale=scale)]

    runs = {
        "forward bf16": lambda: FWD(q16, k16, v16, 0.0, True, scale=scale),
        "forward fp32": lambda: FWD(q32, k32, v32, 0.0, True, scale=scale),
        "backward bf16": lambda: BWD(do16, q16, k16, v16, o16, lse16, 0.0, True, scale=scale),
        "backward fp32": lambda: BWD(do32, q32, k32, v32, o32, lse32, 0.0, True, scale=scale),
        "backward fp32 route": route,
    }
    for f in runs.values():
        f()
    times = {k: [] for k in runs}
    names = list(runs)
    for i in range(a.rounds):
        for k in names[i % len(names):] + names[:i % len(names)]:
            t = time.perf_counter()
            runs[k]()
            times[k].append(time.perf_counter() - t)
    gemm = 2 * b * h * s * s * d / 2  # one causal (s x s x d) GEMM, half of it computed
    print(f"# causal attention b={b} h={h} s={s} d={d}, median of {a.rounds} interleaved "
          f"rounds, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.machine()}")
    print(f"{'pass':<22} {'ms':>8} {'GFLOP/s':>9}")
    for k, v in times.items():
        ms = statistics.median(v) * 1e3
        flops = gemm * (2 if k.startswith("forward") else 5)
        print(f"{k:<22} {ms:>8.2f} {flops / ms / 1e6:>9.0f}")


if __name__ == "__main__":
    main()
