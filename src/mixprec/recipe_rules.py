"""The rules a ``Recipe`` obeys: numbers in range, combinations that cannot train
(errors), and combinations that run but buy nothing (warnings). ``Recipe`` calls them
on construction; they read the recipe's fields and nothing else of mixprec.
"""

from __future__ import annotations

import math
import warnings

__all__ = ["MX_COMPUTE", "check_numbers", "refuse_impossible", "warn_useless"]

#: compute formats that mean OCP MX block scaling (emulated: no torch kernels for them)
MX_COMPUTE = ("fp8_e4m3", "fp8_e5m2", "fp6_e3m2", "fp6_e2m3", "fp4_e2m1")


def check_numbers(r) -> None:
    """Each number in range: scales finite and positive, factors and counts valid."""
    def need(ok: bool, name: str, rule: str) -> None:
        if not ok:
            raise ValueError(f"recipe field {name!r}: {getattr(r, name)!r} is invalid; "
                             f"it must be {rule}")

    for name in ("init_scale", "min_scale", "max_scale"):
        v = getattr(r, name)
        need(isinstance(v, (int, float)) and math.isfinite(v) and v > 0, name,
             "a finite number > 0")
    for name in ("growth_factor", "backoff_factor"):
        v = getattr(r, name)
        need(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
             name, "a finite number")
    # a growth factor of 1e30 reaches max_scale in one step, inf never comes back
    need(1 < r.growth_factor <= 2.0**24, "growth_factor", "> 1 and <= 2^24")
    need(0 < r.backoff_factor < 1, "backoff_factor", "between 0 and 1 (exclusive)")
    need(r.min_scale <= r.max_scale, "min_scale", f"<= max_scale ({r.max_scale})")
    if r.loss_scale != "none":
        need(r.min_scale <= r.init_scale <= r.max_scale, "init_scale",
             f"within [min_scale, max_scale] = [{r.min_scale}, {r.max_scale}]")
    for name, lo in (("growth_interval", 1), ("hysteresis", 1), ("skip_limit", 0),
                     ("amax_history_len", 1), ("margin", 0), ("bf16_last_layers", 0)):
        v = getattr(r, name)
        need(isinstance(v, int) and not isinstance(v, bool) and v >= lo, name,
             f"an integer >= {lo}")
    need(isinstance(r.bf16_last_fraction, (int, float)) and not isinstance(
        r.bf16_last_fraction, bool) and 0 <= r.bf16_last_fraction < 1,
        "bf16_last_fraction", "a share in [0, 1) (0.15: the last 15% of the Linears)")
    need(r.emulate is None or isinstance(r.emulate, bool), "emulate",
         "true, false or auto")
    for name in ("nvfp4_2d", "nvfp4_rht", "nvfp4_sr", "fp8_all_gather"):
        need(isinstance(getattr(r, name), bool), name, "true or false")

def refuse_impossible(r) -> None:
    """Combinations that cannot train, or that mixprec cannot run: an error each."""
    if r.compute in MX_COMPUTE and r.emulate is False:
        raise ValueError(
            f"recipe: compute={r.compute!r} (MX block scaling) has no torch kernels; "
            "it runs emulated only. Drop emulate=false (or set emulate=true).")
    if r.compute == "fp8" and r.fp8_all_gather and r.fp8_scaling not in ("delayed",
                                                                          "current"):
        raise NotImplementedError(
            f"recipe: fp8_all_gather with fp8_scaling={r.fp8_scaling}: the fp8 "
            "all-gather is built for per-tensor scales (delayed, current), which every "
            "rank knows before the gather. Use fp8_scaling=delayed or current, or drop "
            "fp8_all_gather.")
    if r.compute == "fp8" and r.params == "fp16":
        raise ValueError(
            "recipe: compute='fp8' with params='fp16' is not supported: fp8 runs the "
            "rest of the model under bf16 autocast. Use params=fp32 or params=bf16."
        )
    if r.params == "fp16" and r.master == "none" and r.loss_scale == "none":
        raise ValueError(
            "recipe: params='fp16' with master='none' and loss_scale='none' cannot train: "
            "fp16 gradients underflow and fp16 weights swallow small updates. "
            "Set master=fp32 and loss_scale=dynamic (preset 'fp16-master'), or use bf16."
        )
    if r.grads == "fp16" and r.loss_scale == "none":
        raise ValueError(
            "recipe: grads='fp16' with loss_scale='none' loses every gradient below "
            "6e-8. Set loss_scale=dynamic, or grads=fp32 (the default)."
        )
    if r.write != "nearest" and (r.params == "fp32" or r.master == "fp32"):
        raise ValueError(
            f"recipe: write={r.write!r} with params={r.params!r}, master={r.master!r}: "
            "write rules are for 16-bit weights without an fp32 master (with a master "
            "or fp32 weights every update is kept already). Use params=bf16 (or fp16) "
            "with master=none, or drop write.")
    if r.write == "remainder" and r.params != "bf16":
        raise ValueError(
            f"recipe: write='remainder' with params={r.params!r}: the int16 remainder "
            "completes a bf16 weight to fp32. Use params=bf16, or write=kahan / "
            "stochastic for fp16 weights.")
    if r.wgrad == "fp32" and r.grads != "fp32":
        raise ValueError(
            f"recipe: wgrad='fp32' with grads={r.grads!r}: fp32 weight gradients need "
            "fp32 buffers to land in. Set grads=fp32 (the default), or drop wgrad.")

def warn_useless(r, defaults: dict) -> None:
    """Combinations that run but buy nothing (or cost something): a warning each."""
    if r.wgrad == "fp32" and not r.uses_autocast:
        warnings.warn(
            f"recipe: wgrad='fp32' with compute={r.compute!r}: weight gradients are "
            "fp32 already. It is harmless; drop wgrad.", stacklevel=3)
    if r.loss_scale != "none" and "fp16" not in (r.compute, r.params, r.grads) \
            and r.compute not in MX_COMPUTE:
        warnings.warn(
            f"recipe: loss_scale={r.loss_scale!r} with compute={r.compute!r}: "
            "nothing is stored in fp16, so scaling buys nothing (bf16 has fp32's "
            "range). It is harmless; set loss_scale=none to drop it.",
            stacklevel=3,
        )
    if r.params == "fp16" and r.master == "none" and r.write == "nearest":
        warnings.warn(
            "recipe: params='fp16' with master='none' keeps the optimizer's states in "
            "fp16 too: Adam's second moment underflows there and its updates blow up, "
            "and updates below half an fp16 ulp vanish. Prefer 'fp16-master'.",
            stacklevel=3,
        )
    fp8_fields = ("fp8_scaling", "fp8_format", "amax_history_len", "amax_compute_algo",
                  "margin", "fp8_gemm", "block_scales", "mx_rounding", "nvfp4_2d",
                  "nvfp4_rht", "nvfp4_sr", "bf16_last_layers", "bf16_last_fraction",
                  "fp8_all_gather")
    changed = [n for n in fp8_fields if getattr(r, n) != defaults[n]]
    if r.compute != "fp8" and changed:
        warnings.warn(
            f"recipe: {', '.join(changed)} set with compute={r.compute!r}: the fp8 "
            "settings apply to compute=fp8 only. It is harmless; drop them, or use an "
            "fp8 recipe ('fp8', 'fp8-current', 'fp8-rowwise').", stacklevel=3)
    history = [n for n in ("amax_history_len", "amax_compute_algo")
               if getattr(r, n) != defaults[n]]
    if r.compute == "fp8" and r.fp8_scaling != "delayed" and history:
        warnings.warn(
            f"recipe: {', '.join(history)} with fp8_scaling={r.fp8_scaling!r}: amax "
            "histories belong to delayed scaling; current and rowwise scales come from "
            "the tensor at cast time. It is harmless; drop them, or use "
            "fp8_scaling=delayed.", stacklevel=3)
    for field, scaling in (("block_scales", "block"), ("mx_rounding", "mx"),
                           ("nvfp4_2d", "nvfp4"), ("nvfp4_rht", "nvfp4"),
                           ("nvfp4_sr", "nvfp4")):
        if r.compute == "fp8" and getattr(r, field) != defaults[field] \
                and r.fp8_scaling != scaling:
            warnings.warn(
                f"recipe: {field} with fp8_scaling={r.fp8_scaling!r}: it applies to "
                f"fp8_scaling={scaling} only. It is harmless; drop it.", stacklevel=3)
    if r.compute == "fp8" and r.fp8_scaling == "mx" and r.margin != defaults["margin"]:
        warnings.warn(
            "recipe: margin with fp8_scaling='mx': MX scales are powers of two chosen by "
            "mx_rounding, not fp8 max / amax / 2^margin. It is harmless; drop it, or use "
            "mx_rounding=ceil to keep casts from saturating.", stacklevel=3)
    if r.master == "fp32" and r.params == "fp32":
        warnings.warn(
            "recipe: master='fp32' with params='fp32' keeps a second fp32 copy of "
            "every weight for nothing; set master=none.",
            stacklevel=3,
        )
