"""``mixprec.plan``: a per-layer precision plan for your model, from measurements.

It measures three things on this device and chooses from them (``choose``):

1. speed: each distinct Linear shape in each candidate format, forward and backward,
   casts included, on the GEMM route the engine would take (``timing``); each
   transformers experts module on its grouped GEMMs at the tokens its router sends each
   expert on the sample batch (``experts``);
2. numerics: each Linear's and experts module's SQNR against bf16 for output, dgrad
   and wgrad, the share its casts flush to zero and delayed scaling's amax headroom, on
   your batches (``numerics``, ``experts``);
3. bytes: the whole model's step time and peak under the 16-bit recipe and under the
   fp8 recipe with nothing converted (``mixprec.memory.measure(peak=True)``), each
   format's saved activation bytes and each state format's exact bytes.

The plan is a ``Recipe`` with per-module rules, plus a table: layer, shape, choice,
predicted speed-up, SQNR, bytes and the reason for each choice. Predictions are never
negative, and never faster than a format's GEMM route can run; timings that disagreed
beyond their noise after being measured again are listed in ``Plan.timing_noise`` and
under the table. With ``max_loss`` the
planner also runs the model forward under its plan and under the 16-bit recipe on the
calibration batches and, while the plan's loss is more than ``max_loss`` (relative)
above, moves the Linear or experts module with the lowest SQNR back to bf16.

    >>> import torch, mixprec
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
    ...                             torch.nn.Linear(256, 64))
    >>> x = torch.randn(128, 64)
    >>> p = mixprec.plan(model, x, formats=("bf16", "fp8-current"))  # doctest: +SKIP
    >>> print(p.table())                                             # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec.planner.choose import STATE_ORDER, Config, Layer, choose, step_parts
from mixprec.planner.progress import LOSS_STAGE, ProgressFn, Tracker
from mixprec.planner.survey import Survey, forward_loss, survey
from mixprec.planner.table import kept_because, render
from mixprec.planner.timing import BF16, device_key
from mixprec.recipe import LINEAR_PRESETS, Recipe

__all__ = ["plan", "plan_from", "Plan", "PlanRow", "CANDIDATES", "DEFAULT_MIN_SQNR"]

#: the formats the planner measures by default
CANDIDATES = ("bf16", *LINEAR_PRESETS)
#: the default SQNR floor (dB) every GEMM of an fp8/fp4 Linear must reach against bf16.
#: Measured on Gaussian activations: e4m3 outputs ~28-29 dB, e5m2 gradients (dgrad)
#: ~25 dB, MXFP8's e4m3 gradients ~29 dB, NVFP4 ~15-17 dB (so NVFP4 needs a lower floor)
DEFAULT_MIN_SQNR = 20.0


@dataclass(frozen=True)
class PlanRow:
    """One Linear or experts module of the plan (``shape``: an experts module's hidden
    and intermediate widths): its format and states, the predicted speed-up of its
    forward + backward over bf16, its worst SQNR (dB, None for bf16), the bytes it
    saves for backward in its format, and why."""

    layer: str
    shape: tuple[int, int]
    choice: str
    states: str
    speedup: float
    sqnr: float | None
    saved_bytes: float
    reason: str
    #: the seconds it adds to the predicted step in its format (negative: it saves),
    #: as the prediction adds it up (``choose.step_parts``; 0 in bf16)
    delta_s: float = 0.0


@dataclass(frozen=True)
class Plan:
    """A per-layer precision plan: ``recipe`` (train with it), the table ``rows``, the
    predictions and the measured baselines they came from. ``timing_noise``: the
    timings that still disagreed beyond their noise after being measured again, one
    line each (empty where they agreed); the predictions then rest on noisy figures.
    ``not_planned``: modules the planner chose no format for, and why (empty: every
    Linear and transformers experts module has a row). ``step_terms``: the predicted
    step's terms other than the rows' ``delta_s`` (``base``: the 16-bit recipe's
    measured step, ``shell``: what the fp8 recipe adds around its Linears, ``states``:
    the optimizer states'), so that ``predicted_step_s`` is their sum plus the rows'.
    ``low_precision_share``: the share of the model's matmul FLOPs the plan runs below
    16 bits; ``kept_flops``: the FLOPs left in bf16, by why (``table.kept_because``)."""

    recipe: Recipe
    rows: tuple[PlanRow, ...]
    goal: str
    min_sqnr: float
    predicted_step_s: float
    predicted_peak: float
    baseline: dict[str, dict[str, float]]
    device: str
    max_loss: float | None = None
    memory: float | None = None
    loss_delta: float | None = None
    state_reasons: dict[str, str] = field(default_factory=dict)
    timing_noise: tuple[str, ...] = ()
    not_planned: dict[str, str] = field(default_factory=dict)
    step_terms: dict[str, float] = field(default_factory=dict)
    low_precision_share: float | None = None
    kept_flops: dict[str, float] = field(default_factory=dict)

    def table(self) -> str:
        """The plan as a text table, one Linear a line, with the summary under it
        (``planner.table``: every column explained in ``table.COLUMNS``)."""
        return render(self)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-ready (the recipe as its string)."""
        d = asdict(self)
        d["recipe"] = str(self.recipe)
        d["rows"] = [asdict(r) for r in self.rows]
        return d

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON (``Plan.load`` reads it; ``mixprec compare`` and the
        doctor take the file). Written to a temporary file and renamed: atomic."""
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".partial")
        tmp.write_text(json.dumps(self.to_dict(), indent=1, default=_json_number))
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """A plan saved by ``save``."""
        try:
            d = json.loads(Path(path).read_text())
            d["recipe"] = Recipe.parse(d["recipe"])
            d["rows"] = tuple(PlanRow(**{**r, "shape": tuple(r["shape"])})
                              for r in d["rows"])
            d["timing_noise"] = tuple(d.get("timing_noise", ()))
            return cls(**d)
        except (OSError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{str(path)!r} is not a mixprec plan file ({e}); write one "
                             "with mixprec.plan(...).save(path) or `mixprec plan`") from e

    def layer_floor(self) -> dict[str, float]:
        """Each fp8/fp4 Linear's name and the SQNR floor it was chosen under (dB)."""
        return {r.layer: self.min_sqnr for r in self.rows if r.choice != BF16}


def _json_number(v):
    return str(v)


def plan(model: nn.Module, sample_batch: Any, *, goal: str = "fastest",
         memory: float | str | None = None, max_loss: float | None = 0.01,
         min_sqnr: float = DEFAULT_MIN_SQNR, base: Recipe | str = "bf16-master",
         formats: Iterable[str] = CANDIDATES,
         state_formats: Iterable[str] = ("fp32", "bf16", "int8"),
         max_step: float | None = None, loss_fn: Callable | None = None,
         calibration: Iterable[Any] | None = None, cache_file: str | Path | None = None,
         seconds: float = 0.25, progress: ProgressFn | None = None) -> Plan:
    """A per-layer precision plan for ``model`` (the module docstring says how).

    Args:
        sample_batch: one training batch (a tensor, a tuple of the model's inputs or a
            dict of keyword inputs); the model's output on it must be the loss unless
            ``loss_fn(model, batch)`` is given.
        goal: ``"fastest"`` (under ``memory`` and the numerics) or ``"smallest"``
            (fewest peak bytes with the step within ``max_step``).
        memory: a budget for the step's peak, bytes or a string such as ``"2GB"``.
        max_loss: the plan's loss on the calibration batches may exceed the 16-bit
            recipe's by at most this share (0.01: 1%); None skips the check.
        min_sqnr: the SQNR floor (dB) against bf16 for each GEMM of an fp8/fp4 Linear.
        base: the 16-bit recipe the plan departs from (its params, master, emulation).
        formats: the candidate formats (``bf16`` and fp8 preset names).
        state_formats: the optimizer-state formats the planner may use (AdamW).
        max_step: for ``goal="smallest"``, the slowest step allowed, as a multiple of
            the 16-bit recipe's measured step (1.1: up to 10% slower; default 1.0).
        calibration: batches for the numerics (default: ``[sample_batch]``).
        cache_file: a JSON file that keeps the measured speeds across processes.
        seconds: about how long each shape's timing runs.
        progress: called with a ``planner.progress.Progress`` at every unit of work
            done: the stage, how far it is, and the estimate of the whole plan (from
            one training step and the first Linear shape, measured).
    """
    from mixprec.memory.units import parse_bytes

    b = Recipe.coerce(base)
    formats = tuple(dict.fromkeys(formats))
    state_formats = tuple(state_formats)
    _check_args(b, goal, formats, state_formats, max_loss, min_sqnr)
    budget = None if memory is None else parse_bytes(memory, "plan: memory")
    batches = list(calibration) if calibration is not None else [sample_batch]
    tracker = Tracker(progress)
    if max_loss is not None:  # a forward over the batches: about a third of a step each
        tracker.add(LOSS_STAGE, 2, len(batches) / 3)
    sv = survey(model, sample_batch, base=b, formats=formats, state_formats=state_formats,
                min_sqnr=min_sqnr, loss_fn=loss_fn, batches=batches,
                cache_file=cache_file, seconds=seconds, tracker=tracker)
    if goal == "smallest":
        max_step = sv.baselines.step_16 * (1.0 if max_step is None else max_step)
    cfg = choose(sv.layers, sv.units, sv.baselines, goal=goal, memory=budget,
                 max_step=max_step, state_formats=state_formats)
    delta = None
    if max_loss is not None:
        cfg, delta = _hold_loss(model, sv, cfg, batches, loss_fn, max_loss, tracker)
    return plan_from(sv, cfg, goal=goal, max_loss=max_loss, memory=budget,
                     loss_delta=delta, device=next(model.parameters()).device)


def plan_from(sv: Survey, cfg: Config, *, goal: str = "fastest",
              max_loss: float | None = None, memory: float | None = None,
              loss_delta: float | None = None,
              device: torch.device | str = "cpu") -> Plan:
    """The ``Plan`` of configuration ``cfg`` on survey ``sv``: its recipe, table and
    predictions."""
    t, peak = sv.predict(cfg)
    parts = step_parts(cfg, sv.layers, sv.units, sv.baselines)
    rows = tuple(_row(sv.layers[n], cfg, sv.quality, sv.owner.get(n, n),
                      parts.layers.get(n, 0.0)) for n in sv.names)
    share, kept = _coverage(sv, rows)
    b = sv.baselines
    return Plan(sv.recipe(cfg), rows, goal, sv.min_sqnr, t, peak,
                {"16-bit": {"step_s": b.step_16, "peak": b.peak_16},
                 "fp8-shell": {"step_s": b.step_shell, "peak": b.peak_shell}},
                device_key(device), max_loss, memory, loss_delta,
                {k: v for k, v in cfg.reasons.items() if k.startswith("states:")},
                tuple(sv.noise),
                step_terms={"base": parts.base, "shell": parts.shell,
                            "states": parts.states},
                low_precision_share=share, kept_flops=kept)


def _coverage(sv: Survey, rows: tuple[PlanRow, ...]
              ) -> tuple[float | None, dict[str, float]]:
    """The share of the model's matmul FLOPs (``Survey.flops``) the rows run below 16
    bits, and the FLOPs left in bf16 by why (None, {}: no FLOPs counted)."""
    total = sum(sv.flops.values())
    if total <= 0:
        return None, {}
    low, kept, counted = 0.0, {}, set()
    for r in rows:
        names = [n for n in sv.flops if n == r.layer or n.startswith(r.layer + ".")
                 and r.layer in sv.experts]
        counted.update(names)
        f = sum(sv.flops[n] for n in names)
        if r.choice != BF16:
            low += f
        else:
            why = kept_because(r.reason)
            kept[why] = kept.get(why, 0.0) + f
    rest = sum(v for n, v in sv.flops.items() if n not in counted)
    if rest > 0:  # routers, and anything else no plan row is for
        kept["not a planned layer (routers, ...)"] = rest
    return low / total, kept


def _check_args(b: Recipe, goal, formats, state_formats, max_loss, min_sqnr) -> None:
    from mixprec.recipe.layer_rules import LAYER_FORMATS

    if goal not in ("fastest", "smallest"):
        raise ValueError(f"plan: goal={goal!r}; valid: fastest, smallest")
    if b.compute not in ("bf16",) or b.layers:
        raise ValueError(f"plan: base={str(b)!r}; the plan departs from a bf16 recipe "
                         "without rules (bf16, bf16-master, bf16-lean...)")
    bad = [f for f in formats if f not in LAYER_FORMATS]
    if bad:
        raise ValueError(f"plan: formats {bad}; valid: {', '.join(LAYER_FORMATS)}")
    bad = [f for f in state_formats if f not in STATE_ORDER]
    if bad or "fp32" not in state_formats:
        raise ValueError(f"plan: state_formats {list(state_formats)}"
                         + (f" has unknown {bad}" if bad else " lacks 'fp32'")
                         + f"; each of {', '.join(STATE_ORDER)}, and 'fp32' among them")
    if max_loss is not None and not (isinstance(max_loss, (int, float)) and max_loss >= 0):
        raise ValueError(f"plan: max_loss={max_loss!r}; a share >= 0 (0.01: +1%) or None")
    if not isinstance(min_sqnr, (int, float)) or not math.isfinite(min_sqnr):
        raise ValueError(f"plan: min_sqnr={min_sqnr!r}; a finite number of dB (20)")


def _hold_loss(model, sv: Survey, cfg: Config, batches, loss_fn, max_loss,
               tracker: Tracker):
    """Move the lowest-SQNR fp8 Linear back to bf16 while the plan's calibration loss
    is more than ``max_loss`` above the 16-bit recipe's; returns the relative change."""
    tracker.start(LOSS_STAGE)
    ref = forward_loss(model, sv.base, batches, loss_fn)
    tracker.done(LOSS_STAGE)
    while True:
        if not cfg.any_fp8:
            return cfg, 0.0
        got = forward_loss(model, sv.layer_recipe(cfg), batches, loss_fn)
        tracker.done(LOSS_STAGE)
        delta = (got - ref) / abs(ref) if ref else 0.0
        if delta <= max_loss:
            return cfg, delta
        worst = min((n for n, f in cfg.layers.items() if f != BF16),
                    key=lambda n: sv.layers[n].options[cfg.layers[n]].sqnr)
        cfg = cfg.copy()
        cfg.reasons[worst] = (f"bf16: the plan's calibration loss was {delta:+.2%} "
                              f"(over max_loss {max_loss:.2%}) with it in "
                              f"{cfg.layers[worst]}, the lowest SQNR")
        cfg.layers[worst] = BF16


def _row(layer: Layer, cfg: Config, quality, owner: str, delta_s: float) -> PlanRow:
    f = cfg.layers[layer.name]
    o, bf = layer.options[f], layer.options[BF16]
    q = quality.get((layer.name, f))
    st = cfg.states.get(owner, "fp32")
    return PlanRow(layer.name, layer.shape, f, st,
                   bf.seconds / o.seconds if o.seconds > 0 else 1.0,
                   None if f == BF16 or q is None else round(q.sqnr, 2),
                   float(o.saved_bytes), cfg.reasons.get(layer.name, ""), delta_s)
