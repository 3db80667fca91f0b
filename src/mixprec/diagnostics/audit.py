"""Audits: dtypes against the recipe, the loss-scale history, low-precision coverage
of the matmul FLOPs, and the measured kernel speed of this device."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

from mixprec.diagnostics.findings import Finding
from mixprec.engine.param_state import updated_format
from mixprec.recipe import Recipe

if TYPE_CHECKING:
    from mixprec.engine.facade import MixedPrecision

__all__ = ["audit_dtypes", "audit_scale_history", "matmul_coverage", "audit_kernel_speed",
           "audit_comm"]

_HALF = (torch.float16, torch.bfloat16)


def _name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def audit_dtypes(model: nn.Module, optimizer_or_engine: torch.optim.Optimizer | MixedPrecision,
                 recipe: Recipe | str) -> list[Finding]:
    """Check what is stored in which dtype: model params, what the optimizer updates,
    optimizer states and gradient buffers (the first thing to check: print the dtypes
    and confirm the master is fp32)."""
    r = Recipe.coerce(recipe)
    engine = optimizer_or_engine if hasattr(optimizer_or_engine, "param_state") else None
    opts = engine.optimizers if engine else [optimizer_or_engine]
    out = []
    updated = [p for o in opts for g in o.param_groups for p in g["params"]]
    half_updated = Counter(_name(p.dtype) for p in updated if p.dtype in _HALF)
    if half_updated and updated_format(r) == "fp32":
        n = sum(half_updated.values())
        out.append(Finding(
            "error", "master-dtype",
            f"the optimizer updates {n} {', '.join(half_updated)} parameter(s), not fp32 "
            "masters",
            f"recipe {str(r)!r} expects fp32 master weights; found "
            f"{dict(half_updated)} among {len(updated)} optimizer parameters",
            "updates smaller than half an ulp vanish in 16-bit weights (1e-4 on a bf16 "
            "weight of 1.0 is lost). Build MixedPrecision on the fp32 model with a -master "
            "recipe (e.g. 'bf16-master'), which keeps fp32 masters for the optimizer",
            {"dtypes": dict(half_updated)}))
    states = Counter(_name(v.dtype) for o in opts for st in o.state.values()
                     for k, v in st.items()
                     if isinstance(v, torch.Tensor) and v.dim() > 0 and v.dtype in _HALF)
    if states and r.master == "fp32":
        out.append(Finding("warning", "optimizer-state-dtype",
                           "optimizer states are stored in 16 bits",
                           f"state tensors by dtype: {dict(states)}",
                           "keep Adam moments in fp32: the second moment's tiny values "
                           "underflow in fp16 and lose precision in bf16", {}))
    want = r.param_dtype
    model_dt = Counter(_name(p.dtype) for p in model.parameters())
    if engine is not None and not engine.emulating and r.params != "fp32" and \
            _name(want) not in model_dt:
        out.append(Finding("warning", "param-dtype", "model parameters are not in the "
                           "recipe's working dtype", f"found {dict(model_dt)}, recipe says "
                           f"{r.params}", "let MixedPrecision cast the model (pass the fp32 "
                           "model to it)", {}))
    if engine is not None and engine.param_state.buffers:
        bad = {_name(b.dtype) for b in engine.param_state.buffers} - {r.grads}
        bad -= {"float32"} if r.grads == "fp32" else set()
        if bad:
            out.append(Finding("warning", "grad-dtype", "gradient buffers differ from the "
                               "recipe", f"buffers in {bad}, recipe grads={r.grads}",
                               "accumulate gradients in fp32 (grads=fp32)", {}))
    return out


def audit_scale_history(history: list[float], recipe: Recipe | str) -> list[Finding]:
    """A scale that never moves means overflow handling is not wired (or the scale is
    pinned at a bound). Frequent backoffs mean instability."""
    r = Recipe.coerce(recipe)
    if r.loss_scale != "dynamic" or len(history) < 2:
        return []
    out = []
    n = len(history)
    if n >= 2 * r.growth_interval and len(set(history)) == 1:
        s = history[0]
        pinned = (" — pinned at max_scale" if s >= r.max_scale else
                  " — pinned at min_scale" if s <= r.min_scale else "")
        out.append(Finding(
            "warning", "scale-constant",
            f"the loss scale never changed over {n} steps{pinned}",
            f"scale {s:g} for all {n} steps with growth_interval={r.growth_interval}: a "
            "dynamic scale grows after every clean interval and backs off on overflow",
            "check that the scaled loss is what backward() runs on and that step() sees "
            "the gradients (a flat scale means the overflow detection is not wired). If "
            "it sits at max_scale, raise max_scale or ignore this.",
            {"steps": n, "scale": s}))
    backoffs = sum(1 for a, b in zip(history, history[1:]) if b < a)
    if n >= 20 and backoffs / n > 0.1:
        out.append(Finding(
            "warning", "scale-unstable",
            f"the loss scale backed off {backoffs} times in {n} steps",
            f"{backoffs / n:.0%} of steps overflowed; last scale {history[-1]:g}",
            "overflows this frequent point at the model rather than the scale: lower the "
            "learning rate, check for NaN in the data, keep the overflowing layer in fp32 "
            "(the tracer names it), or use bf16",
            {"backoffs": backoffs, "steps": n}))
    if n >= 10 and all(h <= r.min_scale for h in history[-10:]):
        out.append(Finding("error", "scale-at-min", "the loss scale is stuck at min_scale",
                           f"the last 10 scales are {r.min_scale:g}",
                           "the gradients overflow even unscaled: see the non-finite "
                           "tracer; use bf16", {}))
    return out


def _dtype(t: torch.Tensor) -> torch.dtype:
    """A tensor's dtype as the run computes it: under emulation, fp32 tensors holding a
    16-bit format's values count as that format."""
    from mixprec.engine.emulate import active_mode

    mode = active_mode()
    return mode.carrier if mode is not None and t in mode.virtual else t.dtype


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


class _FlopsByDtype(TorchDispatchMode):
    """FLOPs of matmuls, convolutions and attention by the format of their inputs. An
    exact upcast of an fp8 tensor (the ``dequant`` GEMM routes) counts as fp8."""

    def __init__(self):
        super().__init__()
        self.flops = Counter()
        self.upcast = WeakTensorKeyDictionary()  # fp32/bf16 copies of fp8 tensors

    def _of(self, t: torch.Tensor) -> torch.dtype:
        return self.upcast.get(t, None) or _dtype(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        aten = torch.ops.aten
        if func is aten._to_copy.default and args[0].dtype in _FP8:
            self.upcast[out] = args[0].dtype
        elif func in (aten.mm.default, aten.bmm.default, aten.addmm.default,
                      aten._scaled_mm.default):
            a, b = (args[1], args[2]) if func is aten.addmm.default else (args[0], args[1])
            self.flops[self._of(a)] += 2 * a.numel() * b.shape[-1]
        elif func is aten.convolution.default:
            w = args[1]
            self.flops[_dtype(args[0])] += 2 * out.numel() * w[0].numel()
        elif "scaled_dot_product" in func.__name__ and "backward" not in func.__name__:
            q, k = args[0], args[1]
            self.flops[_dtype(q)] += 4 * q.numel() * k.shape[-2]
        return out


def matmul_coverage(run: Callable[[], Any]) -> dict[str, float]:
    """Share of matmul/conv/attention FLOPs of ``run()`` per input dtype."""
    mode = _FlopsByDtype()
    with mode:
        run()
    total = sum(mode.flops.values()) or 1
    return {_name(k): v / total for k, v in mode.flops.items()}


def audit_kernel_speed(device: torch.device, recipe: Recipe | str
                       ) -> tuple[list[Finding], dict]:
    """Matmul speed in bf16 and fp16 against fp32 here, read as mixprec's ``auto``
    choices read it (``mixprec.engine.devices.speed_reading``: alternating rounds on one
    thread), and what those choices made of it (``mixprec.engine.devices.choices``): an info
    finding where a format has no fast kernel and mixprec already routes around it
    (emulation; fp8's other layers in fp32), a warning where the recipe's own kernels run
    slow (``emulate=false``) or the other 16-bit format is much faster, and an info
    finding instead of a ratio where the rounds disagree (the machine was too busy to
    measure). Never advice to turn on what is already on."""
    from mixprec.engine.devices import choices, speed_reading

    r = Recipe.coerce(recipe)
    dev = str(torch.device(device))
    k = choices(r, dev)
    read = {n: speed_reading(dev, dt) for n, dt in
            (("bf16", torch.bfloat16), ("fp16", torch.float16))}
    facts = {"matmul_speed": {n: v.as_dict() for n, v in read.items()},
             "kernels": k.describe()}
    if r.linear is not None:
        return ([Finding(
            "info", "kernel-emulated",
            f"bf16 has no fast kernel on {dev}: the layers around the fp8 Linears run in "
            "fp32 (faster and more exact here)", k.describe(),
            "nothing to change: on a device with fast bf16 they run in bf16", {})]
            if k.fp8_rest == "fp32" else []), facts
    if r.compute not in ("bf16", "fp16"):
        return [], facts
    mine = read[r.compute]
    other = read["bf16" if r.compute == "fp16" else "fp16"]
    rel = {n: v.ratio for n, v in read.items()}
    if k.emulate:
        why = (f"is pinned to the emulated path by {k.source}" if k.source != "measured"
               else "has emulate=true" if r.emulate else
               f"has no fast kernel on {dev} ({mine})")
        return [Finding(
            "info", "kernel-emulated",
            f"{r.compute} {why}: mixprec emulates it exactly on fp32 kernels",
            k.describe(),
            "nothing to change: the numerics are the format's; on a device with "
            f"{r.compute} units the real kernels run", {"relative": rel})], facts
    found = []
    noisy = [v for v in (mine, other) if v.noisy]
    if noisy:
        found.append(Finding(
            "info", "kernel-noisy",
            "matmul speeds could not be measured here: the machine was too busy",
            "; ".join(str(v) for v in noisy) + f". {k.describe()}",
            "compare formats on an idle machine; the auto choices took the median round",
            {"relative": rel}))
    if not mine.noisy and mine.ratio < 0.5:
        found.append(Finding(
            "warning", "kernel-slow",
            f"{r.compute} matmuls are {1 / mine.ratio:.0f}x slower than fp32 on {dev}",
            f"{mine}; {other}",
            (f"use {other.name} if it is fast here ({other}), or " if not other.noisy
             and other.ratio >= 0.5 else "") + f"emulate {r.compute} exactly on fp32 "
            "kernels (emulate=true, or leave emulate at auto)", {"relative": rel}))
    elif not noisy and other.ratio > 1.5 * mine.ratio:
        found.append(Finding(
            "warning", "kernel-better-dtype",
            f"{other.name} matmuls are {other.ratio / mine.ratio:.1f}x faster than "
            f"{r.compute} on {dev}", f"{mine}; {other}",
            f"use the {other.name} recipe here" + (" (no loss scaling needed: fp32's "
                                                  "range)" if other.name == "bf16" else ""),
            {"relative": rel}))
    return found, facts


def audit_comm(engine: MixedPrecision) -> list[Finding]:
    """A ``comm-fallback`` warning where the engine's ``comm_stats`` holds fallbacks:
    what a low-precision format's communication sent in 16 bits instead, and why."""
    stats = getattr(engine, "comm_stats", None)
    falls = list(getattr(stats, "fallbacks", None) or [])
    if not falls:
        return []
    names = ", ".join(f"{f.what} ({f.asked}, sent as {_name(f.sent)})" for f in falls[:4])
    more = f" and {len(falls) - 4} more" if len(falls) > 4 else ""
    whys = sorted({f.why for f in falls})
    return [Finding(
        "warning", "comm-fallback",
        f"{len(falls)} tensor(s) communicated in 16 bits, not as their format's codes",
        f"{names}{more}: {'; '.join(whys[:3])}",
        "give those layers shapes whose shards line up with the format's blocks (the "
        "reason says which multiple), or another format for them in layer: rules; the "
        "run is correct either way, it only sends more bytes",
        {"fallbacks": [{"what": f.what, "asked": f.asked, "sent": str(f.sent),
                        "why": f.why} for f in falls]})]
