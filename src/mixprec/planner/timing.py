"""What one Linear costs in each format on this device: time and saved bytes, measured.

``layer_costs(shapes, formats, recipe, device)`` builds, for each distinct Linear shape
``(in, out, tokens, bias)``, a one-Linear model per candidate format and drives it
through a real ``MixedPrecision`` engine: the same autocast, emulation, fp8 GEMM route
and casts a whole model would run with. Each format's forward plus backward (input
and weight gradients, casts included) is timed in interleaved rounds, so a busy
machine slows every format alike, and the median of the rounds is kept. The bytes that
autograd saves for backward (the casts of the input and the weight) are counted once.

Results are cached per process, keyed by the device, its CPU capability (or GPU name)
and everything the route depends on, so planning a second model of the same shapes
measures nothing again. ``cache_file`` keeps them across processes (JSON).
"""

from __future__ import annotations

import json
import math
import statistics
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from mixprec.recipe import Recipe

__all__ = ["LayerCost", "Shape", "layer_costs", "state_step_costs", "device_key", "clear_cache",
           "recipe_for_format", "BF16"]

#: the format name of a Linear kept in the recipe's high precision
BF16 = "bf16"

#: (in_features, out_features, tokens, has_bias)
Shape = tuple[int, int, int, bool]

_CACHE: dict[str, LayerCost] = {}


@dataclass(frozen=True)
class LayerCost:
    """One shape in one format: ``seconds`` for forward + backward (median of the
    interleaved rounds), ``saved_bytes`` autograd keeps for backward (casts of the
    input and weight; not the parameters), the GEMM route that ran, and
    ``working_bytes``: the most its forward + backward holds at once beyond the saved
    bytes (casts along a second axis, dequantized operands, the output and the
    gradients), which the step's peak pays for its widest Linear."""

    seconds: float
    saved_bytes: int
    route: str
    working_bytes: int = 0


def device_key(device: torch.device | str) -> str:
    """What a measured time depends on beyond the shape: the device and its kind (the
    CPU's vector capability, or the GPU's name)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(dev)}"
    return f"{dev.type}:{torch.backends.cpu.get_cpu_capability()}"


def clear_cache() -> None:
    """Forget every measured cost of this process."""
    _CACHE.clear()


def recipe_for_format(recipe: Recipe, fmt: str) -> Recipe:
    """The recipe a Linear in ``fmt`` runs under when the rest of the model follows
    ``recipe``: fp8 formats take the fp8 preset's scaling and element format into
    ``recipe``'s other fields (params, master, ...); ``bf16`` keeps the fp8 recipe
    around it (the Linear is simply not converted)."""
    from mixprec.recipe import PRESETS

    base = recipe.base
    if fmt == BF16:
        return base
    preset = PRESETS[fmt]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return base.replace(compute="fp8", fp8_scaling=preset.fp8_scaling,
                            fp8_format=preset.fp8_format, bf16_last_layers=0,
                            bf16_last_fraction=0.0)


def _key(shape: Shape, fmt: str, recipe: Recipe, device) -> str:
    return json.dumps([device_key(device), list(shape), fmt, str(recipe.base)])


def layer_costs(shapes: Iterable[Shape], formats: Iterable[str], recipe: Recipe,
                device: torch.device | str = "cpu", *, seconds: float = 0.25,
                cache_file: str | Path | None = None) -> dict[tuple[Shape, str], LayerCost]:
    """``{(shape, format): LayerCost}`` for every shape and format, measured on
    ``device`` (cached). ``recipe`` is the fp8 recipe the Linears sit in (its params,
    master, emulation and GEMM route settings); ``seconds``: about how long each
    shape's interleaved rounds run."""
    formats = list(formats)
    disk = _read(cache_file)
    out: dict[tuple[Shape, str], LayerCost] = {}
    for shape in dict.fromkeys(tuple(s) for s in shapes):
        todo = []
        for f in formats:
            k = _key(shape, f, recipe, device)
            hit = _CACHE.get(k) or disk.get(k)
            if hit is not None:
                out[(shape, f)] = _CACHE.setdefault(k, hit)
            else:
                todo.append(f)
        if todo:
            for f, cost in _measure(shape, todo, recipe, device, seconds).items():
                _CACHE[_key(shape, f, recipe, device)] = cost
                out[(shape, f)] = cost
    if cache_file is not None:
        _write(cache_file, {**disk, **{k: v for k, v in _CACHE.items()}})
    return out


def _read(path) -> dict[str, LayerCost]:
    if path is None or not Path(path).exists():
        return {}
    try:
        raw = json.loads(Path(path).read_text())
        return {k: LayerCost(**v) for k, v in raw.items()}
    except (ValueError, TypeError) as e:
        warnings.warn(f"planner cache {str(path)!r} is unreadable ({e}); measuring again",
                      stacklevel=3)
        return {}


def _write(path, costs: dict[str, LayerCost]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".partial")
    tmp.write_text(json.dumps({k: vars(v) for k, v in costs.items()}, indent=0))
    tmp.replace(path)


def _one_linear(shape: Shape, fmt: str, recipe: Recipe, device):
    """A one-Linear model in ``fmt`` behind a real engine, and the step to time."""
    from mixprec.engine import MixedPrecision
    from mixprec.fp8.linear import fp8_modules

    d_in, d_out, tokens, bias = shape
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(d_in, d_out, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(d_out, d_in, generator=g) * d_in ** -0.5)
    model = nn.Sequential(lin).to(device)
    r = recipe_for_format(recipe, fmt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no Linear converted" for bf16, kernel notes
        engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.0), r,
                                fp8_filter=(lambda m, n: fmt != BF16)
                                if r.compute == "fp8" else None)
    x = torch.randn(tokens, d_in, generator=g).to(device).requires_grad_(True)
    dy = torch.randn(tokens, d_out, generator=g).to(device)
    mods = list(fp8_modules(model).values())
    route = mods[0].backend if mods else ("emulated" if engine.emulating else "native")

    def step():
        with engine.autocast():
            y = model(x)
        y.backward(dy.to(y.dtype))
        x.grad = None
        for p in model.parameters():
            p.grad = None

    def saved() -> int:
        seen: dict = {}
        params = {id(p) for p in model.parameters()}

        def pack(t):
            if id(t) not in params and t is not x and t.device.type != "meta":
                st = t.untyped_storage()
                seen[(st.data_ptr(), st.device)] = st.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with engine.autocast():
                y = model(x)
        del y
        return int(sum(seen.values()))

    def high() -> int:
        from mixprec.memory.ledger import high_water

        return high_water(step, device)

    return step, saved, route, high


def _measure(shape: Shape, formats: list[str], recipe: Recipe, device,
             seconds: float) -> dict[str, LayerCost]:
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    runs = {f: _one_linear(shape, f, recipe, dev) for f in formats}
    times: dict[str, list[float]] = {f: [] for f in formats}
    for step, *_ in runs.values():  # warm-up: first calls build caches and pick routes
        step()
    sync()
    t_end, rounds = time.perf_counter() + seconds, 0
    while rounds < 3 or (time.perf_counter() < t_end and rounds < 50):
        for f, (step, *_) in runs.items():
            sync()
            t = time.perf_counter()
            step()
            sync()
            times[f].append(time.perf_counter() - t)
        rounds += 1
    out = {}
    for f, (_, saved, route, high) in runs.items():
        kept = saved()  # the step's high-water mark beyond what backward keeps
        out[f] = LayerCost(statistics.median(times[f]), kept, route, max(0, high() - kept))
    return out


def state_step_costs(shapes: Iterable[tuple[int, ...]], formats: Iterable[str],
                     device: torch.device | str = "cpu", seconds: float = 0.05
                     ) -> dict[tuple[str, tuple[int, ...]], float]:
    """Seconds one AdamW step spends on one parameter of each shape with its states in
    each format (``mixprec.optim.AdamW``), and under ``"fused"`` in torch's fused AdamW
    with fp32 states, which the planner's base recipes train with:
    ``{(format, shape): seconds}``. A parameter's cost has a part per tensor (the
    per-parameter path's Python and small-kernel overhead, which dominates for biases
    and norms) and a part per element, so each shape is timed as it is: a step over
    ``k`` copies of it (more copies for smaller tensors, so the step's own fixed cost is
    shared out), divided by ``k``, formats interleaved, median of the rounds
    (cached)."""
    from mixprec.optim import AdamW

    dev = torch.device(device)
    names = ["fused", *dict.fromkeys(formats)]
    out: dict[tuple[str, tuple[int, ...]], float] = {}
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for shape in dict.fromkeys(tuple(s) for s in shapes):
        keys = {f: json.dumps([device_key(dev), "adamw-step", list(shape), f]) for f in names}
        todo = [f for f in names if keys[f] not in _CACHE]
        for f in names:
            if keys[f] in _CACHE:
                out[(f, shape)] = _CACHE[keys[f]].seconds
        if not todo:
            continue
        numel = max(1, math.prod(shape))
        k = max(1, min(16, (1 << 20) // numel))
        g = torch.Generator().manual_seed(0)
        steps = {}
        for f in todo:
            params = [nn.Parameter(torch.randn(shape, generator=g).to(dev)) for _ in range(k)]
            for p in params:
                p.grad = torch.randn(shape, generator=g).to(dev)
            opt = (torch.optim.AdamW(params, lr=1e-3, fused=True) if f == "fused"
                   else AdamW(params, lr=1e-3, states=f))
            opt.step()  # creates the states
            steps[f] = opt.step
        times: dict[str, list[float]] = {f: [] for f in todo}
        t_end, rounds = time.perf_counter() + seconds, 0
        while rounds < 3 or (time.perf_counter() < t_end and rounds < 20):
            for f in todo:
                sync()
                t = time.perf_counter()
                steps[f]()
                sync()
                times[f].append(time.perf_counter() - t)
            rounds += 1
        for f in todo:
            out[(f, shape)] = statistics.median(times[f]) / k
            _CACHE[keys[f]] = LayerCost(out[(f, shape)], 0, "adamw")
    return out
