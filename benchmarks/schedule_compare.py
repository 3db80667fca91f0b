"""NVFP4, bf16-master and the schedule "nvfp4>bf16-master@0.8" (NVFP4, then bf16 with
fp32 masters for the last 20% of the steps) trained by ``mixprec compare`` from the same
seed and data; prints the final validation losses as a Markdown table.

    PYTHONPATH=src python benchmarks/schedule_compare.py --steps 100 --size tiny
"""

from __future__ import annotations

import argparse
import platform

import torch

from mixprec.workbench.compare import compare

RECIPES = ["nvfp4", "bf16-master", "nvfp4>bf16-master@0.8"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--out", default="runs/schedule-compare")
    a = ap.parse_args()
    report = compare(RECIPES, steps=a.steps, size=a.size, batch=a.batch, out=a.out,
                     progress=False, doctor_steps=1)
    rows = {r["recipe"]: r for r in report["summary"]}
    ref = rows["bf16-master"]["final_val_loss"]
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{a.steps} steps, size {a.size}, batch {a.batch}")
    print("| recipe | final val loss | vs bf16-master |")
    print("|---|---|---|")
    for name in RECIPES:
        loss = rows[name]["final_val_loss"]
        print(f"| `{name}` | {loss:.4f} | {(loss - ref) / ref * 100:+.2f}% |")


if __name__ == "__main__":
    main()
