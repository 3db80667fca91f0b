"""Whole training steps of a model, timed: the planner's baselines and scales.

``measure_step(model, recipe, batch)`` steps a copy of the model under a recipe and
returns its median step time and measured peak. ``measure_steps`` does the same for
several recipes at once, their copies stepped in turn, one step each per round and
the order of the turns reversed every round, so that a machine that slows down or
speeds up during the measurement, or a copy that runs slower for stepping first or
last, moves every recipe's median alike and not their ratio.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.recipe import Recipe

if TYPE_CHECKING:
    from mixprec.engine.facade import MixedPrecision

__all__ = ["call_loss", "default_loss", "measure_step", "measure_steps", "step_engine",
           "each_step", "first_step"]

#: called after every whole-model step ``measure_steps`` takes (``each_step``)
_STEP_HOOK: ContextVar[Callable[[], None] | None] = ContextVar("mixprec_step_hook",
                                                               default=None)


@contextlib.contextmanager
def each_step(hook: Callable[[], None]) -> Iterator[None]:
    """Within the block, ``hook()`` runs after every step ``measure_steps`` takes
    (untimed, timed, and each peak measured): the planner's progress counts them."""
    token = _STEP_HOOK.set(hook)
    try:
        yield
    finally:
        _STEP_HOOK.reset(token)


def _stepped() -> None:
    hook = _STEP_HOOK.get()
    if hook is not None:
        hook()


def call_loss(model: nn.Module, batch: Any, loss_fn: Callable | None) -> torch.Tensor:
    """The loss of ``model`` on ``batch``: ``loss_fn(model, batch)``, or else the
    model called on the batch (a tuple as positional arguments, a dict as keywords)
    returning a scalar tensor or an object with ``.loss`` (Hugging Face). A pair
    ``(x, y)`` for a model whose forward takes one input (``nn.Sequential``) is an
    input and its target: the loss is ``default_loss(model(x), y)``."""
    if loss_fn is not None:
        loss = loss_fn(model, batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss)
            raise ValueError(f"loss_fn(model, batch) returned {shape}, not a scalar "
                             "tensor: reduce it (e.g. .mean()) to the loss")
        return loss
    if _input_and_target(model, batch):
        return default_loss(model(batch[0]), batch[1])
    out = (model(**batch) if isinstance(batch, dict) else
           model(*batch) if isinstance(batch, (tuple, list)) else model(batch))
    loss = getattr(out, "loss", out)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"the model's output on sample_batch is {got}, not a scalar "
                         "loss: pass a batch (x, y) of an input and its target (class "
                         "indices: cross-entropy; a float tensor of the output's shape: "
                         "mean squared error), or loss_fn=lambda model, batch: <scalar "
                         "loss>")
    return loss


def _input_and_target(model: nn.Module, batch: Any) -> bool:
    """Whether ``batch`` is a pair of tensors and ``model``'s forward takes exactly one
    positional input (so the pair cannot be its arguments)."""
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2
            and all(isinstance(t, torch.Tensor) for t in batch)):
        return False
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    kinds = [p.kind for p in params]
    if inspect.Parameter.VAR_POSITIONAL in kinds:
        return False
    return sum(k in (inspect.Parameter.POSITIONAL_ONLY,
                     inspect.Parameter.POSITIONAL_OR_KEYWORD) for k in kinds) == 1


def default_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The loss of an output against its target when no ``loss_fn`` is given:
    cross-entropy for integer class indices (``out``'s last dim the classes, the rest
    matching ``target``), mean squared error for a float target of ``out``'s shape."""
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"the model's output is a {type(out).__name__}, not a tensor: "
                         "pass loss_fn=lambda model, batch: <scalar loss>")
    if not target.is_floating_point() and not target.is_complex():
        if out.dim() >= 1 and out.shape[:-1] == target.shape:
            return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
    elif out.shape == target.shape:
        return F.mse_loss(out, target.to(out.dtype))
    raise ValueError(
        f"the model's output {tuple(out.shape)} does not fit the target "
        f"{tuple(target.shape)} ({target.dtype}): for cross-entropy the target holds "
        "class indices of the output's shape less its last dim, for mean squared error "
        "a float tensor of the output's shape; or pass loss_fn=lambda model, batch: "
        "<scalar loss>")


def step_engine(model: nn.Module, recipe: Recipe, fp8_filter: Callable | None = None,
                lr: float = 1e-3) -> MixedPrecision:
    """A ``MixedPrecision`` engine on ``model`` under ``recipe`` with the recipe's
    AdamW (its warnings silenced); ``fp8_filter`` picks the Linears an fp8 recipe
    converts."""
    from mixprec.engine.facade import MixedPrecision
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
        _stepped()

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
            _stepped()
        del m, eng
        out.append((statistics.median(times[i]), high))
    return out


def first_step(model: nn.Module, recipe: Recipe, batch: Any,
               loss_fn: Callable | None = None) -> float:
    """Seconds of one training step of a copy of ``model`` under ``recipe``, after one
    untimed step (a process's very first step builds its caches and can take 10x
    longer), for the planner's estimate of its own time."""
    m = copy.deepcopy(model)
    eng = step_engine(m, recipe)
    dev = next(model.parameters()).device
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    t = 0.0
    for _ in range(2):
        sync()
        t = time.perf_counter()
        with eng.autocast():
            loss = call_loss(m, batch, loss_fn)
        eng.backward(loss)
        eng.step()
        sync()
    return time.perf_counter() - t


class _Bound(nn.Module):
    """The model with its batch bound: calling it returns the loss (for ``measure``)."""

    def __init__(self, model, batch, loss_fn):
        super().__init__()
        self.model, self.batch, self.loss_fn = model, batch, loss_fn

    def forward(self):
        return call_loss(self.model, self.batch, self.loss_fn)
