"""The rules a recipe obeys: loss-scale numbers in range, combinations that cannot
train (errors), and combinations that run but buy nothing (warnings). The recipe's
configs call them on construction; they read fields and nothing else of mixprec.
"""

from __future__ import annotations

import math
import warnings

__all__ = ["check_loss_numbers", "refuse_impossible", "warn_useless"]

def check_loss_numbers(r) -> None:
    """Each number of a loss-scale config in range: scales finite and positive, factors
    and counts valid."""
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
    if r.kind != "none":
        need(r.min_scale <= r.init_scale <= r.max_scale, "init_scale",
             f"within [min_scale, max_scale] = [{r.min_scale}, {r.max_scale}]")
    for name, lo in (("growth_interval", 1), ("hysteresis", 1), ("skip_limit", 0)):
        v = getattr(r, name)
        need(isinstance(v, int) and not isinstance(v, bool) and v >= lo, name,
             f"an integer >= {lo}")


def refuse_impossible(r) -> None:
    """Combinations that cannot train, or that mixprec cannot run: an error each."""
    if r.linear is not None and r.params == "fp16":
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

def warn_useless(r) -> None:
    """Combinations that run but buy nothing (or cost something): a warning each."""
    if r.wgrad == "fp32" and not r.uses_autocast:
        warnings.warn(
            f"recipe: wgrad='fp32' with compute={r.compute!r}: weight gradients are "
            "fp32 already. It is harmless; drop wgrad.", stacklevel=3)
    if r.loss_scale != "none" and "fp16" not in (r.compute, r.params, r.grads) \
            and not r.is_mx:
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
    if r.master == "fp32" and r.params == "fp32":
        warnings.warn(
            "recipe: master='fp32' with params='fp32' keeps a second fp32 copy of "
            "every weight for nothing; set master=none.",
            stacklevel=3,
        )
