"""Where a plan is, and how long it should take: progress reports for a callback.

A plan measures in stages (one training step, the Linear shapes, the experts modules,
the numerics, the whole-model steps, the loss check). ``Tracker`` knows each stage's
units of work before it starts and reports every unit done to ``progress(report)``, a
callback the caller draws as it likes (``mixprec plan`` draws a rich progress bar on a
terminal and a plain line every few seconds elsewhere; the core draws nothing).

The estimate of the whole run is measured, then extrapolated: the planner first times
one training step of the model and the first Linear shape, and each stage's units are
priced at the measured time of that stage's units so far, or, before it has any, as so
many training steps (a whole-model step is one; a Linear shape with no measured shape
yet is priced as the first shape was). ``Progress.basis`` says what it rests on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Progress", "Tracker", "ProgressFn", "STEP_STAGE", "SHAPES_STAGE",
           "EXPERTS_STAGE", "NUMERICS_STAGE", "STEPS_STAGE", "LOSS_STAGE"]

#: the stages of a plan, in the order they first run
STEP_STAGE = "one training step"
NUMERICS_STAGE = "numerics on the calibration batches"
SHAPES_STAGE = "timing Linear shapes"
EXPERTS_STAGE = "timing experts modules"
STEPS_STAGE = "whole-model steps"
LOSS_STAGE = "checking the loss"


@dataclass(frozen=True)
class Progress:
    """One report: the ``stage`` running, its units ``done`` of ``total``, seconds
    since the plan started, and the whole plan's estimated seconds (None until the
    first training step and the first shape are measured) with what it rests on."""

    stage: str
    done: int
    total: int
    elapsed_s: float
    estimate_s: float | None
    basis: str = ""

    @property
    def left_s(self) -> float | None:
        """Seconds the estimate leaves (never below 0)."""
        return None if self.estimate_s is None else max(0.0, self.estimate_s
                                                         - self.elapsed_s)


ProgressFn = Callable[[Progress], None]


@dataclass
class _Stage:
    total: int
    #: what one unit costs before any is measured: so many training steps, or None
    #: (priced as the stage ``like`` measured its units)
    steps_per_unit: float | None
    like: str | None = None
    done: int = 0
    spent_s: float = 0.0


class Tracker:
    """The stages of one plan and their progress (module docstring). ``clock``: the
    seconds it reads (tests pass a fake one)."""

    def __init__(self, progress: ProgressFn | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.progress, self.clock = progress, clock
        self.t0 = self._last = clock()
        self.stages: dict[str, _Stage] = {}
        self.step_s: float | None = None
        self.current: str | None = None

    def add(self, stage: str, units: int, steps_per_unit: float | None = None,
            like: str | None = None) -> None:
        """Declare ``units`` of work in ``stage`` (more units add to it), each costing
        ``steps_per_unit`` training steps until one is measured (or what one unit of
        stage ``like`` measured)."""
        s = self.stages.get(stage)
        if s is None:
            self.stages[stage] = _Stage(int(units), steps_per_unit, like)
        else:
            s.total += int(units)

    def start(self, stage: str) -> None:
        """``stage`` begins now (its clock starts here)."""
        self.current = stage
        self._last = self.clock()
        self._report(stage)

    def done(self, stage: str, n: int = 1) -> None:
        """``n`` units of ``stage`` are done: the time since the last mark is theirs."""
        now = self.clock()
        s = self.stages[stage]
        s.done += n
        s.total = max(s.total, s.done)
        s.spent_s += now - self._last
        self._last = now
        self._report(stage)

    def each(self, stage: str, items: list, fn: Callable[[Any], dict]) -> dict:
        """``fn(item)`` for each of ``items``, each a unit of ``stage`` done: their
        dicts merged."""
        out: dict = {}
        self.start(stage)
        for item in items:
            out.update(fn(item))
            self.done(stage)
        return out

    def set_step(self, seconds: float) -> None:
        """The measured seconds of one training step of the model."""
        self.step_s = max(0.0, float(seconds))

    def _unit_s(self, name: str) -> float | None:
        s = self.stages[name]
        if s.done:
            return s.spent_s / s.done
        if s.like is not None and s.like in self.stages and self.stages[s.like].done:
            ref = self.stages[s.like]
            return ref.spent_s / ref.done
        if s.steps_per_unit is not None and self.step_s is not None:
            return s.steps_per_unit * self.step_s
        return None

    def estimate(self) -> float | None:
        """The whole plan's seconds: elapsed, plus each stage's units left at its unit's
        price; None while a stage with units left has no price."""
        left = 0.0
        for name, s in self.stages.items():
            if s.total <= s.done:
                continue
            unit = self._unit_s(name)
            if unit is None:
                return None
            left += (s.total - s.done) * unit
        return self.clock() - self.t0 + left

    def basis(self) -> str:
        """What the estimate rests on, for a reader: the training step and each stage's
        units measured so far."""
        parts = [] if self.step_s is None else [
            f"one training step measured {self.step_s:.2f} s"]
        parts += [f"{name}: {s.done} of {s.total} in {s.spent_s:.1f} s"
                  for name, s in self.stages.items() if s.done and name != STEP_STAGE]
        return "; ".join(parts) + ", extrapolated" if parts else ""

    def _report(self, stage: str) -> None:
        if self.progress is None:
            return
        s = self.stages.get(stage)
        self.progress(Progress(stage, s.done if s else 0, s.total if s else 0,
                               self.clock() - self.t0, self.estimate(), self.basis()))
