"""``mixprec train`` and ``mixprec compare``."""

from __future__ import annotations

import argparse
import os
import sys

from mixprec.workbench import train as train_mod
from mixprec.workbench.compare import CompareInterrupted, compare

__all__ = ["add_train_arguments", "run_train", "add_compare_arguments", "run_compare"]


def _common(p: argparse.ArgumentParser, steps: int, size: str) -> None:
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--size", default=size, help="tiny | small | medium | base")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, help="context length (default: the size's)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``mixprec train``."""
    p.add_argument("--recipe", default="bf16")
    _common(p, steps=200, size="small")
    p.add_argument("--out", default="runs/train", help="metrics, checkpoint, config")
    p.add_argument("--resume", action="store_true", help="continue from OUT/ckpt.pt")
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--parallel", choices=["ddp", "fsdp"],
                   help="data parallel under torchrun (gloo on CPU, nccl on GPU)")
    p.add_argument("--device", choices=["cpu", "cuda"],
                   help="where to train (default: under --parallel each rank's GPU, "
                        "cuda:LOCAL_RANK, where CUDA is available; else cpu)")


def run_train(args: argparse.Namespace) -> int:
    """``mixprec train``: one recipe on the workbench GPT, with checkpoints and resume.
    Ctrl-C ends it with one line saying how to resume, and exit code 130."""
    cfg = train_mod.TrainConfig(recipe=args.recipe, steps=args.steps, size=args.size,
                                batch=args.batch, seq=args.seq, lr=args.lr, seed=args.seed,
                                ckpt_every=args.ckpt_every, eval_every=args.eval_every)
    dist_started = False
    if args.parallel and "RANK" not in os.environ:
        raise ValueError("--parallel needs torchrun: torchrun --nproc-per-node 2 -m "
                         f"mixprec train --parallel {args.parallel} ...")
    # the rank's GPU is made current before the process group: NCCL binds it
    device = train_mod.train_device(args.parallel, args.device)
    if args.parallel:
        import torch.distributed as dist

        if not dist.is_initialized():
            if device.type == "cuda":
                dist.init_process_group("nccl", device_id=device)
            else:
                dist.init_process_group("gloo")
            dist_started = True
    try:
        res = train_mod.train(cfg, args.out, resume=args.resume,
                              progress=not args.no_progress and None,
                              parallel=args.parallel, device=device)
    except KeyboardInterrupt:  # the checkpoints written so far are complete (atomic)
        print(f"mixprec train: interrupted; the last checkpoint in {args.out} (written every "
              f"{args.ckpt_every} steps) continues with --resume", file=sys.stderr)
        return 130
    finally:
        if dist_started:
            import torch.distributed as dist

            dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{cfg.recipe}: final validation loss {res.final_val_loss:.4f}, "
              f"{res.tokens_per_s:,.0f} tokens/s, {res.skipped} skipped steps; "
              f"metrics in {args.out}/metrics.jsonl")
    return 0


def add_compare_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``mixprec compare``."""
    p.add_argument("--recipes", help="comma-separated presets, or ';'-separated recipes "
                                     "(default: fp32,bf16,bf16-master,fp16,fp8); an entry "
                                     "may be a plan file from `mixprec plan` (plan.json) "
                                     "or 'plan' (plan this model now)")
    _common(p, steps=150, size="medium")
    p.add_argument("--out", default="runs/compare", help="report.html, report.json, runs")
    p.add_argument("--scenario", choices=["overflow"],
                   help="overflow: fp16 without loss scaling, from real runs")


def run_compare(args: argparse.Namespace) -> int:
    """``mixprec compare``: several recipes on the same data, one HTML/JSON report.
    Ctrl-C keeps what finished: the report of those recipes is written and printed,
    with one line saying what was interrupted, and the exit code is 130."""
    recipes = None
    if args.recipes:
        sep = ";" if (";" in args.recipes or "=" in args.recipes) else ","
        recipes = [r.strip() for r in args.recipes.split(sep) if r.strip()]
    try:
        report = compare(recipes, steps=args.steps, size=args.size, batch=args.batch,
                         seq=args.seq, lr=args.lr, seed=args.seed, out=args.out,
                         scenario=args.scenario,
                         progress=False if args.no_progress else None)
    except CompareInterrupted as stop:
        if stop.report is not None:
            _print_summary(stop.report, args.out)
        kept = ("no recipe had finished: nothing written" if stop.report is None else
                "the report holds the recipes that finished: " +
                ", ".join(r["recipe"] for r in stop.report["summary"]))
        print(f"mixprec compare: interrupted during {stop.during}; {kept}", file=sys.stderr)
        return 130
    _print_summary(report, args.out)
    return 0


def _print_summary(report: dict, out: str) -> None:
    """The summary table, the timings that disagree, and where the report is."""
    print(f"{'recipe':<22}{'val loss':>10}{'vs fp32':>9}{'tokens/s':>11}{'speed-up':>9}"
          f"{'skipped':>8}{'low-prec':>9}")
    noisy = bool(report.get("timing_noise")) and any(
        r["recipe"] == "fp32" for r in report["summary"])
    for r in report["summary"]:
        vs = r["val_loss_vs_fp32"]
        sp = r["speedup_vs_fp32"]
        speed = f"{sp:.2f}x" if sp else "noisy" if noisy and r["recipe"] != "fp32" else "–"
        print(f"{r['recipe']:<22}{r['final_val_loss']:>10.4f}"
              f"{(f'{vs * 100:+.2f}%' if vs is not None else '–'):>9}"
              f"{r['tokens_per_s']:>11,.0f}{speed:>9}"
              f"{r['skipped_steps']:>8}{_share(r['matmul_weights_low_precision']):>9}")
    print("low-prec: the share of the matmul weights in an fp8/fp4 format")
    for note in report.get("timing_noise", []):
        print(f"timings disagree: {note}; no speed-up or speed advice is given from them "
              "(rerun on an idle machine)")
    print(f"report: {os.path.join(out, 'report.html')}")


def _share(v) -> str:
    return "–" if v is None else f"{v:.0%}"
