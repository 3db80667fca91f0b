"""fp8's eager engine step against fp32's on this CPU, with the dequant route's
conversions as mixprec runs them and as torch's own (``to`` for the e4m3 -> bf16
upcast, ``abs().amax()`` for the per-tensor amax), all in one process.

    python benchmarks/fp8_step.py [--recipe fp8] [--steps 12] [--batch 8]

The workbench GPT at the compare default size (as ``benchmarks/presets.py``); the two
fp8 engines and fp32's are stepped in turn, the order rotating each round, so a busy
host slows each alike. The torch-conversion steps swap ``mixprec.formats.tensor_gemm.upcast`` and
the per-tensor cast's ``abs_max`` for torch's calls around each of their steps; both
fp8 engines compute the same bits. The table gives median and best step times and each
one's ratio to fp32's. Nothing is asserted."""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import warnings

import torch

from mixprec import MixedPrecision
from mixprec.formats import tensor_gemm as gemm
from mixprec.formats.gemm import per_tensor
from mixprec.optim import adamw_for
from mixprec.workbench.compare import cpu_name
from mixprec.workbench.model import GPT, SIZES


@contextlib.contextmanager
def torch_conversions():
    """``gemm.upcast`` and the per-tensor ``abs_max`` as torch's plain calls."""
    saved = gemm.upcast, per_tensor.abs_max
    gemm.upcast = lambda codes, dtype: codes.to(dtype)
    per_tensor.abs_max = lambda t: t.detach().abs().amax()
    try:
        yield
    finally:
        gemm.upcast, per_tensor.abs_max = saved


def engine_step(recipe: str, cfg, batch, around=contextlib.nullcontext):
    torch.manual_seed(0)
    model = GPT(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = MixedPrecision(model, adamw_for(recipe, model.parameters(), lr=3e-4),
                                recipe)

    def step():
        with around():
            with engine.autocast():
                loss = model(*batch)
            engine.backward(loss)
            engine.step()
    return step, engine.kernels.describe()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="fp8")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    cfg = SIZES["medium"]
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab, (args.batch, cfg.seq_len + 1), generator=g)
    batch = (idx[:, :-1], idx[:, 1:])
    runs = {"fp32": engine_step("fp32", cfg, batch)[0]}
    runs[args.recipe], kernels = engine_step(args.recipe, cfg, batch)
    runs[f"{args.recipe}, torch's conversions"] = engine_step(args.recipe, cfg, batch,
                                                             torch_conversions)[0]
    times = {k: [] for k in runs}
    names = list(runs)
    for i in range(args.warmup + args.steps):
        for k in names[i % len(names):] + names[:i % len(names)]:
            t = time.perf_counter()
            runs[k]()
            if i >= args.warmup:
                times[k].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    print(f"# benchmarks/fp8_step.py: GPT {cfg.n_layers}x{cfg.d_model}, batch "
          f"{args.batch}x{cfg.seq_len}, {cpu_name()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {args.steps} interleaved steps; {kernels}")
    print(f"{'engine':<34}{'median (ms)':>12}{'vs fp32':>9}{'best (ms)':>11}{'vs fp32':>9}")
    for k in runs:
        print(f"{k:<34}{med[k] * 1e3:>12.1f}{med[k] / med['fp32']:>8.2f}x"
              f"{best[k] * 1e3:>11.1f}{best[k] / best['fp32']:>8.2f}x")


if __name__ == "__main__":
    main()
