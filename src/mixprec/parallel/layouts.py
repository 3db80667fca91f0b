"""One interface over how a step runs across processes: single, DDP or FSDP2.

The engine and the checkpoints ask a ``Parallel`` what to do instead of testing a
mode string. Each method is a moment of the step where the modes differ:

==================  ==============  ===========================  ==========================
moment              single          DDP                          FSDP2
==================  ==============  ===========================  ==========================
``choose``          measure         rank 0 measures, broadcasts  rank 0 measures, broadcasts
``start``           nothing         broadcast rank 0's weights   broadcast rank 0's weights
``shard``           nothing         nothing                      ``fully_shard`` the units
``wrap``            nothing         DDP + mixprec's comm hook    nothing (already sharded)
``no_reduce``       nothing         ``no_sync()``                no gradient sync
``forward``         nothing         ``no_sync()`` (DDP decides)  nothing (decided in bwd)
``reduce``          nothing         all-reduce the buffers       nothing (backward does)
``local``           the grads       the grads                    each DTensor's local shard
``norm_reduce``     None            None (grads are identical)   all-reduce the squares
``agree_max_``      nothing         all-reduce MAX               all-reduce MAX
``gather``          nothing         nothing                      full tensors (collective)
``after_restore``   nothing         nothing                      fp8 gather scales
==================  ==============  ===========================  ==========================

Tensor parallelism (``"tp"``) takes the model as torch's ``parallelize_module`` left it
(DTensor shards on a ``DeviceMesh``): it starts from rank 0's plain parameters, shards
nothing, wraps nothing, reduces no gradient (DTensor's own collectives did, in the
forward and backward), checks each DTensor's local shard, and sums the norm's squares
over the mesh dims each gradient is sharded on (``norm_of``; replicated ones counted
once). FSDP over a tensor-parallel model (``parallel="fsdp"`` with
``parallel_kwargs={"mesh": mesh["dp"]}``) sums its norm the same way.

``sharded`` is True for FSDP: its fp32 shards are the masters (``ParamState(sharded=)``)
and a checkpoint holds this rank's shards unless gathered.

Pipeline stages (``"pp"``, torch's schedules running the backward) are the ``PP`` of
``mixprec.parallel.pipeline``: ``backwards_run`` and ``drop_window`` are their moments.
On a 3-D mesh a stage is itself tensor-parallel and data-parallel
(``mixprec.parallel.pipeline_mesh``): ``local`` and the norm's sums are the ones above.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from mixprec.engine.checks import check_fsdp_units, check_parallel_kwargs
from mixprec.engine.devices import KernelChoices
from mixprec.engine.gradnorm import fp32_norms
from mixprec.experts.gather import install_experts_gather
from mixprec.formats.gemm import FORMATS
from mixprec.modules.linear import fp8_modules
from mixprec.parallel.comm import (
    CommStats,
    agree_amax_,
    all_reduce_max_,
    broadcast_module_,
    broadcast_object,
    fsdp_policy,
    gather_full,
    reduce_grads_,
    require_process_group,
    shard_fsdp,
    spread_of,
    sum_over_shards_,
    wrap_ddp,
)
from mixprec.parallel.gather import agree_amaxes_, install_fp8_all_gather, refresh_gather_scales_
from mixprec.parallel.presharded import fsdp_sharded
from mixprec.parallel.tensor_parallel import attach_comm_stats
from mixprec.recipe import Recipe
from mixprec.recipe.presets import LINEAR_PRESETS
from mixprec.recipe.syntax import preset_flat

__all__ = ["Parallel", "SingleProcess", "DDP", "FSDP", "TP", "make_parallel",
           "check_parallel_recipe", "resolve_parallel", "has_dtensor_params", "tp_formats",
           "register_mode"]


class Parallel:
    """The interface, and what every mode does by default (what one process does)."""

    #: the mode's name as ``MixedPrecision(parallel=...)`` takes it
    name: str | None = None
    #: parameters are shards (FSDP): the masters are the shards, checkpoints are per rank
    sharded = False
    #: a reducer must see every parameter's gradient arrive (DDP's): the parameter
    #: state's wgrad sink then hands autograd a zero (``ParamState(announce_grads=)``)
    announces_grads = False

    def __init__(self, recipe: Recipe, kwargs: dict | None = None, units=None) -> None:
        self.recipe = recipe
        self.kwargs = kwargs or {}
        self.units = units
        self.world_size = dist.get_world_size() if self.name else 1
        #: bytes each gradient reduction sent (DDP's comm hook), else None
        self.comm_stats = None

    def choose(self, measure: Callable[[], KernelChoices]) -> KernelChoices:
        """The kernel choices every rank uses (``measure`` makes them on this rank)."""
        return measure()

    def start(self, model: nn.Module) -> None:
        """Before anything is built from the weights: every rank starts from rank 0's."""

    def shard(self, model: nn.Module, optimizers: list, emulate: bool) -> nn.Module:
        """Before the parameter state: shard the model (the optimizers follow)."""
        return model

    def wrap(self, model: nn.Module, param_state) -> nn.Module:
        """After the parameter state: the module the user calls."""
        return model

    def no_reduce(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Around a backward that is not the accumulation's last: no reduction yet."""
        return contextlib.nullcontext()

    def forward(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
        """Around a forward; ``last``: its backward is expected to end the window."""
        return contextlib.nullcontext()

    def reduce(self, param_state) -> None:
        """A window ended early, after a ``forward(last=False)``: reduce it now."""

    def backwards_run(self, micro: int, accum_steps: int) -> int:
        """Micro-batches whose backward ran outside ``engine.backward`` since the last
        call (a pipeline schedule's, ``mixprec.parallel.pipeline``): none here."""
        return 0

    def drop_window(self) -> None:
        """The engine's ``zero_grad``: forget what the mode holds of the window."""

    def local(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors this rank checks, unscales and clips (FSDP: local shards)."""
        return grads

    #: how the squares of the gradient norm are summed across ranks (None: not needed)
    norm_reduce = None
    #: the norm of the gradients ``local`` returned last, from placements (None: the
    #: step computes it, with ``norm_reduce``)
    norm_of = None

    def agree_max_(self, t: torch.Tensor) -> torch.Tensor:
        """In place: the max over ranks (the skip decision), so every rank agrees."""
        return t

    def agree_amax(self, fp8_modules: list) -> None:
        """fp8: this step's amaxes become the max over ranks, so the scales agree."""

    def gather(self, obj):
        """``obj`` with its shards gathered to whole tensors (a collective under FSDP)."""
        return obj

    def after_restore(self, fp8_modules: list) -> None:
        """After a checkpoint load wrote the weights: nothing by default."""


class SingleProcess(Parallel):
    """One process, no collectives: the default."""


class _Replicated(Parallel):
    """What DDP and FSDP share: start from rank 0, agree by all-reduce MAX."""

    def choose(self, measure: Callable[[], KernelChoices]) -> KernelChoices:
        """Rank 0 measures and every rank takes its choices: ranks that measured for
        themselves could resolve an ``auto`` choice differently (a loaded core reads
        another speed) and train with different numerics."""
        rank = dist.get_rank()
        mine = measure() if rank == 0 else None
        agreed = broadcast_object(mine, 0)
        return agreed if rank == 0 else dataclasses.replace(
            agreed, source=f"rank 0 ({agreed.source})")

    def start(self, model: nn.Module) -> None:
        broadcast_module_(model)

    def agree_max_(self, t: torch.Tensor) -> torch.Tensor:
        return all_reduce_max_(t)

    def agree_amax(self, fp8_modules: list) -> None:
        agree_amax_(fp8_modules)


class DDP(_Replicated):
    """DistributedDataParallel with mixprec's comm hook (``mixprec.parallel.comm``)."""

    name = "ddp"
    announces_grads = True

    def wrap(self, model: nn.Module, param_state) -> nn.Module:
        """DDP with the comm hook over ``param_state``'s buffers."""
        ddp, self.comm_stats = wrap_ddp(param_state, model, self.recipe, **self.kwargs)
        return ddp

    def no_reduce(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """``no_sync()``: one reduction serves the whole accumulation."""
        return model.no_sync()

    def forward(self, model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
        """``no_sync()`` unless ``last``: DDP's forward decides whether its backward
        reduces, so a backward under ``no_sync()`` alone still would."""
        return contextlib.nullcontext() if last else model.no_sync()

    def reduce(self, param_state) -> None:
        """The buffers all-reduced as the comm hook would (``comm.reduce_grads_``)."""
        reduce_grads_(param_state, self.recipe.comm_dtype, self.comm_stats)


class FSDP(_Replicated):
    """FSDP2 (``fully_shard``) with the recipe's ``MixedPrecisionPolicy``."""

    name = "fsdp"
    sharded = True
    norm_reduce = staticmethod(dist.all_reduce)

    def shard(self, model: nn.Module, optimizers: list, emulate: bool) -> nn.Module:
        """``fully_shard`` the units, then the root; the optimizers follow the shards.
        With ``fp8_all_gather``, the Float8Linear weights get the gather hooks
        (``mixprec.parallel.gather``), recorded in ``comm_stats``."""
        model = shard_fsdp(model, self.recipe, optimizers, self.units, emulate=emulate,
                           **self.kwargs)
        if self.recipe.layout.fp8_all_gather:
            sent = fsdp_policy(self.recipe, emulate).param_dtype  # None: the weight's
            mods = install_fp8_all_gather(fp8_modules(model), self.comm_stats, sent)
            mods += install_experts_gather(model, self.comm_stats, sent)
            refresh_gather_scales_(mods, all_reduce_max_)
        if self.two_d:
            _attach_stats(model, self.comm_stats)
        return model

    def agree_amax(self, fp8_modules: list) -> None:
        """The histories' all-reduce MAX, which also carries current scaling's fp8
        gather amaxes (``mixprec.parallel.gather``): one collective per step."""
        agree_amaxes_(fp8_modules, all_reduce_max_)

    def after_restore(self, fp8_modules: list) -> None:
        """A checkpoint wrote the weights: current scaling's gather scales follow."""
        refresh_gather_scales_(fp8_modules, all_reduce_max_)

    def no_reduce(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """No reduce-scatter until the accumulation's last backward."""
        stack = contextlib.ExitStack()
        model.set_requires_gradient_sync(False)
        stack.callback(model.set_requires_gradient_sync, True)
        return stack

    def local(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each DTensor gradient's local shard (over a tensor-parallel model, their
        spreads are kept for ``norm_of``)."""
        if self.two_d:
            self._spreads = [spread_of(g) for g in grads]
        return [g.to_local() if hasattr(g, "to_local") else g for g in grads]

    def gather(self, obj):
        """Every DTensor in ``obj`` gathered whole (every rank calls it)."""
        return gather_full(obj)

    def __init__(self, recipe: Recipe, kwargs: dict | None = None, units=None,
                 two_d: bool = False) -> None:
        super().__init__(recipe, kwargs, units)
        #: the weights' all-gathers as codes, the 16-bit fallbacks, and (over a
        #: tensor-parallel model) the norm's sums
        self.comm_stats = CommStats()
        #: FSDP over a tensor-parallel model: the norm sums over each gradient's mesh dims
        self.two_d = two_d
        if two_d:
            self.norm_of = self._norm_of
            self.norm_reduce = None

    def _norm_of(self, grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        return _shard_norm(grads, self._spreads, device, self.comm_stats)


def _attach_stats(model: nn.Module, stats: CommStats) -> None:
    """Tensor parallelism: the quantized Linears' amax all-reduces, and the collectives
    of the modules mixprec's plans took (``parallel.tp_plans``), go to ``stats``."""
    attach_comm_stats(fp8_modules(model), stats)
    for m in model.modules():
        if getattr(m, "tp_records_plan", False):
            m.tp_comm_stats = stats


def _shard_norm(local: list[torch.Tensor], spreads: list, device: torch.device,
                stats: CommStats) -> torch.Tensor:
    """The whole model's gradient norm from local shards and their spreads."""
    if len(spreads) != len(local):
        raise RuntimeError(f"{len(local)} gradients for {len(spreads)} spreads: the norm "
                           "must read the gradients ``local`` returned")
    if not local:
        return torch.zeros((), device=device)
    squares = list(torch.stack(fp32_norms(local)).square().unbind())
    return sum_over_shards_(squares, spreads, stats).sqrt()


class TP(_Replicated):
    """Tensor parallelism by torch's ``parallelize_module`` plans: the parameters are
    DTensors on the user's ``DeviceMesh`` (see the module docstring). ``comm_stats``
    counts the engine's own collectives on the mesh (the norm's sums); DTensor's
    forward and backward collectives are torch's."""

    name = "tp"

    def __init__(self, recipe: Recipe, kwargs: dict | None = None, units=None) -> None:
        super().__init__(recipe, kwargs, units)
        self.comm_stats = CommStats()
        self._spreads: list = []

    def shard(self, model: nn.Module, optimizers: list, emulate: bool) -> nn.Module:
        """Nothing is sharded (the plan did it): the quantized Linears record their amax
        all-reduces in ``comm_stats``."""
        _attach_stats(model, self.comm_stats)
        return model

    def local(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each DTensor gradient's local shard; their spreads kept for ``norm_of``."""
        self._spreads = [spread_of(g) for g in grads]
        return [g.to_local() if hasattr(g, "to_local") else g for g in grads]

    def norm_of(self, grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """The whole model's norm, the same on every rank: local squares summed over
        the mesh dims each gradient is sharded on, replicated ones counted once."""
        return _shard_norm(grads, self._spreads, device, self.comm_stats)

    def gather(self, obj):
        """Every DTensor in ``obj`` gathered whole (every rank calls it)."""
        return gather_full(obj)


_MODES = {None: SingleProcess, "ddp": DDP, "fsdp": FSDP, "tp": TP}


def register_mode(name: str, cls: type[Parallel]) -> None:
    """``make_parallel`` builds ``cls`` for ``parallel=name``: for a mode whose module
    builds on this one (``"pp"``, ``mixprec.parallel.pipeline``)."""
    _MODES[name] = cls


#: compute formats tensor parallelism runs besides the Linear formats
_TP_COMPUTE = ("fp32", "tf32", "bf16", "fp16")


def _format_names() -> dict[str, list[str]]:
    """Each registered Linear format's name -> the presets that pick it (or
    ``fp8_scaling=NAME`` where none does)."""
    return {name: [p for p in LINEAR_PRESETS if preset_flat(p)["fp8_scaling"] == name]
            or [f"fp8_scaling={name}"] for name in FORMATS}


def tp_formats() -> str:
    """The Linear formats that run on tensor-parallel shards, as an error message lists
    them: every registered format without a ``tp_unsupported`` reason, by its presets."""
    names = _format_names()
    ok = [n for n, cls in FORMATS.items() if cls.tp_unsupported is None]
    blocks = [p for n in ok if FORMATS[n].block_scaled for p in names[n]]
    listed = ", ".join(p for n in ok for p in names[n])
    return listed + (f"; {', '.join(blocks)} where the shard cuts lie on their blocks"
                     if blocks else "")


def has_dtensor_params(model: nn.Module) -> bool:
    """Whether a tensor-parallel plan made any of ``model``'s parameters a DTensor."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def resolve_parallel(parallel: str | None, model: nn.Module) -> str | None:
    """The mode for ``MixedPrecision(parallel=...)``: a model whose parameters are
    DTensors (``parallelize_module``, or transformers' ``DistributedConfig``: its
    tensor-parallel plan, FSDP2, expert parallelism) runs as ``"tp"`` when no mode is
    given (each DTensor's reductions are its own: FSDP2's in backward, DTensor's); DDP
    over such a model is refused, and so is FSDP over one FSDP2 sharded already."""
    if not has_dtensor_params(model):
        return parallel
    if parallel == "fsdp" and fsdp_sharded(model):
        raise ValueError(
            "parallel='fsdp' over a model FSDP2 sharded already (fully_shard, e.g. "
            "transformers' from_pretrained(..., distributed_config=DistributedConfig("
            "fsdp_size=...))): the engine would shard the shards again. Build the engine "
            "without parallel=: it trains the model's own shards as they are.")
    if parallel is None:
        return "tp"
    if parallel == "ddp":
        raise ValueError(
            "parallel='ddp' over a tensor-parallel model (its parameters are DTensors "
            "from parallelize_module): DDP does not take DTensors. Use parallel='tp', or "
            "parallel='fsdp' with parallel_kwargs={'mesh': mesh['dp']} for a 2-D mesh.")
    return parallel


def check_parallel_recipe(parallel: str | None, recipe: Recipe,
                          tensor_parallel: bool = False) -> None:
    """What a mode cannot do with a recipe, before anything is built
    (``tensor_parallel``: the model's parameters are DTensors)."""
    tp = parallel == "tp" or tensor_parallel
    if tp and recipe.precision.compute not in _TP_COMPUTE and recipe.linear is None:
        raise NotImplementedError(
            f"recipe {str(recipe)!r} with tensor parallelism: its {recipe.precision.compute} "
            "compute does not take DTensor weights. Tensor parallelism runs the 16-bit "
            "recipes (fp32, tf32, bf16, fp16 and their variants) and the Linear formats "
            f"({tp_formats()}): pick one of those.")
    why = recipe.linear is not None and type(recipe.linear).tp_unsupported
    if tp and why:
        raise NotImplementedError(
            f"recipe {str(recipe)!r} with tensor parallelism: its Linear format "
            f"{recipe.linear.name!r} does not run on tensor-parallel shards: {why}. Pick "
            f"one that does ({tp_formats()}), or a 16-bit recipe.")
    if tp and recipe.layout.fp8_all_gather:
        raise NotImplementedError(
            f"recipe {str(recipe)!r} with tensor parallelism: fp8_all_gather (FSDP "
            "gathering the weights as their casts) is not built for tensor-parallel "
            f"shards. Tensor parallelism runs the Linear formats ({tp_formats()}) with "
            "FSDP gathering 16-bit shards, which the Linears cast: drop fp8_all_gather.")
    if recipe.precision.wgrad == "fp32" and parallel == "fsdp":
        raise NotImplementedError(
            f"recipe {str(recipe)!r}: wgrad=fp32 with parallel='fsdp' is not "
            "supported: FSDP reduce-scatters the gradients of its unsharded "
            "low-precision parameters. Use parallel='ddp', or drop wgrad.")


def make_parallel(parallel: str | None, recipe: Recipe, model: nn.Module,
                  kwargs: dict | None = None, units=None) -> Parallel:
    """The ``Parallel`` for ``MixedPrecision(parallel=...)``, after checking its
    arguments (``parallel_kwargs``, ``fsdp_units``) and that a process group is up."""
    kwargs = check_parallel_kwargs(parallel, kwargs)
    units = check_fsdp_units(parallel, units, model)
    if parallel is not None:
        require_process_group(parallel)
    if parallel == "tp" and kwargs:
        raise ValueError(f"parallel_kwargs {sorted(kwargs)} given with parallel='tp', "
                         "which builds nothing from them (the plan is torch's "
                         "parallelize_module); drop them, or use parallel='fsdp' with "
                         "parallel_kwargs={'mesh': mesh['dp']} for a 2-D mesh")
    if parallel == "fsdp" and has_dtensor_params(model):
        return FSDP(recipe, kwargs, units, two_d=True)
    if parallel not in _MODES:  # "pp": its module registers it on import
        raise RuntimeError(f"parallel={parallel!r} is not registered: import "
                           "mixprec.parallel.pipeline first (mixprec's engine does)")
    return _MODES[parallel](recipe, kwargs, units)
