"""What crossed the wire: each collective the engine and its formats run, with its
operation, purpose, dtype and bytes, and every place where a format that asked for
8-bit (or 4-bit) communication sent 16 bits instead (said once per cause, kept for the
doctor). Compiled code records too: ``CommStats.record`` there calls the op
``mixprec::record_comm``, which the graph keeps and which counts when the graph runs;
under CUDA graphs inductor runs it between the captured partitions (the op is tagged
``cudagraph_unsafe``)."""

from __future__ import annotations

import itertools
import warnings
import weakref
from dataclasses import dataclass, field

import torch

__all__ = ["CommStats", "CommRecord", "CommFallback"]

#: the most recent calls ``per_call`` and ``records`` keep (a long run makes millions)
KEEP = 4096
#: the fallbacks already warned about in this process: (what, asked, why)
_WARNED: set[tuple[str, str, str]] = set()
#: each CommStats' key, by which a compiled graph's ``record_comm`` finds it
_KEYS = itertools.count()
_LIVE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
#: the count of collectives recorded from compiled code: the tensor ``record_comm``
#: mutates, so that no graph (AOTAutograd's, inductor's) drops the op as dead code
_TICKS = torch.zeros((), dtype=torch.int64)


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
    _key: int = field(default_factory=lambda: next(_KEYS), repr=False, compare=False)

    def __post_init__(self) -> None:
        _LIVE[self._key] = self

    def __setstate__(self, state: dict) -> None:
        """A copy (pickled, ``copy.deepcopy``) takes a key of its own."""
        self.__dict__.update(state, _key=next(_KEYS))
        _LIVE[self._key] = self

    def record(self, t: torch.Tensor, op: str = "all_reduce", what: str = "grads") -> None:
        """Count one collective's payload: ``t.numel() * t.element_size()`` bytes. In
        compiled code the graph keeps the count (``record_comm``), made when it runs:
        no counter of this object is read while tracing, so none is guarded on."""
        n = t.numel() * t.element_size()
        if torch.compiler.is_compiling():
            torch.ops.mixprec.record_comm(_TICKS, self._key, op, what, t.dtype, n)
            return
        self._count(op, what, t.dtype, n)

    def _count(self, op: str, what: str, dtype: torch.dtype, n: int) -> None:
        self.bytes_sent += n
        self.calls += 1
        self.dtype = dtype
        self.per_call.append(n)
        self.records.append(CommRecord(op, what, dtype, n))
        key = (op, what, dtype)
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


@torch.library.custom_op("mixprec::record_comm", mutates_args=("ticks",),
                         tags=(torch.Tag.cudagraph_unsafe,))
def record_comm(ticks: torch.Tensor, key: int, op: str, what: str, dtype: torch.dtype,
                nbytes: int) -> None:
    """``CommStats.record`` from compiled code: counts one collective of ``nbytes`` in
    the CommStats keyed ``key`` (if it is alive) and bumps ``ticks``.

    The count is Python on the host, which a CUDA graph's replay would not run, and
    ``ticks`` is a CPU tensor: the op is tagged ``cudagraph_unsafe``, so inductor's
    graph partitions (torch's default) run it between CUDA graphs and capture the rest
    of the graph, where an untagged op left whole partitions out of CUDA graphs (a
    mutated CPU input) or would have been replayed without counting. Without graph
    partitions (``torch._inductor.config.graph_partition = False``) inductor skips CUDA
    graphs for a graph that records, and says so."""
    ticks.add_(1)
    stats = _LIVE.get(key)
    if stats is not None:
        stats._count(op, what, dtype, nbytes)


@record_comm.register_fake
def _(ticks, key, op, what, dtype, nbytes) -> None:
    return None
