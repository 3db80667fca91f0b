"""``mixprec bench``: each recipe against the hardware and against hand-written PyTorch.

For each recipe on the workbench GPT (and a plain MLP) it reports the following. Each
recipe is timed in its own phase, interleaved step by step with its hand-written twin:

- step time (median) and tokens/s;
- achieved FLOP/s (``GPTConfig.flops_per_token`` × tokens / step time) and its share of
  this device's peak rate for the GEMMs the recipe really runs, measured by the command
  itself under the recipe's own precision settings (``mixprec.workbench.peaks``: TF32
  for tf32, IEEE fp32 where emulated, each Float8Linear on the route the engine reports,
  FLOP-weighted with the rest of the step);
- the engine's overhead against the equivalent hand-written loop, where torch has one:
  fp32 (plain), bf16 and fp16 (``torch.autocast`` + ``torch.amp.GradScaler`` for fp16),
  as the median of per-round paired ratios with its quartiles (``paired_overhead``);
- bytes held (``memory.measure``) and, on CUDA, the allocator's peak over the phase;
- the GEMM route each fp8 Linear took;
- whether the recipe's timed steps agree (``mixprec.diagnostics.noise``: their
  interquartile range over their median, at most 25%). Where the recipe's or fp32's
  disagree, no speed-up is given and the table says by how much they disagree.

Each recipe's models are built on the device, timed and freed before the next recipe's
are built, so the memory a run needs is its largest recipe's, not the sum of all.

With ``compile=True`` (``--compile``) each recipe also runs with its model under
``torch.compile`` (inductor), interleaved step by step with the eager loop, and the fp8
recipes with torchao's float8 training (tensorwise scaling, the same Linears converted,
the same autocast) under ``torch.compile`` too, where torchao is installed (its
tensorwise recipe beside ``fp8`` and ``fp8-current``, rowwise beside ``fp8-rowwise``): the paired
ratios say whether compiling pays and how mixprec's compiled step compares with the
peer's. The compile itself happens in the warm-up steps and is not timed.
"""

from __future__ import annotations

import contextlib
import gc
import json
import statistics
import warnings
from collections.abc import Iterable
from time import perf_counter  # the step timer (tests replace it with a fake clock)

import torch
from torch import nn

from mixprec.diagnostics.noise import agreement
from mixprec.engine.context import autocast_dtype, make_emulation_mode
from mixprec.engine.facade import MixedPrecision
from mixprec.formats.gemm.per_tensor import PerTensor
from mixprec.formats.gemm.rowwise import RowwiseScaling
from mixprec.memory import measure
from mixprec.modules.linear import fp8_modules
from mixprec.optim import adamw_for
from mixprec.recipe import Recipe
from mixprec.workbench.model import GPT, SIZES
from mixprec.workbench.peaks import combined_peak, peak_gflops, peak_parts

__all__ = ["bench", "peak_gflops", "paired_overhead", "TORCHAO_RECIPES", "torchao_recipe"]

#: torchao's float8 training recipe of the same scaling as a Linear format (by the
#: format's class, its subclasses too), which the bench runs as a peer; a format none
#: of these is has no peer
TORCHAO_RECIPES: dict[type, str] = {PerTensor: "tensorwise", RowwiseScaling: "rowwise"}


def torchao_recipe(fmt: object) -> str | None:
    """torchao's recipe of Linear format ``fmt``'s scaling (``TORCHAO_RECIPES``), or
    None."""
    return next((r for c, r in TORCHAO_RECIPES.items() if isinstance(fmt, c)), None)


def paired_overhead(times: list[float], base: list[float]) -> tuple[float, float, float]:
    """How much slower ``times`` is than ``base``: the median, 25th and 75th percentile
    of the per-round ratios - 1, where round i timed one step of each back to back.

    Pairing steps of the same round cancels slow drifts of a shared host's load, which a
    ratio of the two medians does not; the quartiles show what noise is left.

    >>> paired_overhead([1.1, 2.2, 1.05], [1.0, 2.0, 1.0])[0]  # doctest: +ELLIPSIS
    0.1000...
    """
    if len(times) != len(base) or not times:
        raise ValueError(f"need the same number (> 0) of rounds, got {len(times)} and "
                         f"{len(base)}")
    ratios = sorted(a / b - 1 for a, b in zip(times, base))
    q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else \
        [ratios[0]] * 3
    return statistics.median(ratios), q[0], q[2]


def _mlp(d: int = 1024) -> nn.Module:
    return nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.GELU(),
                         nn.Linear(d, d))


def bench(recipes: Iterable[str] = ("fp32", "bf16", "bf16-master", "fp16", "fp8"), *,
          size: str = "base",
          batch: int = 8, seq: int | None = None, steps: int = 6, warmup: int = 2,
          device: str = "cpu", model: str = "gpt", compile: bool = False) -> dict:
    """Run the benchmark; returns a dict (``--json`` prints it). ``compile``: also time
    each recipe compiled, and torchao's compiled float8 beside the fp8 recipes."""
    if compile and warmup < 1:
        raise ValueError(f"warmup={warmup}: compile needs at least 1 warm-up step, in "
                         "which the graphs are compiled")
    dev = torch.device(device)
    build, loss_of, tokens, flops_per_step, seq = _workload(model, size, batch, seq, dev)
    rows = []
    memo: dict = {}  # each GEMM's peak measured once
    for r in recipes:  # one recipe's models at a time: each is freed before the next
        rows.append(_recipe_row(r, build, loss_of, dev, tokens, flops_per_step, warmup,
                                steps, compile, memo))
        _release(dev, compile)
    base = next((x for x in rows if x["recipe"] == "fp32"), None)
    for x in rows:  # no speed-up from steps that disagree (``diagnostics.noise``)
        x["speedup_vs_fp32"] = (base["step_ms"] / x["step_ms"] if base and not (
            base["timing"]["noisy"] or x["timing"]["noisy"]) else None)
    return {"model": model, "size": size, "batch": batch, "seq": seq, "device": device,
            "steps": steps, "compile": compile, "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "flops_per_step": flops_per_step, "rows": rows,
            "timing_noise": [x["timing_note"] for x in rows if x["timing"]["noisy"]]}


def _recipe_row(r: str, build, loss_of, dev: torch.device, tokens: int,
                flops_per_step: float, warmup: int, steps: int, compile: bool,
                memo: dict | None = None) -> dict:
    """Build ``r``'s engine loop and its twins, time them in one phase, and return the
    recipe's row; nothing of it outlives the call. ``max_memory_allocated``: the CUDA
    allocator's peak over the phase (None on the CPU); ``fp8_routes``: how many fp8
    Linears took each GEMM route (``Float8Linear.backend``); ``peak_parts``: the GEMMs
    the peak is measured on (``workbench.peaks``), each measured once per ``memo``."""
    rec = Recipe.coerce(r)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    m, e, step = _engine_loop(build, rec, loss_of)
    twins = {}
    if rec.precision.compute in ("fp32", "bf16", "fp16") and rec.precision.params == "fp32":
        twins[f"hand:{r}"] = _hand_loop(build(), rec, dev, loss_of, e.emulating)
    if compile:
        twins[f"compiled:{r}"] = _engine_loop(build, rec, loss_of, compiled=True)[2]
        peer = torchao_recipe(rec.linear)
        if peer and _has_torchao():
            twins[f"torchao:{r}"] = _torchao_loop(build(), m, e, dev, loss_of, peer)
    failed: dict[str, str] = {}
    times = _time_phases({r: (step, m, e)}, {r: twins}, dev, warmup, steps, failed)
    held = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    del twins, step
    med = statistics.median(times[r])
    agreed = agreement(f"{r}'s step time", [t * 1e3 for t in times[r]], "ms")
    parts = peak_parts(str(dev), r, e.kernels, m, tokens, flops_per_step,
                       {} if memo is None else memo)
    peak = combined_peak(parts)
    achieved = flops_per_step / med / 1e9
    over, q25, q75 = (paired_overhead(times[r], times[f"hand:{r}"])
                      if f"hand:{r}" in times else (None, None, None))
    routes: dict[str, int] = {}
    for lin in fp8_modules(m).values():
        routes[lin.backend] = routes.get(lin.backend, 0) + 1
    row = {"recipe": r, "step_ms": med * 1e3, "tokens_per_s": tokens / med,
           "gflops": achieved, "peak_gflops": peak, "mfu": achieved / peak,
           "peak_parts": [{**{k: v for k, v in p.items() if k != "flops"},
                           "share": p["flops"] / flops_per_step} for p in parts],
           "overhead_vs_hand": over, "overhead_iqr": (q25, q75),
           "model_state_bytes": measure(m, e).total, "max_memory_allocated": held,
           "timing": agreed.as_dict(), "timing_note": str(agreed),
           "emulated": e.emulating, "kernels": e.kernels.describe(),
           "kernel_choices": e.kernels.as_dict(), "fp8_routes": routes}
    if compile:
        row.update(_compiled_figures(times, r), torchao_error=failed.get(f"torchao:{r}"))
    return row


def _release(dev: torch.device, compiled: bool = False) -> None:
    """Return the freed recipe's memory: drop dynamo's graphs of its compiled models,
    collect its reference cycles and hand CUDA's cached blocks back, so the next recipe
    starts empty."""
    if compiled:
        torch._dynamo.reset()
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _engine_loop(build, rec: Recipe, loss_of, compiled: bool = False):
    """``(model, engine, step)``: one training step of ``rec`` through the engine, on
    the model or (``compiled``) on ``torch.compile(model)``."""
    m = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = MixedPrecision(m, adamw_for(rec, m.parameters()), rec)
    f = torch.compile(m) if compiled else m

    def step():
        with e.autocast():
            loss = loss_of(f)
        e.backward(loss)
        e.step()
    return m, e, step


def _has_torchao() -> bool:
    try:
        import torchao.float8  # noqa: F401
    except Exception:  # not installed, or built for another torch
        return False
    return True


def _torchao_loop(model: nn.Module, converted: nn.Module, engine: MixedPrecision,
                  dev: torch.device, loss_of, recipe: str):
    """torchao's float8 training step under ``torch.compile``: its ``recipe``
    (``tensorwise`` or ``rowwise`` dynamic scaling) on the Linears mixprec converted in
    ``converted``, the autocast ``engine`` runs the other layers in, torch's fused
    AdamW."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    names = {n for n, mod in converted.named_modules() if type(mod).__name__ == "Float8Linear"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        convert_to_float8_training(
            model, config=Float8LinearConfig.from_recipe_name(recipe),
            module_filter_fn=lambda mod, fqn: fqn in names)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    dtype = autocast_dtype(engine.recipe, dev, engine.kernels.fp8_rest)
    f = torch.compile(model)

    def step():
        with torch.autocast(dev.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = loss_of(f)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def _compiled_figures(times: dict[str, list[float]], r: str) -> dict:
    """The compiled step's median, its speed-up over eager (median of paired ratios)
    and, beside torchao's compiled float8, the ratio of the two (< 1: mixprec faster)."""
    c = times[f"compiled:{r}"]
    out = {"compiled_step_ms": statistics.median(c) * 1e3,
           "compile_speedup": 1 / (1 + paired_overhead(c, times[r])[0]),
           "torchao_step_ms": None, "vs_torchao": None, "vs_torchao_iqr": (None, None)}
    ao = times.get(f"torchao:{r}")
    if ao is not None:
        med, q25, q75 = paired_overhead(c, ao)
        out.update(torchao_step_ms=statistics.median(ao) * 1e3, vs_torchao=1 + med,
                   vs_torchao_iqr=(1 + q25, 1 + q75))
    return out


def _workload(model: str, size: str, batch: int, seq: int | None, dev: torch.device):
    """``(build, loss_of, tokens per step, FLOPs per step, seq)`` for ``model``: the
    workbench GPT (``gpt``) or a 4-layer 1024-wide MLP (``mlp``), on seeded inputs;
    ``build`` creates the model's parameters on ``dev``."""
    cfg = SIZES[size]
    seq = seq or cfg.seq_len
    g = torch.Generator().manual_seed(0)
    if model == "gpt":
        idx = torch.randint(0, cfg.vocab, (batch, seq + 1), generator=g).to(dev)
        inputs, tokens = (idx[:, :-1], idx[:, 1:]), batch * seq

        def build():
            torch.manual_seed(0)
            with dev:  # parameters created on the device: no host copy to move
                return GPT(cfg)

        return build, lambda m: m(*inputs), tokens, cfg.flops_per_token() * tokens, seq
    if model == "mlp":
        x = torch.randn(batch * seq, 1024, generator=g).to(dev)
        tokens = batch * seq

        def build():
            torch.manual_seed(0)
            with dev:
                return _mlp()

        flops = 6 * sum(p.numel() for p in _mlp().parameters()) * tokens
        return build, lambda m: m(x).float().pow(2).mean(), tokens, flops, seq
    raise ValueError(f"model {model!r}; valid: gpt, mlp")


def _time_phases(loops: dict, twins: dict[str, dict], dev: torch.device, warmup: int,
                 steps: int, failed: dict[str, str] | None = None
                 ) -> dict[str, list[float]]:
    """Seconds per step of each loop. One phase per recipe: the engine and its twins
    (hand-written, compiled, the peer's) interleaved, the order rotating. Phases are
    kept apart because a big loop's allocations perturb the one after it; speed-ups
    compare phase medians. A peer's step that raises (torchao's float8 GEMM where this
    CPU's oneDNN has no fp8 kernel) leaves the phase, its error in ``failed``."""
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    times = {}
    for r in loops:
        fns = {r: loops[r][0], **twins.get(r, {})}
        names = list(fns)
        if any(k.startswith(("compiled:", "torchao:")) for k in names):
            # each phase compiles new model instances of the same code: without a
            # reset, dynamo's recompile limit (8) would send later phases to eager
            torch._dynamo.reset()
        for k in names:
            times[k] = []
        for i in range(warmup + steps):
            for k in names[i % len(names):] + names[:i % len(names)]:
                if k not in fns:
                    continue
                sync()
                t = perf_counter()
                try:
                    fns[k]()
                except Exception as e:
                    if not k.startswith("torchao:") or failed is None:
                        raise
                    failed[k] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    del fns[k], times[k]
                    continue
                sync()
                if i >= warmup:
                    times[k].append(perf_counter() - t)
    return times


def _hand_loop(model, rec: Recipe, dev, loss_of, emulate: bool = False):
    """The plain-torch twin of the engine's loop; under emulation it enters the same
    EmulationMode by hand (forward and backward), as a user without the engine would."""
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    mode = make_emulation_mode(rec) if emulate else None
    emu = mode if mode is not None else contextlib.nullcontext()
    if rec.precision.compute == "fp32":
        def step():
            loss = loss_of(model)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step
    dtype = torch.bfloat16 if rec.precision.compute == "bf16" else torch.float16
    scaler = torch.amp.GradScaler(dev.type) if rec.precision.compute == "fp16" else None

    def step():
        with torch.autocast(dev.type, dtype=dtype), emu:
            loss = loss_of(model)
        with emu:
            (loss if scaler is None else scaler.scale(loss)).backward()
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)
    return step


def _aligned(head: list[str], rows: list[list[str]]) -> list[str]:
    """``head`` and ``rows`` as lines of columns sized to their widest cell: the first
    left-aligned, the rest right-aligned, two spaces apart (a figure wider than usual
    widens its column instead of pushing the row out of line)."""
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                      for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in [head, *rows]]


def format_table(result: dict) -> str:
    """The result as a text table ("–" where a figure has no baseline: no fp32 row for
    the speed-up, no hand-written twin for the overhead; "noisy" where the steps behind
    a speed-up disagree, with a line saying by how much)."""
    lines = [f"# mixprec bench: {result['model']} {result['size']}, batch {result['batch']}x"
             f"{result['seq']}, {result['device']}, torch {result['torch']}, "
             f"{result['threads']} threads, median of {result['steps']} interleaved steps"]
    rows = []
    base = next((x for x in result["rows"] if x["recipe"] == "fp32"), None)
    for x in result["rows"]:
        ov, sp = x["overhead_vs_hand"], x["speedup_vs_fp32"]
        iqr = ("–" if ov is None else
               f"{x['overhead_iqr'][0] * 100:+.1f}..{x['overhead_iqr'][1] * 100:+.1f}%")
        noisy = _noisy(x) or _noisy(base)
        rows.append([x["recipe"], f"{x['step_ms']:.1f}", f"{x['tokens_per_s']:,.0f}",
                     "noisy" if noisy and base else f"{sp:.2f}x" if sp is not None else "–",
                     f"{x['gflops']:.0f}",
                     f"{x['peak_gflops']:.0f}", f"{x['mfu'] * 100:.0f}%",
                     f"{ov * 100:+.1f}%" if ov is not None else "–", iqr,
                     f"{x['model_state_bytes'] / 2**20:.1f}"])
    lines += _aligned(["recipe", "step ms", "tok/s", "vs fp32", "GFLOP/s", "peak", "of peak",
                       "overhead", "(IQR)", "state MiB"], rows)
    lines.append("overhead: median over rounds of (engine step / hand-written step) - 1, "
                 "each round timing the two back to back; IQR: its quartiles")
    lines += [f"timings disagree: {note}; no speed-up is given from them (rerun on an "
              "idle machine)" for note in result.get("timing_noise", [])]
    if result.get("compile"):
        rows = []
        for x in result["rows"]:
            ao, lo_hi, ao_ms = x["vs_torchao"], x["vs_torchao_iqr"], x["torchao_step_ms"]
            rows.append([x["recipe"], f"{x['step_ms']:.1f}", f"{x['compiled_step_ms']:.1f}",
                         f"{x['compile_speedup']:.2f}x", f"{ao_ms:.1f}" if ao else "–",
                         f"{ao:.2f}x" if ao else "–",
                         f"{lo_hi[0]:.2f}..{lo_hi[1]:.2f}" if ao else "–"])
        lines += ["", *_aligned(["recipe", "eager ms", "compiled", "speed-up", "torchao",
                                 "vs torchao", "(IQR)"], rows)]
        lines += [f"torchao beside {x['recipe']} failed: {x['torchao_error']}"
                  for x in result["rows"] if x.get("torchao_error")]
        lines.append("compiled: the model under torch.compile (inductor), interleaved with "
                     "eager; speed-up: eager / compiled; vs torchao: mixprec compiled / "
                     "torchao float8 compiled (tensorwise, or rowwise beside fp8-rowwise), "
                     "paired per round (< 1: faster)")
    lines += [f"kernels {x['recipe']}: {x['kernels']}" for x in result["rows"]]
    lines += [f"peak {x['recipe']}: " + ", ".join(
        f"{p['gemm']} " + (f"failed ({p['error']})" if "error" in p else
                           f"{p['gflops']:.0f} GFLOP/s") +
        f" for {p['share'] * 100:.0f}% of the FLOPs" for p in x["peak_parts"])
        for x in result["rows"] if len(x.get("peak_parts", ())) > 1 or any(
            "error" in p for p in x.get("peak_parts", ()))]
    return "\n".join(lines)


def _noisy(row: dict | None) -> bool:
    return bool(row) and bool(row.get("timing", {}).get("noisy"))


def add_arguments(p) -> None:
    p.add_argument("--recipes", default="fp32,bf16,bf16-master,fp16,fp8")
    p.add_argument("--size", default="base", help="workbench size (base: 6x512)")
    p.add_argument("--model", choices=["gpt", "mlp"], default="gpt")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--compile", action="store_true",
                   help="also time each recipe under torch.compile, and torchao's "
                        "compiled float8 beside the fp8 recipes")
    p.add_argument("--json", action="store_true")


def run(args) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here")
    sep = ";" if ";" in args.recipes or "=" in args.recipes else ","
    result = bench([r for r in args.recipes.split(sep) if r], size=args.size,
                   batch=args.batch, seq=args.seq, steps=args.steps, device=args.device,
                   model=args.model, compile=args.compile)
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0
