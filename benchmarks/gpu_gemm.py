"""The GEMM table of a GPU run: bf16 against each format below 16 bits, per shape.

    python benchmarks/gpu_gemm.py --device cuda --shapes 4096x4096x4096,8192x8192x8192 \\
        --out gpu-results/bench.jsonl

Per shape ``M×K×N`` (``x`` (M, K) @ ``wᵀ``, ``w`` (N, K)): a bf16 ``torch.mm``, then
each format's forward GEMM as a Linear runs it, on the route ``fp8_gemm=auto`` takes on
this device (``LinearFormat.route``: ``torch._scaled_mm`` per tensor and rowwise, the
block-scaled kernel where the probe accepts it, ``torch._int_mm`` for int8, else the
dequantizing route): the GEMM alone on cast operands, and the GEMM with both casts. Each
row checks the output against the float64 product of the unquantized operands
(``vs_fp64``: relative Frobenius error), so a kernel writing garbage shows. Formats run
fast ones first, the block-scaled ones last; each row is appended to ``--out`` as it
ends (a crash costs the rows after it only; ``benchmarks/gpu_preflight.py`` ran each
kernel in its own process before). Timings are medians of ``--repeats`` calls,
synchronized; nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time
import traceback

import torch

from mixprec.recipe.linear_format import quantizer_for

#: the formats, as recipes: per-tensor and rowwise first, block-scaled last
FORMATS = ("fp8-current", "fp8-rowwise", "int8-rowwise", "fp8-block", "mxfp8", "nvfp4")


def _timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` synchronized calls (after one)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    ts = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def _rel(y: torch.Tensor, want: torch.Tensor) -> float:
    return ((y.double() - want).norm() / want.norm().clamp_min(1e-300)).item()


def row(fmt: str | None, m: int, k: int, n: int, device: torch.device,
        repeats: int) -> dict:
    """One row: ``fmt``'s forward GEMM (``None``: bf16 ``torch.mm``) at ``m×k×n``."""
    g = torch.Generator(device).manual_seed(0)
    x = torch.randn(m, k, device=device, generator=g, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, generator=g, dtype=torch.bfloat16)
    want = x.double() @ w.double().t()
    line = {"bench": "gemm", "format": fmt or "bf16", "m": m, "k": k, "n": n,
            "device": str(device)}
    if fmt is None:
        wt = w.t()
        line.update(route="torch.mm", vs_fp64=_rel(x @ wt, want))
        line["gemm_ms"] = _timed(lambda: x @ wt, device, repeats) * 1e3
        line["with_casts_ms"] = line["gemm_ms"]
    else:
        q = quantizer_for(fmt)
        route = q.route(device)

        def casts():
            return q.cast(x, "input", 1, {}), q.cast(w, "weight", 1, {}).t()

        with q.gemm_context():
            xq, wq = casts()
            y = q.mm(xq, wq, torch.bfloat16, route)
            line.update(route=route, vs_fp64=_rel(y, want))
            line["gemm_ms"] = _timed(lambda: q.mm(xq, wq, torch.bfloat16, route), device,
                                     repeats) * 1e3
            line["with_casts_ms"] = _timed(lambda: q.mm(*casts(), torch.bfloat16, route),
                                           device, repeats) * 1e3
    flops = 2 * m * k * n
    line["gemm_tflops"] = flops / line["gemm_ms"] / 1e9
    line["with_casts_tflops"] = flops / line["with_casts_ms"] / 1e9
    return line


def _interrupted(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", default="4096x4096x4096,8192x8192x8192",
                    help="comma-separated MxKxN")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", help="append one JSON line per row to this file")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupted)
    device = torch.device(args.device)
    shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",") if s]
    formats = [None, *(f for f in args.formats.split(",") if f)]
    failed = False
    for m, k, n in shapes:
        base = None
        for fmt in formats:
            t = time.perf_counter()
            try:
                line = row(fmt, m, k, n, device, args.repeats)
                line["status"] = "ok"
                base = line["with_casts_ms"] if fmt is None else base
                if base:
                    line["vs_bf16"] = line["with_casts_ms"] / base
                    line["gemm_vs_bf16"] = line["gemm_ms"] / base
            except KeyboardInterrupt as e:
                line = {"bench": "gemm", "format": fmt or "bf16", "m": m, "k": k, "n": n,
                        "status": "error", "error": f"interrupted ({e or 'SIGINT'})"}
                _write(line, args.out)
                return 130
            except Exception as e:  # this row's error; the next format runs
                failed = True
                line = {"bench": "gemm", "format": fmt or "bf16", "m": m, "k": k, "n": n,
                        "status": "error", "error": f"{type(e).__name__}: {e}"[:1000],
                        "traceback": traceback.format_exc()[-2000:]}
            line["seconds"] = round(time.perf_counter() - t, 2)
            _write(line, args.out)
    return 1 if failed else 0


def _write(line: dict, out: str | None) -> None:
    text = json.dumps(line, default=str) + "\n"
    if out:
        with open(out, "a") as f:
            f.write(text)
    sys.stdout.write(text)
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
