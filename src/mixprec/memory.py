"""Predict and measure every byte a recipe costs.

``estimate(params, recipe, ...)`` predicts bytes per rank, item by item:

| item | bytes per parameter |
|---|---|
| ``params`` (the working copy) | size of ``recipe.params`` |
| ``grads`` (accumulation buffers) | size of ``recipe.grads``, twice with ``grad_accum=kahan`` |
| ``master`` | 4 with ``master=fp32`` |
| ``optimizer`` | per state: 4 with masters, else the size of ``params`` |

AdamW keeps 2 states per parameter, SGD with momentum 1, plain SGD 0; Adagrad and
RMSprop 1, Adadelta, Adamax, NAdam and RAdam 2 (torch's defaults).

Plus ``fp8`` (amax histories and scales of each Float8Linear), ``buffers`` (BatchNorm
statistics and the like) and ``activations`` (a transformer spec, or a figure you
measured). For a module the count is exact: shared parameters are counted once, and the
optimizer's per-tensor ``step`` counters are included.

ZeRO stages (Rajbhandari et al. 2020) divide by ``world_size``: stage 1 shards the
optimizer states **and the fp32 masters** (they are optimizer state in ZeRO's
accounting, K = 12 bytes for mixed-precision Adam), stage 2 also the gradients, and stage
3 also the working parameters. FSDP2's ``fully_shard`` is stage 3.

``measure(model, engine_or_optimizer, sample_batch)`` counts the bytes that actually
exist, by storage (a storage shared by two tensors counts once). It also counts the
bytes saved for backward in one forward pass, through
``torch.autograd.graph.saved_tensors_hooks``, split into activations and low-precision
weight copies made by autocast or fp8 casts.

Units: ``GB`` means 10^9 bytes, as the seeds and the ZeRO paper use.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from mixprec.recipe import Recipe
from mixprec.wgrad import WEIGHT_CAST_TAG

__all__ = ["Breakdown", "TransformerSpec", "estimate", "measure", "parse_count",
           "activation_bytes", "ITEMS"]

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
    per = 2 * norm + li + 3 * v + v + li + f * v + f * li
    if li != v:
        per += li  # fp8: the projection saves its own fp8 copy of the attention output
    per *= sbh
    if spec.dropout:
        per += 2 * sbh
    if spec.recompute == "none":
        if spec.attention == "flash":
            per += 4.0 * a * s * b
        else:
            soft = (4.0 + v) if spec.fp32_softmax else v
            per += a * s * s * b * (soft + (1 + v if spec.dropout else 0))
    return spec.layers * per + total_extra


_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_count(params: int | float | str | nn.Module) -> int:
    """A parameter count from ``70B``, ``7.5e9``, ``350M``, an int, or a module."""
    if isinstance(params, nn.Module):
        return sum(p.numel() for p in params.parameters())
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


def _state_bytes(r: Recipe, param_bytes: int) -> int:
    return 4 if r.master == "fp32" else param_bytes


def estimate(
    params: int | float | str | nn.Module,
    recipe: Recipe | str,
    optimizer: str = "adamw",
    zero_stage: int = 0,
    world_size: int = 1,
    activations: TransformerSpec | float | None = None,
) -> Breakdown:
    """Bytes per rank of each item for ``params`` trained with ``recipe``.

    >>> round(estimate("70B", "fp32").gb())       # seed 000 §1: ~1120 GB
    1120

    For a module, frozen parameters (``requires_grad=False``) count in ``params`` at
    their own dtype and have no gradient, master or optimizer state. Emulation is
    resolved on its device (fp16 on a CPU is emulated by default, and its working
    copy then lives in fp32 tensors). For a bare count, only
    ``emulate=true`` counts as emulated.
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
    from mixprec.kernels import emulating, fp8_rest

    dev = torch.device("cpu")
    if isinstance(params, nn.Module):
        dev = next(params.parameters()).device
    on_model = isinstance(params, nn.Module)
    emulated = emulating(r, dev) if on_model else bool(r.emulate)
    # what the model's low-precision activations are stored in: fp32 tensors under
    # emulation, and around fp8 Linears where this device runs those layers in fp32
    act_fp32 = emulated or (r.compute == "fp8" and on_model and fp8_rest(r, dev) == "fp32")
    param_bytes = 4 if emulated else _BYTES[r.params]
    if emulated and r.params != "fp32":
        notes.append(f"emulated {r.params}: the working copy is stored in fp32 tensors")
    n_tensors = 0
    buffers = fp8_bytes = frozen_bytes = 0.0
    if isinstance(params, nn.Module):
        uniq = {id(p): p for p in params.parameters()}
        # frozen parameters have no gradient, master or optimizer state, and the engine
        # leaves them in the dtype they have
        frozen = [p for p in uniq.values() if not p.requires_grad]
        frozen_bytes = sum(p.numel() * p.element_size() for p in frozen)
        n -= sum(p.numel() for p in frozen)
        n_tensors = len(uniq) - len(frozen)
        fp8_bytes, fp8_bufs = _fp8_state_bytes(params, r)
        buffers = sum(b.numel() * b.element_size() for b in params.buffers()
                      if id(b) not in fp8_bufs)
    elif r.compute == "fp8":
        notes.append("fp8 scaling state needs the module to count its Linears (~0)")
    shard = {k: (world_size if zero_stage >= lvl else 1)
             for k, lvl in (("optimizer", 1), ("grads", 2), ("params", 3))}
    grads_per = _BYTES[r.grads] * (2 if r.grad_accum == "kahan" else 1)
    items = {
        "params": (n * param_bytes + frozen_bytes) / shard["params"],
        "grads": n * grads_per / shard["grads"],
        "master": (n * 4 if r.master == "fp32" else 0) / shard["optimizer"],
        "optimizer": (n * _STATES[opt][0] * _state_bytes(r, param_bytes)
                      + 4 * n_tensors * _STATES[opt][1]) / shard["optimizer"],
        "fp8": fp8_bytes,
        "buffers": buffers,
    }
    if isinstance(activations, TransformerSpec):
        per = 4 if act_fp32 else {"fp32": 4, "tf32": 4}.get(r.compute, 2)
        islands = r.has_fp32_islands
        spec = activations
        if spec.fp32_norms is None:
            spec = dataclasses.replace(spec, fp32_norms=islands and "layer_norm" in r.keep_fp32)
        if spec.fp32_softmax is None:
            spec = dataclasses.replace(spec, fp32_softmax=islands and "softmax" in r.keep_fp32)
        activations = spec
        items["activations"] = activation_bytes(spec, per, 1 if r.compute == "fp8" else None)
        notes.append(f"activations: Korthikanti et al. 2022, attention={activations.attention}, "
                     f"recompute={activations.recompute}, {per}-byte values")
    elif activations is not None:
        items["activations"] = float(activations)
    return Breakdown(items, str(r), tuple(notes))


def _fp8_state_bytes(model: nn.Module, r: Recipe) -> tuple[float, set[int]]:
    from mixprec.fp8.convert import plan
    from mixprec.fp8.linear import Float8Linear

    existing = [m for m in model.modules() if isinstance(m, Float8Linear)]
    ids = {id(b) for m in existing for b in (m.fp8_amax_history, m.fp8_scale, m.fp8_max)}
    per_module = (3 * r.amax_history_len + 3 + 3) * 4  # history, scale, fp8_max
    if existing:
        return float(len(existing) * per_module), ids
    if r.compute != "fp8":
        return 0.0, ids
    eligible = sum(1 for _, _, why in plan(model) if why is None)
    return float(eligible * per_module), ids


# --- measuring ---------------------------------------------------------------------------

def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


class _Ledger:
    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.items: dict[str, float] = {}

    def add(self, item: str, tensors: Iterable[torch.Tensor | None]) -> None:
        for t in tensors:
            if t is None or not isinstance(t, torch.Tensor):
                continue
            ptr, nbytes = _storage_key(t)
            if ptr == 0 and nbytes == 0 or ptr in self.seen:
                continue
            self.seen.add(ptr)
            self.items[item] = self.items.get(item, 0.0) + nbytes


def measure(model: nn.Module, engine_or_optimizer, sample_batch=None, *,
            loss_fn: Callable | None = None) -> Breakdown:
    """Exact bytes held for ``model`` and its engine (or plain optimizer), by storage.

    With ``sample_batch`` it also runs one forward pass, inside the engine's precision
    context when given an engine, and counts what autograd saves for backward. The
    tensors are deduplicated by storage and split into ``activations`` and
    ``weight_casts`` (bf16/fp8 copies of weights made by autocast or fp8 casts).
    ``sample_batch`` is a tensor or a tuple of model inputs. Buffers such as BatchNorm
    statistics and fp8 amax histories are restored afterwards, so measuring changes
    nothing. On CUDA the breakdown also notes ``torch.cuda.max_memory_allocated``.
    Optimizer states exist only after the first ``step()``: measure after one.
    """
    from mixprec.fp8.linear import Float8Linear

    engine = engine_or_optimizer if hasattr(engine_or_optimizer, "grads") else None
    optimizers = (engine.optimizers if engine is not None else
                  [engine_or_optimizer] if engine_or_optimizer is not None else [])
    led = _Ledger()
    params = list({id(p): p for p in model.parameters()}.values())
    led.add("params", params)
    fp8_bufs = [b for m in model.modules() if isinstance(m, Float8Linear)
                for b in (m.fp8_amax_history, m.fp8_scale, m.fp8_max)]
    led.add("fp8", fp8_bufs)
    led.add("buffers", model.buffers())
    if engine is not None and engine.grads.has_master:
        led.add("master", engine.grads.masters)
    grads = [p.grad for p in params]
    if engine is not None:
        grads += engine.grads.bufs + engine.grads.comps
        grads += [q.grad for q in engine.grads.opt_params]
    led.add("grads", grads)
    for o in optimizers:
        led.add("optimizer", (v for st in o.state.values() for v in st.values()
                              if isinstance(v, torch.Tensor)))
    notes = []
    if sample_batch is not None:
        _measure_forward(model, engine, sample_batch, loss_fn, led, params)
        notes.append("activations: saved tensors of one forward pass, by storage")
    dev = params[0].device if params else torch.device("cpu")
    if dev.type == "cuda":
        notes.append(f"cuda max_memory_allocated: {torch.cuda.max_memory_allocated(dev)}")
    items = {k: led.items.get(k, 0.0) for k in ITEMS if k in led.items}
    recipe = str(engine.recipe) if engine is not None else "(optimizer only)"
    return Breakdown(items, recipe, tuple(notes))


_VIEW_NODES = ("TBackward", "ViewBackward", "TransposeBackward", "PermuteBackward",
               "UnsafeViewBackward", "ExpandBackward", "ReshapeAliasBackward")


def _is_weight_cast(t: torch.Tensor, param_ids: set[int], shapes: set) -> bool:
    if getattr(t, WEIGHT_CAST_TAG, False):  # cast inside mixprec.wgrad's Linear
        return True
    fn = t.grad_fn
    for _ in range(4):  # through views (t(), view, transpose) to the cast itself
        if fn is None or type(fn).__name__.startswith("ToCopyBackward"):
            break
        if not type(fn).__name__.startswith(_VIEW_NODES) or len(fn.next_functions) != 1:
            return False
        fn = fn.next_functions[0][0]
    if fn is not None and type(fn).__name__.startswith("ToCopyBackward"):
        nxt = fn.next_functions[0][0] if fn.next_functions else None
        var = getattr(nxt, "variable", None)
        return var is not None and id(var) in param_ids
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    return fn is None and t.dtype in fp8 and (tuple(t.shape), t.dtype) in shapes


def _measure_forward(model, engine, batch, loss_fn, led: _Ledger, params) -> None:
    param_ids = {id(p) for p in params}
    # fp8 weight copies have the weight's shape, or its transpose (a GPT-2 Conv1D's
    # (in, out) weight is cast as (out, in))
    shapes = {(shape, dt) for p in params for shape in (tuple(p.shape), tuple(p.shape)[::-1])
              for dt in (torch.float8_e4m3fn, torch.float8_e5m2)}
    state_ptrs = {_storage_key(t)[0] for t in [*params, *model.buffers()]}
    saved: list[tuple[str, torch.Tensor]] = []

    def pack(t):
        if isinstance(t, torch.Tensor) and _storage_key(t)[0] not in state_ptrs:
            kind = "weight_casts" if _is_weight_cast(t, param_ids, shapes) else "activations"
            saved.append((kind, t))
        return t

    snapshot = {k: v.clone() for k, v in model.state_dict(keep_vars=False).items()
                if k in dict(model.named_buffers())}
    inputs = batch if isinstance(batch, (tuple, list)) else (batch,)
    ctx = engine.autocast() if engine is not None else torch.autocast("cpu", enabled=False)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
            out = model(*inputs)
            if loss_fn is not None:
                out = loss_fn(out)
        del out
    finally:
        with torch.no_grad():
            named = dict(model.named_buffers())
            for k, v in snapshot.items():
                named[k].copy_(v)
    for kind in ("weight_casts", "activations"):
        led.add(kind, [t for k, t in saved if k == kind])
