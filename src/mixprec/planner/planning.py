"""``mixprec.plan``: a per-layer precision plan for your model, from measurements.

It measures three things on this device and chooses from them (``choose``):

1. speed: each distinct Linear shape in each candidate format, forward and backward,
   casts included, on the GEMM route the engine would take (``timing``);
2. numerics: each Linear's SQNR against bf16 for output, dgrad and wgrad, the share its
   casts flush to zero and delayed scaling's amax headroom, on your batches
   (``numerics``);
3. bytes: the whole model's step time and peak under the 16-bit recipe and under the
   fp8 recipe with nothing converted (``mixprec.memory.measure(peak=True)``), each
   format's saved activation bytes and each state format's exact bytes.

The plan is a ``Recipe`` with per-module rules, plus a table: layer, shape, choice,
predicted speed-up, SQNR, bytes and the reason for each choice. With ``max_loss`` the
planner also runs the model forward under its plan and under the 16-bit recipe on the
calibration batches and, while the plan's loss is more than ``max_loss`` (relative)
above, moves the Linear with the lowest SQNR back to bf16.

    >>> import torch, mixprec
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
    ...                             torch.nn.Linear(256, 64))
    >>> x = torch.randn(128, 64)
    >>> p = mixprec.plan(model, x, formats=("bf16", "fp8-current"))  # doctest: +SKIP
    >>> print(p.table())                                             # doctest: +SKIP
"""

from __future__ import annotations

import copy
import json
import math
import re
import statistics
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec.layer_rules import LayerRule
from mixprec.planner.choose import (
    STATE_ORDER,
    Baselines,
    Config,
    Layer,
    Option,
    StateUnit,
    choose,
    predict,
)
from mixprec.planner.numerics import layer_numerics, linear_names
from mixprec.planner.timing import (
    BF16,
    device_key,
    layer_costs,
    recipe_for_format,
    state_step_costs,
)
from mixprec.recipe import Recipe

__all__ = ["plan", "Plan", "PlanRow", "CANDIDATES", "DEFAULT_MIN_SQNR", "call_loss",
           "measure_step"]

#: the formats the planner measures by default
CANDIDATES = ("bf16", "fp8", "fp8-current", "fp8-rowwise", "fp8-block", "mxfp8", "nvfp4")
#: the default SQNR floor (dB) every GEMM of an fp8/fp4 Linear must reach against bf16.
#: Measured on Gaussian activations: e4m3 outputs ~28-29 dB, e5m2 gradients (dgrad)
#: ~25 dB, MXFP8's e4m3 gradients ~29 dB, NVFP4 ~15-17 dB (so NVFP4 needs a lower floor)
DEFAULT_MIN_SQNR = 20.0


@dataclass(frozen=True)
class PlanRow:
    """One Linear of the plan: its format and states, the predicted speed-up of its
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


@dataclass(frozen=True)
class Plan:
    """A per-layer precision plan: ``recipe`` (train with it), the table ``rows``, the
    predictions and the measured baselines they came from."""

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

    def table(self) -> str:
        """The plan as a text table, one Linear a line, with the totals under it."""
        head = (f"{'layer':<28}{'shape':>12}  {'choice':<12}{'states':<7}{'speed-up':>9}"
                f"{'SQNR dB':>9}{'saved MB':>10}  reason")
        lines = [head]
        for r in self.rows:
            sq = "-" if r.sqnr is None else f"{r.sqnr:.1f}"
            lines.append(f"{r.layer:<28}{r.shape[0]:>5}x{r.shape[1]:<6}  {r.choice:<12}"
                         f"{r.states:<7}{r.speedup:>8.2f}x{sq:>9}"
                         f"{r.saved_bytes / 1e6:>10.2f}  {r.reason}")
        for name, why in self.state_reasons.items():
            lines.append(f"  {name}: {why}")
        b16 = self.baseline["16-bit"]
        lines.append(f"recipe: {self.recipe}")
        lines.append(f"predicted step {self.predicted_step_s * 1e3:.1f} ms (16-bit recipe "
                     f"measured {b16['step_s'] * 1e3:.1f} ms), peak "
                     f"{self.predicted_peak / 1e6:.1f} MB (16-bit {b16['peak'] / 1e6:.1f} "
                     f"MB) on {self.device}")
        if self.loss_delta is not None:
            lines.append(f"calibration loss vs the 16-bit recipe: {self.loss_delta:+.3%}")
        return "\n".join(lines)

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
            return cls(**d)
        except (OSError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{str(path)!r} is not a mixprec plan file ({e}); write one "
                             "with mixprec.plan(...).save(path) or `mixprec plan`") from e

    def layer_floor(self) -> dict[str, float]:
        """Each fp8/fp4 Linear's name and the SQNR floor it was chosen under (dB)."""
        return {r.layer: self.min_sqnr for r in self.rows if r.choice != BF16}


def _json_number(v):
    return str(v)


def call_loss(model: nn.Module, batch, loss_fn: Callable | None) -> torch.Tensor:
    """The loss of ``model`` on ``batch``: ``loss_fn(model, batch)``, or else the
    model called on the batch (a tuple as positional arguments, a dict as keywords)
    returning a scalar tensor or an object with ``.loss`` (Hugging Face)."""
    if loss_fn is not None:
        return loss_fn(model, batch)
    out = (model(**batch) if isinstance(batch, dict) else
           model(*batch) if isinstance(batch, (tuple, list)) else model(batch))
    loss = getattr(out, "loss", out)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError("the model's output on sample_batch is not a scalar loss: pass "
                         "loss_fn=lambda model, batch: <scalar loss>")
    return loss


def plan(model: nn.Module, sample_batch: Any, *, goal: str = "fastest",
         memory: float | str | None = None, max_loss: float | None = 0.01,
         min_sqnr: float = DEFAULT_MIN_SQNR, base: Recipe | str = "bf16-master",
         formats: Iterable[str] = CANDIDATES,
         state_formats: Iterable[str] = ("fp32", "bf16", "int8"),
         max_step: float | None = None, loss_fn: Callable | None = None,
         calibration: Iterable[Any] | None = None, cache_file: str | Path | None = None,
         seconds: float = 0.25) -> Plan:
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
    """
    from mixprec.memory.plan import parse_count

    b = Recipe.coerce(base)
    formats = tuple(dict.fromkeys(formats))
    state_formats = tuple(state_formats)
    _check_args(b, goal, formats, state_formats, max_loss, min_sqnr)
    budget = None if memory is None else float(_bytes(memory, parse_count))
    shell = recipe_for_format(b, "fp8-current")
    batches = list(calibration) if calibration is not None else [sample_batch]
    device = next(model.parameters()).device

    names = linear_names(model)
    if not names:
        raise ValueError("plan: the model has no nn.Linear to choose a format for; "
                         "train it with a 16-bit recipe (bf16-master)")
    shapes = _shapes(model, names, sample_batch, loss_fn)
    fixed = _fixed_reasons(model)
    costs = layer_costs({s for s in shapes.values()}, formats, shell, device,
                        seconds=seconds, cache_file=cache_file)
    quality = layer_numerics(model, batches, lambda m, bt: call_loss(m, bt, loss_fn),
                             [f for f in formats if f != BF16], shell)
    layers = {}
    for n in names:
        opts = {}
        for f in formats:
            c = costs[(shapes[n], f)]
            q = quality.get((n, f))
            refused = None
            if f != BF16:
                if fixed.get(n):
                    refused = fixed[n]
                elif q is None:
                    refused = "has no gradient on the calibration batches"
                elif q.sqnr < min_sqnr:
                    refused = f"SQNR {q.sqnr:.1f} dB < floor {min_sqnr:g} dB"
                elif q.headroom is not None and q.headroom < 0:
                    refused = (f"delayed scale saturates (amax rose 2^{-q.headroom:.1f} "
                               "above its history)")
            opts[f] = Option(f, c.seconds, c.saved_bytes,
                             math.inf if q is None else q.sqnr, refused)
        if BF16 not in opts:
            raise ValueError("plan: formats must include 'bf16' (the fallback of every "
                             "Linear)")
        layers[n] = Layer(n, shapes[n][:2], opts)
    units = _state_units(model)
    base_m = _baselines(model, b, shell, sample_batch, loss_fn, state_formats, device)
    if goal == "smallest":
        max_step = base_m.step_16 * (1.0 if max_step is None else max_step)
    cfg = choose(layers, units, base_m, goal=goal, memory=budget, max_step=max_step,
                 state_formats=state_formats)
    delta = None
    if max_loss is not None:
        cfg, delta = _hold_loss(model, b, shell, cfg, layers, batches, loss_fn, max_loss)
    recipe = _recipe(b, shell, cfg, names, units)
    t, peak = predict(cfg, layers, units, base_m)
    rows = tuple(_row(layers[n], cfg, quality) for n in names)
    return Plan(recipe, rows, goal, float(min_sqnr), t, peak,
                {"16-bit": {"step_s": base_m.step_16, "peak": base_m.peak_16},
                 "fp8-shell": {"step_s": base_m.step_shell, "peak": base_m.peak_shell}},
                device_key(device), max_loss, budget, delta,
                {k: v for k, v in cfg.reasons.items() if k.startswith("states:")})


def _check_args(b: Recipe, goal, formats, state_formats, max_loss, min_sqnr) -> None:
    from mixprec.layer_rules import LAYER_FORMATS

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
        raise ValueError(f"plan: state_formats {list(state_formats)}; valid: "
                         f"{', '.join(STATE_ORDER)}, fp32 among them")
    if max_loss is not None and not (isinstance(max_loss, (int, float)) and max_loss >= 0):
        raise ValueError(f"plan: max_loss={max_loss!r}; a share >= 0 (0.01: +1%) or None")
    if not isinstance(min_sqnr, (int, float)) or not math.isfinite(min_sqnr):
        raise ValueError(f"plan: min_sqnr={min_sqnr!r}; a finite number of dB (20)")


def _bytes(memory, parse_count) -> float:
    if isinstance(memory, str):
        m = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]?)i?b?\s*", memory.lower())
        if not m:
            raise ValueError(f"plan: memory={memory!r}; bytes, or a size such as "
                             "'512MB' or '2GB'")
        return float(m.group(1)) * 1000 ** " kmgt".index(m.group(2) or " ")
    if not (isinstance(memory, (int, float)) and memory > 0):
        raise ValueError(f"plan: memory={memory!r}; a positive number of bytes or '2GB'")
    return float(memory)


def _shapes(model, names, batch, loss_fn) -> dict[str, tuple[int, int, int, bool]]:
    """(in, out, tokens, bias) of each Linear, read from one forward on ``batch``."""
    out, handles = {}, []
    for n in names:
        m = model.get_submodule(n)
        w = m.weight
        d_in, d_out = (w.shape if type(m) is not nn.Linear else w.shape[::-1])

        def hook(mod, args, res, n=n, d_in=d_in, d_out=d_out):
            out[n] = (int(d_in), int(d_out), int(args[0].numel() // d_in),
                      mod.bias is not None)
        handles.append(m.register_forward_hook(hook))
    try:
        with torch.no_grad():
            call_loss(model, batch, loss_fn)
    finally:
        for h in handles:
            h.remove()
    missing = [n for n in names if n not in out]
    for n in missing:  # a Linear the batch never reaches: priced at one token
        m = model.get_submodule(n)
        d_out, d_in = m.weight.shape if type(m) is nn.Linear else m.weight.shape[::-1]
        out[n] = (int(d_in), int(d_out), 1, m.bias is not None)
    return out


def _fixed_reasons(model) -> dict[str, str]:
    """The Linears no fp8 format can take (dims, subclasses), with the reason."""
    from mixprec.fp8.convert import plan as convert_plan

    return {fqn: why for fqn, _, why in convert_plan(model, filter=lambda m, n: True)
            if why is not None}


def _state_units(model) -> dict[str, StateUnit]:
    units: dict[str, list] = {}
    seen = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen or "." not in name:
            continue  # a parameter of the root module has no module name to rule on
        seen.add(id(p))
        units.setdefault(name.rpartition(".")[0], []).append(tuple(p.shape))
    return {k: StateUnit(k, tuple(v)) for k, v in units.items()}


def _engine(model, recipe: Recipe, fp8_filter=None, lr: float = 1e-3):
    from mixprec.engine import MixedPrecision
    from mixprec.optim import adamw_for

    opt = adamw_for(recipe.base, model.parameters(), lr=lr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return MixedPrecision(model, opt, recipe,
                              fp8_filter=fp8_filter if recipe.compute == "fp8" else None)


def measure_step(model: nn.Module, recipe: Recipe, batch, loss_fn=None, *,
                 fp8_filter=None, steps: int = 4, peak: bool = True
                 ) -> tuple[float, float | None]:
    """Median seconds of a training step of a copy of ``model`` under ``recipe`` and the
    step's measured peak bytes (``mixprec.memory.measure(peak=True)``)."""
    from mixprec.memory import measure

    m = copy.deepcopy(model)
    eng = _engine(m, recipe, fp8_filter)
    dev = next(m.parameters()).device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def one():
        with eng.autocast():
            loss = call_loss(m, batch, loss_fn)
        eng.backward(loss)
        eng.step()

    one()
    times = []
    for _ in range(steps):
        sync()
        t = time.perf_counter()
        one()
        sync()
        times.append(time.perf_counter() - t)
    high = None
    if peak:
        high = measure(_Bound(m, batch, loss_fn), eng, sample_batch=(), peak=True,
                       loss_fn=lambda out: out).peak
    return statistics.median(times), high


class _Bound(nn.Module):
    """The model with its batch bound: calling it returns the loss (for ``measure``)."""

    def __init__(self, model, batch, loss_fn):
        super().__init__()
        self.model, self.batch, self.loss_fn = model, batch, loss_fn

    def forward(self):
        return call_loss(self.model, self.batch, self.loss_fn)


def _baselines(model, b, shell, batch, loss_fn, state_formats, device) -> Baselines:
    t16, p16 = measure_step(model, b, batch, loss_fn)
    ts, ps = measure_step(model, shell, batch, loss_fn, fp8_filter=lambda m, n: False)
    cost = state_step_costs([f for f in state_formats], device)
    return Baselines(t16, p16, ts, ps, cost)


def _forward_loss(model, recipe: Recipe, batches, loss_fn, fp8_filter=None) -> float:
    m = copy.deepcopy(model)
    eng = _engine(m, recipe, fp8_filter)
    total = 0.0
    with torch.no_grad():
        for bt in batches:
            with eng.autocast():
                total += float(call_loss(m, bt, loss_fn))
    return total / len(batches)


def _hold_loss(model, b, shell, cfg: Config, layers, batches, loss_fn, max_loss):
    """Move the lowest-SQNR fp8 Linear back to bf16 while the plan's calibration loss
    is more than ``max_loss`` above the 16-bit recipe's; returns the relative change."""
    ref = _forward_loss(model, b, batches, loss_fn)
    while True:
        if not cfg.any_fp8:
            return cfg, 0.0
        r = _layer_recipe(shell, cfg, list(layers))
        got = _forward_loss(model, r, batches, loss_fn)
        delta = (got - ref) / abs(ref) if ref else 0.0
        if delta <= max_loss:
            return cfg, delta
        worst = min((n for n, f in cfg.layers.items() if f != BF16),
                    key=lambda n: layers[n].options[cfg.layers[n]].sqnr)
        cfg = cfg.copy()
        cfg.reasons[worst] = (f"bf16: the plan's calibration loss was {delta:+.2%} "
                              f"(over max_loss {max_loss:.2%}) with it in "
                              f"{cfg.layers[worst]}, the lowest SQNR")
        cfg.layers[worst] = BF16


def _compress(choice: dict[str, str], universe: list[str], default: str | None
              ) -> list[tuple[str, str]]:
    """(pattern, value) rules for ``choice``: names that differ only in their numeric
    parts (``blocks.3.fc``) share one ``*`` pattern when every name it matches in
    ``universe`` has the same value; entries equal to ``default`` are dropped."""
    out: list[tuple[str, str]] = []
    done: set[str] = set()
    for name in universe:
        if name in done or name not in choice:
            continue
        pat = re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", name)
        group = [n for n in universe if fnmatchcase(n, pat)]
        if pat != name and all(choice.get(n) == choice[name] for n in group):
            done.update(group)
            if choice[name] != default:
                out.append((pat, choice[name]))
        else:
            done.add(name)
            if choice[name] != default:
                out.append((name, choice[name]))
    return out


def _layer_recipe(shell: Recipe, cfg: Config, names: list[str]) -> Recipe:
    """The fp8 recipe with one ``layer:`` rule per Linear (compressed), no states."""
    fp8 = [f for f in cfg.layers.values() if f != BF16]
    main = max(set(fp8), key=fp8.count)
    r = recipe_for_format(shell, main)
    rules = tuple(LayerRule("layer", p, v) for p, v in _compress(cfg.layers, names, None))
    return r.replace(layers=rules)


def _recipe(b: Recipe, shell: Recipe, cfg: Config, names, units) -> Recipe:
    r = _layer_recipe(shell, cfg, names) if cfg.any_fp8 else b
    states = tuple(LayerRule("states", p, v) for p, v in
                   _compress(cfg.states, list(units), r.states))
    return r.replace(layers=r.layers + states) if states else r


def _row(layer: Layer, cfg: Config, quality) -> PlanRow:
    f = cfg.layers[layer.name]
    o, bf = layer.options[f], layer.options[BF16]
    q = quality.get((layer.name, f))
    st = cfg.states.get(layer.name, "fp32")
    return PlanRow(layer.name, layer.shape, f, st, bf.seconds / o.seconds,
                   None if f == BF16 or q is None else round(q.sqnr, 2),
                   float(o.saved_bytes), cfg.reasons.get(layer.name, ""))
