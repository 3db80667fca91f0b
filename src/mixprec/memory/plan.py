"""Predict the bytes a recipe costs, item by item (``mixprec.memory`` explains the
accounting)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

from mixprec.engine.devices import emulating, fp8_gemm_route, fp8_rest
from mixprec.engine.param_state import grads_in_place, updated_dtype
from mixprec.experts.expert_parallel import expert_parallel_modules
from mixprec.formats.elements import dtype_of
from mixprec.memory.breakdown import Breakdown
from mixprec.memory.expert_dispatch import ep_buffer_bytes, expert_params
from mixprec.memory.fsdp import FSDP_NOTE, fsdp_gathered_bytes, fsdp_held_recipe, fsdp_sharded
from mixprec.memory.layers import fp8_share, layer_recipes
from mixprec.memory.moe import moe_experts, moe_notes, moe_terms, routed_rows
from mixprec.memory.pipeline import PipelineSchedule
from mixprec.memory.shapes import param_count, spec_linears
from mixprec.memory.spec import TransformerSpec, activation_bytes
from mixprec.memory.stages import stage_breakdowns, worst
from mixprec.memory.transient import (
    backward_transient,
    linear_shapes,
    saved_weight_bytes,
    step_scratch,
    tp_local,
)
from mixprec.memory.units import parse_count, rank_local
from mixprec.modules.linear import fp8_modules, scaling_buffers
from mixprec.optim import pieces, recipe_settings
from mixprec.optim.states import state_bytes
from mixprec.optim.writes import write_bytes
from mixprec.recipe import Recipe
from mixprec.recipe.linear_format import quantizer_for

__all__ = ["estimate", "stage_estimates"]

# torch optimizer -> (parameter-sized states, 0-dim fp32 tensors per parameter such as
# the step count), for torch's defaults (no amsgrad, no RMSprop momentum/centering)
_STATES = {"adamw": (2, 1), "adam": (2, 1), "sgd_momentum": (1, 0), "sgd": (0, 0),
           "adagrad": (1, 1), "rmsprop": (1, 1), "adadelta": (2, 1), "adamax": (2, 1),
           "nadam": (2, 2), "radam": (2, 1)}


def _state_bytes(r: Recipe, emulated: bool) -> int:
    """Bytes per element of the tensors the optimizer updates (its states match them)."""
    return updated_dtype(r, emulated).itemsize


def estimate(
    params: int | float | str | nn.Module | TransformerSpec,
    recipe: Recipe | str,
    optimizer: str = "adamw",
    zero_stage: int = 0,
    world_size: int = 1,
    activations: TransformerSpec | float | None = None,
    sample_batch: Any = None,
    pipeline: PipelineSchedule | None = None,
    expert_parallel: int = 1,
) -> Breakdown:
    """Bytes per rank of each item for ``params`` trained with ``recipe``.

    >>> round(estimate("70B", "fp32").gb())       # AdamW, fp32: ~1120 GB
    1120

    For a module, frozen parameters (``requires_grad=False``) count in ``params`` at
    their own dtype and have no gradient, master or optimizer state. Emulation is
    resolved on its device (fp16 on a CPU is emulated by default, and its working
    copy then lives in fp32 tensors). For a bare count, only
    ``emulate=true`` counts as emulated. A module FSDP2 sharded (``fully_shard``, over
    a tensor-parallel plan or not) is counted as each rank holds it
    (``mixprec.memory.fsdp``): ``zero_stage=3``, ``world_size`` its data-parallel size.

    With a ``TransformerSpec`` the breakdown also predicts the saved weight copies
    (``weight_casts``) and a step's ``peak``: the items less the gradients that
    autograd makes afresh each backward, plus the widest Linear's backward working set
    (``mixprec.memory.transient``), or the optimizer step's scratch where larger.
    ``params`` may be the ``TransformerSpec`` itself: its parameters are counted from
    its shapes (``mixprec.memory.shapes``; grouped-query attention, SwiGLU and experts
    included, ``mixprec.memory.hf_config.spec_from_config`` reads them off a
    transformers config), and it prices the activations too.

    Under ZeRO-3 (FSDP) the ``weight_casts`` are not sharded: each rank casts every
    weight it gathers whole and keeps that cast from the Linear's forward to its
    backward (``_QuantizedMatmul`` saves it; with ``fp8_all_gather`` too, a copy of
    the gathered codes), so an fp8 recipe holds one byte per fp8 weight element of the
    whole model per rank at the end of the forward. Under ``recompute="full"`` a layer's
    casts live from its recomputed forward to its backward only: one layer's.

    For a transformers mixture-of-experts model, ``sample_batch`` (its inputs, as
    ``measure`` takes them) is run once without grad to read how many rows each expert
    gets (``mixprec.memory.moe.routed_rows``): the busiest expert's scratch is priced
    at its rows, not the average.

    ``pipeline`` (a ``PipelineSchedule``: stages, micro-batches, schedule) prices each
    stage of a pipeline of the ``TransformerSpec`` (its share of the layers and states,
    its micro-batches in flight, its boundary buffers: ``mixprec.memory.pipeline``) and
    returns the worst (``mixprec.memory.stages.stage_estimates`` returns every one).
    ``expert_parallel=e`` divides the routed experts' parameters and states over ``e``
    ranks and adds one MoE layer's dispatch and combine buffers, ``ep_buffers``
    (``mixprec.memory.expert_dispatch``); a module is counted as it is (after
    ``mixprec.experts.expert_parallel`` cut it, its experts are this rank's).
    """
    if pipeline is not None:
        return worst(stage_estimates(params, recipe, pipeline, optimizer=optimizer,
                                     zero_stage=zero_stage, world_size=world_size,
                                     activations=activations,
                                     expert_parallel=expert_parallel))
    r = Recipe.coerce(recipe)
    opt = optimizer.lower().replace("-", "_")
    if opt not in _STATES:
        raise ValueError(f"optimizer {optimizer!r}; valid: {', '.join(_STATES)}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage {zero_stage!r}; valid: 0, 1, 2, 3")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if isinstance(params, TransformerSpec):
        activations = params if activations is None else activations
        params = param_count(params)
    n = parse_count(params)
    notes = []
    ep_spec = _ep_spec(params, activations, expert_parallel)
    if ep_spec is not None and not isinstance(params, nn.Module):
        n -= expert_params(ep_spec) - expert_params(ep_spec) // expert_parallel
        notes.append(f"expert_parallel={expert_parallel}: the routed experts' weights and "
                     "states divided over the group, the rest whole on each rank")
    dev = torch.device("cpu")
    if isinstance(params, nn.Module):
        dev = next(params.parameters()).device
    on_model = isinstance(params, nn.Module)
    emulated = emulating(r, dev) if on_model else bool(r.precision.emulate)
    # what the model's low-precision activations are stored in: fp32 tensors under
    # emulation, and around fp8 Linears where this device runs those layers in fp32
    act_fp32 = emulated or (r.linear is not None and on_model and fp8_rest(r, dev) == "fp32")
    # a module FSDP2 sharded: its counts are per rank, its items the engine's shards'
    fsdp = on_model and fsdp_sharded(params, zero_stage)
    held = fsdp_held_recipe(r) if fsdp else r
    param_bytes = 4 if emulated else dtype_of(held.precision.params).itemsize
    if emulated and r.precision.params != "fp32":
        notes.append(f"emulated {r.precision.params}: the working copy is stored in fp32 "
                     "tensors")
    if isinstance(params, nn.Module):
        frozen_n, n_tensors, frozen_bytes, fp8_bytes, buffers = _module_counts(params, r)
        n -= frozen_n
        named = [(k, p) for k, p in params.named_parameters() if p.requires_grad]
        sizes = [tuple(rank_local(p).shape) for _, p in named]
        # each parameter's state format: the recipe's states: rule for its module
        formats = [r.state_format(k) for k, _ in named]
    else:
        n_tensors, frozen_bytes, fp8_bytes, buffers = 0, 0.0, 0.0, 0.0
        sizes = formats = None
        if r.linear is not None:
            notes.append("fp8 scaling state needs the module to count its Linears (~0)")
    shard = {k: (world_size if zero_stage >= lvl and not fsdp else 1)
             for k, lvl in (("optimizer", 1), ("grads", 2), ("params", 3))}
    grads_per = (dtype_of(held.precision.grads).itemsize
                 * (2 if r.precision.grad_accum == "kahan" else 1))
    items = {
        "params": (n * param_bytes + frozen_bytes) / shard["params"],
        "grads": n * grads_per / shard["grads"],
        "master": (n * 4 if held.precision.master == "fp32" else 0) / shard["optimizer"],
        "optimizer": (_optimizer_bytes(held, opt, n, sizes, emulated, notes, formats)
                      + 4 * n_tensors * _STATES[opt][1]) / shard["optimizer"],
        "fp8": fp8_bytes,
        "buffers": buffers,
    }
    if ep_spec is not None:
        width = 4.0 if act_fp32 or r.precision.compute in ("fp32", "tf32") else 2.0
        items["ep_buffers"] = ep_buffer_bytes(ep_spec, r, expert_parallel, width)
        notes.append("ep_buffers: one MoE layer's dispatch and combine send and receive "
                     "buffers, a balanced routing (mixprec.memory.expert_dispatch)")
    peak = None
    if isinstance(activations, TransformerSpec):
        share = (fp8_share(params, r) if on_model and r.layer_rules
                 and r.linear is not None else 1.0)
        items["activations"] = _activation_item(activations, r, act_fp32, notes, emulated,
                                                share)
        act_bytes = 4.0 if act_fp32 or r.precision.compute in ("fp32", "tf32") else 2.0
        shapes, expert_shapes = _linear_routes(params, activations, r, emulated, act_fp32)
        if ep_spec is not None and not on_model:  # this rank's experts only
            expert_shapes = expert_shapes[:len(expert_shapes) // expert_parallel]
        items["weight_casts"] = _held_casts(activations, shapes, expert_shapes, on_model)
        if zero_stage == 3 and items["weight_casts"]:
            notes.append("weight_casts under ZeRO-3: each rank keeps the cast of every "
                         "gathered weight, whole, from its forward to its backward "
                         "(not sharded; recompute='full' keeps one layer's)")
        choice = r.linear.fp8_gemm if r.linear is not None else "auto"
        route = fp8_gemm_route(dev, choice) if on_model else (
            "scaled_mm" if choice == "auto" else choice)
        tokens = activations.seq_len * activations.micro_batch
        work = 0.0
        if on_model and moe_experts(params):  # saved and held as its modules run
            rows = routed_rows(params, sample_batch) if sample_batch is not None else None
            items["activations"], work = moe_terms(params, r, tokens, act_bytes, route,
                                                   activations.seq_len, rows,
                                                   activations.experts_route)
            notes.append("activations: a transformers mixture-of-experts model, priced "
                         "from its own modules (mixprec.memory.moe)")
            notes += moe_notes(params)
        steady = sum(v for k, v in items.items() if k not in ("activations",
                                                                "weight_casts",
                                                                "ep_buffers"))
        # gradients that autograd makes afresh each backward (no accumulation buffers)
        # are not yet there when the backward peaks
        fresh = items["grads"] if grads_in_place(held, emulated) else 0.0
        # rows per expert; under expert parallelism each of a rank's experts gets its
        # share of every rank's tokens
        routed = -(-tokens * activations.top_k * expert_parallel
                   // max(activations.experts, 1))
        backward = (sum(items.values()) - fresh
                    + max(work, backward_transient(tokens, shapes, act_bytes, route),
                          backward_transient(routed, expert_shapes, act_bytes, route)))
        if fsdp:
            backward += fsdp_gathered_bytes(params, r, emulated, world_size)
            notes.append(FSDP_NOTE)
        largest = (max((rank_local(p).numel() for p in params.parameters()), default=0)
                   if on_model
                   else max(i * o for i, o, _, _ in spec_linears(activations)))
        after = steady + (step_scratch(largest, pieces.CHUNK) if r.needs_mixprec_optim else 0.0)
        peak = max(backward, after)
        notes.append("peak: steady state + activations + saved weight copies + the "
                     "widest Linear's backward working set (mixprec.memory.transient)")
    elif activations is not None:
        items["activations"] = float(activations)
    return Breakdown(items, str(r), tuple(notes), peak=peak)


def _ep_spec(params: Any, activations: Any, ep: int) -> TransformerSpec | None:
    """The spec expert parallelism is priced on (None: ``ep`` is 1); raises where
    there is none, or the module is not expert-parallel."""
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise ValueError(f"expert_parallel={ep!r}: the expert-parallel group's size, an "
                         "integer >= 1")
    if ep == 1:
        return None
    if not isinstance(activations, TransformerSpec) or not activations.experts:
        raise ValueError(f"expert_parallel={ep} needs a TransformerSpec with experts "
                         "(activations=, or the spec as params; spec_from_config reads "
                         "one off a transformers config): its tokens, top_k and hidden "
                         "size the dispatch buffers")
    if isinstance(params, nn.Module):
        if not expert_parallel_modules(params):
            raise ValueError(f"expert_parallel={ep} for a module that is not "
                             "expert-parallel: call mixprec.experts.expert_parallel(model, "
                             "group) first (its counts are then this rank's), or price "
                             "the spec")
    if activations.experts % ep:
        raise ValueError(f"expert_parallel={ep}: does not divide experts="
                         f"{activations.experts}; use a group size that divides it")
    return activations


def _linear_routes(params, spec: TransformerSpec, r: Recipe, emulated: bool,
                   act_fp32: bool) -> tuple[list[tuple[int, int, Any]], list]:
    """``(in, out, route)`` of each Linear, and of each routed expert's projection
    apart (they see ``top_k/experts`` of the tokens): the module's (its experts are
    priced by ``mixprec.memory.moe``), or a transformer's from ``spec``
    (``mixprec.memory.shapes.spec_linears``: the head and the router at the rest's
    route)."""
    if r.precision.compute in ("fp32", "tf32") or (r.linear is not None and act_fp32):
        rest = "fp32"  # also the layers around fp8 Linears where this device runs fp32
    elif emulated:
        rest = "autocast_emulated"  # each weight's rounded copy, in an fp32 tensor
    elif r.precision.master == "fp32" or r.precision.params != "fp32":
        rest = "weights16"
    else:
        rest = "autocast16"
    fp8 = r.linear
    if isinstance(params, nn.Module):
        # each Linear at its own format: its layer: rule's fp8 preset, or kept in bf16
        recipes = layer_recipes(params, r) if r.linear is not None else {}
        out = []
        for fqn, i, o in linear_shapes(params):
            own = recipes.get(fqn)
            i, o = tp_local(params.get_submodule(fqn), i, o, spec.tensor_parallel)
            out.append((i, o, rest if own is None else own.linear))
        return out, []
    inner = fp8 if r.linear is not None else rest
    shapes, experts = [], []
    for i, o, role, count in spec_linears(spec):
        route = inner if role in ("layer", "expert") else rest
        (experts if role == "expert" else shapes).extend([(i, o, route)] * count)
    return shapes, experts


def _held_casts(spec: TransformerSpec, shapes: list, experts: list, on_model: bool
                ) -> float:
    """The weight casts held at the forward's end: every Linear's, or under
    ``recompute="full"`` (a bare spec) one layer's and the rest's (the head's)."""
    total = saved_weight_bytes(shapes) + saved_weight_bytes(experts)
    if on_model or spec.recompute != "full":
        return total
    head = saved_weight_bytes(shapes[-1:]) if spec.vocab else 0.0  # spec_linears' last
    return head + (total - head) / spec.layers


def _optimizer_bytes(r: Recipe, opt: str, n: int, sizes: list | None,
                     emulated: bool, notes: list[str],
                     formats: list[str] | None = None) -> float:
    """Parameter-sized optimizer state: torch's optimizers keep it in the dtype they
    update; ``mixprec.optim`` (recipes with ``states``, ``states:`` rules or ``write``)
    in each tensor's own format (``formats``, the rules' by name; else the recipe's ``states``;
    small tensors fp32), plus the write rule's 2 bytes per 16-bit weight."""
    per = _STATES[opt][0]
    if not r.needs_mixprec_optim:
        return n * per * _state_bytes(r, emulated)
    if opt not in ("adamw", "adam", "sgd_momentum", "sgd"):
        raise ValueError(f"recipe {str(r)!r} needs a mixprec.optim optimizer (adamw, adam, "
                         f"sgd_momentum or sgd), not {opt!r}")
    settings = recipe_settings(r)
    states, write = settings["states"], settings["write"]
    if sizes is None:
        sizes = [n]  # state_bytes' model of a bare count: rows of whole blocks
        notes.append(f"states={states}: every tensor counted as quantized (a module "
                     "counts the small ones in fp32)")
        if r.state_rules:
            notes.append("states: rules match parameter names: pass the module to "
                         f"apply them (a bare count is priced at states={states})")
    if formats is None:
        formats = [states] * len(sizes)
    weights16 = r.precision.params != "fp32" and r.precision.master == "none"
    weight_bytes = 4 if emulated else 2  # emulated 16-bit weights live in fp32 tensors
    total = 0
    for k, fmt in zip(sizes, formats):  # a shape, or a bare count
        total += per * state_bytes(fmt, k)
        if weights16:
            total += write_bytes(write, k if isinstance(k, int) else math.prod(k),
                                 weight_bytes)
    return total


def _module_counts(model: nn.Module, r: Recipe):
    """``(frozen elements, trained tensors, frozen bytes, fp8 state bytes, buffer
    bytes)``. Frozen parameters have no gradient, master or optimizer state, and the
    engine leaves them in the dtype they have."""
    uniq = {id(p): p for p in model.parameters()}
    frozen = [p for p in uniq.values() if not p.requires_grad]
    fp8_bytes, fp8_bufs = _fp8_state_bytes(model, r)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers()
                  if id(b) not in fp8_bufs)
    return (sum(rank_local(p).numel() for p in frozen), len(uniq) - len(frozen),
            sum(rank_local(p).numel() * p.element_size() for p in frozen), fp8_bytes, buffers)


def _activation_item(spec: TransformerSpec, r: Recipe, act_fp32: bool,
                     notes: list[str], emulated: bool = False,
                     fp8_share: float = 1.0) -> float:
    """Activation bytes of a transformer: fp32 norms and softmax where the recipe keeps
    them (unless the spec says), values of the recipe's compute width. Under emulation
    the fused attention's output is saved twice: the emulated kernel keeps its own
    fp32 output, and the projection its contiguous input (one more ``4·s·b·h`` a
    layer). Under fp8, ``fp8_share`` of the Linears' inputs
    (``mixprec.memory.layers.fp8_share``) are saved as 1-byte codes and the rest at
    the compute width."""
    per = 4 if act_fp32 else {"fp32": 4, "tf32": 4}.get(r.precision.compute, 2)
    islands = r.has_fp32_islands
    if spec.fp32_norms is None:
        spec = dataclasses.replace(
            spec, fp32_norms=islands and "layer_norm" in r.precision.keep_fp32)
    if spec.fp32_softmax is None:
        spec = dataclasses.replace(
            spec, fp32_softmax=islands and "softmax" in r.precision.keep_fp32)
    notes.append(f"activations: Korthikanti et al. 2022, attention={spec.attention}, "
                 f"recompute={spec.recompute}, {per}-byte values")
    # a format that leaves wgrad in 16 bits saves the Linears' inputs unquantized
    codes = r.linear is not None and "wgrad" in r.linear.quantized_gemms
    total = activation_bytes(spec, per, 1 if codes else None)
    if r.linear is not None and fp8_share < 1.0:
        # layer: rules keep some Linears in bf16: their inputs are saved unquantized
        total = fp8_share * total + (1 - fp8_share) * activation_bytes(spec, per)
        notes.append(f"activations: {fp8_share:.0%} of the Linears' inputs (by "
                     "in_features) saved in fp8, the rest kept in bf16 by layer: rules")
    if emulated and spec.attention == "flash" and spec.recompute == "none":
        total += spec.layers * 4.0 * spec.seq_len * spec.micro_batch * spec.hidden
    return total


def _fp8_state_bytes(model: nn.Module, r: Recipe) -> tuple[float, set[int]]:
    existing = list(fp8_modules(model).values())
    bufs = [b for m in existing for b in scaling_buffers(m).values()]
    ids = {id(b) for b in bufs}
    if existing:
        return float(sum(b.numel() * b.element_size() for b in bufs)), ids
    if r.linear is None:
        return 0.0, ids
    # what each Linear's quantizer keeps: delayed scaling's history, scales and maxima,
    # NVFP4's stochastic-rounding counter; nothing for the others
    total = 0
    for own in layer_recipes(model, r).values():
        if own is not None:
            total += sum(t.numel() * t.element_size()
                         for t, _ in quantizer_for(own).buffers("meta").values())
    return float(total), ids


def stage_estimates(params: TransformerSpec, recipe: Recipe | str,
                    pipeline: PipelineSchedule, *, optimizer: str = "adamw",
                    zero_stage: int = 0, world_size: int = 1,
                    activations: TransformerSpec | None = None,
                    expert_parallel: int = 1) -> list[Breakdown]:
    """Each stage's (rank's) bytes under ``pipeline``: its parameters, gradients,
    masters and optimizer states (a step count per tensor included), one micro-batch's
    activations times its micro-batches in flight, its boundary buffers
    (``pp_buffers``), and the peak of its step (``mixprec.memory.stages``).
    ``zero_stage`` and ``world_size`` describe each stage's data-parallel dimension,
    ``expert_parallel`` its experts' (``estimate``)."""
    return stage_breakdowns(params, recipe, pipeline, estimate=estimate, states=_STATES,
                            optimizer=optimizer, zero_stage=zero_stage,
                            world_size=world_size, activations=activations,
                            expert_parallel=expert_parallel)
