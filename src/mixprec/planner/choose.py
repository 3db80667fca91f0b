"""Choose a format per Linear and a state format per module from measured costs.

The inputs are numbers only (``Layer`` options measured by ``timing`` and ``numerics``,
the two whole-model baselines, per-element optimizer costs), so the choice is a pure
function that tests drive with any speeds they like.

A configuration's predicted step time and peak come from the measured baselines plus
deltas: with at least one fp8 Linear, the step of the fp8 recipe with no Linear
converted (the rest of the model as the fp8 recipe runs it) plus each Linear's time in
its format less its time in bf16 there; with none, the measured step of the 16-bit
recipe itself. Saved activation bytes move the peak the same way, and each state format
moves it by its exact bytes (``mixprec.formats.state_formats.state_bytes``, two states for
AdamW). What a configuration takes out of a measured step (its Linears' bf16 time,
torch's fused AdamW) is scaled to fit in that step (``fit_scale``), so a prediction is
never negative however noisy the timings it adds up.

``goal="fastest"``: every Linear takes its fastest format among those that pass the
numerics (SQNR floor, no saturating delayed scale); the fp8 recipe is kept only if it
beats the 16-bit one as a whole. Under a memory budget, moves that save bytes are then
taken greedily, most bytes per second lost first, until the peak fits.
``goal="smallest"``: from the fastest plan, byte-saving moves are taken, most bytes per
second lost first, while the step stays within the speed floor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mixprec.optim.states import state_bytes, stored_format
from mixprec.planner.timing import BF16

__all__ = ["Option", "Layer", "StateUnit", "Baselines", "Config", "predict", "choose",
           "NoPlanFits", "STATE_ORDER", "fit_scale", "StepParts", "step_parts"]

#: state formats from the most bytes to the fewest
STATE_ORDER = ("fp32", "bf16", "int8", "int4")


class NoPlanFits(ValueError):
    """No configuration meets the memory budget (or the speed floor)."""


@dataclass(frozen=True)
class Option:
    """One format for one Linear: measured ``seconds`` and ``saved_bytes``, SQNR
    against bf16 (inf for bf16 itself), why it is not allowed (None: it is), the
    bytes its forward + backward holds beyond the saved ones (``working_bytes``), its
    GEMM ``route`` and the most it can run faster than bf16 on it (``max_speedup``;
    the survey keeps ``seconds`` within it)."""

    fmt: str
    seconds: float
    saved_bytes: float
    sqnr: float = math.inf
    refused: str | None = None
    working_bytes: float = 0.0
    route: str = ""
    max_speedup: float = math.inf


@dataclass(frozen=True)
class Layer:
    """A Linear: its name, (in, out), and its options by format (bf16 always there)."""

    name: str
    shape: tuple[int, int]
    options: dict[str, Option]
    #: why its timings still disagree after being measured again (empty: they agree);
    #: no speed advice is taken from them
    noisy: tuple[str, ...] = ()

    def allowed(self) -> list[Option]:
        """The options that pass the numerics, bf16 first."""
        return [o for o in self.options.values() if o.refused is None]


@dataclass(frozen=True)
class StateUnit:
    """A module that owns parameters: their shapes, for the state bytes and step cost."""

    name: str
    shapes: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Baselines:
    """Measured whole-model figures: the 16-bit recipe's step (s) and peak (bytes), and
    the fp8 recipe's with no Linear converted; the optimizer's seconds per parameter by
    ``(state format, shape)`` (or per element by state format; ``"fused"``: torch's
    fused AdamW, which the base recipes use); and ``time_scale``: per fp8 format, the
    measured step of every Linear in it over what the Linears timed alone predicted
    (1 where not measured), which carries the timings alone over to the model."""

    step_16: float
    peak_16: float
    step_shell: float
    peak_shell: float
    step_cost: dict
    n_states: int = 2
    time_scale: dict[str, float] = field(default_factory=dict)


@dataclass
class Config:
    """A plan in the making: a format per Linear, a state format per module, and why."""

    layers: dict[str, str]
    states: dict[str, str]
    reasons: dict[str, str] = field(default_factory=dict)

    def copy(self) -> Config:
        """An independent copy (its dicts copied)."""
        return Config(dict(self.layers), dict(self.states), dict(self.reasons))

    @property
    def any_fp8(self) -> bool:
        """Whether any Linear is in an fp8/fp4 format."""
        return any(f != BF16 for f in self.layers.values())


def _step_cost(base: Baselines, fmt: str, shape: tuple[int, ...]) -> float:
    """Seconds of an optimizer step on one parameter: measured for its shape, else
    (a cost given per element) that times its size."""
    got = base.step_cost.get((fmt, tuple(shape)))
    return got if got is not None else base.step_cost[fmt] * math.prod(shape)


def _size(n: float) -> str:
    """Bytes for a message: MB where that reads, else the exact count."""
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n:,.0f} bytes"


def _state_bytes(fmt: str, shape) -> float:
    return float(state_bytes(fmt, tuple(shape)))


def _stored(fmt: str, shape) -> str:
    return stored_format(fmt, tuple(shape))


@dataclass(frozen=True)
class StepParts:
    """A predicted step, term by term, each in seconds: the 16-bit recipe's measured
    step (``base``); what the fp8 recipe adds around its Linears (``shell``: its
    measured step with no Linear converted less ``base``; 0 with no fp8 Linear); each
    Linear's time in its format over its time in bf16 (``layers``, scaled as
    ``predict`` scales it; 0 in bf16); the optimizer states' step over torch's fused
    AdamW (``states``). The prediction is their sum (``total``)."""

    base: float
    shell: float
    layers: dict[str, float]
    states: float

    @property
    def total(self) -> float:
        """The predicted step: every term added up."""
        return self.base + self.shell + sum(self.layers.values()) + self.states


def step_parts(cfg: Config, layers: dict[str, Layer], units: dict[str, StateUnit],
               base: Baselines) -> StepParts:
    """The terms of ``cfg``'s predicted step (``StepParts``; the module docstring's
    model)."""
    scales = _Scales(layers, units, base)
    fp8 = cfg.any_fp8
    per = {name: (scales.layer(f) * (layers[name].options[f].seconds
                                    - layers[name].options[BF16].seconds)
                  if fp8 and f != BF16 else 0.0)
           for name, f in cfg.layers.items()}
    states = 0.0
    if any(f != "fp32" for f in cfg.states.values()):
        # every parameter then steps in mixprec.optim.AdamW rather than torch's fused one
        k = scales.states(fp8)
        for name, f in cfg.states.items():
            for shape in units[name].shapes:
                stored = _stored(f, shape)
                states += k * (_step_cost(base, stored, shape)
                               - _step_cost(base, "fused", shape))
    return StepParts(base.step_16, base.step_shell - base.step_16 if fp8 else 0.0, per,
                     states)


def predict(cfg: Config, layers: dict[str, Layer], units: dict[str, StateUnit],
            base: Baselines) -> tuple[float, float]:
    """(seconds per step, peak bytes) of ``cfg`` (the module docstring's model): the
    step is ``step_parts(...).total``."""
    if cfg.any_fp8:
        peak = base.peak_shell
        for name, f in cfg.layers.items():
            opts = layers[name].options
            peak += opts[f].saved_bytes - opts[BF16].saved_bytes
        # the backward's peak holds the widest Linear's working set on top
        peak += (max(layers[n].options[f].working_bytes for n, f in cfg.layers.items())
                 - max(lay.options[BF16].working_bytes for lay in layers.values()))
    else:
        peak = base.peak_16
    for name, f in cfg.states.items():
        if f != "fp32":
            for shape in units[name].shapes:
                peak += base.n_states * (_state_bytes(_stored(f, shape), shape)
                                         - _state_bytes("fp32", shape))
    return step_parts(cfg, layers, units, base).total, peak


def fit_scale(layers: dict[str, Layer], units: dict[str, StateUnit], base: Baselines,
              fp8: bool) -> float:
    """The most the timings a configuration takes out of a measured step may be scaled
    by: that step (the fp8 recipe's with no Linear converted where ``fp8``, else the
    16-bit recipe's) over all they can take out of it (with ``fp8`` every Linear's bf16
    time alone; torch's fused AdamW on every parameter); inf where that is nothing.
    Below 1 the parts were timed slower than the whole (a busy machine): scaled by it,
    they fill at most the step, so a prediction stays a positive duration."""
    fused = sum(_step_cost(base, "fused", s) for u in units.values() for s in u.shapes)
    alone = sum(lay.options[BF16].seconds for lay in layers.values()) if fp8 else 0.0
    step = base.step_shell if fp8 else base.step_16
    return math.inf if alone + fused <= 0 else max(0.0, step) / (alone + fused)


class _Scales:
    """What ``predict`` multiplies measured differences by: per fp8 format, its
    measured ``time_scale`` (1 where none), never above ``fit_scale``; the optimizer's
    costs at most 1, never above it either."""

    def __init__(self, layers: dict[str, Layer], units: dict[str, StateUnit],
                 base: Baselines) -> None:
        self.base = base
        self.fit8 = fit_scale(layers, units, base, True)
        self.fit16 = fit_scale(layers, units, base, False)

    def layer(self, f: str) -> float:
        """The scale of format ``f``'s Linear timings in the model."""
        return min(max(0.0, self.base.time_scale.get(f, 1.0)), self.fit8)

    def states(self, fp8: bool) -> float:
        """The scale of the optimizer's timings, with fp8 Linears or without."""
        return min(1.0, self.fit8 if fp8 else self.fit16)


def _fastest(layers: dict[str, Layer], units: dict[str, StateUnit],
             base: Baselines) -> Config:
    cfg = Config({}, {u: "fp32" for u in units})
    for name, layer in layers.items():
        allowed = layer.allowed()
        best = min(allowed, key=lambda o: (o.seconds, o.fmt != BF16))  # a tie: bf16
        cfg.layers[name] = best.fmt
        bf = layer.options[BF16]
        fp8 = [o for o in layer.options.values() if o.fmt != BF16]
        if best.fmt != BF16 and layer.noisy:
            cfg.layers[name] = BF16
            said = "; ".join(layer.noisy[:2]) + (f"; {len(layer.noisy) - 2} more"
                                                  if len(layer.noisy) > 2 else "")
            cfg.reasons[name] = (f"bf16: its timings disagree ({said}): "
                                 f"no speed advice from them ({best.fmt} timed "
                                 f"{bf.seconds / best.seconds:.2f}x bf16's speed); plan "
                                 "again on a quieter machine")
        elif best.fmt != BF16:
            cfg.reasons[name] = (f"fastest allowed: {bf.seconds / best.seconds:.2f}x "
                                 "bf16's speed")
        elif not fp8:
            cfg.reasons[name] = "bf16: no fp8 format measured"
        elif all(o.refused for o in fp8):
            cfg.reasons[name] = "bf16: " + "; ".join(f"{o.fmt} {o.refused}" for o in fp8)
        else:
            quick = min((o for o in fp8 if o.refused is None), key=lambda o: o.seconds)
            ratio = bf.seconds / quick.seconds
            why = (f"its {quick.route} GEMM route allows at most {quick.max_speedup:.2f}x"
                   if ratio >= quick.max_speedup else
                   "its casts cost more than its GEMM saves")
            cfg.reasons[name] = (f"bf16: fastest; {quick.fmt} runs at {ratio:.2f}x "
                                 f"bf16's speed ({why})")
    if cfg.any_fp8 and predict(cfg, layers, units, base)[0] >= base.step_16:
        for name, f in cfg.layers.items():
            if f != BF16:
                cfg.layers[name] = BF16
                cfg.reasons[name] = ("bf16: the fp8 recipe's step is slower than the "
                                     "16-bit recipe's as a whole, though this layer alone "
                                     f"was faster in {f}")
    return cfg


class _Pricer:
    """``predict`` of a configuration kept current under single changes, so that each
    candidate change is priced in O(1) rather than by summing the whole model again (a
    model of hundreds of Linears has as many candidates per greedy step)."""

    def __init__(self, cfg: Config, layers: dict[str, Layer], units: dict[str, StateUnit],
                 base: Baselines) -> None:
        self.layers, self.units, self.base = layers, units, base
        self.scales = _Scales(layers, units, base)
        self.w16 = max((lay.options[BF16].working_bytes for lay in layers.values()),
                       default=0.0)
        self._unit: dict[tuple[str, str], tuple[float, float]] = {}
        self.cfg = cfg.copy()
        self._totals()

    def _layer(self, name: str, f: str) -> tuple[float, float]:
        """(seconds, saved bytes) Linear ``name`` adds in ``f`` over bf16."""
        opts = self.layers[name].options
        return (self.scales.layer(f) * (opts[f].seconds - opts[BF16].seconds),
                opts[f].saved_bytes - opts[BF16].saved_bytes)

    def _state(self, name: str, f: str) -> tuple[float, float]:
        """(seconds, bytes) module ``name``'s states in ``f`` add over torch's fused
        AdamW with fp32 states."""
        key = (name, f)
        if key not in self._unit:
            t = p = 0.0
            for shape in self.units[name].shapes:
                stored = _stored(f, shape)
                t += _step_cost(self.base, stored, shape) - _step_cost(self.base, "fused",
                                                                        shape)
                p += self.base.n_states * (_state_bytes(stored, shape)
                                           - _state_bytes("fp32", shape))
            self._unit[key] = (t, p)
        return self._unit[key]

    def _totals(self) -> None:
        c = self.cfg
        parts = [self._layer(n, f) for n, f in c.layers.items()]
        self.lt, self.ls = sum(x for x, _ in parts), sum(y for _, y in parts)
        self.n8 = sum(f != BF16 for f in c.layers.values())
        work = sorted(((self.layers[n].options[f].working_bytes, n)
                       for n, f in c.layers.items()), reverse=True)
        self.top = work[:2]
        states = [self._state(n, f) for n, f in c.states.items()]
        self.st, self.sp = sum(x for x, _ in states), sum(y for _, y in states)
        self.n_low = sum(f != "fp32" for f in c.states.values())

    def _value(self, lt, ls, n8, wmax, st, sp, n_low) -> tuple[float, float]:
        b = self.base
        if n8:
            t, p = b.step_shell + lt, b.peak_shell + ls + wmax - self.w16
        else:
            t, p = b.step_16, b.peak_16
        if n_low:  # every parameter then steps in mixprec.optim.AdamW
            t, p = t + self.scales.states(n8 > 0) * st, p + sp
        return t, p

    def now(self) -> tuple[float, float]:
        """(seconds, peak bytes) of the current configuration."""
        wmax = self.top[0][0] if self.top else 0.0
        return self._value(self.lt, self.ls, self.n8, wmax, self.st, self.sp, self.n_low)

    def after(self, kind: str, name: str, f: str) -> tuple[float, float]:
        """(seconds, peak bytes) with Linear (``kind="layer"``) or module
        (``"states"``) ``name`` in format ``f`` instead."""
        c = self.cfg
        if kind == "states":
            (t0, p0), (t1, p1) = self._state(name, c.states[name]), self._state(name, f)
            n_low = self.n_low + (f != "fp32") - (c.states[name] != "fp32")
            wmax = self.top[0][0] if self.top else 0.0
            return self._value(self.lt, self.ls, self.n8, wmax, self.st - t0 + t1,
                               self.sp - p0 + p1, n_low)
        old = c.layers[name]
        (t0, s0), (t1, s1) = self._layer(name, old), self._layer(name, f)
        n8 = self.n8 + (f != BF16) - (old != BF16)
        rest = [w for w, n in self.top if n != name][:1]
        wmax = max([*rest, self.layers[name].options[f].working_bytes])
        return self._value(self.lt - t0 + t1, self.ls - s0 + s1, n8, wmax, self.st,
                           self.sp, self.n_low)

    def apply(self, kind: str, name: str, f: str) -> None:
        """Make the change ``after`` priced."""
        if kind == "states":
            self.cfg.states[name] = f
        else:
            self.cfg.layers[name] = f
            self.cfg.reasons[name] = f"{f}: saves activation bytes"
        self._totals()


def _moves(cfg: Config, layers: dict[str, Layer], units: dict[str, StateUnit],
           state_formats: tuple[str, ...]):
    """Every single change, as ``(kind, name, format)``: a Linear to another allowed
    format, a module's states one step down ``STATE_ORDER`` (within
    ``state_formats``)."""
    for name, layer in layers.items():
        for o in layer.allowed():
            if o.fmt != cfg.layers[name]:
                yield "layer", name, o.fmt
    order = [f for f in STATE_ORDER if f in state_formats]
    for name in units:
        cur = cfg.states[name]
        lower = order[order.index(cur) + 1:] if cur in order else []
        if lower:
            yield "states", name, lower[0]


def _greedy(cfg: Config, layers, units, base, state_formats, done, allowed) -> Config:
    """Take the move with the most bytes saved per second lost, while ``allowed(t, p)``
    holds for the result, until ``done(t, p)``."""
    pricer = _Pricer(cfg, layers, units, base)
    t, p = pricer.now()
    while not done(t, p):
        best, best_key = None, None
        for move in _moves(pricer.cfg, layers, units, state_formats):
            t2, p2 = pricer.after(*move)
            saved, lost = p - p2, t2 - t
            if saved <= 0 or not allowed(t2, p2):
                continue
            key = (math.inf if lost <= 0 else saved / lost, saved)
            if best_key is None or key > best_key:
                best, best_key = (move, t2, p2), key
        if best is None:
            break
        move, t, p = best
        pricer.apply(*move)
    return pricer.cfg


def choose(layers: dict[str, Layer], units: dict[str, StateUnit], base: Baselines, *,
           goal: str = "fastest", memory: float | None = None,
           max_step: float | None = None,
           state_formats: tuple[str, ...] = ("fp32", "bf16", "int8")) -> Config:
    """The configuration for ``goal`` (module docstring): ``memory`` is a budget on the
    predicted peak (bytes), ``max_step`` on the predicted step (seconds, for
    ``smallest``). Raises ``NoPlanFits`` when no move brings the peak under ``memory``."""
    if goal not in ("fastest", "smallest"):
        raise ValueError(f"goal={goal!r}; valid: fastest, smallest")
    cfg = _fastest(layers, units, base)
    fits = (lambda t, p: True) if memory is None else (lambda t, p: p <= memory)
    if goal == "fastest":
        if memory is not None:
            cfg = _greedy(cfg, layers, units, base, state_formats, fits,
                          lambda t, p: True)
    else:
        floor = math.inf if max_step is None else max_step
        cfg = _greedy(cfg, layers, units, base, state_formats, lambda t, p: False,
                      lambda t, p: t <= floor)
    t, p = predict(cfg, layers, units, base)
    if memory is not None and p > memory:
        raise NoPlanFits(
            f"no plan fits memory={_size(memory)}: the smallest found peaks at "
            f"{_size(p)} ({goal}). Allow fewer-byte states (state_formats with "
            "'int4'), more fp8 formats, a smaller batch, or a larger budget.")
    if goal == "smallest" and max_step is not None and t > max_step:
        raise NoPlanFits(
            f"no plan meets the speed floor: the fastest found takes {t * 1e3:.2f} ms a "
            f"step, over max_step={max_step * 1e3:.2f} ms. Raise max_step (a multiple "
            "of the 16-bit recipe's step: 1.0 is as fast as it), or allow faster "
            "formats.")
    for name, f in cfg.states.items():
        if f != "fp32":
            cfg.reasons[f"states:{name}"] = f"states {f}: fits the memory budget"
    return cfg
