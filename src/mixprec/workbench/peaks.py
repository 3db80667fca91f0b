"""The peak GEMM rate each ``mixprec bench`` row is measured against.

A row's peak is the rate of the GEMMs its step really runs, each measured on a large
GEMM (8192² on CUDA, 2048² on a CPU) under the recipe's own precision settings:

- the dense layers: fp32 as the user set it (``fp32``: a process-wide TF32 or bf16
  setting counts), TF32 under the ``tf32`` recipe's settings, IEEE fp32 where the
  format is emulated (emulation pins it), bf16 or fp16 otherwise; an fp8 recipe's
  other layers in ``fp8_rest`` (bf16, or fp32 as set);
- each Float8Linear on the route the engine reports it takes
  (``engine.kernels.gemm_for(scaling)``), timed through its quantizer's own ``mm`` on
  its casts: ``torch._scaled_mm`` per tensor or rowwise, the block-scaled kernels, or
  the dequantizing bf16 / IEEE fp32 GEMMs (256² for ``scaled_mm`` on a CPU, where it
  may be a reference kernel).

With several, the peak is the rate the step's FLOPs would run at if each GEMM ran at
its own peak: ``sum(flops) / sum(flops_i / peak_i)``, each Float8Linear counted
``6 · in · out`` FLOPs per token and the rest of the step's FLOPs at the dense rate.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from mixprec.engine.devices import KernelChoices, best_time, matmul_gflops
from mixprec.formats import elements as formats
from mixprec.formats.fp32_precision import ieee_fp32_matmul, tf32
from mixprec.modules.linear import fp8_modules
from mixprec.recipe import Recipe
from mixprec.recipe.linear_format import Quantizer, quantizer_for

__all__ = ["peak_gflops", "peak_parts", "combined_peak", "dense_kind", "dense_gflops",
           "fp8_gflops"]

_HALF = ("bf16", "fp16")


def dense_kind(recipe: Recipe | str, kernels: KernelChoices | None = None) -> str:
    """What a recipe's dense (not fp8) GEMMs run as: ``fp32`` (as set), ``ieee``
    (pinned: emulation), ``tf32``, ``bf16`` or ``fp16``."""
    r = Recipe.coerce(recipe)
    if (kernels is not None and kernels.emulate) or r.is_mx:
        return "ieee"
    if r.linear is not None:
        rest = kernels.fp8_rest if kernels is not None else "bf16"
        return "bf16" if rest == "bf16" else "fp32"
    compute = r.precision.compute
    return compute if compute in ("fp32", "tf32", "bf16", "fp16") else "ieee"


def _size(dev: torch.device) -> int:
    return 8192 if dev.type == "cuda" else 2048


def dense_gflops(device: str, kind: str) -> float:
    """GFLOP/s of a large GEMM of ``dense_kind`` ``kind`` on ``device``, under the
    settings that kind runs with (``ieee`` pinned, ``tf32`` the recipe's)."""
    dev = torch.device(device)
    pin = (ieee_fp32_matmul() if kind == "ieee" else tf32() if kind == "tf32"
           else contextlib.nullcontext())
    dtype = formats.dtype_of(kind) if kind in _HALF else torch.float32
    with pin:  # uncached: the cache's key does not hold the precision setting
        return matmul_gflops.__wrapped__(str(dev), dtype, _size(dev), 0.5)


def fp8_gflops(device: str, quantizer: Quantizer, route: str, out_dtype: torch.dtype
               ) -> float:
    """GFLOP/s of ``quantizer``'s forward GEMM on ``route`` (``mm`` on its casts of two
    n×n operands, output in ``out_dtype``), under its own ``gemm_context``."""
    dev = torch.device(device)
    n = 256 if dev.type == "cpu" and route == "scaled_mm" else _size(dev)
    g = torch.Generator().manual_seed(0)
    x, w = (torch.randn(n, n, generator=g).to(dev) for _ in range(2))
    state = {k: t for k, (t, _) in quantizer.buffers(dev).items()}
    with torch.no_grad(), torch.autocast(dev.type, enabled=False), quantizer.gemm_context():
        xq = quantizer.cast(x, "input", 1, state)
        wq = quantizer.cast(w, "weight", 1, state).t()
        return 2 * n**3 / best_time(lambda: quantizer.mm(xq, wq, out_dtype, route), dev, 0.5) / 1e9


def peak_parts(device: str, recipe: Recipe | str, kernels: KernelChoices | None = None,
               model: nn.Module | None = None, tokens: int = 0, flops: float = 0.0,
               memo: dict | None = None) -> list[dict]:
    """The GEMMs of a row's peak: ``{"gemm", "flops", "gflops"}`` each (module doc).

    With ``model`` (its Float8Linears), ``tokens`` per step and the step's ``flops``:
    each Float8Linear's route and the dense rest, by FLOPs. Without: an fp8 recipe's
    own scaling on its route alone, or the dense kind. ``memo`` keeps measured rates
    between rows. A route whose GEMM raises when timed (a kernel this device lacks,
    reported as taken) reads NaN GFLOP/s with its ``"error"``, so the row shows it
    instead of the benchmark losing every row."""
    r = Recipe.coerce(recipe)
    if model is not None and not (tokens > 0 and flops > 0):
        raise ValueError(f"peak of a model's step: tokens={tokens} and flops={flops} must "
                         "both be > 0 (the tokens and FLOPs of one step)")
    memo = {} if memo is None else memo
    dense = dense_kind(r, kernels)
    out_dtype = torch.bfloat16 if dense == "bf16" else torch.float32  # the forward's
    routes: dict[tuple, float] = {}
    if model is not None:
        for m in fp8_modules(model).values():
            key = (m.quantizer, _route(kernels, m.quantizer, device))
            routes[key] = routes.get(key, 0.0) + 6 * m.in_features * m.out_features * tokens
    elif r.linear is not None:
        q = quantizer_for(r)
        routes[(q, _route(kernels, q, device))] = 1.0
    parts = []
    rest = flops - sum(routes.values()) if model is not None else 0.0 if routes else 1.0
    if rest > 0:
        key = ("dense", dense)
        if key not in memo:
            memo[key] = dense_gflops(device, dense)
        parts.append({"gemm": dense if dense != "ieee" else "fp32 (IEEE)", "flops": rest,
                      "gflops": memo[key]})
    for (q, route), f in routes.items():
        key = ("fp8", q, route, out_dtype)
        if key not in memo:
            try:
                memo[key] = fp8_gflops(device, q, route, out_dtype), None
            except RuntimeError as e:
                memo[key] = math.nan, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        rate, error = memo[key]
        parts.append({"gemm": f"{q.name} {route}", "flops": f, "gflops": rate,
                      **({"error": error} if error else {})})
    return parts


def _route(kernels: KernelChoices | None, quantizer: Quantizer, device: str) -> str:
    """The route the engine reports for Linears of ``quantizer``'s scaling; without
    one (or for a recipe that is not fp8), the quantizer's own ``auto`` choice here."""
    route = kernels.gemm_for(quantizer.name) if kernels is not None else None
    return route or quantizer.route(device, "auto")


def peak_gflops(device: str, recipe: Recipe | str, kernels: KernelChoices | None = None,
                model: nn.Module | None = None, tokens: int = 0, flops: float = 0.0,
                memo: dict | None = None) -> float:
    """The peak GFLOP/s a row of ``recipe`` is measured against: ``peak_parts``
    combined, ``sum(flops) / sum(flops / gflops)`` (the module doc)."""
    return combined_peak(peak_parts(device, recipe, kernels, model, tokens, flops, memo))


def combined_peak(parts: list[dict]) -> float:
    """The rate of ``peak_parts``' FLOPs, each at its GEMM's peak:
    ``sum(flops) / sum(flops / gflops)``."""
    return sum(p["flops"] for p in parts) / sum(p["flops"] / p["gflops"] for p in parts)
