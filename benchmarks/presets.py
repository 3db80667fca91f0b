"""Every preset's default step against the fp32 engine step, on this CPU, as chosen.

    python benchmarks/presets.py [--steps 6] [--batch 8] [--skip-torchao]
    python benchmarks/presets.py --recipes fp8,fp8-current --skip-torchao --steps 12

The workbench GPT at the compare default size (4 layers, d=256, seq 128), AdamW fused,
each preset as ``emulate=auto`` and ``fp8_gemm=auto`` decide here (the kernel choices are
printed beside the figures). Steps are interleaved, order rotating, so load hits every
recipe alike; the table gives medians and each preset's ratio to fp32. torchao's
``convert_to_float8_training`` (tensorwise, its own recipe: bf16 autocast around the fp8
Linears) runs in the same rounds where torchao is installed (a benchmark dependency).
No timing is asserted anywhere: these are the figures the README quotes.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from mixprec import MixedPrecision
from mixprec.optim import adamw_for
from mixprec.recipe import preset_names
from mixprec.workbench.compare import cpu_name
from mixprec.workbench.model import GPT, SIZES


def _engine_step(recipe: str, cfg, batch):
    torch.manual_seed(0)
    model = GPT(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = MixedPrecision(model, adamw_for(recipe, model.parameters(), lr=3e-4),
                                recipe)

    def step():
        with engine.autocast():
            loss = model(*batch)
        engine.backward(loss)
        engine.step()
    return step, engine.kernels.describe()


def _torchao_step(cfg, batch):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = GPT(cfg)
    convert_to_float8_training(model, config=Float8LinearConfig(),
                               module_filter_fn=lambda mod, fqn: fqn != "head")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--skip-torchao", action="store_true")
    ap.add_argument("--recipes", default=None,
                    help="comma-separated presets to run (fp32 always runs), e.g. fp8")
    args = ap.parse_args()
    cfg = SIZES["medium"]
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab, (args.batch, cfg.seq_len + 1), generator=g)
    batch = (idx[:, :-1], idx[:, 1:])
    runs, kernels = {}, {}
    wanted = None if args.recipes is None else {"fp32", *args.recipes.split(",")}
    unknown = sorted((wanted or set()) - set(preset_names()))
    if unknown:
        ap.error(f"--recipes {','.join(unknown)}: valid: {', '.join(preset_names())}")
    for r in preset_names():
        if r == "tf32" or wanted is not None and r not in wanted:
            continue  # tf32: the same kernels as fp32 on a CPU
        runs[r], kernels[r] = _engine_step(r, cfg, batch)
    if not args.skip_torchao:
        try:
            runs["torchao float8 (tensorwise)"] = _torchao_step(cfg, batch)
        except ImportError:
            print("torchao: not installed (pip install torchao); skipped")
    times = {k: [] for k in runs}
    names = list(runs)
    for i in range(args.warmup + args.steps):
        for k in names[i % len(names):] + names[:i % len(names)]:
            t = time.perf_counter()
            runs[k]()
            if i >= args.warmup:
                times[k].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"# benchmarks/presets.py: GPT {cfg.n_layers}x{cfg.d_model}, batch "
          f"{args.batch}x{cfg.seq_len}, {cpu_name()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, median of {args.steps} interleaved steps")
    print(f"{'recipe':<28}{'step (ms)':>10}{'vs fp32 step':>14}  kernels")
    for k in runs:
        print(f"{k:<28}{med[k] * 1e3:>10.1f}{med[k] / med['fp32']:>13.2f}x  "
              f"{kernels.get(k, '')}")
    if "torchao float8 (tensorwise)" in med:
        ao = med["torchao float8 (tensorwise)"]
        print(f"fp8-current against torchao float8: {ao / med['fp8-current']:.2f}x "
              "torchao's speed")


if __name__ == "__main__":
    main()
