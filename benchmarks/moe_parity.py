"""50 steps of every tiny transformers MoE family under every low-precision format.

    python benchmarks/moe_parity.py [--models mixtral,gpt_oss] [--recipes fp8,nvfp4]
                                    [--steps 50]

Each family (tests/helpers/moe_models.py: Mixtral, Qwen3-MoE, DeepSeek-V3, GPT-OSS; 2 layers,
hidden 64, 4 experts, top-2) trains with AdamW (lr 3e-3) on a fresh batch of a Markov
stream each step (8 × 16 tokens; loss floor ln 4 = 1.39), from the same initial weights
and batches, under bf16-master and each fp8/fp4 recipe. For each recipe it checks that
the experts ran in the format: every experts projection holds an ``ExpertsFormat`` of
the recipe's scaling, the coverage reports the experts in the recipe, and mixprec's
grouped GEMM ran 4 times a step (2 layers × 2 projections). The table: the final loss
(mean of the last 5) and its difference from bf16-master's, against a 2% bound.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers.moe_models import (  # noqa: E402
    MODELS,
    VOCAB,
    count_experts_gemms,
    markov_batches,
    model,
    train,
)
from mixprec import MixedPrecision  # noqa: E402
from mixprec.experts import experts_formats  # noqa: E402
from mixprec.recipe import Recipe  # noqa: E402
from mixprec.recipe.linear_format import quantizer_for  # noqa: E402

RECIPES = ("fp8", "fp8-current", "fp8-rowwise", "fp8-block", "mxfp8", "nvfp4",
           "int8-rowwise")
LR, BOUND, TAIL = 3e-3, 0.02, 5


def run(kind: str, recipe: str, steps: int) -> list[float]:
    """The losses of ``steps`` steps of family ``kind`` under ``recipe``; raises if
    the experts did not run in the recipe's format."""
    m = model(kind)
    engine = MixedPrecision(m, torch.optim.AdamW(m.parameters(), lr=LR), recipe)
    with count_experts_gemms() as counted:
        losses = train(m, engine, markov_batches(steps))
    formats = experts_formats(m)
    if recipe == "bf16-master":
        if formats or counted.calls:
            raise RuntimeError(f"{kind}: bf16-master ran {counted.calls} quantized "
                               "experts GEMMs")
        return losses
    want = quantizer_for(Recipe.coerce(recipe)).name
    got = {f.scaling for f in formats.values()}
    shares = engine.coverage.shares("experts")
    if len(formats) != 4 or got != {want} or shares != {recipe: 1.0} \
            or counted.calls != 4 * steps:
        raise RuntimeError(f"{kind} under {recipe}: the experts did not run in the format "
                           f"({len(formats)} ExpertsFormats of scaling {got}, want 4 of "
                           f"{want!r}; coverage {shares}; {counted.calls} grouped GEMMs "
                           f"for {steps} steps, want {4 * steps})")
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    models, recipes = args.models.split(","), args.recipes.split(",")
    print(f"# {args.steps} steps, AdamW lr {LR}, Markov stream (floor ln 4 = "
          f"{math.log(4):.3f}, start ln {VOCAB} = {math.log(VOCAB):.3f}); final = mean "
          f"of the last {TAIL} losses; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    print(f"| {'model':<11} | {'recipe':<12} | {'final':>6} | {'vs bf16-master':>14} | "
          f"{'within 2%':<9} | {'s':>5} |")
    print(f"|{'-' * 13}|{'-' * 14}|{'-' * 8}|{'-' * 16}|{'-' * 11}|{'-' * 7}|")
    outside = []
    for kind in models:
        ref = None
        for recipe in ["bf16-master", *recipes]:
            t = time.perf_counter()
            try:
                losses = run(kind, recipe, args.steps)
            except Exception as e:  # one failing case prints and the table goes on
                print(f"| {kind:<11} | {recipe:<12} | failed: {type(e).__name__}: {e}")
                outside.append((kind, recipe))
                continue
            final = sum(losses[-TAIL:]) / TAIL
            secs = time.perf_counter() - t
            if recipe == "bf16-master":
                ref = final
                print(f"| {kind:<11} | {recipe:<12} | {final:>6.3f} | {'':>14} | {'':<9} | "
                      f"{secs:>5.0f} |", flush=True)
                continue
            diff = (final - ref) / ref if ref else float("nan")
            ok = abs(diff) <= BOUND
            if not ok:
                outside.append((kind, recipe))
            print(f"| {kind:<11} | {recipe:<12} | {final:>6.3f} | {diff:>+13.2%} | "
                  f"{'yes' if ok else 'NO':<9} | {secs:>5.0f} |", flush=True)
    if outside:
        print(f"# outside the {BOUND:.0%} bound or failed: "
              + ", ".join(f"{k} {r}" for k, r in outside))
        sys.exit(1)


if __name__ == "__main__":
    main()
