"""A training step's peak memory: ``estimate()``'s prediction against
``measure(..., peak=True)``'s measured high-water mark, for every preset.

    python benchmarks/memory_peak.py [--size medium] [--batch 8] [--recipes fp32,bf16]

The workbench GPT (``--size``, the compare default ``medium``: 4 layers, d=256,
sequence 128) with each preset's optimizer (``mixprec.optim.adamw_for``), after two
steps. The prediction uses the model and a transformer spec of its shape
(``F.scaled_dot_product_attention``: flash, no dropout); the measurement takes one real
step (undone afterwards) under ``torch.profiler``'s memory events. MB = 2^20 bytes.
No figure is asserted here (tests/test_memory_peak.py asserts the bound)."""

from __future__ import annotations

import argparse
import warnings

import torch

from mixprec import MixedPrecision
from mixprec.memory import TransformerSpec, estimate, measure
from mixprec.optim import adamw_for
from mixprec.recipe import PRESETS
from mixprec.workbench.compare import cpu_name
from mixprec.workbench.model import GPT, SIZES


def peaks(recipe: str, size: str = "medium", batch: int = 8) -> tuple[float, float, float]:
    """``(steady, estimated peak, measured peak)`` in bytes for one preset."""
    cfg = SIZES[size]
    torch.manual_seed(0)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab, (batch, cfg.seq_len + 1))
    spec = TransformerSpec(layers=cfg.n_layers, hidden=cfg.d_model, heads=cfg.n_heads,
                           seq_len=cfg.seq_len, micro_batch=batch, vocab=cfg.vocab,
                           attention="flash", dropout=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        predicted = estimate(model, recipe, activations=spec)
        engine = MixedPrecision(model, adamw_for(recipe, model.parameters(), lr=1e-3),
                                recipe)
        for _ in range(2):
            with engine.autocast():
                loss = model(idx[:, :-1], idx[:, 1:])
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
        got = measure(model, engine, (idx[:, :-1], idx[:, 1:]), peak=True)
    steady = sum(v for k, v in got.items.items() if k not in ("activations",
                                                               "weight_casts"))
    return steady, predicted.peak, got.peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="medium")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--recipes", default=",".join(PRESETS))
    args = ap.parse_args()
    print(f"# benchmarks/memory_peak.py --size {args.size} --batch {args.batch}: "
          f"{cpu_name()}, torch {torch.__version__}")
    print("| recipe | steady MB | estimated peak MB | measured peak MB | estimate / measured |")
    print("|---|---|---|---|---|")
    mb = 2.0 ** 20
    for r in args.recipes.split(","):
        steady, est, got = peaks(r, args.size, args.batch)
        print(f"| `{r}` | {steady / mb:.1f} | {est / mb:.1f} | {got / mb:.1f} | "
              f"{est / got:.3f} |", flush=True)


if __name__ == "__main__":
    main()
