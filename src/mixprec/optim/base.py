"""What every ``mixprec.optim`` optimizer shares: its settings, what it takes from an
engine, the step and the weight writes.

``LowPrecisionOptimizer`` is put together from one part per concept: the state format
of each parameter (``per_param``), the update of a tensor in pieces of rows
(``pieces``), DTensor shards (``sharding``) and checkpoints (``state_dict``). Adam and
SGD (``adam``, ``sgd``) add the update's math, torch's single-tensor one op for op.
With fp32 states and fp32 weights nothing is decoded or encoded, so the step is
torch's, bit for bit.

**Skipping.** ``found_inf`` / ``grad_scale`` come as torch's fused optimizers take them
from ``GradScaler``: attributes set around ``step()`` (or the keywords of the same
names). A CPU ``found_inf`` is read directly (free there) and a skipped step returns
before touching anything. On another device the step runs on copies and commits them
with ``torch.where(found_inf, old, new)``: no host sync, and a skipped step leaves every
state, the weight and the step count bit-identical. Its bias corrections are then
computed from the step tensor on the device (as torch's ``capturable=True``).

**Weights without masters.** A bf16/fp16 parameter is read into fp32 by the write
rule (``mixprec.optim.writes``: with its compensation or remainder), updated there and
written back by it. fp32 parameters are updated in place.

**From an engine** (``bind``): an ``EngineBinding`` carries the fp32 gradients of
16-bit weights (so they update from fp32 gradients rather than a 16-bit copy) and the
format that emulated weights hold (fp32 tensors holding bf16 values, written as bf16
weights are). Without one, the optimizer steps on ``p.grad``, as torch's do.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from mixprec.formats import elements as formats
from mixprec.optim.per_param import StateFormats
from mixprec.optim.pieces import PieceLoop, commit
from mixprec.optim.sharding import ShardedUpdate, is_dtensor, shard_like
from mixprec.optim.state_dict import Checkpoints
from mixprec.optim.states import STATE_FORMATS
from mixprec.optim.writes import WRITE_RULES, Stream, split_remainder, write_rule

if TYPE_CHECKING:
    from torch.optim.optimizer import ParamsT

__all__ = ["LowPrecisionOptimizer", "EngineBinding"]

_HALF = ("bf16", "fp16")


@dataclass(frozen=True, kw_only=True)
class EngineBinding:
    """What an engine hands a ``LowPrecisionOptimizer`` once, at setup (``bind``).

    >>> import torch
    >>> from mixprec.optim import AdamW, EngineBinding
    >>> w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    >>> grad_fp32 = torch.full((4,), 0.5)
    >>> opt = AdamW([w], lr=0.1)
    >>> opt.bind(EngineBinding(grads={id(w): grad_fp32}))
    >>> opt.step()  # reads grad_fp32, not w.grad
    """

    #: the fp32 gradient of each parameter it has one for, keyed by ``id()`` of the
    #: tensor the optimizer updates; the others step on ``p.grad``
    grads: Mapping[int, torch.Tensor] | None = None
    #: the format fp32 weights hold under mixprec's emulation (``"bf16"``, ``"fp16"``):
    #: they are then written as weights of that format (None: real fp32 weights)
    emulated_format: Literal["bf16", "fp16"] | None = None

    def __post_init__(self) -> None:
        if self.emulated_format not in (None, *_HALF):
            raise ValueError(
                f"EngineBinding(emulated_format={self.emulated_format!r}); valid: None, "
                f"{', '.join(map(repr, _HALF))} (the 16-bit format the fp32 weights hold)")
        if self.grads is not None and not isinstance(self.grads, Mapping):
            raise TypeError(
                f"EngineBinding(grads=...) takes a mapping of id(parameter) to its fp32 "
                f"gradient, not {type(self.grads).__name__}")


_UNBOUND = EngineBinding()


class LowPrecisionOptimizer(StateFormats, PieceLoop, ShardedUpdate, Checkpoints,
                            torch.optim.Optimizer):
    """Base class: ``states`` (fp32, bf16, fp8, int8, int4), ``write`` (nearest, stochastic,
    kahan, remainder) and ``seed`` (the key of the stochastic writes' counter-based
    random bits)."""

    #: the engine's no-sync path: this optimizer skips itself given ``found_inf``
    takes_found_inf = True
    _step_supports_amp_scaling = True
    #: this step's device flag and gradient scale, set around ``step()`` as torch's
    #: ``GradScaler`` sets them on torch's fused optimizers
    found_inf: torch.Tensor | None = None
    grad_scale: torch.Tensor | None = None
    #: force the device (no-sync) skip path on the CPU too (tests)
    sync_free = False
    #: the state names this optimizer stores, and which of them are non-negative
    _STATES: tuple[tuple[str, bool], ...] = ()

    def __init__(self, params: ParamsT, defaults: dict, *, states: str = "fp32",
                 write: str = "nearest", seed: int = 0) -> None:
        if states not in STATE_FORMATS:
            raise ValueError(f"states={states!r}; valid: {', '.join(STATE_FORMATS)}")
        if write not in WRITE_RULES:
            raise ValueError(f"write={write!r}; valid: {', '.join(WRITE_RULES)}")
        if not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        super().__init__(params, defaults)
        for i, g in enumerate(self.param_groups):
            for name, value in (("states", states), ("write", write)):
                if name in g and g[name] != value:
                    raise ValueError(
                        f"param group {i} asks for {name}={g[name]!r}, the optimizer for "
                        f"{name}={value!r}: {name} is one per optimizer; build one "
                        "optimizer per setting (the engine takes a list of optimizers)"
                        + (", or give those parameters their own state format with "
                           "set_state_formats({param: format})" if name == "states"
                           else ""))
        self.states, self.write, self.seed = states, write, seed
        #: the write rule object (``mixprec.optim.writes``)
        self.rule = write_rule(write)
        #: per-parameter state formats set by ``set_state_formats``, by position
        self._formats: dict[int, str] = {}
        self._fmt: dict[int, str] = {}  # this step's declared format, by id
        self._binding = _UNBOUND
        self._grad_scale: torch.Tensor | None = None  # this step's, read by each piece
        #: stochastic writes: applied steps so far, per device (a 0-d int64 tensor that
        #: keys the counter-based random bits, ``mixprec.optim.writes.counter_bits``)
        self._sr_steps: dict[torch.device, torch.Tensor] = {}
        #: where a device's counter starts (a restored checkpoint's count: every device
        #: steps together, so one count serves all, whatever device saved it)
        self._sr_start = 0
        self._index: dict[int, int] = {}

    # --- what an engine hands over ---------------------------------------------------

    def bind(self, binding: EngineBinding) -> None:
        """Take what an engine hands over (``EngineBinding``); ``MixedPrecision`` calls
        this itself. A later call replaces the earlier one."""
        if not isinstance(binding, EngineBinding):
            raise TypeError(f"bind takes a mixprec.optim.EngineBinding, not "
                            f"{type(binding).__name__}: bind(EngineBinding(grads=..., "
                            "emulated_format=...))")
        self._binding = binding

    @property
    def binding(self) -> EngineBinding:
        """What ``bind`` handed over (an empty ``EngineBinding`` when used alone)."""
        return self._binding

    @property
    def grad_buffers(self) -> Mapping[int, torch.Tensor] | None:
        """The fp32 gradients from ``bind`` (read-only)."""
        return self._binding.grads

    @grad_buffers.setter
    def grad_buffers(self, value) -> None:
        raise AttributeError("grad_buffers is handed over by bind: "
                             "opt.bind(EngineBinding(grads={id(param): grad_fp32, ...}))")

    @property
    def emulated_format(self) -> str | None:
        """The format emulated weights hold, from ``bind`` (read-only)."""
        return self._binding.emulated_format

    @emulated_format.setter
    def emulated_format(self, value) -> None:
        raise AttributeError("emulated_format is handed over by bind: "
                             "opt.bind(EngineBinding(emulated_format='bf16'))")

    @contextlib.contextmanager
    def _without_engine_grads(self) -> Iterator[None]:
        """Step on ``p.grad`` for a while (``materialize_states``)."""
        saved = self._binding
        self._binding = dataclasses.replace(saved, grads=None)
        try:
            yield
        finally:
            self._binding = saved

    # --- the step ------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, *,
             found_inf: torch.Tensor | None = None,
             grad_scale: torch.Tensor | None = None) -> float | None:
        """One update of every parameter with a gradient (see the module docstring).
        ``found_inf`` / ``grad_scale`` default to the attributes of the same names."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = self.found_inf if found_inf is None else found_inf
        grad_scale = self.grad_scale if grad_scale is None else grad_scale
        skip = None
        if found_inf is not None:
            if found_inf.device.type == "cpu" and not self.sync_free:
                if found_inf.item():
                    return loss
            else:
                skip = found_inf.reshape(()) > 0
        # each parameter's position: its stochastic-rounding stream (FSDP re-points the
        # groups at shards after construction, so it is read here, in group order)
        self._grad_scale = grad_scale  # each piece unscales and upcasts its own rows
        params = self._params()
        self._index = {id(q): i for i, q in enumerate(params)}
        self._fmt = {id(q): f for q, f in zip(params, self.state_formats())}
        for group in self.param_groups:
            done = (self._fused_step(group, found_inf, grad_scale)
                    if group.get("fused") else set())
            for p in group["params"]:
                g = None if id(p) in done else self._grad(p)
                if g is None:
                    continue
                if is_dtensor(g):
                    g = g.to_local()
                if is_dtensor(p):
                    self._update_shard(p, g, group, self.state[p], skip)
                else:
                    self._update_tensor(p, p.shape, g, group, self.state[p], skip)
        for count in self._sr_steps.values():  # a skipped step draws the same bits again
            count.add_(1 if skip is None else (~skip).to(count.dtype))
        return loss

    def _fused_step(self, group, found_inf, grad_scale) -> set[int]:
        """``fused=True``: the fp32 parameters with fp32 states go through torch's own
        fused kernel (the subclass's), as ``torch.optim`` with ``fused=True`` would
        step them; returns their ids. The rest, and every quantized state, take the
        per-tensor path."""
        return set()

    def _grad(self, p: torch.Tensor) -> torch.Tensor | None:
        grads = self._binding.grads
        if grads is not None and id(p) in grads:
            return grads[id(p)]
        return p.grad

    def _creates(self, group: dict) -> tuple[str, ...]:
        """The states this optimizer keeps for a parameter of ``group`` once it has
        stepped (all of ``_STATES`` unless a subclass says otherwise)."""
        return tuple(n for n, _ in self._STATES)

    def _math(self, w, g, values, group, state, step, skip) -> dict:
        raise NotImplementedError

    # --- weights -------------------------------------------------------------------

    def _weight_format(self, p: torch.Tensor) -> str:
        """``fp32`` for fp32 weights (updated in place), else the 16-bit format."""
        if p.dtype == torch.float32:
            return self._binding.emulated_format or "fp32"
        name = formats.name_of(p.dtype)
        return name if name in _HALF else "other"

    def _init_state(self, p, state, fmt) -> None:
        """Empty state, plus the write rule's buffers for a 16-bit weight."""
        if fmt == "other":
            raise TypeError(f"mixprec.optim updates fp32, bf16 and fp16 parameters, not "
                            f"{p.dtype}")
        if fmt != "fp32":
            self.rule.check_weight(fmt)
            self.rule.init_state(p, state)

    def init_remainders(self, params: list, fp32_values: list) -> None:
        """Start ``write="remainder"`` from exact fp32 values: each bf16 parameter (or
        emulated one) becomes the rounding ``split_remainder`` gives, and its remainder
        the low bits, so weight + remainder equal the fp32 value bit for bit."""
        for p, v in zip(params, fp32_values, strict=True):
            shard = is_dtensor(p)  # FSDP2: the local rows, states sharded like p
            target = p.data.to_local() if shard else p.data
            v = v.detach().to_local() if is_dtensor(v) else v.detach()
            w, rem = split_remainder(v.float().contiguous())
            local: dict = {}
            self._init_state(target, local, "bf16")
            local["remainder"].copy_(rem)
            for k, t in local.items():
                self.state[p][k] = shard_like(t, p) if shard and t.ndim else t
            target.copy_(w if target.dtype == torch.bfloat16 else w.float())

    def _read_weight(self, p, state, fmt, skip) -> torch.Tensor:
        if fmt == "fp32":
            return p.data if skip is None else p.data.clone()
        return self.rule.read(p, state)

    def _write_weight(self, p, w, state, fmt, skip, offset: int = 0,
                      key: int | None = None) -> None:
        if fmt == "fp32":
            if skip is not None:
                p.data.copy_(torch.where(skip, p.data, w))
            return
        stream = None
        if self.rule.draws_bits:
            index = self._index.get(id(p) if key is None else key, 0)
            stream = Stream(self.seed, index, self._sr_step(p.device), offset)
        new, buffers = self.rule.land(w, formats.dtype_of(fmt), state, stream)
        for name, value in buffers.items():
            commit(state[name], value.to(state[name].dtype), skip)
        commit(p.data, new.to(p.dtype), skip)

    @torch.no_grad()
    def stored_value(self, p: torch.Tensor) -> torch.Tensor:
        """The fp32 value this optimizer holds for ``p``: the weight, less its Kahan
        compensation, or joined with its remainder (a copy)."""
        state = self.state.get(p, {})
        if self.rule.buffers and all(b in state for b in self.rule.buffers):
            return self.rule.stored_value(p, state)
        return p.detach().float().clone()

    def _sr_step(self, device: torch.device) -> torch.Tensor:
        """The applied-step counter on ``device`` (created at 0)."""
        count = self._sr_steps.get(device)
        if count is None:
            count = self._sr_steps[device] = torch.full((), self._sr_start,
                                                        dtype=torch.int64, device=device)
        return count
