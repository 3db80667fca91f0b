"""Do repeated timings agree? The one rule every reported speed figure is held to.

A figure timed over several rounds (steps, profiled steps, interleaved phases) is only
as good as its rounds' agreement. The planner, the workbench's reports and the doctor's
time share all hold to it: the rounds' interquartile range over their median,
``spread``; above ``NOISY_SPREAD`` (25%) the rounds disagree, the machine was too busy
(other processes held the cores) and no speed advice may be drawn from them. On a
shared 2-core host one recipe's per-step tokens/s once ranged from 1,210 to 62,806: a
ratio of two such medians read bf16 at 0.03x fp32 where bf16's kernels ran 4.3x faster.

``agreement(what, values, unit)`` measures a list of rounds and says, for a report,
whether they disagree and by how much (``str(agreement)``).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["NOISY_SPREAD", "spread", "Agreement", "agreement"]

#: rounds whose interquartile range exceeds this share of their median disagree (the
#: planner's timings, the workbench's reports and the doctor's time share alike)
NOISY_SPREAD = 0.25


def spread(values: Iterable[float]) -> float:
    """The interquartile range of ``values`` over their median (0 for fewer than two
    values, or a median of 0).

    >>> spread([1.0, 1.0, 1.0, 3.0, 3.0])
    2.0
    """
    vals = list(values)
    if len(vals) < 2:
        return 0.0
    q1, q2, q3 = statistics.quantiles(vals, n=4, method="inclusive")
    return (q3 - q1) / q2 if q2 > 0 else 0.0


@dataclass(frozen=True)
class Agreement:
    """How far the rounds of one timed figure agree: ``what`` they time (``"fp32's
    per-step tokens/s"``), their ``unit``, and the rounds."""

    what: str
    values: tuple[float, ...]
    unit: str = ""

    @property
    def spread(self) -> float:
        """The rounds' interquartile range over their median (``spread``)."""
        return spread(self.values)

    @property
    def noisy(self) -> bool:
        """Whether the rounds disagree: a spread above ``NOISY_SPREAD``."""
        return self.spread > NOISY_SPREAD

    def as_dict(self) -> dict:
        """The figures as plain data (reports' JSON)."""
        return {"what": self.what, "spread": self.spread, "noisy": self.noisy,
                "low": min(self.values, default=None),
                "high": max(self.values, default=None), "rounds": len(self.values)}

    def __str__(self) -> str:
        lo, hi = min(self.values, default=0.0), max(self.values, default=0.0)
        unit = f" {self.unit}" if self.unit else ""
        verdict = (f"above {NOISY_SPREAD:.0%}: the rounds disagree" if self.noisy
                   else "the rounds agree")
        return (f"{self.what} ranged {_num(lo)} to {_num(hi)}{unit} over "
                f"{len(self.values)} rounds (interquartile range {self.spread:.0%} of the "
                f"median, {verdict})")


def _num(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def agreement(what: str, values: Iterable[float], unit: str = "") -> Agreement:
    """The ``Agreement`` of the rounds ``values`` of the figure ``what``."""
    return Agreement(what, tuple(float(v) for v in values), unit)
