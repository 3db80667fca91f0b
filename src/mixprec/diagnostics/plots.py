"""The doctor's pictures (matplotlib, imported here only)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from mixprec.diagnostics.monitor import NumericsMonitor
from mixprec.diagnostics.stats import HIST_EDGES, WATCHED
from mixprec.formats import elements as formats

if TYPE_CHECKING:
    import torch
    from torch import nn

    from mixprec.recipe import Recipe

__all__ = ["draw_plots"]


def draw_plots(model_factory: Callable[[], nn.Module],
               batch_fn: Callable[[nn.Module, int], torch.Tensor], recipe: Recipe | str,
               scales: Sequence[float], out: Path) -> list[str]:
    """Gradient-magnitude histogram with the formats' ranges (Micikevicius et al. 2018,
    Fig. 3), per-layer underflow fractions, and the loss-scale trace."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("doctor(plots=...) draws with matplotlib: pip install "
                          "'mixprec[cli]' (or matplotlib)") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    model = model_factory()
    mon = NumericsMonitor(model)
    with mon.sample(0):
        batch_fn(model, 0).float().backward()
    mon.remove()
    files = []
    for name, draw in (("grad_histogram.png", _histogram), ("underflow.png", _underflow)):
        fig = draw(plt, mon)
        files.append(str(out / name))
        fig.savefig(files[-1])
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 3), dpi=120)
    ax.plot(range(len(scales)), scales, marker=".")
    ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss scale")
    ax.set_title(f"Loss scale, recipe {recipe}")
    fig.tight_layout()
    files.append(str(out / "loss_scale.png"))
    fig.savefig(files[-1])
    plt.close(fig)
    return files


def _histogram(plt, mon: NumericsMonitor):
    """Activation-gradient magnitudes, under bands for each format's range."""
    hist = mon.histogram("act_grad")
    centers = [(a + b) / 2 for a, b in zip(HIST_EDGES[:-1].tolist(), HIST_EDGES[1:].tolist())]
    fig, ax = plt.subplots(figsize=(9, 4.2), dpi=120)
    total = sum(hist) or 1
    ax.bar(centers, [h / total for h in hist], width=1.0, color="tab:blue",
           label="activation gradients (fp32 pass)")
    colors = {"fp16": "tab:red", "bf16": "tab:green", "fp8_e5m2": "tab:orange"}
    for i, (name, c) in enumerate(colors.items()):
        f = formats.get(name)
        lo, hi = math.log2(f.min_subnormal), math.log2(f.max)
        top = 0.97 - 0.06 * i
        ax.axvspan(lo, hi, ymin=top - 0.045, ymax=top, color=c, alpha=0.6,
                   label=f"{name} range: 2^{lo:.0f} … 2^{hi:.0f}")
        ax.axvline(lo, color=c, linestyle=":", linewidth=1.2)
    ax.set_xlabel("log2 |gradient|")
    ax.set_ylabel("share of elements")
    ax.set_title("Activation-gradient magnitudes against each format's representable range"
                 " (dotted: smallest subnormal)", fontsize=10)
    ax.set_xlim(-140, 20)
    ax.set_ylim(0, max(h / total for h in hist) * 1.45 if any(hist) else 1)
    ax.legend(fontsize=8, loc="center left")
    fig.tight_layout()
    return fig


def _underflow(plt, mon: NumericsMonitor):
    """Per parameter: the share of gradient elements each format flushes to zero."""
    summ = {k.split(":", 1)[1]: v for k, v in mon.summary().items()
            if k.startswith("param_grad:")}
    fig, ax = plt.subplots(figsize=(9, max(3.0, 0.25 * len(summ) + 1)), dpi=120)
    names = list(summ)
    for i, fmt in enumerate(WATCHED):
        ax.barh([j + i * 0.2 for j in range(len(names))],
                [summ[n][f"{fmt}_to_zero"] for n in names], height=0.2, label=fmt)
    ax.set_yticks(range(len(names)), names, fontsize=6)
    ax.set_xlabel("share of gradient elements that flush to zero")
    ax.legend(fontsize=8)
    ax.set_title("Per-parameter gradient underflow by format (loss scale 1)")
    fig.tight_layout()
    return fig
