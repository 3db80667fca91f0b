"""Model-state bytes per parameter for each optimizer-state and weight-write recipe.

    python benchmarks/optim_memory.py [--size medium]

On the workbench GPT (the compare default size): each recipe with real 16-bit tensors
(``emulate=false``, so the bytes are those of the storage a GPU would hold), one step
and one more backward (so states and gradients exist), then ``measure()`` beside
``estimate()``, item by item. Then a 70B model's account under the same recipes
(``estimate`` of a bare count, every state counted as quantized). The README's tables
come from this script.
"""

from __future__ import annotations

import argparse
import warnings

import torch

from mixprec import MixedPrecision
from mixprec.memory import estimate, measure
from mixprec.optim import adamw_for
from mixprec.workbench.compare import cpu_name
from mixprec.workbench.model import GPT, SIZES

RECIPES = ("fp32", "bf16-master", "bf16,params=bf16", "bf16-sr", "bf16-kahan",
           "bf16-remainder", "bf16-master,states=bf16", "bf16-master,states=fp8",
           "bf16-master,states=int8", "bf16-sr,states=int8", "bf16-lean")
ITEMS = ("params", "grads", "master", "optimizer")


def _real(recipe: str) -> str:
    return recipe if recipe == "fp32" else f"{recipe},emulate=false"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", default="medium", choices=list(SIZES))
    args = ap.parse_args()
    cfg = SIZES[args.size]
    idx = torch.randint(0, cfg.vocab, (1, 33), generator=torch.Generator().manual_seed(0))
    print(f"# benchmarks/optim_memory.py: workbench GPT {args.size} "
          f"({cfg.n_layers}x{cfg.d_model}), {cpu_name()}, torch {torch.__version__}")
    print(f"{'recipe':<26}" + "".join(f"{k:>11}" for k in ITEMS)
          + f"{'B/param':>9}{'measure == estimate':>21}")
    for recipe in RECIPES:
        torch.manual_seed(0)
        model = GPT(cfg)
        n = sum(p.numel() for p in model.parameters())
        predicted = estimate(model, _real(recipe))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = MixedPrecision(model, adamw_for(recipe, model.parameters()),
                                    _real(recipe))
        for i in range(2):
            with engine.autocast():
                loss = model(idx[:, :-1], idx[:, 1:])
            engine.backward(loss)
            if i == 0:
                engine.step()
        got = measure(model, engine)
        same = all(got[k] == predicted[k] for k in ITEMS)
        per = sum(got[k] for k in ITEMS) / n
        print(f"{recipe:<26}" + "".join(f"{got[k] / n:>11.3f}" for k in ITEMS)
              + f"{per:>9.3f}{'yes' if same else 'NO':>21}")
    print("\n# a 70B model, AdamW, GB = 1e9 bytes, estimate()")
    print(f"{'recipe':<26}" + "".join(f"{k:>11}" for k in ITEMS) + f"{'total':>9}")
    for recipe in RECIPES:
        b = estimate("70B", recipe)
        print(f"{recipe:<26}" + "".join(f"{b[k] / 1e9:>11.0f}" for k in ITEMS)
              + f"{sum(b[k] for k in ITEMS) / 1e9:>9.0f}")


if __name__ == "__main__":
    main()
