"""Final validation loss of each optimizer-state and weight-write recipe against fp32.

    python benchmarks/optim_accuracy.py [--steps 300] [--size medium] [--skip-torchao]

The workbench GPT (``mixprec train``'s loop: same seed, same data, AdamW betas
(0.9, 0.95), lr 3e-3 with warmup and cosine decay, clipping at 1.0) at the compare
default size, one run per row, as ``emulate=auto`` decides on this CPU. torchao's
``AdamW8bit``, ``AdamWFp8`` and ``AdamW4bit`` run in the same loop on ``bf16-master``'s fp32 masters
where torchao is installed (a benchmark dependency), beside ``bf16-master,states=int8``,
``states=fp8`` and ``states=int4``. torchao's ``_AdamW(bf16_stochastic_round=True)`` needs real bf16
weight tensors, which emulation replaces by fp32 ones holding bf16 values: where bf16 is
emulated it steps real bf16 copies of them (``Bf16Storage``), which is the same
arithmetic as on bf16 weights. Model-state bytes are ``measure()``'s after the run. No
figure is asserted: these are the README's.
"""

from __future__ import annotations

import argparse
import time

import torch

import mixprec.workbench.train as train_mod
from mixprec.engine.devices import emulating
from mixprec.recipe import Recipe
from mixprec.workbench.compare import cpu_name
from mixprec.workbench.train import TrainConfig, train

ROWS = [  # label, recipe, optimizer (None: the one the recipe needs)
    ("fp32 AdamW", "fp32", None),
    ("bf16-master", "bf16-master", None),
    ("nearest bf16 weights", "bf16,params=bf16", None),
    ("stochastic writes", "bf16-sr", None),
    ("Kahan writes", "bf16-kahan", None),
    ("remainder writes", "bf16-remainder", None),
    ("bf16 moments", "bf16-master,states=bf16", None),
    ("fp8 moments", "bf16-master,states=fp8", None),
    ("int8 moments", "bf16-master,states=int8", None),
    ("int4 moments", "bf16-master,states=int4", None),
    ("bf16-lean", "bf16-lean", None),
    ("SR + bf16 moments", "bf16-sr,states=bf16", None),  # torchao _AdamW's bytes
    ("torchao AdamWFp8", "bf16-master", "AdamWFp8"),
    ("torchao AdamW8bit", "bf16-master", "AdamW8bit"),
    ("torchao AdamW4bit", "bf16-master", "AdamW4bit"),
    ("torchao bf16 SR AdamW", "bf16,params=bf16", "_AdamW"),
]
ITEMS = ("params", "grads", "master", "optimizer")


def _state_bytes(opt) -> int:
    """Bytes of the optimizer's state tensors; torchao's quantized states are tensor
    subclasses, counted by their inner tensors (codes, scales)."""
    total = 0
    for st in opt.state.values():
        for v in st.values():
            if not isinstance(v, torch.Tensor):
                continue
            inner = ([getattr(v, n) for n in v.__tensor_flatten__()[0]]
                     if hasattr(v, "__tensor_flatten__") else [v])
            total += sum(t.numel() * t.element_size() for t in inner)
    return total


class Bf16Storage(torch.optim.Optimizer):
    """An optimizer made for real bf16 weights (``inner``, built on the first step over
    bf16 copies), run on emulated ones: fp32 tensors that hold bf16 values. Each step
    gives the copies the gradients in bf16, as a bf16 weight's ``.grad`` would hold them,
    steps ``inner``, and writes its bf16 results back (exactly: they are bf16 values)."""

    def __init__(self, params, make_inner, lr: float) -> None:
        super().__init__(list(params), {"lr": lr})
        self.make_inner = make_inner
        self.inner = None
        self.copies: list[torch.Tensor] = []

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"]]
        if self.inner is None:
            self.copies = [p.detach().to(torch.bfloat16).requires_grad_() for p in params]
            self.inner = self.make_inner(self.copies)
        for p, c in zip(params, self.copies):
            c.grad = None if p.grad is None else p.grad.to(torch.bfloat16)
        lr = self.param_groups[0]["lr"]
        for g in self.inner.param_groups:
            if isinstance(g["lr"], torch.Tensor):
                g["lr"].fill_(lr)
            else:
                g["lr"] = lr
        self.inner.step()
        for p, c in zip(params, self.copies):
            p.copy_(c.float())


def _run(recipe: str, torchao_cls: str | None, args, seed: int = 0
         ) -> tuple[float, float, float, bool]:
    """(final val loss, model-state bytes per parameter, seconds, emulated). Bytes are
    those of real 16-bit storage: the planner's (equal to measure(), tests/memory/test_memory.py
    and tests/optim/test_optim_engine.py), and for torchao the state tensors it holds after
    the run."""
    from mixprec.memory import estimate

    original = train_mod.adamw_for
    made = []
    if torchao_cls is not None:
        import torchao.optim as ao

        cls = getattr(ao, torchao_cls)
        extra = {"bf16_stochastic_round": True} if torchao_cls == "_AdamW" else {}

        def build(r, params, **kw):
            if torchao_cls == "_AdamW" and emulating(Recipe.coerce(r), torch.device("cpu")):
                return Bf16Storage(params, lambda ps: cls(ps, **kw, **extra), kw["lr"])
            return cls(params, **kw, **extra)
    else:
        build = original

    def capture(r, params, **kw):
        made.append(build(r, params, **kw))
        return made[-1]

    train_mod.adamw_for = capture
    try:
        t = time.perf_counter()
        res = train(TrainConfig(recipe=recipe, size=args.size, steps=args.steps,
                                batch=args.batch, seed=seed), progress=False)
        dt = time.perf_counter() - t
    finally:
        train_mod.adamw_for = original
    cfg = train_mod.SIZES[args.size]
    # real 16-bit storage (what a GPU holds), whether or not this CPU emulated it
    plan = estimate(train_mod.GPT(cfg), recipe if recipe == "fp32" else
                    f"{recipe},emulate=false")
    opt = getattr(made[-1], "inner", None) or made[-1]
    states = _state_bytes(opt) if torchao_cls is not None else plan["optimizer"]
    per = (sum(plan[k] for k in ("params", "grads", "master")) + states) / cfg.n_params
    return res.evals[-1]["val_loss"], per, dt, res.emulated


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--size", default="medium")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--skip-torchao", action="store_true")
    ap.add_argument("--only", default=None,
                    help="run the fp32 row and the rows whose label contains one of "
                         "these (comma-separated)")
    ap.add_argument("--noise-seeds", type=int, default=0,
                    help="only run fp32 with seeds 1..N (other init and data): how far "
                         "the final loss moves between runs that differ in no numerics")
    args = ap.parse_args()
    if args.noise_seeds:
        for seed in range(1, args.noise_seeds + 1):
            loss, _, dt, _ = _run("fp32", None, args, seed)
            print(f"fp32 AdamW, seed {seed}: val loss {loss:.4f} ({dt / 60:.1f} min)",
                  flush=True)
        return
    try:
        import torchao  # noqa: F401
        have_torchao = not args.skip_torchao
    except ImportError:
        have_torchao = False
    print(f"# benchmarks/optim_accuracy.py: workbench GPT {args.size}, {args.steps} steps, "
          f"batch {args.batch}, {cpu_name()}, torch {torch.__version__}")
    print(f"{'row':<24}{'recipe':<26}{'val loss':>9}{'vs fp32':>9}{'B/param':>9}"
          f"{'min':>6}")
    base = None
    for label, recipe, ao_cls in ROWS:
        if ao_cls is not None and not have_torchao:
            continue
        if args.only and base is not None and not any(
                o in label for o in args.only.split(",")):
            continue
        loss, per, dt, emulated = _run(recipe, ao_cls, args)
        base = loss if base is None else base
        print(f"{label:<24}{recipe:<26}{loss:>9.4f}{(loss / base - 1) * 100:>+8.2f}%"
              f"{per:>9.2f}{dt / 60:>6.1f}" + ("  (emulated)" if emulated else ""),
              flush=True)


if __name__ == "__main__":
    main()
