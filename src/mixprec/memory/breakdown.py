"""What the memory planner returns: bytes per rank by item (``mixprec.memory`` explains
the accounting), with the notes and the step's peak."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Breakdown", "ITEMS", "GB"]

ITEMS = ("params", "grads", "master", "optimizer", "fp8", "buffers", "activations",
         "weight_casts", "pp_buffers", "ep_buffers")
GB = 1e9


@dataclass(frozen=True)
class Breakdown:
    """Bytes per rank by item, plus what the numbers assumed."""

    items: dict[str, float]
    recipe: str
    notes: tuple[str, ...] = field(default=())
    #: the highest bytes held during one training step (forward, backward and optimizer
    #: step): ``measure(..., peak=True)``'s measured high-water mark, or ``estimate``'s
    #: prediction when it has a transformer spec; None when not known
    peak: float | None = None

    @property
    def total(self) -> float:
        """Sum of all items, in bytes."""
        return float(sum(self.items.values()))

    def __getitem__(self, item: str) -> float:
        return self.items.get(item, 0.0)

    def gb(self, item: str | None = None) -> float:
        """One item, or the total, in GB (1e9 bytes)."""
        return (self.total if item is None else self[item]) / GB

    def table(self) -> str:
        """Plain-text table of the items in GB, with the notes."""
        rows = [f"{'item':<13}{'GB':>12}"]
        rows += [f"{k:<13}{v / GB:>12.3f}" for k, v in self.items.items() if v]
        rows.append(f"{'total':<13}{self.total / GB:>12.3f}")
        if self.peak is not None:
            rows.append(f"{'peak':<13}{self.peak / GB:>12.3f}")
        return "\n".join(rows + [f"  note: {n}" for n in self.notes])
