"""The dequant routes' per-element work on this CPU: torch's fp8 -> bf16/fp32 ``to``
against ``mixprec.formats.tensor_gemm.upcast``, and ``t.abs().amax()`` against
``mixprec.formats.scaling.abs_max``, on one operand of the compare GPT's Linears.

    python benchmarks/fp8_upcast.py [--rounds 15] [--shape 1024x256] [--threads 1]

Each round times every pair once, in turn (best of 3 calls); the table gives each
one's median over rounds and the median of the per-round ratio (interleaved, so the
ratio survives a noisy host). Both sides are bit for bit the same (the tests check
it); nothing is asserted here."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mixprec.formats.scaling import abs_max
from mixprec.formats.tensor_gemm import upcast
from mixprec.workbench.compare import cpu_name


def _best(fn, x) -> float:
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - t)
    return best


def pairs(shape: tuple[int, int]) -> dict[str, tuple]:
    """name -> (torch's way, mixprec's way, operand)."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3
    out = {}
    for f8, name in ((torch.float8_e4m3fn, "e4m3"), (torch.float8_e5m2, "e5m2")):
        codes = x.to(f8)
        for dt, dn in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
            out[f"{name} -> {dn}"] = (lambda c, dt=dt: c.to(dt),
                                      lambda c, dt=dt: upcast(c, dt), codes)
    for dt, dn in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        out[f"amax of |{dn}|"] = (lambda t: t.abs().amax(), abs_max, x.to(dt))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--shape", default="1024x256")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shape = tuple(int(v) for v in args.shape.split("x"))
    cases = pairs(shape)
    times = {k: ([], [], []) for k in cases}
    for _ in range(args.rounds):
        for k, (ref, ours, x) in cases.items():
            a, b = _best(ref, x), _best(ours, x)
            times[k][0].append(a)
            times[k][1].append(b)
            times[k][2].append(a / b)
    print(f"# benchmarks/fp8_upcast.py: {shape[0]}x{shape[1]}, {cpu_name()}, torch "
          f"{torch.__version__}, {args.threads} thread(s), median of {args.rounds} rounds")
    print(f"{'operation':<16}{'torch (us)':>12}{'mixprec (us)':>14}{'speed-up':>10}")
    for k, (a, b, r) in times.items():
        print(f"{k:<16}{statistics.median(a) * 1e6:>12.0f}{statistics.median(b) * 1e6:>14.0f}"
              f"{statistics.median(r):>9.2f}x")


if __name__ == "__main__":
    main()
