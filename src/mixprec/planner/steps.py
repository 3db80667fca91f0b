"""Whole training steps of a model, timed: the planner's baselines and scales.

``measure_step(model, recipe, batch)`` steps a copy of the model under a recipe and
returns its median step time and measured peak. ``measure_steps`` does the same for
several recipes at once, their copies stepped in turn, one step each per round and
the order of the turns reversed every round, so that a machine that slows down or
speeds up during the measurement, or a copy that runs slower for stepping first or
last, moves every recipe's median alike and not their ratio.
"""

from __future__ import annotations

import copy
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mixprec.recipe import Recipe

if TYPE_CHECKING:
    from mixprec.engine import MixedPrecision

__all__ = ["call_loss", "measure_step", "measure_steps", "step_engine"]


def call_loss(model: nn.Module, batch: Any, loss_fn: Callable | None) -> torch.Tensor:
    """The loss of ``model`` on ``batch``: ``loss_fn(model, batch)``, or else the
    model called on the batch (a tuple as positional arguments, a dict as keywords)
    returning a scalar tensor or an object with ``.loss`` (Hugging Face)."""
    if loss_fn is not None:
        loss = loss_fn(model, batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss)
            raise ValueError(f"loss_fn(model, batch) returned {shape}, not a scalar "
                             "tensor: reduce it (e.g. .mean()) to the loss")
        return loss
    out = (model(**batch) if isinstance(batch, dict) else
           model(*batch) if isinstance(batch, (tuple, list)) else model(batch))
    loss = getattr(out, "loss", out)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError("the model's output on sample_batch is not a scalar loss: pass "
                         "loss_fn=lambda model, batch: <scalar loss>")
    return loss


def step_engine(model: nn.Module, recipe: Recipe, fp8_filter: Callable | None = None,
                lr: float = 1e-3) -> MixedPrecision:
    """A ``MixedPrecision`` engine on ``model`` under ``recipe`` with the recipe's
    AdamW (its warnings silenced); ``fp8_filter`` picks the Linears an fp8 recipe
    converts."""
    from mixprec.engine import MixedPrecision
    from mixprec.optim import adamw_for

    opt = adamw_for(recipe, list(model.named_parameters()), lr=lr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return MixedPrecision(model, opt, recipe,
                              fp8_filter=fp8_filter if recipe.linear is not None else None)


def measure_step(model: nn.Module, recipe: Recipe, batch: Any,
                 loss_fn: Callable | None = None, *,
                 fp8_filter: Callable | None = None, steps: int = 4, peak: bool = True
                 ) -> tuple[float, float | None]:
    """Median seconds of a training step of a copy of ``model`` under ``recipe`` (one
    untimed step, then ``steps`` timed) and the step's measured peak bytes
    (``mixprec.memory.measure(peak=True)``; None unless ``peak``)."""
    return measure_steps(model, [(recipe, fp8_filter)], batch, loss_fn, steps=steps,
                         peak=peak)[0]


def measure_steps(model: nn.Module, runs: Sequence[tuple[Recipe, Callable | None]],
                  batch: Any, loss_fn: Callable | None = None, *, steps: int = 4,
                  peak: bool = True) -> list[tuple[float, float | None]]:
    """``measure_step`` for each ``(recipe, fp8_filter)`` of ``runs``, interleaved:
    one copy of ``model`` per run, each stepped once untimed, then ``steps`` rounds of
    one timed step of each copy, the copies' order reversed every round. The median
    step of each copy, and its peak measured after the rounds (``measure_step``)."""
    from mixprec.memory import measure

    if steps < 1:
        raise ValueError(f"measure_steps: steps={steps!r} times nothing; pass steps >= 1")
    copies = []
    for recipe, fp8_filter in runs:
        m = copy.deepcopy(model)
        copies.append((m, step_engine(m, recipe, fp8_filter)))
    dev = next(model.parameters()).device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def one(m, eng):
        with eng.autocast():
            loss = call_loss(m, batch, loss_fn)
        eng.backward(loss)
        eng.step()

    for m, eng in copies:
        one(m, eng)
    times: list[list[float]] = [[] for _ in copies]
    for r in range(steps):
        order = range(len(copies)) if r % 2 == 0 else reversed(range(len(copies)))
        for i in order:
            sync()
            t = time.perf_counter()
            one(*copies[i])
            sync()
            times[i].append(time.perf_counter() - t)
    out = []
    for i in range(len(copies)):
        m, eng = copies[i]
        copies[i] = None  # freed once measured
        high = None
        if peak:
            high = measure(_Bound(m, batch, loss_fn), eng, sample_batch=(), peak=True,
                           loss_fn=lambda out: out).peak
        del m, eng
        out.append((statistics.median(times[i]), high))
    return out


class _Bound(nn.Module):
    """The model with its batch bound: calling it returns the loss (for ``measure``)."""

    def __init__(self, model, batch, loss_fn):
        super().__init__()
        self.model, self.batch, self.loss_fn = model, batch, loss_fn

    def forward(self):
        return call_loss(self.model, self.batch, self.loss_fn)
