"""What the planner measures about one model on this device, before it chooses.

``survey(model, sample_batch, ...)`` returns a ``Survey``: each Linear's options (time
and saved bytes per format from ``timing``, SQNR and refusals from ``numerics``) and
each transformers experts module's (``experts``: timed at the tokens its router sends
each expert, scored on its real inputs), the modules that own parameters (for state
formats), and the whole model's measured baselines: the step time and peak of the
16-bit recipe and of the fp8 recipe with no Linear converted, and per fp8 format the
step with every Linear in it against that one, which scales the Linears' timed-alone
differences to the model (``steps.measure_steps``: each two steps compared are stepped
in turn). No format is taken as faster than its GEMM route can run
(``timing.max_speedup``), and timings that disagree beyond their noise are measured
again, a bounded number of times; those that still disagree are listed in
``Survey.noise``, which the plan reports.
``Survey.predict(config)`` prices any configuration from them (``choose.predict``),
and ``Survey.recipe(config)`` writes it as a recipe with per-module rules, so a
configuration can be predicted and then measured (``benchmarks/plan.py`` does both).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mixprec.engine.convert import plan as convert_plan
from mixprec.engine.coverage import coverage, step_flops
from mixprec.planner.choose import (
    Baselines,
    Config,
    Layer,
    Option,
    StateUnit,
    fit_scale,
    predict,
)
from mixprec.planner.experts import (
    experts_costs,
    experts_numerics,
    experts_shapes,
    kept_in_bf16,
    widths,
)
from mixprec.planner.numerics import LayerNumerics, layer_numerics, linear_names
from mixprec.planner.progress import (
    EXPERTS_STAGE,
    NUMERICS_STAGE,
    SHAPES_STAGE,
    STEP_STAGE,
    STEPS_STAGE,
    Tracker,
)
from mixprec.planner.steps import (
    call_loss,
    each_step,
    first_step,
    measure_step,
    measure_steps,
    step_engine,
)
from mixprec.planner.timing import (
    BF16,
    MAX_MEASUREMENTS,
    disagreements,
    layer_costs,
    max_speedup,
    noise_report,
    recipe_for_format,
    state_step_costs,
    uncached,
)
from mixprec.recipe import Recipe
from mixprec.recipe.layer_rules import LayerRule
from mixprec.recipe.presets import SHELL_PRESET

__all__ = ["Survey", "survey", "call_loss", "measure_step", "forward_loss"]


@dataclass
class Survey:
    """The measurements behind a plan (module docstring)."""

    base: Recipe
    shell: Recipe
    names: list[str]
    layers: dict[str, Layer]
    units: dict[str, StateUnit]
    baselines: Baselines
    quality: dict[tuple[str, str], LayerNumerics]
    min_sqnr: float
    #: each Linear's weight -> the module its states are ruled by: the first owner
    #: ``named_parameters()`` names (a tied head's weight is its embedding's)
    owner: dict[str, str]
    #: the timings that still disagreed beyond their noise after being measured again,
    #: one line each (empty: they agreed)
    noise: list[str] = dataclasses.field(default_factory=list)
    #: the model's transformers experts modules (candidates too: in ``names``, ``layers``)
    experts: list[str] = dataclasses.field(default_factory=list)
    #: forward matmul FLOPs on the sample batch of every module whose weight feeds a
    #: matmul (``coverage.step_flops``: Linears, routers, experts projections), by name
    flops: dict[str, float] = dataclasses.field(default_factory=dict)

    def predict(self, cfg: Config) -> tuple[float, float]:
        """(seconds per step, peak bytes) predicted for ``cfg``."""
        return predict(cfg, self.layers, self.units, self.baselines)

    def uniform(self, fmt: str, states: str = "fp32") -> Config:
        """Every Linear in ``fmt`` where it may take it (else bf16), every module's
        states in ``states``: for predicting plans the planner would not choose."""
        layers = {n: (fmt if fmt in lay.options and lay.options[fmt].refused is None
                      else BF16) for n, lay in self.layers.items()}
        return Config(layers, {u: states for u in self.units})

    def recipe(self, cfg: Config) -> Recipe:
        """``cfg`` as a recipe: the fp8 recipe of its most common fp8 format with one
        ``layer:`` rule per Linear and experts module (where any of them is fp8, else
        the 16-bit recipe), and ``states:`` rules for modules whose states are not the
        recipe's."""
        r = self.layer_recipe(cfg) if cfg.any_fp8 else self.base
        states = tuple(LayerRule("states", p, v) for p, v in
                       compress(cfg.states, list(self.units), r.optim.states))
        return r.replace(layers=r.layers + states) if states else r

    def layer_recipe(self, cfg: Config) -> Recipe:
        """The fp8 recipe of ``cfg``'s Linears and experts modules, without its state
        rules."""
        fp8 = [f for f in cfg.layers.values() if f != BF16]
        main = max(sorted(set(fp8)), key=fp8.count)
        r = recipe_for_format(self.shell, main)
        rules = tuple(LayerRule("layer", p, v)
                      for p, v in compress(cfg.layers, self.names, None))
        return r.replace(layers=rules)


def compress(choice: dict[str, str], universe: list[str], default: str | None
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


def survey(model: nn.Module, sample_batch: Any, *, base: Recipe, formats: tuple[str, ...],
           state_formats: tuple[str, ...], min_sqnr: float, loss_fn: Callable | None,
           batches: list, cache_file: str | Path | None = None,
           seconds: float = 0.25, tracker: Tracker | None = None) -> Survey:
    """Measure ``model`` for the planner (module docstring; ``mixprec.plan``'s
    arguments). ``tracker`` hears of every unit of work done (``planner.progress``)."""
    tr = tracker if tracker is not None else Tracker()
    shell = recipe_for_format(base, SHELL_PRESET)
    device = next(model.parameters()).device
    names = linear_names(model)
    if not names:
        raise ValueError("plan: the model has no nn.Linear to choose a format for; "
                         "train it with a 16-bit recipe (bf16-master)")
    if BF16 not in formats:
        raise ValueError("plan: formats must include 'bf16' (the fallback of every "
                         "Linear)")
    low = sorted({str(p.dtype) for p in model.parameters()
                  if p.is_floating_point() and p.element_size() < 4})
    if low:
        raise ValueError(f"plan: the model's parameters are {', '.join(low)}, not fp32 (a "
                         "MixedPrecision engine's working copy, or a model cast to 16 bits); "
                         "the planner measures from fp32 weights: plan the model before "
                         "building its engine, or load engine.export_state_dict() into a "
                         "fresh fp32 model and plan that")
    shapes = _shapes(model, names, sample_batch, loss_fn)
    fixed = _fixed_reasons(model)
    fmts8 = [f for f in formats if f != BF16]
    todo = uncached(set(shapes.values()), formats, shell, device, cache_file)
    tr.add(STEP_STAGE, 1, 1.0)
    tr.add(SHAPES_STAGE, len(todo))
    tr.add(NUMERICS_STAGE, len(fmts8), len(batches))  # a unit: one format
    tr.add(STEPS_STAGE, BASELINE_STEPS + len(fmts8) * 2 * (1 + PAIR_STEPS), 1.0)
    tr.start(STEP_STAGE)
    tr.set_step(first_step(model, base, sample_batch, loss_fn))
    tr.done(STEP_STAGE)
    quality: dict = {}

    def numerics(fmts: list[str]) -> None:  # the first format alone prices the rest
        if fmts:
            tr.start(NUMERICS_STAGE)
            quality.update(layer_numerics(model, batches,
                                          lambda m, bt: call_loss(m, bt, loss_fn),
                                          fmts, shell))
            tr.done(NUMERICS_STAGE, len(fmts))
    numerics(fmts8[:1])
    # the estimate is whole once the first shape is timed (``planner.progress``)
    costs = tr.each(SHAPES_STAGE, todo, lambda one: layer_costs(
        [one], formats, shell, device, seconds=seconds, cache_file=cache_file))
    done = set(shapes.values()) - set(todo)
    if done:
        costs.update(layer_costs(done, formats, shell, device, seconds=seconds,
                                 cache_file=cache_file))
    numerics(fmts8[1:])
    noise = noise_report(costs, shell, device)
    layers = {n: _layer(n, shapes[n][:2], lambda f, n=n: costs[(shapes[n], f)],
                        quality, formats, shell, device, fixed.get(n), min_sqnr,
                        shapes[n])
              for n in names}
    experts = _experts(model, sample_batch, loss_fn, batches, formats, shell, device,
                       min_sqnr, quality, noise, seconds, cache_file, tr)
    layers.update(experts)
    units = _state_units(model)
    first = {}
    for pname, p in model.named_parameters():
        first.setdefault(id(p), pname.rpartition(".")[0])
    owner = {n: first.get(id(model.get_submodule(n).weight), n) for n in names}
    owner.update({n: n for n in experts})
    # the fp8 recipe's step with nothing converted: its experts modules kept in bf16 too
    kept = kept_in_bf16(shell, experts)
    tr.start(STEPS_STAGE)
    with each_step(lambda: tr.done(STEPS_STAGE)):
        base_m = _baselines(model, base, kept, sample_batch, loss_fn, state_formats,
                            device)
        base_m = dataclasses.replace(base_m, time_scale=_time_scales(
            model, kept, sample_batch, loss_fn, layers, fixed, base_m, noise))
    for fp8, parts, step in ((True, "the Linears and the optimizer", "the fp8 recipe's"),
                             (False, "the optimizer", "the 16-bit recipe's")):
        k = fit_scale(layers, units, base_m, fp8)
        if k < 1:
            noise.append(f"{parts} timed alone add up to {1 / k:.2f}x {step} whole "
                         "step: scaled down to fit in it")
    flops = _matmul_flops(model, base, sample_batch, loss_fn)
    return Survey(base, shell, names + list(experts), layers, units, base_m, quality,
                  float(min_sqnr), owner, noise, list(experts), flops)


def _matmul_flops(model: nn.Module, base: Recipe, batch, loss_fn) -> dict[str, float]:
    """Forward matmul FLOPs on ``batch`` of every module whose weight feeds a matmul
    (``coverage.step_flops``: Linears, routers, experts projections), by name."""
    cov = coverage(model, base)
    with torch.no_grad():
        got = step_flops(model, cov, lambda: call_loss(model, batch, loss_fn))
    return {r.name: float(got.get(r.name, 0)) for r in cov.rows}


def _layer(name: str, shape: tuple[int, int], cost: Callable[[str], Any], quality,
           formats, shell: Recipe, device, fixed: str | None, min_sqnr: float,
           key: Any) -> Layer:
    """One candidate (a Linear or an experts module) with its option per format:
    ``cost(format)`` its measured ``LayerCost``, never faster than its route allows;
    ``key`` its timed shape, whose timings' disagreements it keeps (``Layer.noisy``)."""
    opts = {}
    bf = cost(BF16).seconds
    noisy = tuple(disagreements(key, {f: cost(f) for f in formats}, shell,
                                device))
    for f in formats:
        c = cost(f)
        q = quality.get((name, f))
        most = max_speedup(c.route, shell, device) if f != BF16 else 1.0
        opts[f] = Option(f, max(c.seconds, bf / most), c.saved_bytes,
                         math.inf if q is None else q.sqnr,
                         None if f == BF16 else _refusal(fixed, q, min_sqnr),
                         c.working_bytes, c.route, most)
    return Layer(name, shape, opts, noisy)


def _experts(model, batch, loss_fn, batches, formats, shell, device, min_sqnr,
             quality: dict, noise: list[str], seconds, cache_file,
             tr: Tracker) -> dict[str, Layer]:
    """The experts modules as candidates (``planner.experts``): timed at the tokens
    the router sends each expert on ``batch``, scored on ``batches``; their numerics
    go into ``quality``, their timings' disagreements into ``noise``."""
    shapes = experts_shapes(model, lambda: call_loss(model, batch, loss_fn))
    if not shapes:
        return {}
    mods = {s: model.get_submodule(n) for n, s in reversed(shapes.items())}
    fmts8 = [f for f in formats if f != BF16]
    tr.add(EXPERTS_STAGE, len(mods), like=SHAPES_STAGE)
    tr.add(NUMERICS_STAGE, len(fmts8))
    costs = tr.each(EXPERTS_STAGE, list(mods), lambda one: experts_costs(
        {one: mods[one]}, formats, shell, device, seconds=seconds, cache_file=cache_file))
    tr.start(NUMERICS_STAGE)
    quality.update(experts_numerics(model, batches,
                                    lambda m, bt: call_loss(m, bt, loss_fn), fmts8, shell))
    tr.done(NUMERICS_STAGE, len(fmts8))
    noise += noise_report(costs, shell, device)
    return {n: _layer(n, widths(model.get_submodule(n)), lambda f, s=s: costs[(s, f)],
                      quality, formats, shell, device, None, min_sqnr, s)
            for n, s in shapes.items()}


def _refusal(fixed: str | None, q: LayerNumerics | None, floor: float) -> str | None:
    if fixed:
        return fixed
    if q is None:
        return "has no gradient on the calibration batches"
    if q.sqnr < floor:
        return f"SQNR {q.sqnr:.1f} dB < floor {floor:g} dB"
    if q.headroom is not None and q.headroom < 0:
        return f"delayed scale saturates (amax rose 2^{-q.headroom:.1f} above its history)"
    return None


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


#: training steps of a copy, their times discarded, before the baselines are measured:
#: a process's first whole-model steps run slower while its allocator and kernel caches
#: settle (a config-built Mixtral's first 16-bit steps measured 25-40% over its later
#: ones on a CPU), and the plan is for the steps after them
WARMUP_STEPS = 8


def _baselines(model, b, shell, batch, loss_fn, state_formats, device) -> Baselines:
    """The 16-bit recipe's and the fp8 shell's measured step and peak (after
    ``WARMUP_STEPS`` steps whose times are discarded; the two stepped in turn,
    ``measure_steps``), and the optimizer's measured cost per parameter shape and state
    format."""
    measure_step(model, b, batch, loss_fn, steps=WARMUP_STEPS - 1, peak=False)
    (t16, p16), (ts, ps) = measure_steps(
        model, [(b, None), (shell, lambda m, n: False)], batch, loss_fn)
    shapes = {tuple(p.shape) for p in model.parameters() if p.requires_grad}
    cost = state_step_costs(shapes, [f for f in state_formats], device)
    return Baselines(t16, p16, ts, ps, cost)


#: timed steps of each of ``_time_scales``' two copies, stepped in turn (4 in all, as
#: one ``measure_step``)
PAIR_STEPS = 2
#: the whole-model steps ``_baselines`` takes: the warm-up's (one untimed and
#: ``WARMUP_STEPS - 1`` timed), one untimed and 4 timed of each of its two copies, and
#: one peak measured on each
BASELINE_STEPS = WARMUP_STEPS + 2 * (1 + 4) + 2
#: the share of the whole step two step timings are not told apart within, at least
STEP_TOLERANCE = 0.05


def _time_scales(model, shell: Recipe, batch, loss_fn, layers: dict[str, Layer],
                 fixed: dict[str, str], base: Baselines,
                 noise: list[str] | None = None) -> dict[str, float]:
    """Per fp8 format: the measured step with every Linear it can take in it, less the
    shell's step (the two stepped in turn, ``PAIR_STEPS`` timed steps each:
    ``measure_steps``), over the sum of those Linears' timed-alone differences from
    bf16. A Linear timed alone is not timed inside the model (other inputs, caches, the
    engine's hooks), so the whole-model step sets the scale. Where the two differ in
    sign or by more than 4x either way the format gets none, and the prediction falls
    back to the timings alone, capped to fit the step; where they also differ by more
    than the steps' noise (``STEP_TOLERANCE`` of the step, or the range of the steps
    measured so far) the pair is measured again, at most ``MAX_MEASUREMENTS`` times in
    all, the last pair taken, and a difference that remains goes to ``noise``."""
    out = {}
    fmts = {f for lay in layers.values() for f in lay.options if f != BF16}
    for f in sorted(fmts):
        den = sum(lay.options[f].seconds - lay.options[BF16].seconds
                  for n, lay in layers.items() if n not in fixed)
        if den == 0:
            continue
        shells, steps = [], []
        while True:
            (t, _), (ts, _) = measure_steps(
                model, [(recipe_for_format(shell, f), lambda m, n: True),
                        (shell, lambda m, n: False)],
                batch, loss_fn, steps=PAIR_STEPS, peak=False)
            steps.append(t)
            shells.append(ts)
            diff = t - ts
            k = diff / den
            if 0.25 <= k <= 4:
                out[f] = k
                break
            tol = max(STEP_TOLERANCE * ts,
                      max(steps) - min(steps) + max(shells) - min(shells))
            if abs(diff - den) <= tol:
                break  # the two agree within the noise: no scale, nothing to report
            if len(steps) == MAX_MEASUREMENTS:
                if noise is not None:
                    noise.append(
                        f"{f}: the whole step with every Linear in it measured "
                        f"{diff * 1e3:+.2f} ms against the fp8 recipe's with none, its "
                        f"Linears timed alone {den * 1e3:+.2f} ms ({len(steps)} "
                        "measurements): their timings alone are used")
                break
    return out


def forward_loss(model: nn.Module, recipe: Recipe, batches: list,
                 loss_fn: Callable | None, fp8_filter: Callable | None = None) -> float:
    """The mean loss of a copy of ``model`` under ``recipe``'s precision on
    ``batches`` (forward only, no update)."""
    m = copy.deepcopy(model)
    eng = step_engine(m, recipe, fp8_filter)
    total = 0.0
    with torch.no_grad():
        for bt in batches:
            with eng.autocast():
                total += float(call_loss(m, bt, loss_fn))
    return total / len(batches)


