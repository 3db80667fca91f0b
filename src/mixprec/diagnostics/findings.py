"""A finding: what the doctor saw, the evidence, and what to change."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Literal

__all__ = ["Finding", "Report"]

Severity = Literal["error", "warning", "info"]


@dataclass(frozen=True)
class Finding:
    """One diagnosis: what was seen (evidence) and what to change (advice)."""

    severity: Severity
    code: str
    title: str
    evidence: str
    advice: str
    data: dict = field(default_factory=dict)

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
