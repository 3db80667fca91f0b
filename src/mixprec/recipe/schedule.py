"""Precision schedules: which recipe a run trains in at each optimizer step.

A ``PrecisionSchedule`` is a pure description: phases, each a recipe and the step it
starts at (an integer step, or a fraction of the run's ``total_steps``). The engine
(``mixprec.engine.switch``) moves between them at step boundaries::

    >>> s = PrecisionSchedule([(0, "nvfp4"), (0.8, "bf16-master")], total_steps=1000)
    >>> s.starts(), str(s.recipe_at(799)), str(s.recipe_at(800))
    ((0, 800), 'nvfp4', 'bf16-master')
    >>> str(s)
    'nvfp4>bf16-master@0.8'
    >>> PrecisionSchedule.parse("bf16-master>fp8@100").starts()
    (0, 100)

The string form: phases separated by ``>``, each ``RECIPE@START`` (the first starts at
0 and may leave ``@0`` out); ``START`` with a ``.`` is a fraction of ``total_steps``,
otherwise a step. NVIDIA's NVFP4 pretraining recipe (arXiv 2509.25149) is
``"nvfp4>bf16-master@0.8"``: NVFP4 for the first 80% of the steps, then bf16 with fp32
masters, which brings the loss to within 0.5% of bf16's.
"""

from __future__ import annotations

import math
from dataclasses import KW_ONLY, dataclass
from typing import Literal

from mixprec.recipe.types import Recipe

__all__ = ["PrecisionSchedule", "FP8_STATE_CHOICES", "is_schedule_text"]

#: what a switch does with the fp8 scaling state of Linears quantized on both sides
FP8_STATE_CHOICES = ("keep", "reset")


def is_schedule_text(text: object) -> bool:
    """Whether ``text`` is a schedule's string form (it holds a ``>``), not a recipe's."""
    return isinstance(text, str) and ">" in text


def _start(value: object, i: int) -> int | float:
    """A phase's start: an int step >= 0 or a float fraction in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"phase {i}: start {value!r} is not a step (int) or a fraction of "
                         "total_steps (float in [0, 1)); write e.g. (800, 'bf16-master') "
                         "or (0.8, 'bf16-master')")
    if isinstance(value, float) and not (0.0 <= value < 1.0 and math.isfinite(value)):
        raise ValueError(f"phase {i}: fraction {value!r} is outside [0, 1); a fraction "
                         "is a share of total_steps, a step count is an int")
    if isinstance(value, int) and value < 0:
        raise ValueError(f"phase {i}: step {value!r} is negative; steps count from 0")
    return value


@dataclass(frozen=True)
class PrecisionSchedule:
    """Recipes by step: ``PrecisionSchedule([(0, "nvfp4"), (800, "bf16-master")])``.

    Pass it as ``MixedPrecision(..., recipe=schedule)`` (or ``schedule=``); a string
    ``"nvfp4>bf16-master@0.8"`` is the same. The engine trains optimizer step ``n``
    (counting from 0, skipped steps included) in ``recipe_at(n)``, switching right after
    the step before a phase's start."""

    #: the phases, ``(start, recipe)`` in increasing order of start, the first at 0: a
    #: start is an int step or a float fraction of ``total_steps``; a recipe, a
    #: ``Recipe`` or a recipe string
    phases: tuple[tuple[int | float, Recipe], ...]
    _: KW_ONLY
    #: the run's optimizer steps, which fractional starts are shares of (None: not known
    #: yet; the trainers' callbacks fill it from ``max_steps``)
    total_steps: int | None = None
    #: the fp8 scaling state (delayed scaling's amax history and scales, NVFP4's
    #: rounding stream) of a Linear quantized in the same format on both sides of a
    #: switch: ``"keep"`` carries it on, ``"reset"`` starts it afresh as a new engine
    #: would. A Linear whose format changes always starts afresh.
    fp8_state: Literal["keep", "reset"] = "keep"

    def __post_init__(self) -> None:
        raw = self.phases
        if isinstance(raw, (str, bytes)) or not hasattr(raw, "__iter__"):
            raise ValueError(f"phases must be a list of (start, recipe) pairs, got {raw!r}")
        phases = []
        for i, item in enumerate(raw):
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise ValueError(f"phase {i}: {item!r} is not a (start, recipe) pair")
            start = _start(item[0], i)
            recipe = item[1]
            if not isinstance(recipe, (Recipe, str)):
                raise ValueError(f"phase {i}: recipe {recipe!r} is not a Recipe or a "
                                 "recipe string")
            phases.append((start, Recipe.coerce(recipe)))
        if not phases or phases[0][0] != 0:
            raise ValueError(f"phases {raw!r}: the first phase must start at 0 (step 0 or "
                             "fraction 0.0)")
        object.__setattr__(self, "phases", tuple(phases))
        if self.total_steps is not None and (isinstance(self.total_steps, bool) or not
                                             isinstance(self.total_steps, int)
                                             or self.total_steps < 1):
            raise ValueError(f"total_steps must be an int >= 1 or None, got "
                             f"{self.total_steps!r}")
        if self.fp8_state not in FP8_STATE_CHOICES:
            raise ValueError(f"fp8_state={self.fp8_state!r}: choose one of "
                             f"{', '.join(FP8_STATE_CHOICES)}")
        if self.total_steps is not None or not self.fractional:
            self.starts()  # the order check

    # --- reading it ------------------------------------------------------------------

    @property
    def recipes(self) -> tuple[Recipe, ...]:
        """Each phase's recipe, in order."""
        return tuple(r for _, r in self.phases)

    @property
    def fractional(self) -> bool:
        """Whether a phase starts at a fraction of ``total_steps``."""
        return any(isinstance(s, float) and s > 0 for s, _ in self.phases)

    def starts(self) -> tuple[int, ...]:
        """Each phase's first step (fractions: ``round(fraction * total_steps)``)."""
        if self.fractional and self.total_steps is None:
            raise ValueError(
                f"schedule {str(self)!r} starts a phase at a fraction of the run but "
                "total_steps is not set: PrecisionSchedule(..., total_steps=N), or "
                "engine.set_total_steps(N) (the Trainer and Lightning callbacks set it "
                "from max_steps)")
        out = tuple(s if isinstance(s, int) else round(s * self.total_steps)
                    for s, _ in self.phases)
        if any(b <= a for a, b in zip(out, out[1:])):
            raise ValueError(f"schedule {str(self)!r}: phases start at steps {out}; each "
                             "must start after the one before (a phase of no step)")
        return out

    def phase_at(self, step: int) -> int:
        """The index of the phase optimizer step ``step`` trains in."""
        starts = self.starts()
        return max(i for i, s in enumerate(starts) if s <= step)

    def recipe_at(self, step: int) -> Recipe:
        """The recipe optimizer step ``step`` trains in."""
        return self.phases[self.phase_at(step)][1]

    def with_total_steps(self, total_steps: int) -> PrecisionSchedule:
        """This schedule over a run of ``total_steps`` optimizer steps."""
        return PrecisionSchedule(self.phases, total_steps=total_steps,
                                 fp8_state=self.fp8_state)

    # --- the string form -------------------------------------------------------------

    def __str__(self) -> str:
        parts = []
        for i, (start, r) in enumerate(self.phases):
            parts.append(str(r) if i == 0 else f"{r}@{start!r}")
        return ">".join(parts)

    @classmethod
    def parse(cls, text: str, *, total_steps: int | None = None,
              fp8_state: Literal["keep", "reset"] = "keep") -> PrecisionSchedule:
        """Parse ``"RECIPE>RECIPE@START>..."`` (see the module docstring)."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"schedule text {text!r}: write e.g. 'nvfp4>bf16-master@0.8'")
        phases: list[tuple[int | float, str]] = []
        for i, part in enumerate(text.split(">")):
            recipe, at, start = part.strip().rpartition("@")
            if not at:
                recipe, start = start, ("0" if i == 0 else "")
            if not start:
                raise ValueError(f"schedule {text!r}: phase {i} ({part!r}) has no @START; "
                                 "every phase after the first needs one, e.g. "
                                 "'bf16-master@0.8' or 'bf16-master@800'")
            try:
                value: int | float = float(start) if "." in start else int(start)
            except ValueError:
                raise ValueError(f"schedule {text!r}: start {start!r} of phase {i} is not "
                                 "a step (800) or a fraction (0.8)") from None
            phases.append((value, recipe))
        return cls(phases, total_steps=total_steps, fp8_state=fp8_state)

    @classmethod
    def coerce(cls, value: PrecisionSchedule | str) -> PrecisionSchedule:
        """A schedule from a schedule or its string form."""
        return value if isinstance(value, PrecisionSchedule) else cls.parse(value)
