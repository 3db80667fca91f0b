"""Build the parts of an engine from ``(model, optimizers, recipe)``.

In order: the checks (everything that can refuse the arguments runs before the model
is touched, so a refused engine leaves it exactly as it was), the fp8 swap, parallel
sharding, the parameter state (casting the working copy, building masters and
buffers), the optimizers re-pointed at the masters (and on CUDA torch's default Adam,
AdamW and SGD made fused, ``checks.fuse_default_optimizers``), DDP's wrap, the loss scaler and
the FP32 islands' module patches.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from mixprec.engine.checks import (
    check_device,
    check_fp8_all_gather,
    check_fp8_filter,
    check_model,
    check_optimizers,
    fuse_default_optimizers,
    param_counts,
)
from mixprec.engine.context import fp32_island_modules, make_emulation_mode, wrap_fp32_modules
from mixprec.engine.convert import convert as fp8_convert
from mixprec.engine.coverage import coverage, low_precision
from mixprec.engine.devices import KernelChoices, choices, has_fast_kernels
from mixprec.engine.param_state import ParamState
from mixprec.engine.scaler import LossScaler
from mixprec.experts import experts_formats
from mixprec.experts.expert_parallel import expert_parallel_modules
from mixprec.experts.hook import convert_experts, experts_modules, restore_experts
from mixprec.modules.linear import fp8_modules
from mixprec.optim import recipe_settings
from mixprec.optim.base import EngineBinding, LowPrecisionOptimizer
from mixprec.optim.kinds import unfuse_over_dtensors
from mixprec.parallel import pipeline  # noqa: F401 - registers parallel="pp" (make_parallel)
from mixprec.parallel.comm import shard_like
from mixprec.parallel.ep_layout import EP, expert_shard_of
from mixprec.parallel.layouts import (
    Parallel,
    check_parallel_recipe,
    has_dtensor_params,
    make_parallel,
    resolve_parallel,
)
from mixprec.parallel.tp_agree import data_group, share_streams
from mixprec.recipe import Recipe
from mixprec.recipe.layer_rules import owner_of

__all__ = ["Parts", "build", "as_optimizers", "check_loop_args"]


@dataclass(frozen=True)
class Parts:
    """What ``build`` made; the engine holds them and delegates to them."""

    recipe: Recipe
    #: the user's module, and what to call (the DDP wrapper, or the module)
    module: nn.Module
    model: nn.Module
    device: torch.device
    kernels: KernelChoices
    parallel: Parallel
    param_state: ParamState
    scaler: LossScaler
    #: the emulation mode forward and backward share (None when not emulating)
    emulation_mode: object
    fp8_report: object
    fp8_modules: list
    frozen: list
    param_counts: list
    #: undoes the FP32 islands' patches on third-party norm modules and points the
    #: experts configs back at their own implementation
    undo_islands: Callable[[], None]
    #: the share of matmul weights in each format (``mixprec.engine.coverage``)
    coverage: object = None


def as_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """One optimizer or an iterable of them, as a non-empty list (or a TypeError)."""
    opts = ([optimizer] if isinstance(optimizer, torch.optim.Optimizer)
            else list(optimizer))
    if not opts or not all(isinstance(o, torch.optim.Optimizer) for o in opts):
        raise TypeError("optimizer must be a torch.optim.Optimizer or a list of them")
    return opts


def check_loop_args(model, grad_accum_steps, max_grad_norm, loss_scaler) -> None:
    """The engine's own arguments: each wrong one named, with what is valid."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(grad_accum_steps, int) or grad_accum_steps < 1:
        raise ValueError(f"grad_accum_steps must be an integer >= 1, got "
                         f"{grad_accum_steps!r}")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm!r}")
    if loss_scaler is not None and not isinstance(loss_scaler, LossScaler):
        raise TypeError(f"loss_scaler must be a mixprec.engine.scaler.LossScaler (a subclass "
                        f"for a policy of your own), got {type(loss_scaler).__name__}")


def _swap_fp8(model: nn.Module, r: Recipe, kernels: KernelChoices, fp8_filter):
    """fp8 recipes: Linears -> Float8Linears, reusing the Parameters (the optimizer stays
    valid), each as the recipe's ``layer:`` rules say, on the GEMM route ``kernels``
    chose for its scaling. A model converted by hand is kept."""
    if r.linear is None:
        return None
    mods = fp8_modules(model)
    if not mods:
        # a model whose experts run in fp8 runs in fp8 even with no Linear converted
        has_experts = bool(experts_formats(model) or experts_modules(model))
        with warnings.catch_warnings():  # the coverage report speaks for such a model
            if has_experts:
                warnings.filterwarnings("ignore", "fp8: no Linear was converted")
            return fp8_convert(model, r.replace(fp8_gemm=kernels.fp8_gemm),
                               filter=fp8_filter, routes=kernels.fp8_gemm_routes or None,
                               allow_none=has_experts)
    off = {name: m.scaling for name, m in mods.items()
           if _scaling_of(r, name) != m.scaling}  # the module against its rule
    if off and not r.layer_rules:
        warnings.warn(
            f"the model's Float8Linears (converted by hand) use fp8_scaling="
            f"{'/'.join(sorted({m.scaling for m in mods.values()}))}, the recipe says "
            f"{r.linear.name}: each module keeps its own. Convert with the engine's "
            "recipe to match.",
            stacklevel=4)
    elif off:
        said = ", ".join(f"{n}: {s}, the recipe says {_scaling_of(r, n)}"
                         for n, s in list(off.items())[:4])
        warnings.warn(
            f"{len(off)} of the model's Float8Linears (converted by hand) use another "
            f"fp8_scaling than the recipe and its layer: rules give them ({said}): each "
            "module keeps its own. Convert with the engine's recipe to match.",
            stacklevel=4)
    return None


def _scaling_of(r: Recipe, name: str) -> str:
    """The fp8 scaling the recipe's rules give the Linear ``name`` (``bf16``: none)."""
    return "bf16" if r.layer_format(name) == "bf16" else r.for_layer(name).linear.name


def _repoint(optimizers: list, state: ParamState) -> None:
    """Point the optimizers' param groups at the fp32 masters. State they hold already
    (Adagrad builds it in ``__init__``; or a run of plain fp32 steps) belongs to the
    fp32 values the masters copy, so it moves with them."""
    if not state.has_master:
        return
    master_of = {id(p): m for p, m in zip(state.working, state.masters)}
    for o in optimizers:
        for g in o.param_groups:
            g["params"] = [master_of.get(id(p), p) for p in g["params"]]
        for p in list(o.state):
            if id(p) in master_of:
                o.state[master_of[id(p)]] = o.state.pop(p)


def _hand_over(optimizers: list, state: ParamState, fp32_init: list | None) -> None:
    """What ``mixprec.optim`` optimizers take from the parameter state: through
    ``bind``, the fp32 gradient buffers of 16-bit weights (so no 16-bit copy is made)
    and the format that emulated weights hold; for ``write="remainder"`` the exact
    initial values (``init_remainders``); and each parameter's state format by the
    recipe's ``states:`` rules (``set_state_formats``, keyed on what the optimizer
    updates: the masters where there are some)."""
    rules = state.recipe.state_rules
    owners = list(dict.fromkeys(owner_of(n) for n in state.names))
    for rule in rules:  # a pattern that names nothing is most likely misspelt
        if not any(rule.matches(m) for m in owners):
            warnings.warn(
                f"recipe rule {rule} matches the module of no trained parameter (they "
                f"are {', '.join(map(repr, owners[:4]))}{', ...' * (len(owners) > 4)}): "
                "check its pattern against the names model.named_modules() gives",
                stacklevel=4)
    ours = [o for o in optimizers if isinstance(o, LowPrecisionOptimizer)]
    if not ours:
        return
    if rules:
        _set_state_formats(ours, state)
    index = {id(p): i for i, p in enumerate(state.working)}
    buffers = None
    if not state.has_master and not state.direct and len(ours) == len(optimizers):
        buffers = state.lend_grads()  # no master: keyed by the working parameters
    binding = EngineBinding(grads=buffers, emulated_format=None if state.has_master
                            else state.round_to)
    for o in ours:
        o.bind(binding)
        if fp32_init is not None:
            mine = [p for g in o.param_groups for p in g["params"] if id(p) in index]
            o.init_remainders(mine, [fp32_init[index[id(p)]] for p in mine])


def _set_state_formats(optimizers: list, state: ParamState) -> None:
    """Each optimizer's parameters get the state format the recipe's rules give their
    names; a format set by hand that the recipe contradicts is replaced, with a
    warning."""
    r = state.recipe
    where = {id(q): i for i, q in enumerate(state.opt_params)}
    for o in optimizers:
        formats = {}
        for q, had in zip(o._params(), o.state_formats()):
            if id(q) not in where:
                continue  # a frozen parameter: never stepped
            name = state.names[where[id(q)]]
            formats[q] = want = r.state_format(name)
            if had not in (o.states, want):
                warnings.warn(
                    f"{type(o).__name__} keeps {had} states for {name!r} (set by hand); "
                    f"recipe {str(r)!r} says {want}: the recipe's rules decide. Put a "
                    f"states:{owner_of(name) or '*'}={had} rule in the recipe to keep it.",
                    stacklevel=5)
        o.set_state_formats(formats)


def check_expert_parallel(parallel: str | None, model: nn.Module) -> None:
    """DDP and FSDP would reduce an expert-parallel model's expert shards, which hold
    different experts on each rank, as replicas."""
    sharded = expert_parallel_modules(model)
    if sharded and parallel in ("ddp", "fsdp"):
        raise NotImplementedError(
            f"parallel={parallel!r} over a model whose experts expert_parallel sharded "
            f"({sharded[0]}{', ...' if len(sharded) > 1 else ''}): it would average the "
            "ranks' different experts as replicas. Build the engine without parallel= "
            "and average the other gradients with ExpertShards.average_grads before "
            "engine.step() (docs/guides/expert-parallel.md); for data parallelism beside "
            "EP pass a 2-D mesh: expert_parallel(model, mesh) with dims ('dp', 'ep').")
    if sharded and has_dtensor_params(model):
        raise NotImplementedError(
            f"a model whose experts expert_parallel sharded ({sharded[0]}"
            f"{', ...' if len(sharded) > 1 else ''}) with DTensor parameters (FSDP2's "
            "fully_shard or a tensor-parallel plan): FSDP2 over the expert-data-parallel "
            "dim and tensor parallelism beside EP are not built. Pass a 2-D mesh to "
            "expert_parallel(model, mesh) on the plain model (the experts replicated over "
            "its 'dp' dim, ExpertShards.average_grads averaging them there) and build the "
            "engine without parallel= (docs/guides/expert-parallel.md).")


def build(model: nn.Module, optimizers: list, r: Recipe, *, parallel=None,
          parallel_kwargs=None, fsdp_units=None, fp8_filter=None,
          loss_scaler: LossScaler | None = None) -> Parts:
    """Check everything, then build the parts, in the order the module docstring gives."""
    parallel = resolve_parallel(parallel, model)
    check_expert_parallel(parallel, model)
    check_parallel_recipe(parallel, r, has_dtensor_params(model))
    check_fp8_filter(fp8_filter, r, model)
    check_fp8_all_gather(r, model, fp8_filter)
    ep = expert_shard_of(model) if parallel is None else None
    par = (EP(r, ep) if ep is not None  # expert parallel: the skip and norm agreed
           else make_parallel(parallel, r, model, parallel_kwargs, fsdp_units))
    params, frozen = check_model(model)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    device = params[0].device
    kernels = par.choose(lambda: choices(r, device))
    check_device(device, r, kernels.emulate)
    check_optimizers(optimizers, params, frozen, r, parallel, kernels.emulate)
    # the model is touched from here on
    par.start(model)
    # one mode for the engine's life: backward must see the tags forward made
    emu_mode = make_emulation_mode(r) if kernels.emulate else None
    # before FSDP: fully_shard must manage the Float8Linears, or they see sharded weights
    fp8_report = _swap_fp8(model, r, kernels, fp8_filter)
    if low_precision(r):  # transformers' experts modules: their projections too
        convert_experts(model, r.replace(fp8_gemm=kernels.fp8_gemm),
                        routes=kernels.fp8_gemm_routes or None)
    # stochastic rounding: the ranks that see the same data draw alike, whole or sharded
    share_streams([*fp8_modules(model).values(), *experts_formats(model).values()],
                  data_group(model))
    cov = coverage(model, r, dict(fp8_report.skipped) if fp8_report else None)
    # write=remainder starts from the exact fp32 weights, before a cast drops bits (FSDP
    # may store 16-bit shards): taken whole here, placed like the parameters below
    fp32_init = ([p.detach().clone() for p in model.parameters() if p.requires_grad]
                 if recipe_settings(r)["write"] == "remainder" else None)
    model = par.shard(model, optimizers, kernels.emulate)
    if fp32_init is not None:
        fp32_init = [shard_like(v, p) for v, p in
                     zip(fp32_init, [p for p in model.parameters() if p.requires_grad])]
    state = ParamState([p for p in model.parameters() if p.requires_grad], r,
                       emulate=kernels.emulate, names=names, sharded=par.sharded,
                       announce_grads=par.announces_grads)
    state.record_sums(par.comm_stats)  # partial-sum gradients' sums (TP, FSDP x TP)
    if emu_mode is not None and state.round_to is not None:
        emu_mode.tag(state.working)  # bf16 values in fp32 tensors
    _repoint(optimizers, state)
    _hand_over(optimizers, state, fp32_init)
    unfuse_over_dtensors(optimizers)  # fused SGD over DTensors: torch has no rule
    if not par.sharded:  # torch's default Adam/AdamW/SGD on CUDA: fused, no host sync
        fuse_default_optimizers(optimizers)
    module, model = model, par.wrap(model, state)
    scaler = LossScaler.from_recipe(r, device) if loss_scaler is None else loss_scaler
    undo_norms = (wrap_fp32_modules(fp32_island_modules(module, r.precision.keep_fp32), device.type)
                  if r.has_fp32_islands else (lambda: None))

    def undo() -> None:  # the norms' patches and the experts' implementation
        undo_norms()
        restore_experts(module)
    state.mark_working()  # after the broadcast of rank 0's weights
    return Parts(r, module, model, device, kernels, par, state, scaler, emu_mode,
                 fp8_report, [*fp8_modules(module).values(),
                              *experts_formats(module).values()],
                 frozen, param_counts(optimizers), undo, cov)


def warn_kernel_choices(r: Recipe, kernels: KernelChoices, device: torch.device) -> None:
    """Say where an ``auto`` choice left the format's own kernels (measured)."""
    if kernels.emulate and r.precision.emulate is None and kernels.source != "measured":
        warnings.warn(
            f"{r.precision.compute} is emulated exactly on fp32 kernels: {kernels.source} pins the "
            "emulated path. Set emulate=false in the recipe to run the real kernels.",
            stacklevel=3)
    elif kernels.emulate and r.precision.emulate is None:
        warnings.warn(
            f"{r.precision.compute} has no fast kernels on {device.type}: mixprec emulates "
            f"it exactly on fp32 kernels ({kernels.describe()}). Set emulate=false to run "
            "the real kernels.", stacklevel=3)
    elif kernels.fp8_rest == "fp32" and r.linear is not None:
        warnings.warn(
            f"bf16 has no fast kernels on {device.type}: the layers around the fp8 "
            f"Linears compute in fp32 instead of bf16, faster and more exact here "
            f"({kernels.describe()}).", stacklevel=3)
    elif r.precision.emulate is False and r.emulatable and \
            not has_fast_kernels(device, r.precision.compute):
        warnings.warn(
            f"{r.precision.compute} compute with emulate=false on {device.type}: this device "
            "has no fast kernel for it (measured); emulate=auto would run it exactly "
            "on fp32 kernels instead.", stacklevel=3)
