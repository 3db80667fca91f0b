"""``mixprec doctor``: diagnose a recipe on the workbench GPT or on your own model."""

from __future__ import annotations

import argparse
import importlib

import torch

from mixprec.diagnostics.doctor import doctor
from mixprec.workbench import GPT, GPTConfig
from mixprec.workbench.data import load_corpus, sample_batch

__all__ = ["add_arguments", "run", "load_target"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``mixprec doctor``."""
    p.add_argument("--recipe", default="bf16",
                   help="recipe to diagnose (default bf16), or a plan file from `mixprec "
                        "plan` (.json): its planned fp8 layers are held to its SQNR floor")
    p.add_argument("--model", default="workbench",
                   help="'workbench' (a small GPT on the built-in corpus) or "
                        "'package.module:factory', where factory() returns "
                        "(model, batch_fn) and batch_fn(model, step) returns the loss")
    p.add_argument("--steps", type=int, default=10, help="training steps to watch")
    p.add_argument("--reference-steps", type=int, default=3,
                   help="steps of the layer-by-layer comparison against fp32 (0: skip)")
    p.add_argument("--lr", type=float, default=1e-3,
                   help="learning rate of the doctor's optimizer (default 1e-3): give your "
                        "run's, since whether updates vanish into the weights, and whether "
                        "the loss diverges, depend on it")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                   help="the doctor's optimizer (default adamw, torch's defaults)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--plots", help="folder for the gradient histogram and other plots")


def load_target(spec: str):
    """(model_factory, batch_fn) for 'workbench' or 'package.module:factory'."""
    if spec == "workbench":
        corpus = load_corpus(max_bytes=500_000)
        cfg = GPTConfig(n_layers=2, d_model=64, n_heads=4, seq_len=64)
        g = torch.Generator().manual_seed(0)
        data = [sample_batch(corpus.train, 8, cfg.seq_len, g) for _ in range(64)]

        def factory():
            torch.manual_seed(0)
            return GPT(cfg)

        def batch_fn(model, step):
            x, y = data[step % len(data)]
            return model(x, y)

        return factory, batch_fn
    mod_name, sep, attr = spec.partition(":")
    if not sep:
        raise ValueError(f"--model {spec!r}: expected 'workbench' or 'package.module:factory'")
    try:
        factory = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--model {spec!r}: cannot load it ({e})") from None
    out = factory()
    if not (isinstance(out, tuple) and len(out) == 2):
        raise ValueError(f"--model {spec!r}: factory() must return (model, batch_fn)")
    model, batch_fn = out
    import copy

    return (lambda: copy.deepcopy(model)), batch_fn


def run(args: argparse.Namespace) -> int:
    """``mixprec doctor``: diagnose a recipe on a model and print the findings."""
    factory, batch_fn = load_target(args.model)
    report = doctor(factory, batch_fn, args.recipe, steps=args.steps, lr=args.lr,
                    optimizer=args.optimizer, reference_steps=args.reference_steps,
                    plots=args.plots)
    if args.json:
        print(report.to_json())
    else:
        from rich.console import Console

        con = Console(width=120)
        con.print(f"[bold]{str(report).splitlines()[0]}[/bold]")
        style = {"error": "red", "warning": "yellow", "info": "cyan"}
        for f in report.findings:
            con.print(f"[{style[f.severity]}]{f.severity}[/] {f.title}")
            con.print(f"  evidence: {f.evidence}", highlight=False)
            con.print(f"  advice:   {f.advice}", highlight=False)
        speed = report.facts.get("matmul_speed")
        if speed:
            con.print("matmul speed against fp32 here (one thread, alternating rounds): "
                      + ", ".join(f"{n} too noisy to measure" if v["noisy"] else
                                  f"{n} {v['ratio']:.2g}x" for n, v in speed.items()),
                      highlight=False)
        if report.facts.get("kernels"):
            con.print(f"kernel choices: {report.facts['kernels']}", highlight=False)
        weights = report.facts.get("matmul_weights_by_format", {})
        flops = report.facts.get("matmul_flops_by_format", {})
        for kind in dict.fromkeys([*weights, *flops]):
            said = [f"{what} " + ", ".join(f"{f} {v:.0%}" for f, v in sorted(d[kind].items()))
                    for what, d in (("weights", weights), ("FLOPs", flops)) if kind in d]
            con.print(f"coverage {kind}: " + "; ".join(said), highlight=False)
        for pth in report.facts.get("plots", []):
            con.print(f"plot: {pth}")
    return 1 if any(f.severity == "error" for f in report.findings) else 0
