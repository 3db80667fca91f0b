"""Draw the README's figure: training loss of each recipe of one `mixprec compare` run.

    python benchmarks/readme_figure.py                       # runs `mixprec compare` first
    python benchmarks/readme_figure.py --report runs/compare/report.json

Writes docs/loss-curves.png (smoothed training loss, validation points, the machine and
the command in the caption)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--report", default=None, help="a report.json from `mixprec compare`")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--out", default=str(ROOT / "docs" / "loss-curves.png"))
    args = ap.parse_args()
    if args.report is None:
        from mixprec.workbench.compare import compare

        report = compare(steps=args.steps, out=ROOT / "runs" / "readme-figure",
                         progress=False)
    else:
        report = json.loads(Path(args.report).read_text())

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.6), dpi=120)
    for recipe, c in report["curves"].items():
        ys, k = c["loss"], max(1, len(c["loss"]) // 30)
        smooth = [sum(ys[max(0, i - k + 1): i + 1]) / len(ys[max(0, i - k + 1): i + 1])
                  for i in range(len(ys))]
        (line,) = ax.plot(c["steps"], smooth, lw=1.6, label=recipe)
        ax.plot(c["val_steps"], c["val_loss"], "o", ms=3.5, color=line.get_color())
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("mixprec compare, one seed: training loss (smoothed) and validation (dots)",
                 fontsize=10)
    ax.legend(frameon=False, fontsize=8)
    ax.grid(alpha=0.3)
    fig.text(0.01, 0.01, f"{report['machine']}; python benchmarks/readme_figure.py",
             fontsize=6, color="gray")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
