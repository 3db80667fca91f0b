"""What this device is fast at, measured, not assumed: every ``auto`` choice lives here.

One measurement is behind every choice and every figure shown of it:
``speed_reading(device, dtype)`` times a matmul in ``dtype`` and one in fp32 alternately
on one thread, three rounds, and keeps each round's ratio (``SpeedReading``);
``route_reading`` does the same for ``torch._scaled_mm`` against a dequant route's GEMM.
Absolute rates are not shown: on a loaded host a multi-threaded GEMM stalls at its
barriers (fp32 read 1.4 GFLOP/s in one run, 131 in the next, on a busy 2-core machine).
Rounds that disagree by more than ``NOISE_SPREAD`` are reported as too noisy to measure,
not as a ratio. From those readings this module decides, once per process:

- ``emulate=auto`` (``has_fast_kernels`` / ``emulating``): a 16-bit format without fast
  kernels is emulated exactly on fp32 kernels. CPUs either have units for a format
  (AVX-512 BF16, AMX, AVX512-FP16: ~1x fp32 or better) or run it in software (AVX2:
  ~0.01-0.02x), so the threshold ``FAST_ENOUGH`` sits far from both;
- ``fp8_gemm=auto``: the GEMM route of each fp8 scaling, ``mixprec.formats.route``'s one
  decision: ``scaled_mm`` (torch's scaled matmul: fp8 products, fp32 accumulation, one
  rounding to the output dtype), ``dequant`` (the codes widened to bf16, which holds
  every e4m3/e5m2 value exactly, a bf16 GEMM with fp32 accumulation whose output is
  rounded to bf16 and rounded again after the scales are applied), or ``dequant_fp32``
  (the codes widened to fp32, an fp32 GEMM, the scales applied in fp32: exact up to
  fp32 summation order). CUDA takes the kernel where the GPU has it (block-scaled ones
  after a probe on the device). On a CPU ``dequant`` stands for bf16's GEMM where bf16
  is fast, ``dequant_fp32`` elsewhere, and ``scaled_mm`` wins only where
  ``route_reading`` finds it clearly faster than that;
- the int8 format's GEMM route (``mixprec.formats.gemm.int8``): on a CPU, per GEMM shape
  class, ``torch._int_mm`` where ``int8_reading`` finds it ``INT8_MARGIN`` faster than
  the exact route's fp32 GEMM (the two are bit-identical: speed only);
- what the layers around an fp8 recipe's Linears run in (``fp8_rest``): bf16 autocast
  where bf16 is fast, else fp32 (no autocast), which is faster and more exact there.

``choices(recipe, device)`` reports the decisions with the readings behind them; the
engine (``engine.kernels``), ``mixprec bench`` and the doctor show it. Under DDP and
FSDP rank 0's choices are every rank's (``mixprec.parallel.layouts``), so all ranks run the
same numerics. Tests replace ``speed_reading`` / ``route_reading`` to cover both
outcomes of every choice on any chip. No choice reads ``matmul_gflops`` (multi-threaded,
best-of: the peak ``mixprec bench`` divides by).

**Pinning the path.** ``MIXPREC_EMULATE=on`` makes every ``auto`` choice take the path
of a chip without 16-bit units (bf16/fp16 emulated on fp32 kernels, fp32 around fp8
Linears, fp32 dequant GEMMs); ``MIXPREC_EMULATE=off`` the path of a chip with them (real
bf16/fp16 tensors and kernels, bf16 around fp8 Linears, bf16 dequant GEMMs). Unset or
``auto``, the choices are measured. Both paths run on any CPU (real bf16 on an AVX2 chip
only slowly), which is how one machine tests both. A recipe's explicit ``emulate=true``
or ``emulate=false`` is never overridden.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

import torch

from mixprec.formats import route as _route
from mixprec.formats.elements import get
from mixprec.formats.fp32_precision import ieee_fp32_matmul  # the exact routes import it from here
from mixprec.formats.gemm import FORMATS
from mixprec.formats.gemm import int8 as _int8
from mixprec.formats.route import gemm_route
from mixprec.recipe import MX_COMPUTE, Recipe

__all__ = ["matmul_gflops", "relative_speed", "FAST_ENOUGH", "has_fast_kernels",
           "emulating", "fp8_gemm_gflops", "fp8_gemm_route", "fp8_rest", "choices",
           "KernelChoices", "SCALED_MM_MARGIN", "EMULATE_ENV", "pinned_emulation",
           "ieee_fp32_matmul", "SpeedReading", "speed_reading",
           "route_reading", "NOISE_SPREAD", "best_time", "int8_reading", "INT8_MARGIN"]

#: below this fraction of fp32's matmul throughput a format counts as having no fast
#: kernel, and ``emulate=auto`` emulates it on fp32 kernels instead. Chips either have
#: units for a format (~1x fp32 or better) or emulate it in software (~0.02x), so the
#: threshold sits far from both and a busy machine cannot flip the decision.
FAST_ENOUGH = 0.2

#: ``fp8_gemm=auto`` on a CPU takes ``_scaled_mm`` over the dequant route only when it is
#: this much faster: a clear win, not a draw a busy machine decided
SCALED_MM_MARGIN = 1.25

#: a reading whose rounds' ratios differ by more than this factor (largest over
#: smallest) was taken on a machine too busy to measure: it says so instead of a ratio
NOISE_SPREAD = 2.0

#: the environment variable that pins every ``auto`` choice to one path (module doc)
EMULATE_ENV = "MIXPREC_EMULATE"
_PIN = {"on": True, "true": True, "1": True, "off": False, "false": False, "0": False,
        "auto": None, "": None}


def pinned_emulation() -> bool | None:
    """What ``MIXPREC_EMULATE`` pins ``emulate=auto`` to: True (the emulated path), False
    (the real 16-bit path) or None (unset or ``auto``: measured). Read at each call, so
    a test can set it; a value other than on/off/auto raises, naming it."""
    raw = os.environ.get(EMULATE_ENV, "")
    key = raw.strip().lower()
    if key not in _PIN:
        raise ValueError(f"{EMULATE_ENV}={raw!r}; valid: on, off, auto (or unset). 'on' "
                         "emulates 16-bit formats on fp32 kernels, 'off' runs their real "
                         "kernels, 'auto' measures which this device is fast at.")
    return _PIN[key]


@cache
def matmul_gflops(device: str, dtype: torch.dtype, n: int = 512, seconds: float = 0.05
                  ) -> float:
    """GFLOP/s of an n×n matmul in ``dtype`` on ``device``: the fastest single call within
    about ``seconds`` (best-of is what a busy machine distorts least). Cached."""
    dev = torch.device(device)
    # the caller may be inside autocast (the first auto decision can be taken in a
    # forward pass): there the "fp32" probe would run in bf16 and read ~1x
    with torch.autocast(dev.type, enabled=False), torch.no_grad():
        return _gflops(dev, dtype, n, seconds)


def best_time(fn: Callable[[], object], device: torch.device | str,
              seconds: float) -> float:
    """The fastest call of ``fn`` (after one warm-up) over about ``seconds``, at least 3
    calls, each waited for on ``device`` (CUDA's stream; nothing on the CPU)."""
    sync = _sync(torch.device(device))
    fn()
    sync()
    best, k, t_end = float("inf"), 0, time.perf_counter() + seconds
    while k < 3 or time.perf_counter() < t_end:
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
        k += 1
    return best


def _sync(dev: torch.device):
    return torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)


def _gflops(dev: torch.device, dtype: torch.dtype, n: int, seconds: float) -> float:
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=g).to(dev, dtype)
    b = torch.randn(n, n, generator=g).to(dev, dtype)
    return 2 * n**3 / best_time(lambda: a @ b, dev, seconds) / 1e9


@dataclass(frozen=True, kw_only=True)
class SpeedReading:
    """How fast kernel ``name`` ran against kernel ``base`` (a format's matmul against
    fp32's; ``_scaled_mm`` against a dequant route's GEMM): the ratio of their rates in
    each round, the two timed back to back on one thread (``speed_reading``)."""

    name: str
    base: str
    rounds: tuple[float, ...]

    @property
    def ratio(self) -> float:
        """The median round: what the ``auto`` choices decide on."""
        return statistics.median(self.rounds)

    @property
    def noisy(self) -> bool:
        """Whether the rounds disagree by more than ``NOISE_SPREAD``: the machine was too
        busy for the ratio to mean anything (the choice still takes the median)."""
        return max(self.rounds) > NOISE_SPREAD * min(self.rounds)

    def __str__(self) -> str:
        if self.noisy:
            lo, hi = min(self.rounds), max(self.rounds)
            return (f"{self.name} against {self.base}: too noisy to measure (rounds "
                    f"{_times(lo)} to {_times(hi)})")
        return f"{self.name} {_times(self.ratio)} {self.base}"

    def as_dict(self) -> dict:
        """The reading as plain data (the doctor's facts)."""
        return {"against": self.base, "ratio": self.ratio, "rounds": list(self.rounds),
                "noisy": self.noisy}


def _times(v: float) -> str:
    return f"{v:.0f}x" if v >= 10 else f"{v:.2g}x"


def _alternate(name: str, base: str, fast, slow, clear_below: float) -> SpeedReading:
    """Three rounds of ``fast()`` then ``slow()`` (rates) on one thread, which measures
    a kernel alone (a multi-threaded GEMM waits for a thread whose core another process
    holds); alternating puts the same load on both. A first round below ``clear_below``
    decides alone (0.02 on AVX2, where each slow call takes ~50 ms)."""
    rounds: list[float] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        while len(rounds) < 3 and not (rounds and rounds[0] < clear_below):
            rounds.append(fast() / slow())  # in that order
    finally:
        torch.set_num_threads(threads)
    return SpeedReading(name=name, base=base, rounds=tuple(rounds))


def speed_reading(device: torch.device | str, dtype: torch.dtype) -> SpeedReading:
    """``dtype``'s matmul throughput against fp32's on ``device``, in alternating rounds
    on one thread (cached per process): behind ``emulate=auto``, ``fp8_rest``, the fp8
    dequant route, ``KernelChoices.describe`` and the doctor alike."""
    return _speed_reading(str(torch.device(device)), dtype)


@cache
def _speed_reading(dev: str, dtype: torch.dtype) -> SpeedReading:
    return _alternate(get(dtype).name, "fp32",
                      lambda: matmul_gflops.__wrapped__(dev, dtype, 256, 0.01),
                      lambda: matmul_gflops.__wrapped__(dev, torch.float32, 256, 0.01),
                      FAST_ENOUGH / 4)


def relative_speed(device: torch.device | str, dtype: torch.dtype) -> float:
    """Matmul throughput in ``dtype`` over fp32's on ``device``: the median round of
    ``speed_reading``."""
    return speed_reading(device, dtype).ratio


def has_fast_kernels(device: torch.device | str, compute: str) -> bool:
    """Whether ``device`` has fast kernels for a compute format: measured once. fp16 and
    bf16 on a CPU are fast only on chips with units for them (AVX512-FP16 / AMX-FP16,
    AVX-512 BF16 / AMX-BF16); the MX formats have no torch kernels anywhere.
    ``MIXPREC_EMULATE`` overrides the measurement for fp16 and bf16 (module doc)."""
    if compute in MX_COMPUTE:
        return False
    pinned = pinned_emulation() if compute in ("fp16", "bf16") else None
    if pinned is not None:  # MIXPREC_EMULATE: the path is pinned, not measured
        return not pinned
    if compute in ("fp16", "bf16") and torch.device(device).type == "cpu":
        dt = torch.float16 if compute == "fp16" else torch.bfloat16
        return speed_reading(device, dt).ratio >= FAST_ENOUGH
    return True


def emulating(recipe: Recipe, device: torch.device | str) -> bool:
    """Resolve ``recipe.emulate`` (None = auto) for ``device``. fp8 recipes are exact
    already (their Linears round with the fp8 casts); their other layers follow
    ``fp8_rest``."""
    if recipe.precision.emulate is not None:
        return recipe.precision.emulate
    return (recipe.linear is None and recipe.precision.compute not in ("fp32", "tf32")
            and not has_fast_kernels(device, recipe.precision.compute))


def fp8_rest(recipe: Recipe, device: torch.device | str) -> str:
    """What the layers around an fp8 recipe's Float8Linears compute in: ``bf16``
    (autocast) where this device has fast bf16 kernels, else ``fp32``: there fp32 is both
    faster (~45x on an AVX2 CPU) and more exact, and ops with no bf16 CPU kernel at all
    (oneDNN's LSTM on AVX2) keep working. Working weights stored in bf16 (``params=bf16``)
    need bf16 autocast to meet their inputs, so they keep it."""
    if recipe.precision.params != "fp32" or has_fast_kernels(device, "bf16"):
        return "bf16"
    return "fp32"


@cache
def fp8_gemm_gflops(device: str, n: int = 128) -> float:
    """GFLOP/s of ``torch._scaled_mm`` on an n×n e4m3 GEMM (bf16 out) on ``device``, or 0
    where it does not run. On some CPUs it is a reference kernel (~0.1 GFLOP/s), on
    others it reaches fp32's speed, so it is measured, on a small n (cached)."""
    dev = torch.device(device)
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        a = torch.randn(n, n, generator=g).to(dev, torch.float8_e4m3fn)
        b = torch.randn(n, n, generator=g).to(dev, torch.float8_e4m3fn).t()
        one = torch.ones((), device=dev)
        with torch.autocast(dev.type, enabled=False), torch.no_grad():
            t = best_time(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one,
                                                   out_dtype=torch.bfloat16), dev, 0.01)
    except (RuntimeError, NotImplementedError, TypeError):
        return 0.0
    return 2 * n**3 / t / 1e9


def route_reading(device: torch.device | str, route: str) -> SpeedReading:
    """``torch._scaled_mm`` (128×128, e4m3) against the GEMM of dequant ``route`` (bf16
    for ``dequant``, fp32 for ``dequant_fp32``), read as ``speed_reading`` (cached)."""
    return _route_reading(str(torch.device(device)), route)


@cache
def _route_reading(dev: str, route: str) -> SpeedReading:
    dt = torch.bfloat16 if route == "dequant" else torch.float32
    return _alternate("scaled_mm", route, lambda: fp8_gemm_gflops.__wrapped__(dev),
                      lambda: matmul_gflops.__wrapped__(dev, dt, 128, 0.01),
                      SCALED_MM_MARGIN / 4)


#: ``fp8_gemm=auto`` of the int8 format on a CPU takes ``torch._int_mm`` for a GEMM shape
#: class where it reads this much faster than the exact route's fp32 GEMM (the routes
#: are bit-identical: a near draw either way costs little)
INT8_MARGIN = 1.1
#: ``int8_reading`` measures a shape class with each dim cut to this (a 4096-wide class
#: would take seconds on one thread); the aspect of the shape is what it reads
INT8_READ_CAP = 2048


def int8_reading(device: torch.device | str, shape: tuple[int, int, int]) -> SpeedReading:
    """``torch._int_mm`` on an int8 ``shape`` (M, K, N) GEMM against the fp32 GEMM of the
    int8 format's exact route on the same shape (dims cut to ``INT8_READ_CAP``), read as
    ``speed_reading`` (cached per device and shape)."""
    return _int8_reading(str(torch.device(device)), tuple(shape))


@cache
def _int8_reading(dev: str, shape: tuple[int, int, int]) -> SpeedReading:
    m, k, n = (min(d, INT8_READ_CAP) for d in shape)
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8).to(dev)
    b = torch.randint(-127, 128, (k, n), generator=g, dtype=torch.int8).to(dev)
    af, bf = a.float(), b.float()

    def rate(fn):
        return 1.0 / best_time(fn, dev, 0.0)

    with torch.autocast(torch.device(dev).type, enabled=False), torch.no_grad():
        return _alternate("int_mm", "fp32", lambda: rate(lambda: torch._int_mm(a, b)),
                          lambda: rate(lambda: af @ bf), INT8_MARGIN / 4)


def _measured_int8(dev: torch.device, shape: tuple[int, int, int]) -> bool:
    """``mixprec.formats.gemm.int8``'s ``auto`` per GEMM shape class off CUDA."""
    return int8_reading(dev, shape).ratio > INT8_MARGIN


def fp8_gemm_route(device: torch.device | str, choice: str = "auto") -> str:
    """The route of the per-tensor and rowwise fp8 GEMMs on ``device`` for ``fp8_gemm``
    ``choice``: ``mixprec.formats.route.gemm_route``'s answer for those scalings, for
    callers without a quantizer (the memory planner, ``benchmarks/cpu_kernels.py``)."""
    per_tensor = next(f for f in FORMATS.values() if f.per_tensor)
    return gemm_route(device, per_tensor(), choice)


@dataclass(frozen=True)
class KernelChoices:
    """The hardware-dependent choices for one recipe on one device, and why.

    ``emulate``: whether the compute format is emulated; ``fp8_gemm``: the fp8 GEMM route
    (fp8 recipes); ``fp8_rest``: what the layers around fp8 Linears compute in;
    ``speeds``: the readings the measured choices took (``SpeedReading`` by kernel name:
    ``bf16``, ``fp16`` against fp32, ``scaled_mm`` against its dequant route); ``source``:
    who decided (``measured``, ``MIXPREC_EMULATE=on|off``, or ``rank 0`` on the other
    ranks of a data-parallel run); ``fp8_gemm_routes``: under ``layer:`` rules, the
    route of each fp8 scaling the Linears run (``gemm_for``)."""

    emulate: bool
    fp8_gemm: str | None = None
    fp8_rest: str | None = None
    speeds: dict[str, SpeedReading] = field(default_factory=dict)
    source: str = "measured"
    #: recipes with ``layer:`` rules: the fp8 GEMM route of each ``fp8_scaling`` their
    #: Linears run (``fp8_gemm`` is the recipe's own scaling's); empty without rules
    fp8_gemm_routes: dict[str, str] = field(default_factory=dict)

    def gemm_for(self, scaling: str) -> str | None:
        """The fp8 GEMM route of a Linear with fp8 scaling ``scaling``."""
        return self.fp8_gemm_routes.get(scaling, self.fp8_gemm)

    def describe(self) -> str:
        """One line a person reads: what was chosen, by whom, and the readings it took
        (ratios, or that the machine was too noisy to measure)."""
        parts = [f"emulate={'on' if self.emulate else 'off'}"]
        if self.fp8_gemm is not None:
            other = ", ".join(f"{s}: {r}" for s, r in self.fp8_gemm_routes.items()
                              if r != self.fp8_gemm)
            parts += [f"fp8_gemm={self.fp8_gemm}" + (f" ({other})" if other else ""),
                      f"rest of the model in {self.fp8_rest}"]
        if self.source != "measured":
            parts.append(f"decided by {self.source}")
        read = ", ".join(str(v) for v in self.speeds.values())
        return "; ".join(parts) + (f" (measured on one thread, alternating: {read})"
                                   if read else "")

    def as_dict(self) -> dict:
        """The choices that change numerics, as plain data (checkpoints record it)."""
        out = {"emulate": self.emulate, "fp8_gemm": self.fp8_gemm, "fp8_rest": self.fp8_rest}
        if self.fp8_gemm_routes:
            out["fp8_gemm_routes"] = dict(self.fp8_gemm_routes)
        return out


def choices(recipe: Recipe, device: torch.device | str) -> KernelChoices:
    """Every ``auto`` choice for ``recipe`` on ``device``, with the readings behind the
    measured ones (CPU; none where ``MIXPREC_EMULATE`` pins the path)."""
    dev = torch.device(device)
    emulate = emulating(recipe, dev)
    pinned = pinned_emulation()
    source = "measured" if pinned is None else f"{EMULATE_ENV}={'on' if pinned else 'off'}"
    speeds: dict[str, SpeedReading] = {}
    if dev.type == "cpu" and pinned is None and (recipe.uses_autocast or recipe.precision.emulate):
        for dt in (torch.bfloat16, torch.float16):
            reading = speed_reading(dev, dt)
            speeds[reading.name] = reading
    if recipe.linear is None:
        return KernelChoices(emulate, speeds=speeds, source=source)
    # layer: rules may put Linears on other scalings, whose GEMMs take other routes
    own = _scaling_recipes(recipe)
    routes = {s: _fp8_route(r, dev) for s, r in own.items()}
    if dev.type == "cpu" and recipe.linear.fp8_gemm == "auto" and \
            not recipe.precision.emulate and any(
            r.linear.takes_tensor_route for r in own.values()):  # the route took a reading
        speeds["scaled_mm"] = route_reading(
            dev, "dequant" if has_fast_kernels(dev, "bf16") else "dequant_fp32")
    return KernelChoices(emulate, routes[recipe.linear.name], fp8_rest(recipe, dev),
                         speeds, source, routes if recipe.layer_rules else {})


def _scaling_recipes(recipe: Recipe) -> dict[str, Recipe]:
    """The recipe the Linears of each fp8 scaling run with: ``recipe``'s own scaling
    first, then each ``layer:`` rule's preset (``Recipe.for_layer``)."""
    out = {recipe.linear.name: recipe.base}
    for rule in recipe.layer_rules:
        if rule.value != "bf16":
            r = recipe.with_format(rule.value)
            out.setdefault(r.linear.name, r)
    return out


def _fp8_route(recipe: Recipe, dev: torch.device) -> str:
    """The GEMM route of ``recipe``'s Linears (``mixprec.formats.route``: one decision).
    Emulation's ``auto`` takes the bf16 dequant route of the per-tensor scalings."""
    q = recipe.linear
    choice = q.fp8_gemm
    if recipe.precision.emulate and choice == "auto" and q.takes_tensor_route:
        choice = "dequant"
    return q.route(dev, choice)


def _measured_tensor_route(dev: torch.device) -> str:
    """``mixprec.formats.route``'s ``auto`` for the per-tensor routes off CUDA (its
    ``measured_route``): from this module's readings, which it cannot import."""
    dequant = "dequant" if has_fast_kernels(dev, "bf16") else "dequant_fp32"
    return "scaled_mm" if route_reading(dev, dequant).ratio > SCALED_MM_MARGIN else dequant


_route.register_measured_route(_measured_tensor_route)
_int8.register_measured_int8(_measured_int8)
