"""What crossed the wire: each collective the engine and its formats run, with its
operation, purpose, dtype and bytes, and every place where a format that asked for
8-bit (or 4-bit) communication sent 16 bits instead (said once per cause, kept for the
doctor)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

__all__ = ["CommStats", "CommRecord", "CommFallback"]

#: the most recent calls ``per_call`` and ``records`` keep (a long run makes millions)
KEEP = 4096
#: the fallbacks already warned about in this process: (what, asked, why)
_WARNED: set[tuple[str, str, str]] = set()


@dataclass(frozen=True)
class CommRecord:
    """One collective this rank took part in."""

    #: the collective: ``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"``, ...
    op: str
    #: what it carried: ``"grads"``, ``"norm"``, ``"amax"``, ``"weights"``, ...
    what: str
    #: the payload's dtype as it crossed the wire
    dtype: torch.dtype
    #: this rank's payload in bytes (numel × element size)
    nbytes: int


@dataclass(frozen=True)
class CommFallback:
    """A collective sent in 16 bits where the format asked for fewer."""

    #: what was sent (a module's weight, an activation, ...)
    what: str
    #: the format that asked for low-precision communication
    asked: str
    #: the dtype that was sent instead
    sent: torch.dtype
    #: why the low-precision route could not be taken, and the fix where there is one
    why: str


@dataclass
class CommStats:
    """Bytes this rank sent in the collectives counted here (numel × element size of
    the payload, once per call): DDP's gradient buckets, the gradient norm's sums over a
    tensor-parallel mesh, FSDP's all-gathers of weight codes; each call is also kept as
    a ``CommRecord`` (``records``), and each 16-bit fallback as a ``CommFallback``
    (``fallbacks``). The sums (``bytes_sent``, ``calls``, ``totals()``) count every
    call; ``per_call`` and ``records`` hold the most recent ones (at least ``KEEP``)."""

    bytes_sent: int = 0
    calls: int = 0
    dtype: torch.dtype | None = None
    per_call: list[int] = field(default_factory=list)
    records: list[CommRecord] = field(default_factory=list)
    fallbacks: list[CommFallback] = field(default_factory=list)
    _totals: dict = field(default_factory=dict, repr=False)

    def record(self, t: torch.Tensor, op: str = "all_reduce", what: str = "grads") -> None:
        """Count one collective's payload: ``t.numel() * t.element_size()`` bytes."""
        n = t.numel() * t.element_size()
        self.bytes_sent += n
        self.calls += 1
        self.dtype = t.dtype
        self.per_call.append(n)
        self.records.append(CommRecord(op, what, t.dtype, n))
        key = (op, what, t.dtype)
        self._totals[key] = self._totals.get(key, 0) + n
        if len(self.records) > 2 * KEEP:  # trimmed in halves: amortised O(1) per call
            del self.records[:-KEEP]
            del self.per_call[:-KEEP]

    def totals(self) -> dict[tuple[str, str, torch.dtype], int]:
        """``(op, what, dtype) -> bytes`` over every call."""
        return dict(self._totals)

    def fallback(self, what: str, asked: str, sent: torch.dtype, why: str) -> None:
        """Note that ``what`` crossed the wire as ``sent`` although format ``asked``
        wanted fewer bits; warns once per ``(what's kind, asked, why)`` in a process."""
        fb = CommFallback(what, asked, sent, why)
        if fb not in self.fallbacks:
            self.fallbacks.append(fb)
        key = (what.split(":")[0], asked, why)
        if key not in _WARNED:
            _WARNED.add(key)
            warnings.warn(f"{what} is communicated in {sent} although {asked!r} asked for "
                          f"low-precision communication: {why}", stacklevel=3)
