"""A finding: what the doctor saw, the evidence, and what to change."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Literal

__all__ = ["Finding", "Report", "CODES"]

Severity = Literal["error", "warning", "info"]

#: Every finding code the doctor, the dtype audit and the workbench emit, with what it
#: means in a few words (the troubleshooting page has one entry per code).
CODES: dict[str, str] = {
    "nonfinite-origin": "inf/NaN traced to the module and op where it first appears",
    "nonfinite": "non-finite gradients that no module produced: the data or the loss",
    "grad-underflow": "gradient elements that flush to zero in fp16 at the loss scale",
    "update-vanish": "weight updates lost in the weights' rounding",
    "loss-diverging": "a loss that grew step over step: the learning rate, not the format",
    "update-ratio": "steps that move the weights by far more than the usual ~1e-3",
    "master-dtype": "the optimizer updates 16-bit weights, not fp32 masters",
    "optimizer-state-dtype": "optimizer states stored in 16 bits",
    "param-dtype": "parameters not in the recipe's working dtype",
    "grad-dtype": "gradient buffers in another dtype than the recipe's",
    "scale-constant": "a dynamic loss scale that never moves",
    "scale-unstable": "a loss scale that backs off on many steps",
    "scale-at-min": "a loss scale stuck at min_scale",
    "reference-divergence": "layers whose gradients are far from fp32's",
    "coverage": "a small share of matmul FLOPs in low precision",
    "fp8-range": "fp8 casts that flush a layer's values to zero",
    "kernel-emulated": "no fast kernel for the format here: emulated exactly",
    "kernel-slow": "the format's matmuls are slower than fp32's here",
    "kernel-better-dtype": "the other 16-bit format is much faster here",
    "kernel-noisy": "the machine was too busy to measure matmul speeds",
    "time-share": "matmuls are a small share of the step, bounding any speed-up",
    "timing-noisy": "timed rounds that disagree: no speed advice drawn from them",
    "step-slow": "a recipe's step takes several times fp32's",
    "engine": "the recipe cannot run on this model",
    "plan-floor": "a planned fp8/fp4 layer whose SQNR fell below the plan's floor",
    "comm-fallback": "a low-precision format's weights or activations sent in 16 bits",
}


@dataclass(frozen=True)
class Finding:
    """One diagnosis: what was seen (evidence) and what to change (advice)."""

    severity: Severity
    code: str
    title: str
    evidence: str
    advice: str
    data: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.code not in CODES:
            raise ValueError(f"finding code {self.code!r} is not in "
                             "mixprec.diagnostics.findings.CODES; add it there (and its "
                             "entry to the troubleshooting page)")
        if self.severity not in ("error", "warning", "info"):
            raise ValueError(f"severity {self.severity!r}; valid: error, warning, info")

    def __str__(self) -> str:
        return (f"[{self.severity}] {self.title}\n  evidence: {self.evidence}\n"
                f"  advice: {self.advice}")


@dataclass
class Report:
    """The doctor's findings (errors first) and the facts they were drawn from."""

    recipe: str
    findings: list[Finding]
    facts: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """No errors and no warnings."""
        return not any(f.severity in ("error", "warning") for f in self.findings)

    def codes(self) -> list[str]:
        """The finding codes, in order (e.g. ``["nonfinite-origin"]``)."""
        return [f.code for f in self.findings]

    def to_json(self) -> str:
        """The report as JSON: recipe, ok, findings (with evidence and advice), facts."""
        return json.dumps({"recipe": self.recipe, "ok": self.ok,
                           "findings": [asdict(f) for f in self.findings],
                           "facts": self.facts}, indent=2, default=str)

    def __str__(self) -> str:
        head = f"mixprec doctor: recipe {self.recipe}: " + (
            "no problems found" if self.ok else
            f"{sum(f.severity == 'error' for f in self.findings)} error(s), "
            f"{sum(f.severity == 'warning' for f in self.findings)} warning(s)")
        return "\n".join([head, *map(str, self.findings)])
