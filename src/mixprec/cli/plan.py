"""``mixprec plan``: a per-layer precision plan for the workbench GPT, as a table, a
recipe string and a JSON file that ``mixprec compare`` and ``mixprec doctor`` take."""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run", "parse_share"]


def parse_share(text: str) -> float | None:
    """``--max-loss``: ``1%``, ``+1%`` or ``0.01`` (a relative share), or ``none``."""
    t = text.strip().lower()
    if t in ("none", "off"):
        return None
    try:
        v = float(t.lstrip("+").rstrip("%")) / (100 if t.endswith("%") else 1)
    except ValueError:
        v = -1.0
    if not v >= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r}; give a share of the 16-bit recipe's loss: 1%, +1% or 0.01 (or "
            "none to skip the loss check)")
    return v


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``mixprec plan``."""
    from mixprec.planner import CANDIDATES, DEFAULT_MIN_SQNR

    p.add_argument("--size", default="medium", help="tiny | small | medium | base "
                   "(default medium, as mixprec compare)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, help="context length (default: the size's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goal", choices=("fastest", "smallest"), default="fastest")
    p.add_argument("--memory", help="budget for the step's peak, e.g. 2GB or 512MB")
    p.add_argument("--max-loss", type=parse_share, default=0.01,
                   help="the plan's calibration loss may exceed the 16-bit recipe's by "
                        "this share: 1%%, +1%% or 0.01 (default 1%%; none: no check)")
    p.add_argument("--min-sqnr", type=float, default=DEFAULT_MIN_SQNR,
                   help=f"SQNR floor (dB) against bf16 for each fp8/fp4 GEMM (default "
                        f"{DEFAULT_MIN_SQNR:g})")
    p.add_argument("--base", default="bf16-master",
                   help="the 16-bit recipe the plan departs from (default bf16-master)")
    p.add_argument("--formats", type=_names, default=CANDIDATES,
                   help=f"candidate formats, comma-separated (default {','.join(CANDIDATES)})")
    p.add_argument("--states", type=_names, default=("fp32", "bf16", "int8"),
                   help="optimizer-state formats allowed, comma-separated (default "
                        "fp32,bf16,int8)")
    p.add_argument("--max-step", type=float,
                   help="with --goal smallest: the slowest step allowed, as a multiple "
                        "of the 16-bit recipe's (1.1: 10%% slower)")
    p.add_argument("--calibration", type=int, default=3,
                   help="training batches the numerics are measured on (default 3)")
    p.add_argument("--seconds", type=float, default=0.25,
                   help="about how long each Linear shape is timed (default 0.25)")
    p.add_argument("--cache", help="JSON file keeping measured speeds across runs")
    p.add_argument("--out", default="plan.json", help="where the plan is written "
                   "(default plan.json): mixprec compare --recipes plan.json,bf16")


def run(args: argparse.Namespace) -> int:
    """``mixprec plan``: plan the workbench GPT, print the table, write the JSON."""
    from mixprec.workbench.planning import plan_workbench

    p = plan_workbench(size=args.size, batch=args.batch, seq=args.seq, seed=args.seed,
                       calibration=args.calibration, goal=args.goal, memory=args.memory,
                       max_loss=args.max_loss, min_sqnr=args.min_sqnr, base=args.base,
                       formats=args.formats, state_formats=args.states,
                       max_step=args.max_step, cache_file=args.cache,
                       seconds=args.seconds)
    p.save(args.out)
    print(p.table())
    print(f"plan: {args.out}")
    shape = f"--size {args.size} --batch {args.batch}" + (f" --seq {args.seq}" if args.seq
                                                           else "")
    print(f"train it: mixprec train {shape} --recipe '{p.recipe}'")
    print(f"compare it: mixprec compare {shape} --recipes {args.out},bf16,fp8")
    return 0
