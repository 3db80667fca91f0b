"""Predict the bytes a recipe costs, item by item (``mixprec.memory`` explains the
accounting)."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from mixprec.master import grads_in_place, updated_dtype
from mixprec.memory.fsdp import FSDP_NOTE, fsdp_gathered_bytes, fsdp_held_recipe, fsdp_sharded
from mixprec.memory.layers import fp8_share, layer_recipes
from mixprec.memory.moe import moe_experts, moe_notes, moe_terms
from mixprec.memory.transient import (
    backward_transient,
    linear_shapes,
    saved_weight_bytes,
    step_scratch,
    tp_local,
)
from mixprec.recipe import Recipe

__all__ = ["Breakdown", "TransformerSpec", "estimate", "parse_count", "parse_bytes",
           "activation_bytes",
           "ITEMS", "GB"]

ITEMS = ("params", "grads", "master", "optimizer", "fp8", "buffers", "activations",
         "weight_casts")
_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# torch optimizer -> (parameter-sized states, 0-dim fp32 tensors per parameter such as
# the step count), for torch's defaults (no amsgrad, no RMSprop momentum/centering)
_STATES = {"adamw": (2, 1), "adam": (2, 1), "sgd_momentum": (1, 0), "sgd": (0, 0),
           "adagrad": (1, 1), "rmsprop": (1, 1), "adadelta": (2, 1), "adamax": (2, 1),
           "nadam": (2, 2), "radam": (2, 1)}
GB = 1e9


@dataclass(frozen=True)
class Breakdown:
    """Bytes per rank by item, plus what the numbers assumed."""

    items: dict[str, float]
    recipe: str
    notes: tuple[str, ...] = field(default=())
    #: the highest bytes held during one training step (forward, backward and optimizer
    #: step): ``measure(..., peak=True)``'s measured high-water mark, or ``estimate``'s
    #: prediction when it has a transformer spec; None when not known
    peak: float | None = None

    @property
    def total(self) -> float:
        """Sum of all items, in bytes."""
        return float(sum(self.items.values()))

    def __getitem__(self, item: str) -> float:
        return self.items.get(item, 0.0)

    def gb(self, item: str | None = None) -> float:
        """One item, or the total, in GB (1e9 bytes)."""
        return (self.total if item is None else self[item]) / GB

    def table(self) -> str:
        """Plain-text table of the items in GB, with the notes."""
        rows = [f"{'item':<13}{'GB':>12}"]
        rows += [f"{k:<13}{v / GB:>12.3f}" for k, v in self.items.items() if v]
        rows.append(f"{'total':<13}{self.total / GB:>12.3f}")
        if self.peak is not None:
            rows.append(f"{'peak':<13}{self.peak / GB:>12.3f}")
        return "\n".join(rows + [f"  note: {n}" for n in self.notes])


@dataclass(frozen=True, kw_only=True)
class TransformerSpec:
    """Shapes for the activation formula of Korthikanti et al. 2022 (§4.1).

    With the defaults (16-bit activations, dropout, nothing kept in fp32, no ``vocab``)
    it is the paper's per-layer ``s·b·h·(34 + 5·a·s/h)`` bytes times ``layers``:
    ``34·s·b·h`` = 2 norm inputs (2+2) + QKV input (2) + Q, K, V (6) + projection input
    (2) + MLP input (2) + fc output (8) + GELU output (8) + two dropout masks (1+1), and
    ``5·a·s²·b`` = softmax output (2) + its dropout mask (1) + dropout output (2).

    Each term follows what a run really saves:

    - ``attention="flash"`` (``F.scaled_dot_product_attention``'s fused kernels) saves no
      s×s matrix, only its fp32 log-sum-exp (``4·a·s·b``);
    - ``dropout=False`` drops the masks and the dropout output;
    - ``fp32_norms`` / ``fp32_softmax`` (mixprec's FP32 islands; ``estimate`` sets them
      from the recipe's ``keep_fp32``): the norm inputs are saved as fp32 copies, and the
      fp32 softmax output is saved together with the low-precision copy that the PV
      matmul takes;
    - ``linear_input_bytes`` (1 under fp8 recipes, whose Linears save fp8 copies of their
      inputs); ``vocab``: the output layer's input, and the fp32 logits of the loss
      (``4·s·b·V``), plus the final norm;
    - recomputation: ``selective`` drops the s×s terms, ``full`` keeps each layer's input.
    """

    layers: int
    hidden: int
    heads: int
    seq_len: int
    micro_batch: int = 1
    ffn_mult: int = 4
    vocab: int | None = None
    attention: Literal["materialized", "flash"] = "materialized"
    recompute: Literal["none", "selective", "full"] = "none"
    dropout: bool = True
    fp32_norms: bool | None = None
    fp32_softmax: bool | None = None
    #: tensor-parallel ranks: Q, K, V, the attention and the MLP's hidden values are
    #: split over them (Korthikanti et al. §4.2.2: ``s·b·h·(10 + 24/t + 5·a·s/(h·t))``);
    #: the norms, the Linears' replicated inputs and the head stay whole
    tensor_parallel: int = 1
    #: Linears that read the attention's input: 1 (a fused QKV) or 3 (separate q, k, v);
    #: each casts and saves its own copy where the input is cast (16 bits, fp8)
    qkv_linears: Literal[1, 3] = 1


def activation_bytes(spec: TransformerSpec, bytes_per_value: float = 2.0,
                     linear_input_bytes: float | None = None) -> float:
    """Bytes saved for backward by one forward pass (see TransformerSpec)."""
    s, b, h, a, f = spec.seq_len, spec.micro_batch, spec.hidden, spec.heads, spec.ffn_mult
    v = bytes_per_value
    li = v if linear_input_bytes is None else linear_input_bytes
    sbh = s * b * h
    norm = 4.0 if spec.fp32_norms else v
    total_extra = 0.0
    if spec.vocab:
        total_extra = (norm + li) * sbh + 4.0 * s * b * spec.vocab
    if spec.recompute == "full":
        return spec.layers * v * sbh + total_extra
    # norms, QKV input, Q/K/V, attention output (the projection's input), MLP input,
    # fc output (GELU's input), GELU output (the second Linear's input)
    tp = spec.tensor_parallel
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel={tp!r}: the number of tensor-parallel ranks, "
                         "an integer >= 1")
    split = 3 * v + v + f * v + f * li  # Q/K/V, attention output, fc and GELU outputs
    if li != v:
        split += li  # fp8: the projection saves its own fp8 copy of the attention output
    if spec.qkv_linears not in (1, 3):
        raise ValueError(f"qkv_linears={spec.qkv_linears!r}: 1 (a fused QKV Linear) or 3 "
                         "(separate q, k and v Linears)")
    # separate q, k, v Linears each keep their own cast of the input (none in fp32)
    copies = spec.qkv_linears if li < 4 else 1
    per = (2 * norm + copies * li + li + split / tp) * sbh
    if spec.dropout:
        per += 2 * sbh
    if spec.recompute == "none":
        if spec.attention == "flash":
            per += 4.0 * a * s * b / tp
        else:
            soft = (4.0 + v) if spec.fp32_softmax else v
            per += a * s * s * b * (soft + (1 + v if spec.dropout else 0)) / tp
    return spec.layers * per + total_extra


_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(params: int | float | str | nn.Module) -> int:
    """A parameter count from ``70B``, ``7.5e9``, ``350M``, an int, or a module."""
    if isinstance(params, nn.Module):
        return sum(_local(p).numel() for p in params.parameters())
    if isinstance(params, (int, float)) and not isinstance(params, bool):
        if params <= 0 or not math.isfinite(params):
            raise ValueError(f"parameter count must be > 0, got {params!r}")
        return int(params)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmbgt]?)\s*",
                     str(params).lower())
    if not m:
        raise ValueError(f"parameter count {params!r}: expected a number with an optional "
                         "K/M/B/T suffix, e.g. '70B', '7.5e9', '350M'")
    return parse_count(float(m.group(1)) * _SUFFIX[m.group(2)])


def parse_bytes(size: int | float | str, what: str = "size") -> float:
    """Bytes from ``80GB``, ``80G``, ``512MB``, ``24GiB``, ``141e9`` or a number;
    ``what`` names the argument in the error (``--device-memory``, ``memory``).

    >>> parse_bytes("24GiB"), parse_bytes("512MB"), parse_bytes(2e9)
    (25769803776.0, 512000000.0, 2000000000.0)
    """
    if isinstance(size, (int, float)) and not isinstance(size, bool):
        if size > 0 and math.isfinite(size):
            return float(size)
        raise ValueError(f"{what}={size!r}: a positive number of bytes, or e.g. 2GB")
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*"
                     r"(gib|gb|g|mib|mb|m|kib|kb|k|tib|tb|t|b)?\s*", str(size).lower())
    if not m:
        raise ValueError(f"{what}={size!r}: expected e.g. 80GB, 512MB, 24GiB or 141e9")
    return float(m.group(1)) * _UNITS[m.group(2)]


_UNITS = {None: 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6,
          "mib": 2**20, "g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12,
          "tib": 2**40}


def _state_bytes(r: Recipe, emulated: bool) -> int:
    """Bytes per element of the tensors the optimizer updates (its states match them)."""
    return updated_dtype(r, emulated).itemsize


def estimate(
    params: int | float | str | nn.Module,
    recipe: Recipe | str,
    optimizer: str = "adamw",
    zero_stage: int = 0,
    world_size: int = 1,
    activations: TransformerSpec | float | None = None,
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
    """
    r = Recipe.coerce(recipe)
    opt = optimizer.lower().replace("-", "_")
    if opt not in _STATES:
        raise ValueError(f"optimizer {optimizer!r}; valid: {', '.join(_STATES)}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage {zero_stage!r}; valid: 0, 1, 2, 3")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    n = parse_count(params)
    notes = []
    from mixprec.kernels import emulating, fp8_gemm_route, fp8_rest

    dev = torch.device("cpu")
    if isinstance(params, nn.Module):
        dev = next(params.parameters()).device
    on_model = isinstance(params, nn.Module)
    emulated = emulating(r, dev) if on_model else bool(r.emulate)
    # what the model's low-precision activations are stored in: fp32 tensors under
    # emulation, and around fp8 Linears where this device runs those layers in fp32
    act_fp32 = emulated or (r.linear is not None and on_model and fp8_rest(r, dev) == "fp32")
    # a module FSDP2 sharded: its counts are per rank, its items the engine's shards'
    fsdp = on_model and fsdp_sharded(params, zero_stage)
    held = fsdp_held_recipe(r) if fsdp else r
    param_bytes = 4 if emulated else _BYTES[held.params]
    if emulated and r.params != "fp32":
        notes.append(f"emulated {r.params}: the working copy is stored in fp32 tensors")
    if isinstance(params, nn.Module):
        frozen_n, n_tensors, frozen_bytes, fp8_bytes, buffers = _module_counts(params, r)
        n -= frozen_n
        named = [(k, p) for k, p in params.named_parameters() if p.requires_grad]
        sizes = [tuple(_local(p).shape) for _, p in named]
        # each parameter's state format: the recipe's states: rule for its module
        formats = [r.state_format(k) for k, _ in named]
    else:
        n_tensors, frozen_bytes, fp8_bytes, buffers = 0, 0.0, 0.0, 0.0
        sizes = formats = None
        if r.linear is not None:
            notes.append("fp8 scaling state needs the module to count its Linears (~0)")
    shard = {k: (world_size if zero_stage >= lvl and not fsdp else 1)
             for k, lvl in (("optimizer", 1), ("grads", 2), ("params", 3))}
    grads_per = _BYTES[held.grads] * (2 if r.grad_accum == "kahan" else 1)
    items = {
        "params": (n * param_bytes + frozen_bytes) / shard["params"],
        "grads": n * grads_per / shard["grads"],
        "master": (n * 4 if held.master == "fp32" else 0) / shard["optimizer"],
        "optimizer": (_optimizer_bytes(held, opt, n, sizes, emulated, notes, formats)
                      + 4 * n_tensors * _STATES[opt][1]) / shard["optimizer"],
        "fp8": fp8_bytes,
        "buffers": buffers,
    }
    peak = None
    if isinstance(activations, TransformerSpec):
        share = (fp8_share(params, r) if on_model and r.layer_rules
                 and r.linear is not None else 1.0)
        items["activations"] = _activation_item(activations, r, act_fp32, notes, emulated,
                                                share)
        act_bytes = 4.0 if act_fp32 or r.compute in ("fp32", "tf32") else 2.0
        shapes = _linear_routes(params, activations, r, emulated, act_fp32)
        items["weight_casts"] = saved_weight_bytes(shapes)
        choice = r.linear.fp8_gemm if r.linear is not None else "auto"
        route = fp8_gemm_route(dev, choice) if on_model else (
            "scaled_mm" if choice == "auto" else choice)
        tokens = activations.seq_len * activations.micro_batch
        work = 0.0
        if on_model and moe_experts(params):  # saved and held as its modules run
            items["activations"], work = moe_terms(params, r, tokens, act_bytes, route,
                                                      activations.seq_len)
            notes.append("activations: a transformers mixture-of-experts model, priced "
                         "from its own modules (mixprec.memory.moe)")
            notes += moe_notes(params)
        steady = sum(v for k, v in items.items() if k not in ("activations",
                                                                "weight_casts"))
        # gradients that autograd makes afresh each backward (no accumulation buffers)
        # are not yet there when the backward peaks
        fresh = items["grads"] if grads_in_place(held, emulated) else 0.0
        backward = (sum(items.values()) - fresh
                    + max(work, backward_transient(tokens, shapes, act_bytes, route)))
        if fsdp:
            backward += fsdp_gathered_bytes(params, r, emulated, world_size)
            notes.append(FSDP_NOTE)
        largest = (max((_local(p).numel() for p in params.parameters()), default=0)
                   if on_model
                   else activations.ffn_mult * activations.hidden ** 2)  # an MLP weight
        from mixprec.optim.pieces import CHUNK

        after = steady + (step_scratch(largest, CHUNK) if r.needs_mixprec_optim else 0.0)
        peak = max(backward, after)
        notes.append("peak: steady state + activations + saved weight copies + the "
                     "widest Linear's backward working set (mixprec.memory.transient)")
    elif activations is not None:
        items["activations"] = float(activations)
    return Breakdown(items, str(r), tuple(notes), peak=peak)


def _linear_routes(params, spec: TransformerSpec, r: Recipe, emulated: bool,
                   act_fp32: bool) -> list[tuple[int, int, str]]:
    """``(in, out, route)`` of each Linear: the module's, or a transformer's from
    ``spec`` (QKV, projection, the two MLP Linears per layer, and the head)."""
    if r.compute in ("fp32", "tf32") or (r.linear is not None and act_fp32):
        rest = "fp32"  # also the layers around fp8 Linears where this device runs fp32
    elif emulated:
        rest = "autocast_emulated"  # each weight's rounded copy, in an fp32 tensor
    elif r.master == "fp32" or r.params != "fp32":
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
        return out
    h, f = spec.hidden, spec.ffn_mult
    inner = fp8 if r.linear is not None else rest
    per_layer = [(h, 3 * h, inner), (h, h, inner), (h, f * h, inner), (f * h, h, inner)]
    head = [(h, spec.vocab, rest)] if spec.vocab else []
    return per_layer * spec.layers + head


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
    from mixprec.optim import recipe_settings
    from mixprec.optim.states import state_bytes
    from mixprec.optim.writes import write_bytes

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
    weights16 = r.params != "fp32" and r.master == "none"
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
    return (sum(_local(p).numel() for p in frozen), len(uniq) - len(frozen),
            sum(_local(p).numel() * p.element_size() for p in frozen), fp8_bytes, buffers)


def _local(p: torch.Tensor) -> torch.Tensor:
    """What this rank stores of ``p``: a DTensor's local shard (a tensor-parallel plan's
    or FSDP's), else ``p``; so a module's counts are per rank, replicated tensors whole."""
    return p.to_local() if hasattr(p, "to_local") else p


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
    per = 4 if act_fp32 else {"fp32": 4, "tf32": 4}.get(r.compute, 2)
    islands = r.has_fp32_islands
    if spec.fp32_norms is None:
        spec = dataclasses.replace(spec, fp32_norms=islands and "layer_norm" in r.keep_fp32)
    if spec.fp32_softmax is None:
        spec = dataclasses.replace(spec, fp32_softmax=islands and "softmax" in r.keep_fp32)
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
    from mixprec.fp8.linear import fp8_modules, scaling_buffers
    from mixprec.fp8.quantizers import quantizer_for

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

