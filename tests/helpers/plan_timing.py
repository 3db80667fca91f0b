"""Plans of the tiny workbench GPT in seconds: the planner's measured speeds replaced by
fixed ones (every fp8 format twice bf16's speed, experts modules' too), its numerics
and loss check real."""

from __future__ import annotations

import contextlib
import importlib

import pytest

from mixprec.planner.choose import STATE_ORDER, Baselines
from mixprec.planner.timing import BF16, LayerCost

#: a few candidates keep the numerics quick
FORMATS = ("bf16", "fp8-current", "mxfp8")
TINY = dict(size="tiny", batch=4, seq=None, seed=0)


def _costs(shapes, formats, recipe, device, *, seconds=0.25, cache_file=None):
    def seconds(shape, f):  # MXFP8 the quickest on the wide Linears (out >= 256)
        return 1e-3 if f == BF16 else 4e-4 if f == "mxfp8" and shape[1] >= 256 else 5e-4
    return {(s, f): LayerCost(seconds(s, f), 1000, "fixed") for s in shapes for f in formats}


def _experts_costs(modules, formats, recipe, device, *, seconds=0.25, cache_file=None):
    """Every experts module's fp8/fp4 formats at 2x bf16's speed, as the Linears'."""
    return {(s, f): LayerCost(1e-3 if f == BF16 else 5e-4, 1000, "fixed")
            for s in modules for f in formats}


def _baselines(model, b, shell, batch, loss_fn, state_formats, device):
    return Baselines(0.1, 1e6, 0.09, 1e6, {f: 1e-9 for f in ("fused", *STATE_ORDER)})


def fixed_timing(mp: pytest.MonkeyPatch) -> None:
    """Replace the planner's timing (per-shape GEMMs, whole-model steps) on ``mp``, in
    whichever of the planner's modules call them."""
    import mixprec.planner

    patched = 0
    for name in ("survey", "planning"):
        try:  # the module, not the function mixprec.planner re-exports as ``plan``
            mod = importlib.import_module(f"mixprec.planner.{name}")
        except ImportError:
            continue
        for attr, fake in (("layer_costs", _costs), ("_baselines", _baselines),
                           ("_time_scales", lambda *a: {}),
                           ("experts_costs", _experts_costs)):
            if hasattr(mod, attr):
                mp.setattr(mod, attr, fake)
                patched += 1
    assert patched == 4, f"the planner's timing moved: {mixprec.planner.__file__}"


@contextlib.contextmanager
def fixed_timing_ctx():
    """``fixed_timing`` for a module-scoped fixture."""
    with pytest.MonkeyPatch.context() as mp:
        fixed_timing(mp)
        yield
