"""``mixprec plan``: a per-layer precision plan for the workbench GPT, as a table, a
recipe string and a JSON file that ``mixprec compare`` and ``mixprec doctor`` take.
While it measures, its progress goes to stderr: a rich progress bar on a terminal, a
plain line every few seconds elsewhere (a pipe, a log file), with the estimate of its
time first."""

from __future__ import annotations

import argparse
import sys
import threading
import time
from typing import IO, Any

from mixprec.planner import CANDIDATES, DEFAULT_MIN_SQNR
from mixprec.planner.progress import Progress
from mixprec.planner.table import columns_help
from mixprec.workbench.planning import plan_workbench

__all__ = ["add_arguments", "run", "parse_share", "PlainProgress", "EPILOG"]

#: what ``mixprec plan --help`` prints under the arguments
EPILOG = ("The table's columns:\n" + columns_help() + "\nUnder it: the recipe, the "
          "predicted step as the sum of its terms, the peak, and the\nshare of the "
          "matmul FLOPs the plan runs below 16 bits. Progress goes to stderr.")


def _duration(seconds: float) -> str:
    """``42 s`` or ``3 min 05 s``."""
    s = round(max(0.0, seconds))
    return f"{s} s" if s < 90 else f"{s // 60} min {s % 60:02d} s"


class PlainProgress:
    """The planner's progress as plain lines on ``stream``: the estimate once it is
    measured, each stage as it starts, and where it is at most every ``every_s``
    seconds, a line then even while one long unit of work runs (a timer thread)."""

    def __init__(self, stream: IO[str] | None = None, every_s: float = 5.0) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.every_s = every_s
        self.last: Progress | None = None
        self.estimate: float | None = None
        self._said = 0.0
        self._stage: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._timer = threading.Thread(target=self._beat, daemon=True)
        self._timer.start()

    def _say(self, text: str) -> None:
        self.stream.write(f"plan: {text}\n")
        self.stream.flush()
        self._said = time.monotonic()

    def __call__(self, p: Progress) -> None:
        with self._lock:
            self.last = p
            if self.estimate is None and p.estimate_s is not None:
                self.estimate = p.estimate_s
                self._say(f"estimated {_duration(p.estimate_s)} in all ({p.basis})")
            if p.stage != self._stage:
                self._stage = p.stage
                self._say(f"{p.stage}: {p.done}/{p.total}")
            elif time.monotonic() - self._said >= self.every_s:
                self._say(self._where(p))

    def _where(self, p: Progress) -> str:
        elapsed = time.monotonic() - self._t0
        left = "" if p.estimate_s is None else \
            f", about {_duration(p.estimate_s - elapsed)} left"
        return f"{p.stage}: {p.done}/{p.total}, {_duration(elapsed)} elapsed{left}"

    def _beat(self) -> None:
        while not self._stop.wait(self.every_s / 5):
            with self._lock:
                if self.last is not None and time.monotonic() - self._said >= self.every_s:
                    self._say(self._where(self.last))

    def close(self) -> None:
        """Stop the timer thread."""
        self._stop.set()
        self._timer.join()


class _RichProgress:
    """The planner's progress as a rich bar (a terminal): the stage, its units, the
    time elapsed and the estimate's time left."""

    def __init__(self) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeElapsedColumn,
        )
        from rich.progress import Progress as Bar

        self.bar = Bar(TextColumn("{task.description}"), BarColumn(),
                       MofNCompleteColumn(), TimeElapsedColumn(),
                       TextColumn("{task.fields[left]}"), transient=True)
        self.bar.start()
        self.task = self.bar.add_task("plan", total=None, left="")
        self.estimate: float | None = None

    def __call__(self, p: Progress) -> None:
        if self.estimate is None and p.estimate_s is not None:
            self.estimate = p.estimate_s
            self.bar.console.print(f"plan: estimated {_duration(p.estimate_s)} in all "
                                   f"({p.basis})")
        left = "" if p.left_s is None else f"about {_duration(p.left_s)} left"
        self.bar.update(self.task, description=p.stage, completed=p.done,
                        total=p.total or None, left=left)

    def close(self) -> None:
        """Stop drawing."""
        self.bar.stop()


def progress_for(stream: Any = None) -> PlainProgress | _RichProgress:
    """A rich bar where ``stream`` (stderr) is a terminal, else plain lines."""
    stream = stream if stream is not None else sys.stderr
    if getattr(stream, "isatty", lambda: False)():
        try:
            return _RichProgress()
        except ImportError:
            pass
    return PlainProgress(stream)


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
    p.epilog = EPILOG
    p.formatter_class = argparse.RawDescriptionHelpFormatter


def run(args: argparse.Namespace) -> int:
    """``mixprec plan``: plan the workbench GPT, print the table, write the JSON."""
    shown = progress_for()
    t0 = time.monotonic()
    try:
        p = plan_workbench(size=args.size, batch=args.batch, seq=args.seq, seed=args.seed,
                           calibration=args.calibration, goal=args.goal,
                           memory=args.memory, max_loss=args.max_loss,
                           min_sqnr=args.min_sqnr, base=args.base, formats=args.formats,
                           state_formats=args.states, max_step=args.max_step,
                           cache_file=args.cache, seconds=args.seconds, progress=shown)
    finally:
        shown.close()
    took = time.monotonic() - t0
    estimated = "" if shown.estimate is None else \
        f" (estimated {_duration(shown.estimate)})"
    print(f"plan: took {_duration(took)}{estimated}", file=sys.stderr)
    p.save(args.out)
    print(p.table())
    print(f"plan: {args.out}")
    shape = f"--size {args.size} --batch {args.batch}" + (f" --seq {args.seq}" if args.seq
                                                           else "")
    print(f"train it: mixprec train {shape} --recipe '{p.recipe}'")
    print(f"compare it: mixprec compare {shape} --recipes {args.out},bf16,fp8")
    return 0
