"""The formats below 16 bits against bf16-master, compiled, on this CPU, and what bounds them.

    python benchmarks/compiled_formats.py [--size base] [--batch 8] [--steps 6]
                                          [--rounds 7] [--only steps,gemms,casts]

1. ``steps``: the workbench GPT's training step under ``torch.compile`` (inductor) for
   ``bf16-master``, ``int8-rowwise`` and ``fp8-current`` (``--recipes``), each built by
   ``mixprec bench``'s own loop (``workbench.bench._engine_loop``: the engine, the
   recipe's ``adamw_for``, the model compiled), all in one process and interleaved step
   by step, the order rotating each round. The table gives each recipe's median step
   and the median of its per-round ratio to bf16-master's step with the quartiles.
2. ``gemms``: per GEMM shape ``M×K×N``, int8 (the two rowwise casts,
   ``torch._int_mm``, the scales) eager and compiled (one ``torch.compile(dynamic=True)``
   for every shape), and ``torch._int_mm`` alone, against a bf16 ``torch.mm``; the
   GFLOP/s of bf16 and of ``_int_mm`` alone. Interleaved round by round; ratios are
   ``bf16 time / its time`` (above 1: faster than bf16).
3. ``casts``: the bandwidth of each cast on a 2-D bf16 tensor (bytes read + written over
   its time, GB/s), eager and compiled, beside ``clone()`` (memcpy) and one fp32 pass.

No timing is asserted anywhere; the figures fill docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from mixprec.formats.gemm.int8 import cast_int8_rowwise
from mixprec.recipe import Recipe
from mixprec.recipe.linear_format import quantizer_for
from mixprec.workbench.bench import _engine_loop, _workload
from mixprec.workbench.compare import cpu_name

#: the GEMM sweep: square shapes, then the GPT base step's GEMMs at batch 8 (2048 tokens)
GEMMS = [(256, 256, 256), (512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048),
         (4096, 4096, 4096), (2048, 512, 1536), (2048, 512, 2048), (2048, 2048, 512),
         (8192, 1024, 1024)]


def _rounds(fns: dict, rounds: int, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds per call of each of ``fns``, one call each per round, the order rotating."""
    names = list(fns)
    times: dict[str, list[float]] = {k: [] for k in names}
    for i in range(warmup + rounds):
        for k in names[i % len(names):] + names[:i % len(names)]:
            t = time.perf_counter()
            fns[k]()
            if i >= warmup:
                times[k].append(time.perf_counter() - t)
    return times


def _ratio(times: list[float], base: list[float]) -> tuple[float, float, float]:
    """Median and quartiles of the per-round ratio ``times / base``."""
    r = sorted(a / b for a, b in zip(times, base))
    q = statistics.quantiles(r, n=4, method="inclusive") if len(r) > 1 else [r[0]] * 3
    return statistics.median(r), q[0], q[2]


def steps(args) -> None:
    dev = torch.device("cpu")
    build, loss_of, tokens, flops, seq = _workload("gpt", args.size, args.batch, None, dev)
    fns = {}
    for r in args.recipes:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fns[r] = _engine_loop(build, Recipe.coerce(r), loss_of, compiled=True)[2]
    t = time.perf_counter()
    for r, fn in fns.items():  # the compile, untimed
        fn()
        print(f"# {r} compiled after {time.perf_counter() - t:.0f} s", flush=True)
    compile_s = time.perf_counter() - t
    times = _rounds(fns, args.steps, warmup=1)
    base = times[args.recipes[0]]
    print(f"\n## Compiled step: GPT {args.size}, batch {args.batch} × seq {seq} "
          f"({tokens} tokens), {args.steps} interleaved rounds (compile {compile_s:.0f} s)\n")
    print(f"| recipe | compiled step (ms) | vs {args.recipes[0]} (median) | quartiles "
          "| GFLOP/s |")
    print("|---|---|---|---|---|")
    for r, ts in times.items():
        med, q1, q3 = _ratio(ts, base)
        print(f"| {r} | {statistics.median(ts) * 1e3:.1f} | **{med:.2f}x** "
              f"| {q1:.2f}-{q3:.2f} | {flops / statistics.median(ts) / 1e9:.0f} |",
              flush=True)


def _int8(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    qa, sa = cast_int8_rowwise(a, 1)
    qb, sb = cast_int8_rowwise(b, 1)
    return (torch._int_mm(qa, qb.t()).float() * sa * sb.t()).to(torch.bfloat16)


def _gemm_times(m: int, k: int, n: int, compiled, rounds: int) -> dict[str, list[float]]:
    """Seconds per call of bf16 ``mm``, int8 eager and compiled, ``_int_mm`` alone."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=g).bfloat16()
    b = torch.randn(n, k, generator=g).bfloat16()
    ac, bc = cast_int8_rowwise(a, 1)[0], cast_int8_rowwise(b, 1)[0].t()
    bt = b.t()
    with torch.no_grad():
        compiled(a, b)  # compile (once: dynamic shapes) before the rounds
        return _rounds({"bf16": lambda: a @ bt, "eager": lambda: _int8(a, b),
                        "compiled": lambda: compiled(a, b),
                        "int_mm": lambda: torch._int_mm(ac, bc)}, rounds)


def gemms(args) -> None:
    compiled = torch.compile(_int8, dynamic=True)
    print("\n## GEMM sweep: int8 rowwise (casts + `torch._int_mm` + scales) against bf16 "
          "`torch.mm`\n")
    print("| M×K×N | bf16 mm (ms) | bf16 GFLOP/s | int8 eager vs bf16 | int8 compiled vs "
          "bf16 | `_int_mm` alone vs bf16 | `_int_mm` GFLOP/s |")
    print("|---|---|---|---|---|---|---|")
    for m, k, n in GEMMS:
        if 2 * m * k * n / 1e9 > args.max_gflop:
            continue
        t = _gemm_times(m, k, n, compiled, args.rounds)
        fl = 2 * m * k * n / 1e9
        bf, im = statistics.median(t["bf16"]), statistics.median(t["int_mm"])
        inv = {k: 1 / _ratio(v, t["bf16"])[0] for k, v in t.items()}
        print(f"| {m}×{k}×{n} | {bf * 1e3:.2f} | {fl / bf:.0f} | {inv['eager']:.2f}x "
              f"| **{inv['compiled']:.2f}x** | {inv['int_mm']:.2f}x | {fl / im:.0f} |",
              flush=True)


def casts(args) -> None:
    m, k = args.cast_shape
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(0)).bfloat16()
    fp8 = quantizer_for("fp8-current")

    def int8_cast():
        return cast_int8_rowwise(x, 1)

    def fp8_cast():
        return fp8.cast(x, "input", 1, {})

    c_int8 = torch.compile(int8_cast)
    c_fp8 = torch.compile(fp8_cast)
    with torch.no_grad():
        c_int8(), c_fp8()
        fns = {"clone (memcpy)": x.clone, "one fp32 pass (x.float())": x.float,
               "int8 rowwise, eager": int8_cast, "int8 rowwise, compiled": c_int8,
               "fp8 current, eager": fp8_cast, "fp8 current, compiled": c_fp8}
        t = _rounds(fns, args.rounds)
    out_bytes = {"clone (memcpy)": 2, "one fp32 pass (x.float())": 4}
    print(f"\n## Casts of a {m}×{k} bf16 tensor: bytes read + written per second\n")
    print("| operation | ms | GB/s | vs memcpy's time |")
    print("|---|---|---|---|")
    base = statistics.median(t["clone (memcpy)"])
    for name, ts in t.items():
        med = statistics.median(ts)
        moved = m * k * (2 + out_bytes.get(name, 1))  # read bf16, write the codes
        print(f"| {name} | {med * 1e3:.2f} | {moved / med / 1e9:.1f} | {med / base:.1f}x |",
              flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="base")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--recipes", default="bf16-master,int8-rowwise,fp8-current",
                   help="comma-separated; the first is the baseline")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--max-gflop", type=float, default=float("inf"))
    p.add_argument("--cast-shape", type=int, nargs=2, default=(2048, 2048))
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--only", default="steps,gemms,casts")
    args = p.parse_args()
    args.recipes = args.recipes.split(",")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_name()}, capability {torch.backends.cpu.get_cpu_capability()}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    parts = args.only.split(",")
    for name, fn in (("casts", casts), ("gemms", gemms), ("steps", steps)):
        if name in parts:
            fn(args)


if __name__ == "__main__":
    main()
