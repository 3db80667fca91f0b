"""Coverage: which share of the weights that feed the model's matmuls runs in which format.

At build the engine reads the model as it will train: every converted Linear in its
fp8/fp4 preset, every transformers experts module in its projections' format, and
everything else that multiplies a weight (Linears left in high precision and why, the
mixture-of-experts routers, experts modules kept) in the recipe's 16-bit compute. The
report counts parameters (a weight's FLOPs per token are proportional to its size for a
dense layer; an expert's are that times the share of tokens routed to it), by module
kind: ``attention``, ``linear`` (the MLPs and the rest), ``head``, ``experts``,
``router``. The report says the share in 16 bits (or the recipe's wider compute
format) and the share below 16 bits apart, and lists the largest modules a low-precision
recipe kept in 16 bits, with how many more it kept. A low-precision recipe that leaves
more than half of them in 16 bits warns once, naming the largest modules left out and
why.

``step_flops`` weights the same rows by the matmul FLOPs of a real forward: a Linear
(or router) ``2 · tokens · params``, each projection of an experts module ``2 ·
routed pairs · params per expert`` (the (token, expert) pairs its router sent, so
an expert's share follows its tokens), and ``Coverage.weighted`` turns those counts
into the same report by FLOPs (``engine.coverage_flops``). The backward doubles every
weight's FLOPs alike, so the shares are a training step's.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mixprec.experts.format import ExpertsFormat
from mixprec.experts.hook import experts_modules
from mixprec.formats import elements as formats
from mixprec.modules.linear import Float8Linear, is_conv1d
from mixprec.recipe import Recipe

__all__ = ["Coverage", "CoverageRow", "coverage", "warn_low_coverage", "low_precision",
           "step_flops", "element_bits", "model_experts"]

#: the share of matmul weights below which a low-precision recipe warns
WARN_BELOW = 0.5
#: how many of the modules kept in 16 bits the report and the warning name
NAMED = 3


def element_bits(fmt: str) -> int | None:
    """The bits of one element of a compute format (``"bf16"``: 16), or None for a
    Linear or experts format (an fp8/fp4/int8 preset: below 16 bits by definition)."""
    try:
        return formats.get(fmt).total_bits
    except ValueError:
        return None


def _below_16(fmt: str) -> bool:
    bits = element_bits(fmt)
    return bits is None or bits < 16


def low_precision(r: Recipe) -> bool:
    """Whether ``r`` runs Linears in a low-precision (fp8/fp4) format: the one check."""
    return r.linear is not None


@dataclass(frozen=True)
class CoverageRow:
    """One module whose weight feeds a matmul: its name, kind, parameter count, format
    (an fp8/fp4 preset name or a 16-bit dtype) and, for one left in 16 bits under a
    low-precision recipe, why."""

    name: str
    kind: str
    params: int
    format: str
    reason: str | None = None


@dataclass(frozen=True)
class Coverage:
    """The rows, and the share of parameters in each format (overall and per kind).

    >>> from torch import nn
    >>> from mixprec.engine.convert import convert
    >>> net = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 16))
    >>> report = convert(net, "fp8-current")
    >>> cov = coverage(net, "fp8-current", dict(report.skipped))
    >>> round(cov.low_precision_share, 3), cov.by_kind()["head"]
    (0.8, {'bf16': 1.0})
    >>> print(str(cov).splitlines()[0])
    coverage: 20% of 2,560 matmul weight parameters in 16 bits (bf16),
    80% below 16 bits (fp8-current)
    """

    rows: tuple[CoverageRow, ...]
    high: str = "bf16"
    #: what each row's ``params`` counts (``weighted``: FLOPs of a forward)
    unit: str = "matmul weight parameters"

    @property
    def total(self) -> int:
        """Parameters that feed matmuls (FLOPs, for a ``weighted`` report)."""
        return sum(r.params for r in self.rows)

    def weighted(self, counts: Mapping[str, int], unit: str = "matmul FLOPs"
                 ) -> Coverage:
        """The same rows, each counted by ``counts[row.name]`` (0 where absent: a
        module the forward never reached) in place of its parameters."""
        return Coverage(tuple(dataclasses.replace(r, params=int(counts.get(r.name, 0)))
                              for r in self.rows), self.high, unit)

    def shares(self, kind: str | None = None) -> dict[str, float]:
        """Format -> share of the parameters (of ``kind``, or of all)."""
        rows = [r for r in self.rows if kind is None or r.kind == kind]
        total = sum(r.params for r in rows) or 1
        counts: dict[str, int] = {}
        for r in rows:
            counts[r.format] = counts.get(r.format, 0) + r.params
        return {f: c / total for f, c in counts.items()}

    def by_kind(self) -> dict[str, dict[str, float]]:
        """Kind -> (format -> share of that kind's parameters)."""
        return {k: self.shares(k) for k in dict.fromkeys(r.kind for r in self.rows)}

    @property
    def low_precision_share(self) -> float:
        """The share of the parameters below 16 bits (an fp8/fp4/int8 format)."""
        return sum(r.params for r in self.rows if _below_16(r.format)) / (self.total or 1)

    @property
    def high_precision_share(self) -> float:
        """The share of the parameters in 16 bits or more (the recipe's compute format:
        all of them under a 16-bit recipe, the modules kept under a low-precision one)."""
        return sum(r.params for r in self.rows if not _below_16(r.format)) / (self.total or 1)

    def kept(self) -> list[CoverageRow]:
        """Every module a low-precision recipe kept in 16 bits, largest first (none
        under a 16-bit recipe: nothing there was meant to go lower)."""
        return sorted((r for r in self.rows if r.reason is not None), key=lambda r: -r.params)

    def left_out(self, n: int = NAMED) -> list[CoverageRow]:
        """The ``n`` largest modules left in 16 bits."""
        rows = [r for r in self.rows if r.format == self.high]
        return sorted(rows, key=lambda r: -r.params)[:n]

    def _widths(self, below: bool) -> str:
        """The formats of the rows above or below 16 bits: ``"16 bits (bf16)"``."""
        fmts = sorted({r.format for r in self.rows if _below_16(r.format) == below})
        if below:
            return f"below 16 bits ({', '.join(fmts)})" if fmts else "below 16 bits"
        bits = sorted({element_bits(f) for f in fmts or [self.high]})
        width = f"{bits[0]} bits" if len(bits) == 1 else "16 bits or more"
        return f"{width} ({', '.join(fmts or [self.high])})"

    def __str__(self) -> str:
        lines = [f"coverage: {self.high_precision_share:.0%} of {self.total:,} {self.unit} "
                 f"in {self._widths(False)}, {self.low_precision_share:.0%} "
                 f"{self._widths(True)}"]
        for kind, shares in self.by_kind().items():
            said = ", ".join(f"{f} {s:.0%}" for f, s in sorted(shares.items()))
            lines.append(f"  {kind:<10} {said}")
        kept = self.kept()
        for r in kept[:NAMED]:
            lines.append(f"  kept {r.name} ({r.params:,}): {r.reason}")
        if len(kept) > NAMED:
            rest = sum(r.params for r in kept[NAMED:])
            lines.append(f"  ... and {len(kept) - NAMED} more kept in {self.high} "
                         f"({rest:,}; engine.coverage.kept() lists them)")
        return "\n".join(lines)


def _kind(name: str, m: nn.Module, head: set[str]) -> str:
    if name in head:
        return "head"
    leaf = name.rsplit(".", 1)[-1]
    if "attn" in name or "attention" in name or leaf in ("q_proj", "k_proj", "v_proj",
                                                          "o_proj", "qkv"):
        return "attention"
    return "linear"


def _is_router(m: nn.Module) -> bool:
    w = getattr(m, "weight", None)
    return ("router" in type(m).__name__.lower() and isinstance(w, nn.Parameter)
            and w.dim() == 2)


def coverage(model: nn.Module, recipe: Recipe | str,
             skipped: Mapping[str, str] | None = None) -> Coverage:
    """The coverage of ``model`` as it stands under ``recipe``; ``skipped``: the reason
    each Linear the fp8 swap left alone has (``ConvertReport.skipped``)."""
    r = Recipe.coerce(recipe)
    high = "bf16" if low_precision(r) else r.precision.compute
    skipped = dict(skipped or {})
    lp = low_precision(r)
    linears = [n for n, m in model.named_modules()
               if isinstance(m, nn.Linear) or is_conv1d(m)]
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    head = {n for n, m in model.named_modules() if (isinstance(m, nn.Linear)
            or is_conv1d(m)) and (id(m.weight) in tied or "head" in skipped.get(n, ""))}
    if linears and not head and linears[-1] not in {n for n, m in model.named_modules()
                                                   if isinstance(m, Float8Linear)}:
        head.add(linears[-1])
    rows = []
    for name, m in model.named_modules():
        if isinstance(m, Float8Linear):
            rows.append(CoverageRow(name, _kind(name, m, head), m.weight.numel(),
                                    m.fp8_recipe.fp8_name or "fp8"))
        elif isinstance(m, nn.Linear) or is_conv1d(m):
            why = skipped.get(name, "not converted") if lp else None
            rows.append(CoverageRow(name, _kind(name, m, head), m.weight.numel(), high, why))
        elif _is_router(m):
            why = "router: kept in high precision (it picks the experts)" if lp else None
            rows.append(CoverageRow(name, "router", m.weight.numel(), high, why))
    for name, m in experts_modules(model).items():
        for proj in ("gate_up_proj", "up_proj", "down_proj"):
            w = getattr(m, proj, None)
            if w is None or w.dim() != 3:
                continue
            fmt = getattr(m, f"{proj}_fp8", None)
            params = w.numel() // w.shape[0] * model_experts(m, w)
            if isinstance(fmt, ExpertsFormat):
                rows.append(CoverageRow(f"{name}.{proj}", "experts", params,
                                        fmt.format_name))
            else:
                why = None if not lp else (
                    "its layer: rule keeps it" if r.layer_format(name) == "bf16"
                    else "not converted")
                rows.append(CoverageRow(f"{name}.{proj}", "experts", params, high, why))
    rows += _own_experts(model, set(experts_modules(model)))
    return Coverage(tuple(rows), high)


def model_experts(m: nn.Module, w: torch.Tensor) -> int:
    """How many experts experts module ``m``'s 3-D weight ``w`` has in the model: its
    first dim (a DTensor's is the model's where transformers' expert parallelism
    shards it), or the group's where ``expert_parallel`` cut it to this rank's. A
    sharded weight counts whole, as a sharded Linear's DTensor does, so the shares are
    the model's on every layout."""
    ep = m.__dict__.get("_mixprec_ep")
    return ep.num_experts if ep is not None else w.shape[0]


def _own_experts(model: nn.Module, done: set[str]) -> list[CoverageRow]:
    """The 3-D parameters of a module of the user's own that holds ExpertsFormats
    (``mixprec.experts.grouped_mm`` called directly), in their format."""
    rows = []
    for name, m in model.named_modules():
        fmts = {c.format_name for c in m.children() if isinstance(c, ExpertsFormat)}
        if not fmts or name in done:
            continue
        for pname, p in m.named_parameters(recurse=False):
            if p.dim() == 3:
                full = f"{name}.{pname}" if name else pname
                rows.append(CoverageRow(full, "experts", p.numel(), "/".join(sorted(fmts))))
    return rows


def warn_low_coverage(cov: Coverage, r: Recipe, stacklevel: int = 3) -> None:
    """One warning when a low-precision recipe leaves more than half of the matmul
    weights in 16 bits, naming the largest modules left out and why."""
    if not low_precision(r) or not cov.total or cov.low_precision_share >= WARN_BELOW:
        return
    named = "; ".join(f"{x.name} ({x.params:,} parameters): {x.reason}"
                      for x in cov.left_out())
    more = len(cov.kept()) - len(cov.left_out())
    if more > 0:
        named += f"; and {more} more"
    warnings.warn(
        f"recipe {str(r)!r} runs only {cov.low_precision_share:.0%} of this model's "
        f"matmul weights in low precision; the largest left in {cov.high}: {named}. "
        "engine.coverage lists every module; layer: rules, bf16_last_layers or the "
        "fp8_filter decide what converts.", stacklevel=stacklevel)


def step_flops(model: nn.Module, cov: Coverage, run: Callable[[], Any]) -> dict[str, int]:
    """The forward matmul FLOPs of each row of ``cov`` while ``run()`` runs ``model``
    (module docstring): by row name, counted by forward hooks; experts by the routed
    (token, expert) pairs their top-k indices give."""
    flops: dict[str, int] = {}
    handles = []
    experts = experts_modules(model)
    modules = dict(model.named_modules())
    for row in cov.rows:
        m = modules.get(row.name)
        if m is None or row.kind == "experts":
            continue

        def dense(mod, args, out, name=row.name, params=row.params):
            x = args[0]
            flops[name] = flops.get(name, 0) + 2 * (x.numel() // x.shape[-1]) * params
        handles.append(m.register_forward_hook(dense))
    for name, m in experts.items():
        def routed(mod, args, out, name=name):
            if len(args) < 2:  # not called as (hidden, top_k_index, top_k_weights)
                return
            # expert parallelism (transformers' or expert_parallel's) calls the module
            # with the model's expert ids of this rank's tokens: their FLOPs, as a
            # data-parallel Linear's row counts its rank's tokens
            for proj in ("gate_up_proj", "up_proj", "down_proj"):
                w = getattr(mod, proj, None)
                if isinstance(w, torch.Tensor) and w.dim() == 3:
                    pairs = int((args[1] < model_experts(mod, w)).sum())
                    key = f"{name}.{proj}"
                    flops[key] = (flops.get(key, 0)
                                  + 2 * pairs * (w.numel() // w.shape[0]))
        handles.append(m.register_forward_hook(routed))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return flops
