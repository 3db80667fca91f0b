"""The ``mixprec`` command line. Sits on top of the library; nothing imports it.

Subcommands are registered in ``_COMMANDS``; each takes parsed args and returns an exit
code. rich is imported lazily, only to print.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from collections.abc import Callable, Sequence

__all__ = ["main", "build_parser"]


def _console():
    from rich.console import Console

    return Console(soft_wrap=False, width=max(120, Console().width))


def _num(v: float) -> str:
    if v == 0 or math.isnan(v) or math.isinf(v):
        return str(v)
    return f"{v:.6g}" if 1e-4 <= abs(v) < 1e7 else f"{v:.4e}"


def cmd_formats(args: argparse.Namespace) -> int:
    from mixprec.formats import elements as formats

    names = args.formats.split(",") if args.formats else formats.names()
    fmts = [formats.get(n) for n in names]
    con = _console()
    con.print(_formats_table(fmts) if args.value is None else _value_table(args, fmts))
    if args.value is not None and args.update is not None:
        con.print("An update survives on a stored w when w + update rounds to another "
                  "value: |update| > half the spacing at w (at exactly half, ties go to "
                  "the even neighbour).\nLast column: it survives on every w below that "
                  "|w|, subnormals included; above it, a step away from zero vanishes; "
                  "never: not even on the smallest subnormal or on 0.")
    return 0


def _formats_table(fmts):
    """Each format's layout and limits."""
    from rich.table import Table

    t = Table(title="Floating-point formats (mixprec.formats.elements)")
    for col in ("format", "bits s/e/m", "bias", "max", "min normal", "min subnormal",
                "eps", "digits", "inf/NaN", "torch dtype"):
        t.add_column(col, justify="right" if col not in ("format", "inf/NaN") else "left")
    for f in fmts:
        special = ("inf+NaN" if f.has_inf else {"single": "NaN only", "none": "neither",
                                                "ieee": "NaN"}[f.nan])
        t.add_row(f.name, f"{int(f.signed)}/{f.exponent_bits}/{f.mantissa_bits}",
                  str(f.bias), _num(f.max), _num(f.min_normal), _num(f.min_subnormal),
                  _num(f.eps), f"{f.decimal_digits:.2f}", special,
                  str(f.torch_dtype).replace("torch.", "") if f.torch_dtype else "-")
    return t


def _what_happens(f, value: float, q: float) -> str:
    """How ``value`` fared when stored in ``f`` as ``q``."""
    a = abs(value)
    if math.isnan(q):
        return "NaN (overflow: no inf in this format)" if not math.isnan(value) else "NaN"
    if math.isinf(q):
        return "overflows to inf"
    if q == 0 and a > 0:
        return f"underflows to 0 (below {_num(f.min_subnormal)})"
    if a > f.max:
        return f"clamped to max {_num(f.max)}"
    if 0 < a < f.min_normal:
        return f"subnormal (below {_num(f.min_normal)}): precision lost"
    return "normal"


def _value_table(args, fmts):
    """``args.value`` stored in each format (and, with ``--update``, whether adding the
    update to the stored value changes it)."""
    import torch
    from rich.table import Table

    from mixprec.formats import elements as formats

    x = torch.tensor([args.value], dtype=torch.float64)
    title = f"{args.value!r} in each format"
    if args.update is not None:
        title += f", then + {args.update!r}"
    t = Table(title=title)
    cols = ["format", "stored", "rel. error", "spacing there", "what happens"]
    if args.update is not None:
        cols += ["after update", "update", "survives for |w| below"]
    for c in cols:
        t.add_column(c, justify="left" if c in ("format", "what happens", "update") else "right")
    for f in fmts:
        q = formats.quantize(x, f).item()
        step = formats.ulp(torch.tensor([q if math.isfinite(q) else f.max],
                                        dtype=torch.float64), f).item()
        rel = abs(q - args.value) / abs(args.value) if args.value and math.isfinite(q) else (
            math.inf if math.isfinite(args.value) and not math.isfinite(q) else 0.0)
        row = [f.name, _num(q), f"{rel:.2e}", _num(step), _what_happens(f, args.value, q)]
        if args.update is not None and not math.isfinite(q):
            row += ["–", "lost: no value", _bound(f, args.update)]
        elif args.update is not None:
            after = formats.quantize(torch.tensor([q + args.update], dtype=torch.float64),
                                     f).item()
            fate = ("survives" if math.isfinite(after) and after != q else
                    "[red]vanishes[/red]" if after == q else "[red]overflows[/red]")
            row += [_num(after), fate, _bound(f, args.update)]
        t.add_row(*row)
    return t


def _bound(f, update: float) -> str:
    """``formats.survival_bound`` as the table shows it: "never" when no w keeps it."""
    from mixprec.formats import elements as formats

    b = formats.survival_bound(update, f)
    return "[red]never[/red]" if b == 0 else "every w" if b == math.inf else _num(b)


def build_parser() -> argparse.ArgumentParser:
    """The ``mixprec`` argument parser: one subcommand per room (formats, memory, ...)."""
    p = argparse.ArgumentParser(
        prog="mixprec",
        description="Mixed-precision training toolkit for PyTorch.",
    )
    import torch

    from mixprec import __version__

    p.add_argument("--version", action="version",
                   version=f"mixprec {__version__} (torch {torch.__version__})")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    f = sub.add_parser("formats", help="table of number formats; where a value lands in each")
    f.add_argument("--value", type=float, help="show this value stored in each format")
    f.add_argument("--update", type=float,
                   help="with --value: does adding this to the stored value survive?")
    f.add_argument("--formats", help="comma-separated subset, e.g. fp32,bf16,fp16")
    f.set_defaults(func=cmd_formats)
    for name, (help_, add, func) in _COMMANDS.items():
        s = sub.add_parser(name, help=help_)
        add(s)
        s.set_defaults(func=func)
    return p


def _memory_args(p):
    from mixprec.cli.memory import add_arguments

    add_arguments(p)


def _memory_run(args):
    from mixprec.cli.memory import run

    return run(args)


def _doctor_args(p):
    from mixprec.cli.doctor import add_arguments

    add_arguments(p)


def _doctor_run(args):
    from mixprec.cli.doctor import run

    return run(args)


def _lazy(module: str, name: str):
    def f(*a):
        import importlib

        return getattr(importlib.import_module(module), name)(*a)
    return f


# name -> (help, add_arguments(parser), run(args) -> int); other rooms register here.
_COMMANDS: dict[str, tuple[str, Callable, Callable]] = {
    "memory": ("bytes per rank of each item a recipe costs (planner)", _memory_args,
               _memory_run),
    "doctor": ("diagnose a recipe: overflow origins, underflow, dtypes, kernel speed",
               _doctor_args, _doctor_run),
    "train": ("train the workbench GPT under a recipe (checkpoints, --resume, --parallel)",
              _lazy("mixprec.cli.workbench", "add_train_arguments"),
              _lazy("mixprec.cli.workbench", "run_train")),
    "bench": ("speed of each recipe against the hardware and hand-written PyTorch",
              _lazy("mixprec.workbench.bench", "add_arguments"),
              _lazy("mixprec.workbench.bench", "run")),
    "compare": ("train several recipes side by side and write report.html",
                _lazy("mixprec.cli.workbench", "add_compare_arguments"),
                _lazy("mixprec.cli.workbench", "run_compare")),
    "plan": ("a per-layer precision plan for the workbench GPT, measured (plan.json)",
             _lazy("mixprec.cli.plan", "add_arguments"), _lazy("mixprec.cli.plan", "run")),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``mixprec`` command line; returns the process exit code (2: bad input)."""
    missing = [m for m in ("rich", "matplotlib") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"mixprec: the command line needs {' and '.join(missing)}: "
              "pip install 'mixprec[cli]'", file=sys.stderr)
        return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, PermissionError, NotImplementedError) as e:
        print(f"mixprec {args.command}: error: {e}", file=sys.stderr)
        return 2
