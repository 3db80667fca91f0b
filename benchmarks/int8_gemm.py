"""INT8 rowwise against bf16 on this CPU: per-shape GEMM speed and a Linear's step.

    python benchmarks/int8_gemm.py [--rounds 7] [--threads N]
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python benchmarks/int8_gemm.py

1. per GEMM shape ``M×K×N``: ``torch._int_mm`` with the two rowwise int8 casts
   (``mixprec.formats.gemm.int8.cast_int8_rowwise``) and the scales applied, against a
   bf16 ``torch.mm`` of the same shape; also the exact dequantizing route's speed (the
   fp32 GEMMs over 1024-wide chunks), ``torch._int_mm`` alone and an fp32 ``mm``, each
   as a ratio to bf16's time;
2. per Linear ``tokens × in → out``: forward + backward of ``Float8Linear`` under
   ``int8-rowwise`` on each route (``fp8_gemm=scaled_mm``: ``_int_mm``; ``dequant_fp32``:
   the exact route) against ``nn.Linear``, both in what an fp8 recipe runs the rest of
   the model in here (``mixprec.engine.devices.fp8_rest``: bf16 autocast where bf16 is fast,
   else fp32, where the int8 Linear's wgrad runs in fp32 too).

``--max-gflop`` skips shapes above that many GFLOP (a CPU without bf16 units runs a
bf16 GEMM at ~1 GFLOP/s).

Each row's kernels run interleaved, round by round (one call each), and the
table gives the median over rounds of each kernel's time and of the ratio ``bf16 time /
its time`` within the round (above 1: faster than bf16). Nothing is asserted: the
figures fill docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from torch import nn

from mixprec import Recipe
from mixprec.engine import devices as kernels
from mixprec.formats.gemm.int8 import cast_int8_rowwise, int8_gemm
from mixprec.modules.linear import Float8Linear
from mixprec.workbench.compare import cpu_name

#: GEMM shapes M×K×N: square ones, the two AMX shapes of the docs, odd ones
GEMMS = [(256, 256, 256), (512, 512, 512), (2048, 2048, 2048), (4096, 1024, 4096),
         (1024, 4096, 1024), (37, 200, 1000), (1000, 1000, 1000), (2048, 768, 3072),
         (2048, 3072, 768)]
#: Linear shapes tokens × in → out
LINEARS = [(256, 1024, 1024), (2048, 1024, 1024), (2048, 1024, 4096), (2048, 4096, 1024),
           (1000, 768, 2304)]


def _interleave(fns: dict, rounds: int) -> dict[str, tuple[float, float]]:
    """Median time of each of ``fns`` and median ratio ``bf16 / it`` over ``rounds``
    rounds that run every function once in turn."""
    for fn in fns.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    base = times["bf16"]
    return {k: (statistics.median(v), statistics.median(b / t for b, t in zip(base, v)))
            for k, v in times.items()}


def _gemm_row(m: int, k: int, n: int, rounds: int) -> str:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=g).bfloat16()
    b = torch.randn(n, k, generator=g).bfloat16()
    ac, _ = cast_int8_rowwise(a, 1)
    bc, _ = cast_int8_rowwise(b, 1)
    bt = b.t()

    def int8(use):
        qa, qsa = cast_int8_rowwise(a, 1)
        qb, qsb = cast_int8_rowwise(b, 1)
        return int8_gemm(qa, qb.t(), qsa, qsb.t(), torch.bfloat16, use)

    af, bft = a.float(), bt.float()
    got = _interleave({"bf16": lambda: a @ bt, "fp32": lambda: af @ bft,
                       "int8": lambda: int8(True),
                       "int_mm": lambda: torch._int_mm(ac, bc.t()),
                       "exact": lambda: int8(False)}, rounds)
    return (f"| {m}×{k}×{n} | {got['bf16'][0] * 1e3:.2f} | {got['int8'][0] * 1e3:.2f} "
            f"| **{got['int8'][1]:.2f}x** | {got['int_mm'][1]:.2f}x "
            f"| {got['exact'][1]:.2f}x | {got['fp32'][1]:.2f}x |")


def gemms(rounds: int, max_gflop: float) -> None:
    print("\n## GEMMs: int8 (casts + torch._int_mm + scales) against bf16 torch.mm\n")
    print("| M×K×N | bf16 mm (ms) | int8 incl. casts (ms) | vs bf16 | _int_mm alone "
          "| exact route incl. casts | fp32 mm |")
    print("|---|---|---|---|---|---|---|")
    for m, k, n in GEMMS:
        if 2 * m * k * n / 1e9 > max_gflop:
            continue
        print(_gemm_row(m, k, n, rounds), flush=True)


def _step(mod: nn.Module, x: torch.Tensor, rest: str):
    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=rest == "bf16"):
            y = mod(x)
        y.float().sum().backward()
        x.grad = None
        mod.weight.grad = mod.bias.grad = None
    return run


def _linear_row(t: int, i: int, o: int, rounds: int, rest: str) -> str:
    torch.manual_seed(0)
    lin = nn.Linear(i, o)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = Float8Linear.from_linear(nn.Linear(i, o), "int8-rowwise,fp8_gemm=scaled_mm")
        exact = Float8Linear.from_linear(nn.Linear(i, o), "int8-rowwise,fp8_gemm=dequant_fp32")
    x = torch.randn(t, i).to(getattr(torch, {"bf16": "bfloat16"}.get(rest, "float32")))
    x.requires_grad_(True)
    got = _interleave({"bf16": _step(lin, x, rest), "fast": _step(fast, x, rest),
                       "exact": _step(exact, x, rest)}, rounds)
    return (f"| {t} × {i} → {o} | {got['bf16'][0] * 1e3:.1f} "
            f"| {got['fast'][0] * 1e3:.1f} | **{got['fast'][1]:.2f}x** "
            f"| {got['exact'][0] * 1e3:.1f} | {got['exact'][1]:.2f}x |")


def linears(rounds: int, max_gflop: float) -> None:
    rest = kernels.fp8_rest(Recipe.parse("int8-rowwise"), "cpu")
    print(f"\n## Linear forward + backward: int8-rowwise against {rest} "
          f"(fp8_rest={rest})\n")
    print(f"| tokens × in → out | {rest} (ms) | int8, _int_mm (ms) | vs {rest} "
          f"| int8, exact route (ms) | vs {rest} |")
    print("|---|---|---|---|---|---|")
    for t, i, o in LINEARS:
        if 6 * t * i * o / 1e9 <= max_gflop:
            print(_linear_row(t, i, o, rounds, rest), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--only", choices=("gemms", "linears"), default=None)
    p.add_argument("--max-gflop", type=float, default=float("inf"))
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_name()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {args.rounds} rounds")
    with torch.no_grad():
        if args.only != "linears":
            gemms(args.rounds, args.max_gflop)
    if args.only != "gemms":
        linears(args.rounds, args.max_gflop)


if __name__ == "__main__":
    main()
