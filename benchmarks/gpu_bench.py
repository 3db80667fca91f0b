"""One recipe of ``mixprec bench`` in its own process, as one JSON line.

    python benchmarks/gpu_bench.py --list                 # the GPU run's recipes and boxes
    python benchmarks/gpu_bench.py --recipe fp8 --device cuda --size large --batch 4 \\
        --steps 4 --warmup 1 --out gpu-results/bench.jsonl

``benchmarks/gpu.sh`` runs one process per recipe, each in its own time box, so an
out-of-memory error or a crash costs that recipe's line only. The line holds the
bench's row (step time, tokens/s, MFU against the peak the bench measures for the
recipe's route, the allocator's peak, the route each fp8 Linear took, the engine's
kernel choices) and every warning raised, the fp8 route probe's among them. A recipe
that raises, or is interrupted (SIGINT or SIGTERM at the end of its box), still writes
its line: ``status`` ``error`` with the exception. The line is appended to ``--out``
in one write (and printed).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
import traceback
import warnings

#: the GPU run's recipes and their time boxes (seconds), fast ones first, those on
#: dequantizing fp32 GEMMs on sm90 (fp8-block where the probe refuses the kernel, MX,
#: NVFP4) last
RECIPES = (("bf16", 25), ("bf16-master", 25), ("fp16", 25), ("fp8", 25),
           ("fp8-rowwise", 25), ("tf32", 30), ("bf16-master,wgrad=fp32", 30),
           ("fp32", 40), ("fp8-block", 45), ("mxfp8", 45), ("nvfp4", 45))


def _interrupted(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _probe_route(recipe: str, device: str) -> str | None:
    """The GEMM route an fp8 recipe's Linears take on ``device`` (this runs the
    block-scaled probe under ``fp8_gemm=auto``, so its warnings are caught here)."""
    from mixprec.recipe import Recipe

    fmt = Recipe.coerce(recipe).linear
    return None if fmt is None else fmt.route(device)


def run_one(args: argparse.Namespace) -> dict:
    """The line for ``args.recipe``: the bench row with the run's settings, or the
    error; with the warnings raised and the wall time."""
    t0 = time.perf_counter()
    line = {"recipe": args.recipe, "status": "error", "device": args.device,
            "size": args.size, "batch": args.batch, "seq": args.seq, "steps": args.steps,
            "warmup": args.warmup}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            import torch

            from mixprec.workbench.bench import bench

            line["torch"] = torch.__version__
            if args.device == "cuda" and not torch.cuda.is_available():
                raise RuntimeError("--device cuda: no CUDA device here")
            line["probe_route"] = _probe_route(args.recipe, args.device)
            result = bench([args.recipe], size=args.size, batch=args.batch, seq=args.seq,
                           steps=args.steps, warmup=args.warmup, device=args.device)
            line.update(result["rows"][0], status="ok", seq=result["seq"],
                        flops_per_step=result["flops_per_step"])
            line.pop("speedup_vs_fp32", None)  # one recipe: no fp32 row to compare with
        except KeyboardInterrupt as e:
            line["error"] = f"interrupted ({e or 'SIGINT'}): the recipe's time box ended"
        except BaseException as e:  # whatever it is, the line is written
            line["error"] = f"{type(e).__name__}: {e}"[:2000]
            line["traceback"] = traceback.format_exc()[-3000:]
    seen = []
    for w in caught:
        text = f"{w.category.__name__}: {w.message}"[:500]
        if text not in seen:
            seen.append(text)
    line["warnings"] = seen[:20]
    line["wall_s"] = round(time.perf_counter() - t0, 2)
    return line


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--list", action="store_true",
                    help="print the GPU run's recipes, one 'recipe<TAB>box seconds' a line")
    ap.add_argument("--recipe")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", default="large")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", help="append the line to this file")
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(f"{r}\t{box}" for r, box in RECIPES))
        return 0
    if not args.recipe:
        ap.error("--recipe is required (or --list)")
    signal.signal(signal.SIGTERM, _interrupted)
    line = run_one(args)
    text = json.dumps(line, default=str) + "\n"
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)
    sys.stdout.write(text)
    return 0 if line["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
