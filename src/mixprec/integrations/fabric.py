"""Fabric under a mixprec recipe: ``setup_fabric`` in place of ``fabric.setup``.

**Fabric** has no precision hook that sees the model and its optimizer together, which
the engine needs for its masters, so it gets ``setup_fabric`` in place of
``fabric.setup``::

    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp"); fabric.launch()
    model, optimizer = setup_fabric(fabric, model, optimizer, recipe="bf16-master")
    loss = model(x, y)          # the forward runs under the recipe
    fabric.backward(loss)       # engine.backward
    fabric.clip_gradients(model, optimizer, max_norm=1.0)   # engine.clip_grad_norm_
    optimizer.step()            # engine.step; optimizer.zero_grad() does nothing
    fabric.save(path, {"mixprec": optimizer.engine, ...})   # fabric.load restores it
    fabric.save(path, {"model": model, "optimizer": optimizer})  # the fp32 masters
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mixprec.engine.facade import MixedPrecision
from mixprec.integrations._proxies import EngineOptimizer, EngineScheduler, autocast_forward
from mixprec.recipe import Recipe

if TYPE_CHECKING:
    from lightning.fabric import Fabric
    from torch.optim.lr_scheduler import LRScheduler

__all__ = ["setup_fabric"]


class _Weights:
    """Stands in for the model in ``fabric.save`` / ``fabric.load``: its state is the
    engine's export (the fp32 masters), and loading sets masters and working copy."""

    def __init__(self, engine: MixedPrecision) -> None:
        self.engine = engine

    def state_dict(self) -> dict:
        return self.engine.export_state_dict()

    def load_state_dict(self, weights: dict) -> None:
        self.engine.load_fp32_state_dict(weights)


def _route_fabric_checkpoints(fabric, engine: MixedPrecision) -> None:
    """``fabric.save(path, {"model": model, "optimizer": optimizer, ...})``, as Fabric's
    guide writes it: the model's entry is the fp32 masters (``export_state_dict``, so it
    loads strictly into the plain model), the optimizer's is the wrapped optimizer's
    state; ``fabric.load`` of the same dict sets the masters and the working copy from
    it. The engine itself (``{"mixprec": engine}``) still carries the whole state."""
    inner_save, inner_load = fabric.save, fabric.load
    mine = {id(engine.model), id(engine.module)}

    def swap(state):
        if state is None:
            return None, ()
        routed = [k for k, v in state.items() if id(v) in mine]
        return {k: (_Weights(engine) if k in routed else v) for k, v in state.items()}, routed

    def save(path, state, filter=None):
        swapped, _ = swap(state)
        return inner_save(path, swapped, filter=filter)

    def load(path, state=None, strict=True, **kwargs):
        swapped, routed = swap(state)
        remainder = inner_load(path, swapped, strict=strict, **kwargs)
        if state is not None:  # Fabric writes loaded plain values back into the dict
            for k, v in swapped.items():
                if k not in routed:
                    state[k] = v
        return remainder

    fabric.save, fabric.load = save, load


def setup_fabric(fabric: Fabric, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 recipe: Recipe | str, scheduler: LRScheduler | None = None,
                 grad_accum_steps: int = 1, parallel: str = "ddp", **engine_kwargs: Any
                 ) -> (tuple[nn.Module, EngineOptimizer]
                       | tuple[nn.Module, EngineOptimizer, EngineScheduler]):
    """``fabric.setup`` for a mixprec ``recipe``: ``(module, optimizer)``, plus the
    scheduler if one is given.

    The model moves to ``fabric.device`` and a ``MixedPrecision`` engine is built over
    it and ``optimizer`` (``parallel`` when ``fabric.world_size > 1``: the engine's own
    DDP or FSDP, so every rank agrees on each skipped step). The module's forward runs
    under ``engine.autocast()``; ``fabric.backward(loss)`` becomes ``engine.backward``;
    the returned optimizer's ``step()`` is ``engine.step()`` (``.engine`` is the
    engine) and its ``zero_grad()`` does nothing. With ``grad_accum_steps=k`` the
    engine divides each loss by k, reduces once per window and updates on the k-th
    backward: call ``optimizer.step()`` on every micro-batch or, as Fabric's guide
    does, only at the window's end, with the micro-batches before it under
    ``fabric.no_backward_sync(model, enabled=...)``.
    ``fabric.clip_gradients(model, optimizer, max_norm=...)`` is
    ``engine.clip_grad_norm_``. A ``scheduler`` is stepped by the engine after
    each applied update; the returned one's ``step()`` does nothing. ``fabric.save`` /
    ``fabric.load`` carry the engine's whole state when it is in the state dict; the
    model's entry (``{"model": model}``) is the fp32 masters, and loading it sets the
    masters and the working copy.

    Fabric's own precision must stay ``"32-true"``: the recipe is the precision."""
    if str(getattr(fabric.strategy.precision, "precision", "32-true")) != "32-true":
        raise ValueError(
            f"Fabric(precision={fabric.strategy.precision.precision!r}) would add "
            "Fabric's autocast on top of the recipe; build Fabric with the default "
            "precision ('32-true') and let the recipe set it")
    if parallel not in ("ddp", "fsdp"):
        raise ValueError(f"parallel={parallel!r}; valid: ddp, fsdp")
    model.to(fabric.device)
    engine = MixedPrecision(model, optimizer, recipe, grad_accum_steps=grad_accum_steps,
                            scheduler=scheduler,
                            parallel=parallel if fabric.world_size > 1 else None,
                            **engine_kwargs)
    autocast_forward(engine.model, engine)

    no_sync = {"on": False}  # inside fabric.no_backward_sync(model, enabled=True)

    def backward(loss, *args, model=None, **kwargs):
        if args or set(kwargs) - {"retain_graph"}:
            raise TypeError("fabric.backward under mixprec takes the loss (and "
                            "retain_graph) only")
        engine.backward(loss, retain_graph=kwargs.get("retain_graph", False),
                        last=False if no_sync["on"] else None)

    inner_no_sync = fabric.no_backward_sync

    @contextlib.contextmanager
    def no_backward_sync(module, enabled: bool = True):
        if module is not engine.model:
            with inner_no_sync(module, enabled=enabled):
                yield
            return
        if enabled and engine.grad_accum_steps == 1:
            raise ValueError(
                "fabric.no_backward_sync(model) under mixprec: give setup_fabric "
                "grad_accum_steps=k, the accumulation window's length; the engine then "
                "reduces once per window (inside no_backward_sync or not) and updates "
                "on its k-th backward")
        no_sync["on"] = bool(enabled)
        try:
            yield
        finally:
            no_sync["on"] = False

    fabric.backward = backward
    fabric.no_backward_sync = no_backward_sync
    inner_clip = fabric.clip_gradients

    def clip_gradients(module, optimizer, clip_val=None, max_norm=None, norm_type=2.0,
                       error_if_nonfinite=True):
        if getattr(optimizer, "engine", None) is not engine:
            return inner_clip(module, optimizer, clip_val=clip_val, max_norm=max_norm,
                              norm_type=norm_type, error_if_nonfinite=error_if_nonfinite)
        if clip_val is not None:
            raise NotImplementedError(
                "fabric.clip_gradients(clip_val=...) under a mixprec recipe: the engine "
                "clips by norm, on the unscaled fp32 gradients inside its step. Use "
                "fabric.clip_gradients(model, optimizer, max_norm=...).")
        if max_norm is None:
            raise ValueError("fabric.clip_gradients needs max_norm (or clip_val)")
        # the true norm; an overflow returns inf and the step is skipped, never raises
        return engine.clip_grad_norm_(float(max_norm), norm_type)

    fabric.clip_gradients = clip_gradients
    proxy = EngineOptimizer(engine, optimizer)
    _route_fabric_checkpoints(fabric, engine)
    out = (engine.model, proxy)
    return out + (EngineScheduler(scheduler),) if scheduler is not None else out
