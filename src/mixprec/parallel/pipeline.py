"""Pipeline parallelism as torch writes it (``torch.distributed.pipelining``).

Each rank builds its engine over its stage's module(s) with ``parallel="pp"``; torch's
schedule runs the forward and the backward of every micro-batch, so the engine meets
the gradients in flight instead of in ``engine.backward``::

    engine = mixprec.MixedPrecision(stage_module, opt, recipe="bf16-master",
                                    parallel="pp", grad_accum_steps=n_microbatches)
    stage = PipelineStage(stage_module, rank, world, device,
                          *stage_args(stage_module, sample, engine))
    schedule = Schedule1F1B(stage, n_microbatches, loss_fn=engine.pipeline_loss(loss_fn))
    with engine.autocast():
        schedule.step(x) / schedule.step(target=y, losses=losses)
    engine.step()

What the ``PP`` mode does at each moment of the step:

- the loss (``PipelineLoss``, the last stage's): ``loss * scale / grad_accum_steps``, so
  the gradients every stage receives carry the loss scale;
- each micro-batch's backward: a post-accumulate-grad hook per parameter takes the fresh
  ``.grad`` into the parameter state (the fp32 buffers of ``-master`` recipes; held aside
  and put back at ``step()`` where ``.grad`` is the accumulator), so 16-bit gradients add
  up in fp32, and torch's ``scale_grads`` (which divides ``.grad`` at the end of the
  schedule's step) finds nothing to divide: the result does not depend on it. A
  parameter ``tied`` across stages must get a gradient on every stage that holds it;
- ``step()``: the micro-batches the hooks saw join the window (``backwards_run``); the
  skip decision is the MAX over the pipeline group, the norm the square root of the SUM
  of squares over it (parameters tied across stages, ``tied=``, counted once);
- the fp8 scales and the start are each stage's own (no weight is broadcast).

On a 3-D ``DeviceMesh`` (``parallel_kwargs={"mesh": mesh}``, dims named ``pp``, ``dp``,
``tp`` as torchtitan builds them) a stage is itself split by a tensor-parallel plan over
``mesh["tp"]`` and replicated over ``mesh["dp"]``: its replicas' gradients are averaged
at the window's end, the skip is the MAX over the whole world, the norm also sums over
the ``tp`` shards (``mixprec.parallel.pipeline_mesh``).

Zero-bubble schedules (``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``,
``ScheduleDualPipeV``) write the weight gradients' ``.grad`` themselves, past autograd's
accumulation: ``step()`` finds them there and refuses, naming the schedules that work.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mixprec.engine.gradnorm import fp32_norms
from mixprec.engine.param_state import ParamState
from mixprec.engine.scaler import LossScaler
from mixprec.parallel.comm import (
    gather_full,
    require_process_group,
    spread_of,
    sum_over_shards_,
)
from mixprec.parallel.comm_stats import CommStats
from mixprec.parallel.layouts import _attach_stats, _Replicated, register_mode
from mixprec.parallel.pipeline_mesh import StageMesh
from mixprec.recipe import Recipe

__all__ = ["PP", "PipelineLoss", "stage_args", "WORKING_SCHEDULES"]

#: torch's schedules the engine trains with (each checked on two gloo ranks)
WORKING_SCHEDULES = ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
                     "ScheduleLoopedBFS")
#: the keys ``parallel_kwargs`` takes under ``parallel="pp"``
_KWARGS = ("group", "mesh", "tied")


class PipelineLoss:
    """The schedule's ``loss_fn``: the user's loss, times the loss scale, divided by
    ``grad_accum_steps`` (what ``engine.backward`` does to a loss), for torch's
    schedule to run the backward of. ``losses`` keeps each micro-batch's own loss
    (detached, unscaled, undivided) until ``take()``: the schedule's ``losses`` list
    holds the scaled ones."""

    def __init__(self, loss_fn: Callable[..., torch.Tensor], scaler: LossScaler,
                 divide_by: int) -> None:
        if not callable(loss_fn):
            raise TypeError(f"pipeline_loss takes the loss function (output, target) -> "
                            f"loss, got {type(loss_fn).__name__}")
        self.loss_fn, self.scaler, self.divide_by = loss_fn, scaler, divide_by
        #: the micro-batches' own losses since the last ``take()``
        self.losses: list[torch.Tensor] = []

    def __call__(self, output: Any, target: Any, **kwargs: Any) -> torch.Tensor:
        loss = self.loss_fn(output, target, **kwargs)
        self.losses.append(loss.detach())
        return self.scaler.scale_loss(loss, self.divide_by)

    def take(self) -> list[torch.Tensor]:
        """The micro-batches' losses so far (device tensors, no sync), then forget them."""
        out, self.losses = self.losses, []
        return out


class PP(_Replicated):
    """Pipeline parallelism over torch's ``PipelineStage`` (see the module docstring).

    ``parallel_kwargs``: ``group`` (the pipeline's process group; default: the world),
    or ``mesh`` (a 1-D ``DeviceMesh``, e.g. ``mesh["pp"]``, or the whole mesh with dims
    named ``pp``, ``dp``, ``tp``: ``pipeline_mesh.StageMesh``), and ``tied``: names of this
    stage's parameters that are copies of a parameter another stage holds (a tied
    embedding and head), the same number, shapes and order on every rank of the group:
    they start from the group's first rank, their gradients are summed over the group
    and counted once in the norm."""

    name = "pp"

    def __init__(self, recipe: Recipe, kwargs: dict | None = None,
                 units: Any = None) -> None:
        kwargs = dict(kwargs or {})
        bad = sorted(set(kwargs) - set(_KWARGS))
        if bad:
            raise ValueError(f"parallel_kwargs {bad} with parallel='pp'; valid: "
                             f"{', '.join(_KWARGS)}")
        if units is not None:
            raise ValueError("fsdp_units given with parallel='pp'; it chooses FSDP's "
                             "units: drop it")
        require_process_group("pp")
        super().__init__(recipe, None, None)
        #: the pipeline's group and, on a 3-D mesh, the stage's ``dp`` and ``tp`` groups
        self.mesh = StageMesh(kwargs.get("group"), kwargs.get("mesh"))
        #: the pipeline's process group: the norm is summed over it
        self.group = self.mesh.pp
        self.world_size = dist.get_world_size(self.group)
        #: the stage's replicas' averaging and its shards' norm sums (3-D meshes)
        self.comm_stats = CommStats() if self.mesh.inner else None
        self._spreads: list = []
        self._keep: list[bool] = []
        self.tied = tuple(kwargs.get("tied", ()))
        self._state = None
        self._hooks: list = []
        self._counts: list[int] = []
        self._held: list[torch.Tensor | None] = []
        self._tied_idx: list[int] = []
        self._counted: list[bool] = []
        self._uncounted: set[int] = set()

    # --- building ------------------------------------------------------------------

    def start(self, model: nn.Module) -> None:
        """Each stage keeps its own weights; ``tied`` ones start from the group's first
        rank's; a stage's ``tp`` and ``dp`` ranks start from the same
        (``StageMesh.start``)."""
        self.mesh.check_model(model)
        params = dict(model.named_parameters())
        missing = [n for n in self.tied if n not in params]
        if missing:
            raise ValueError(f"parallel_kwargs tied={list(self.tied)}: {missing} not among "
                             f"this stage's parameters ({', '.join(list(params)[:6])}, ...)")
        src = dist.get_global_rank(self.group, 0) if self.group is not dist.group.WORLD else 0
        with torch.no_grad():
            for n in self.tied:
                dist.broadcast(params[n].data, src, group=self.group)
        self.mesh.start(model)

    def shard(self, model: nn.Module, optimizers: list, emulate: bool) -> nn.Module:
        """Nothing is sharded (a tensor-parallel plan did it): the quantized Linears of
        such a stage record their amax all-reduces in ``comm_stats``."""
        if self.mesh.tp is not None:
            _attach_stats(model, self.comm_stats)
        return model

    def wrap(self, model: nn.Module, param_state: ParamState) -> nn.Module:
        """The hooks that take each micro-batch's gradient into ``param_state``."""
        self._state = state = param_state
        n = len(state.working)
        self._counts, self._held = [0] * n, [None] * n
        self._tied_idx = [state.names.index(t) for t in self.tied if t in state.names]
        first = dist.get_rank(self.group) == 0
        self._counted = [first or i not in self._tied_idx for i in range(n)]
        for i, p in enumerate(state.working):
            self._hooks.append(p.register_post_accumulate_grad_hook(
                lambda p, i=i: self._take(i, p)))
        return model

    def _take(self, i: int, p: nn.Parameter) -> None:
        """A micro-batch's gradient of working parameter ``i`` arrived in ``.grad``."""
        self._counts[i] += 1
        state = self._state
        if state.direct:  # .grad is the accumulator: held aside until step()
            held = self._held[i]
            self._held[i] = p.grad if held is None else held.add_(p.grad)
        else:
            state.receive([i], [p.grad])
        p.grad = None

    # --- the step --------------------------------------------------------------------

    def backwards_run(self, micro: int, accum_steps: int) -> int:
        """The micro-batches whose backward torch's schedule ran since the last call
        (the most any parameter saw), their gradients in place for the step; raises if
        they overfill the window or arrived past the hooks (a zero-bubble schedule)."""
        state = self._state
        stray = [state.names[i] for i, p in enumerate(state.working) if p.grad is not None]
        if stray:
            raise NotImplementedError(
                f"{len(stray)} gradient(s) (the first: {stray[0]!r}) were written to .grad "
                "past autograd's accumulation, as zero-bubble schedules' weight passes do "
                "(ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV): "
                "the engine cannot accumulate or unscale them. Use one of "
                f"{', '.join(WORKING_SCHEDULES)}.")
        n = max(self._counts, default=0)
        self._counts = [0] * len(self._counts)
        if state.direct and micro + n >= accum_steps:  # the window is whole: in place
            for i, p in enumerate(state.working):
                if self._held[i] is not None:
                    p.grad, self._held[i] = self._held[i], None
        if n and micro + n > accum_steps:
            raise ValueError(
                f"the pipeline schedule ran {micro + n} micro-batches in this window, more "
                f"than grad_accum_steps={accum_steps}: build the engine with "
                "grad_accum_steps = n_microbatches x the schedule steps per update (the "
                "loss is divided by it)")
        if n and micro + n == accum_steps:  # the window is whole: the replicas' mean
            self.mesh.average(state, self.recipe.comm_dtype, self.comm_stats)
        return n

    def drop_window(self) -> None:
        """``zero_grad``: the held gradients and the hooks' counts are dropped."""
        self._counts = [0] * len(self._counts)
        self._held = [None] * len(self._held)

    def local(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The gradients (DTensors': their local shards, the spreads kept for the
        norm); ``tied`` ones summed over the group first."""
        if self._tied_idx:
            aligned = self._state.grads
            tied = [_local(aligned[i]) for i in self._tied_idx if aligned[i] is not None]
            if tied:
                flat = torch.cat([g.reshape(-1).float() for g in tied])
                dist.all_reduce(flat, group=self.group)
                for g, v in zip(tied, flat.split([g.numel() for g in tied])):
                    g.copy_(v.view_as(g))
            self._uncounted = {id(aligned[i]) for i in self._tied_idx if not self._counted[i]}
        self._keep = [id(g) not in self._uncounted for g in grads]
        self._spreads = [spread_of(g) for g in grads]
        return [_local(g) for g in grads]

    def norm_of(self, grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """The whole pipeline's norm: this stage's squares (summed over the ``tp``
        dims each gradient is sharded on, as ``parallel="tp"`` sums them) summed over
        the group, a tied parameter's counted on the group's first rank only; ``dp``
        replicas hold the same averaged gradients."""
        if len(self._keep) != len(grads):
            raise RuntimeError(f"{len(grads)} gradients for {len(self._keep)} read by "
                               "local(): the norm must read the gradients it returned")
        mine = [(g, s) for g, s, k in zip(grads, self._spreads, self._keep) if k]
        sq = (sum_over_shards_(list(torch.stack(fp32_norms([g for g, _ in mine]))
                                    .square().unbind()), [s for _, s in mine],
                               self.comm_stats)
              if mine else torch.zeros((), device=device))
        dist.all_reduce(sq, group=self.group)
        return sq.sqrt()

    def agree_max_(self, t: torch.Tensor) -> torch.Tensor:
        """The MAX over the pipeline group and the stage's own groups (the whole
        mesh): every rank skips the same steps."""
        return self.mesh.agree_max_(t)

    def agree_amax(self, fp8_modules: list) -> None:
        """The MAX over the stage's ``dp`` and ``tp`` ranks (amax histories); nothing
        on a 1-D mesh: each stage's Linears are its own."""
        self.mesh.agree_amax(fp8_modules)

    def gather(self, obj: Any) -> Any:
        """Every DTensor in ``obj`` (a tensor-parallel stage's) gathered whole over
        ``tp`` (every rank of the stage calls it)."""
        return gather_full(obj)

    def loss(self, loss_fn: Callable[..., torch.Tensor], scaler: LossScaler,
             accum_steps: int) -> PipelineLoss:
        """The schedule's ``loss_fn`` (``PipelineLoss``)."""
        return PipelineLoss(loss_fn, scaler, accum_steps)


def _empty_like(t: Any, grad: bool) -> Any:
    """An empty tensor of ``t``'s shape and dtype (``grad``: requiring grad where it
    floats); anything else as it is."""
    if not isinstance(t, torch.Tensor):
        return t
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    return out.requires_grad_(grad and t.is_floating_point())


def stage_args(module: nn.Module | Sequence[nn.Module], sample: Any, engine: Any, *,
               stage_index: int | Sequence[int]) -> Any:
    """``(input_args, output_args)`` for torch's ``PipelineStage``: one micro-batch's
    input and the stage's output under ``engine.autocast()``, as empty tensors of their
    shapes and dtypes. torch's own inference between stages runs collectives that hang
    over gloo, and guesses fp32 where autocast makes the boundary bf16.

    A collective over the engine's pipeline group: every rank calls it once, with all
    its stages (``module``, ``sample`` and ``stage_index`` as lists where a rank holds
    several, as interleaved schedules place them; a list of pairs comes back).

    ``sample``: each stage's input for one micro-batch (a tensor or a tuple of them), in
    fp32. Each stage runs it once under ``engine.autocast()`` without grad (fp8 delayed
    scaling records its amaxes, as any forward does), the ranks exchange the dtypes of
    their stages' floating outputs, and a stage after the first takes the dtypes its
    previous stage sends (bf16 under the bf16 recipes, fp32 after an fp32 island or
    where the 16-bit path is emulated): its floating inputs, in order, are cast to
    them and marked as requiring grad, so gradients flow back across the boundary."""
    many = isinstance(stage_index, (list, tuple))
    mods = list(module) if many else [module]
    samples = list(sample) if many else [sample]
    ids = list(stage_index) if many else [stage_index]
    if not len(mods) == len(samples) == len(ids):
        raise ValueError(f"stage_args: {len(mods)} modules, {len(samples)} samples and "
                         f"{len(ids)} stage indices: give one of each per stage")
    args = [tuple(s) if isinstance(s, (tuple, list)) else (s,) for s in samples]
    mine = {}
    with torch.no_grad(), engine.autocast():
        for m, a, i in zip(mods, args, ids):
            mine[i] = [o.dtype for o in _flat(m(*a)) if _floating(o)]
    group = getattr(engine.parallelism, "group", None)
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    sent = {i: d for part in every for i, d in part.items()}
    out = []
    for m, a, i in zip(mods, args, ids):
        if i > 0:
            if i - 1 not in sent:
                raise ValueError(f"stage_args: no rank of the pipeline group holds stage "
                                 f"{i - 1}, before stage {i} (indices: {sorted(sent)})")
            dtypes = iter(sent[i - 1])
            a = tuple(t.to(next(dtypes, t.dtype)) if _floating(t) else t for t in a)
        with torch.no_grad(), engine.autocast():
            outs = _flat(m(*a))
        out.append((tuple(_empty_like(t, i > 0) for t in a),
                    tuple(_empty_like(t, True) for t in outs)))
    return out if many else out[0]


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view that writes through), or ``t`` itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _floating(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def _flat(out: Any) -> tuple:
    """A stage's output as the tuple torch's stage sends."""
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


register_mode("pp", PP)  # make_parallel builds it for parallel="pp"
