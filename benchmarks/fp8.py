"""FP8 numerics, training and a side-by-side with torchao, on this machine.

    python benchmarks/fp8.py [--steps 300] [--skip-torchao] [--only training]
                             [--recipes bf16,fp8-block,mxfp8]

1. SQNR (dB) of Float8Linear against a bf16 nn.Linear on Gaussian data, for the output
   and both gradients, per scaling mode and shape (delayed: after one step that fills
   the history, as in training). Then the same with one outlier token (its input row and
   its gradient row 10^k times larger): per-tensor against rowwise, block and MX scaling.
   The block recipes (fp8-block, mxfp8, nvfp4 and their switches) in torchao's own SQNR
   setup (``--only blocks``).
2. The workbench GPT trained ``--steps`` steps on the built-in corpus with bf16, fp8
   (delayed), fp8-current, fp8-rowwise, fp8-block and mxfp8 (or ``--recipes``) from the
   same seed and data; final validation loss.
3. torchao's ``convert_to_float8_training`` (tensorwise, dynamic) against mixprec
   ``fp8-current`` on a tiny GPT: step time and loss. torchao calls ``torch._scaled_mm``,
   which on this CPU is a reference kernel (~0.1 GFLOP/s), so mixprec runs twice: with its
   CPU default (``fp8_gemm=dequant``) and on the same ``_scaled_mm`` kernel.
   Needs ``pip install torchao`` (a benchmark dependency only).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
from torch import nn

from mixprec import MixedPrecision
from mixprec.modules.linear import Float8Linear
from mixprec.workbench import GPT, GPTConfig
from mixprec.workbench.compare import cpu_name
from mixprec.workbench.data import load_corpus, sample_batch, val_batches


def sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.double(), x.double()
    return 20 * math.log10(ref.norm().item() / (ref - x).norm().item())


def sqnr_table() -> None:
    print("\n## SQNR of Float8Linear vs bf16 nn.Linear (dB; higher is better)")
    print(f"{'scaling':<9} {'M x K x N':<18} {'output':>7} {'dgrad':>7} {'wgrad':>7}")
    for scaling in ("delayed", "current", "rowwise", "block", "mx"):
        for m, k, n in [(16, 16, 16), (256, 512, 128), (1024, 1024, 1024), (512, 4096, 64),
                        (2048, 4096, 4096)]:
            torch.manual_seed(0)
            ref = nn.Linear(k, n)
            f8 = Float8Linear.from_linear(nn.Linear(k, n), f"fp8,fp8_scaling={scaling}")
            f8.load_state_dict(ref.state_dict(), strict=False)
            x, gy = torch.randn(m, k), torch.randn(m, n)

            def run(mod, x=x, gy=gy):
                xi = x.clone().requires_grad_()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    y = mod(xi)
                y.backward(gy.to(y.dtype))
                dw = mod.weight.grad.clone()
                mod.weight.grad = mod.bias.grad = None
                return y.float(), xi.grad.float(), dw

            if scaling == "delayed":
                run(f8)
                f8.update_scales()
            y8, dx8, dw8 = run(f8)
            y, dx, dw = run(ref)
            print(f"{scaling:<9} {f'{m}x{k}x{n}':<18} {sqnr(y, y8):>7.1f} {sqnr(dx, dx8):>7.1f} "
                  f"{sqnr(dw, dw8):>7.1f}")


BLOCK_SQNR = ("fp8-current", "fp8-rowwise", "fp8-block", "fp8-block,block_scales=pow2",
              "mxfp8", "mxfp8,mx_rounding=floor", "nvfp4", "nvfp4,nvfp4_2d=false",
              "nvfp4,nvfp4_rht=false", "nvfp4,nvfp4_sr=false")


def block_sqnr_table(m: int = 1024, k: int = 512, n: int = 256) -> None:
    """torchao's SQNR setup for its block-scaled recipes: x ~ N(0, 1), a bias-free
    Linear against its fp32 self, the output gradient of ``y.sum()`` (ones) and then
    Gaussian; output, dgrad and wgrad SQNR in dB."""
    print(f"\n## SQNR vs the fp32 Linear, {m}x{k}x{n}, x ~ N(0,1) (dB): y.sum() grads | "
          "Gaussian grads")
    print(f"{'recipe':<30} {'out':>6} {'dgrad':>6} {'wgrad':>6} | {'out':>6} {'dgrad':>6} "
          f"{'wgrad':>6}")
    for recipe in BLOCK_SQNR:
        row = []
        for gaussian in (False, True):
            torch.manual_seed(0)
            lin = nn.Linear(k, n, bias=False)
            f8 = Float8Linear.from_linear(nn.Linear(k, n, bias=False), recipe)
            f8.weight = nn.Parameter(lin.weight.detach().clone())
            x = torch.randn(m, k)
            go = torch.randn(m, n) if gaussian else torch.ones(m, n)
            outs = []
            for mod in (lin, f8):
                xi = x.clone().requires_grad_()
                y = mod(xi)
                y.backward(go)
                outs.append((y.detach(), xi.grad, mod.weight.grad))
            row += [sqnr(a, b) for a, b in zip(*outs)]
        print(f"{recipe:<30} " + " ".join(f"{v:>6.1f}" for v in row[:3]) + " | "
              + " ".join(f"{v:>6.1f}" for v in row[3:]))


def outlier_table() -> None:
    """One token's input row and gradient row 10^k times the others' (M=K=N=1024): SQNR
    over the other tokens' outputs and input gradients, per-tensor (current) against
    rowwise scaling, with e5m2 (hybrid) and e4m3 gradients. wgrad is left out: it sums
    over tokens, so the outlier's own product dominates it and any SQNR reads high."""
    print("\n## One outlier token ×10^k: SQNR (dB) of the other tokens' output and dgrad "
          "against float64")
    print(f"{'k':>2} {'recipe':<28} {'output':>7} {'dgrad':>7}")
    m, k, n = 1024, 1024, 1024
    for power in (0, 3, 5, 7):
        torch.manual_seed(0)
        lin = nn.Linear(k, n, bias=False)
        x, gy = torch.randn(m, k), torch.randn(m, n)
        x[7] *= 10.0**power
        gy[7] *= 10.0**power
        rest = [i for i in range(m) if i != 7]
        w64 = lin.weight.detach().double()
        y_ref, dx_ref = (x.double() @ w64.t())[rest], (gy.double() @ w64)[rest]
        for recipe in ("fp8-current", "fp8-rowwise", "fp8-current,fp8_format=e4m3",
                       "fp8-rowwise,fp8_format=e4m3", "fp8-block", "mxfp8"):
            f8 = Float8Linear.from_linear(lin, recipe)
            xi = x.clone().requires_grad_()
            y = f8(xi)
            y.backward(gy)
            lin.weight.grad = None
            print(f"{power:>2} {recipe:<28} {sqnr(y_ref, y[rest]):>7.1f} "
                  f"{sqnr(dx_ref, xi.grad[rest]):>7.1f}")


def train(recipe: str, cfg: GPTConfig, corpus, steps: int, batch: int, lr: float,
          seed: int = 0):
    torch.manual_seed(seed)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, fused=True)
    engine = MixedPrecision(model, opt, recipe, max_grad_norm=1.0)
    g = torch.Generator().manual_seed(seed)
    times = []
    for _ in range(steps):
        x, y = sample_batch(corpus.train, batch, cfg.seq_len, g)
        t = time.perf_counter()
        with engine.autocast():
            loss = model(x, y)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t)
    model.eval()
    with torch.no_grad():
        vals = [model(x, y).item() for x, y in val_batches(corpus.val, batch, cfg.seq_len)]
    return sum(vals) / len(vals), statistics.median(times)


TRAINING = ("bf16", "fp8", "fp8-current", "fp8-rowwise", "fp8-block", "mxfp8")


def training_comparison(steps: int, recipes=TRAINING) -> None:
    corpus = load_corpus(max_bytes=2_000_000)
    cfg = GPTConfig(n_layers=4, d_model=128, n_heads=4, seq_len=128)
    print(f"\n## {steps} steps, GPT {cfg.n_layers}x{cfg.d_model} seq {cfg.seq_len}, batch 16, "
          f"AdamW lr 3e-3, corpus {corpus.fingerprint}: final validation loss (fp32 eval)")
    print(f"{'recipe':<36} {'val loss':>9} {'vs bf16':>8} {'step (ms)':>10}", flush=True)
    base = None
    for r in recipes:  # printed as they finish; the first is the baseline
        v, t = train(r, cfg, corpus, steps, 16, 3e-3)
        base = v if base is None else base
        print(f"{r:<36} {v:>9.4f} {(v / base - 1) * 100:>+7.2f}% {t * 1e3:>10.1f}",
              flush=True)


def torchao_comparison(steps: int = 20) -> None:
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        print("\n## torchao: not installed (pip install torchao); skipped")
        return
    cfg = GPTConfig(n_layers=2, d_model=64, n_heads=4, seq_len=32, vocab=256)
    g0 = torch.Generator().manual_seed(0)
    corpus = load_corpus(max_bytes=500_000)
    batches = [sample_batch(corpus.train, 4, cfg.seq_len, g0) for _ in range(steps)]

    def fresh():
        torch.manual_seed(0)
        return GPT(cfg)

    def last_linear_is_head(mod, fqn):  # same policy as mixprec: keep the tied head
        return fqn != "head"

    ao = fresh()
    convert_to_float8_training(ao, config=Float8LinearConfig(),
                               module_filter_fn=last_linear_is_head)
    ao_opt = torch.optim.AdamW(ao.parameters(), lr=3e-3, fused=True)

    def ao_step(x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = ao(x, y)
        loss.backward()
        ao_opt.step()
        ao_opt.zero_grad(set_to_none=True)
        return loss.item()

    runs = {"torchao tensorwise": ao_step}
    for name, recipe in (("mixprec fp8-current", "fp8-current"),
                         ("mixprec fp8-current, _scaled_mm", "fp8-current,fp8_gemm=scaled_mm")):
        m = fresh()
        e = MixedPrecision(m, torch.optim.AdamW(m.parameters(), lr=3e-3, fused=True), recipe)

        def step(x, y, m=m, e=e):
            with e.autocast():
                loss = m(x, y)
            e.backward(loss)
            e.step()
            return loss.item()

        runs[name] = step
    times = {k: [] for k in runs}
    losses = {k: [] for k in runs}
    for i, (x, y) in enumerate(batches):  # interleaved, order rotating
        names = list(runs)[i % len(runs):] + list(runs)[:i % len(runs)]
        for k in names:
            t = time.perf_counter()
            losses[k].append(runs[k](x, y))
            times[k].append(time.perf_counter() - t)
    ref_t = statistics.median(times["torchao tensorwise"])
    ref_l = statistics.mean(losses["torchao tensorwise"][-5:])
    print(f"\n## vs torchao float8 (tiny GPT {cfg.n_layers}x{cfg.d_model}, batch 4x{cfg.seq_len},"
          f" {steps} interleaved steps; loss = mean of the last 5 training losses)")
    print(f"{'run':<34} {'step (ms)':>10} {'speed vs torchao':>17} {'loss':>8} {'Δloss':>8}")
    for k in runs:
        t, l_ = statistics.median(times[k]), statistics.mean(losses[k][-5:])
        print(f"{k:<34} {t * 1e3:>10.1f} {ref_t / t:>16.2f}x {l_:>8.4f} "
              f"{(l_ / ref_l - 1) * 100:>+7.2f}%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--skip-torchao", action="store_true")
    ap.add_argument("--only", choices=("sqnr", "blocks", "outliers", "training", "torchao"))
    ap.add_argument("--recipes", default=",".join(TRAINING),
                    help="recipes for the training comparison, ','-separated, or "
                         "';'-separated when one has key=value fields (first: the "
                         "baseline)")
    args = ap.parse_args()
    print(f"# benchmarks/fp8.py: torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{cpu_name()}")
    if args.only in (None, "sqnr"):
        sqnr_table()
    if args.only in (None, "blocks"):
        block_sqnr_table()
    if args.only in (None, "outliers"):
        outlier_table()
    if args.only in (None, "training"):
        # as `mixprec bench`: a recipe with key=value fields needs ';' between recipes
        sep = ";" if (";" in args.recipes or "=" in args.recipes) else ","
        training_comparison(args.steps, args.recipes.split(sep))
    if args.only in (None, "torchao") and not args.skip_torchao:
        torchao_comparison()


if __name__ == "__main__":
    main()
