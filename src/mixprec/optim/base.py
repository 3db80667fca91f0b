"""What every ``mixprec.optim`` optimizer shares: state formats, write rules, the skip.

Each step, per parameter: the gradient (divided by ``grad_scale`` if given) and the
stored states are decoded to fp32, the update runs in fp32 as torch's single-tensor
implementation does it, op for op, and the results are encoded back. With fp32 states
and fp32 weights nothing is decoded or encoded, so the step is torch's, bit for bit.

**Skipping.** ``found_inf`` / ``grad_scale`` are read from attributes, as torch's
fused optimizers and ``GradScaler`` do. A CPU ``found_inf`` is read directly (free
there) and a skipped step returns before touching anything. On another device the
step runs on copies and commits them with ``torch.where(found_inf, old, new)``: no host
sync, and a skipped step leaves every state, the weight and the step count
bit-identical. Its bias corrections are then computed from the step tensor on the
device (as torch's ``capturable=True``), not in float64 on the host.

**Weights without masters.** A bf16/fp16 parameter is read into fp32 (with its
compensation or remainder), updated there, and written back by the ``write`` rule
(``mixprec.optim.writes``). fp32 parameters are updated in place. Under mixprec's
emulation the engine sets ``emulated_format`` (``"bf16"``): the fp32 tensors then hold
bf16 values and are written as bf16 weights would be. The engine also hands over its
fp32 gradient buffers (``grad_buffers``), so low-precision weights update from fp32
gradients rather than from a 16-bit copy.

**FSDP2 shards.** A DTensor parameter (sharded on dim 0) is updated through its local
shard: the update is elementwise, and the block formats cut blocks along rows
(``mixprec.optim.states``), so a shard's states are exactly those rows of the whole
tensor's. Which format a state takes is decided on the whole parameter's shape. Each
state is kept as a DTensor sharded like its parameter, so checkpoints gather or
reshard it as they do the parameter. Shards take the per-tensor path under
``fused=True`` too.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch

from mixprec.optim.states import (
    LAYOUT,
    STATE_FORMATS,
    decode,
    decode_layout1,
    encode,
    stored_format,
)
from mixprec.optim.writes import (
    WRITE_RULES,
    counter_bits,
    join_remainder,
    split_remainder,
    stochastic_round,
    stream_key,
)

if TYPE_CHECKING:
    from torch.optim.optimizer import ParamsT

__all__ = ["LowPrecisionOptimizer"]

_HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


class LowPrecisionOptimizer(torch.optim.Optimizer):
    """Base class: ``states`` (fp32, bf16, fp8, int8, int4), ``write`` (nearest, stochastic,
    kahan, remainder) and ``seed`` (the key of the stochastic writes' counter-based
    random bits)."""

    #: the engine's no-sync path: this optimizer skips itself given ``found_inf``
    takes_found_inf = True
    _step_supports_amp_scaling = True
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
        #: per-parameter state formats set by ``set_state_formats``, by the parameter's
        #: position in the param groups (positions survive the engine re-pointing the
        #: groups at fp32 masters or FSDP shards; tensors' ids do not)
        self._formats: dict[int, str] = {}
        self._fmt: dict[int, str] = {}  # this step's declared format, by id
        self.emulated_format: str | None = None
        self.grad_buffers: dict[int, torch.Tensor] | None = None
        self._grad_scale: torch.Tensor | None = None  # this step's, read by each piece
        #: stochastic writes: applied steps so far, per device (a 0-d int64 tensor that
        #: keys the counter-based random bits, ``mixprec.optim.writes.counter_bits``)
        self._sr_steps: dict[torch.device, torch.Tensor] = {}
        #: where a device's counter starts (a restored checkpoint's count: every device
        #: steps together, so one count serves all, whatever device saved it)
        self._sr_start = 0
        self._index: dict[int, int] = {}

    # --- per-parameter state formats -----------------------------------------------

    def set_state_formats(self, formats: Mapping[torch.Tensor, str]) -> None:
        """Store the states of some parameters in another format than ``states``:
        ``{parameter: "int8", ...}``, keyed on the tensors this optimizer updates (under
        ``MixedPrecision`` with fp32 masters: the masters; the engine sets the recipe's
        ``states:`` rules itself). Each parameter's update then decodes and encodes its
        own format (``stored_format``: small and 1-D tensors still keep fp32 in the
        block formats); fp32 ones stay torch's update bit for bit, and ``fused=True``
        takes only those. States that exist already are re-encoded in the new format.

        >>> import torch
        >>> from mixprec.optim import AdamW
        >>> emb, head = (torch.nn.Parameter(torch.ones(64, 64)) for _ in range(2))
        >>> opt = AdamW([emb, head])
        >>> opt.set_state_formats({emb: "int8"})
        >>> opt.state_format(emb), opt.state_format(head)
        ('int8', 'fp32')
        """
        position = {id(p): i for i, p in enumerate(self._params())}
        new = {}
        for p, fmt in formats.items():
            if fmt not in STATE_FORMATS:
                raise ValueError(f"state format {fmt!r} for a parameter of shape "
                                 f"{tuple(p.shape)}; valid: {', '.join(STATE_FORMATS)}")
            if id(p) not in position:
                raise ValueError(
                    f"set_state_formats: a tensor of shape {tuple(p.shape)} is not a "
                    "parameter of this optimizer; key the formats on the tensors in its "
                    "param_groups (under MixedPrecision with fp32 masters: "
                    "engine.param_state.opt_params)")
            new[position[id(p)]] = fmt
        params = self._params()
        before = self.state_formats()
        for i, fmt in new.items():
            if fmt != before[i] and self.state.get(params[i]):
                self._recode(params[i], before[i], fmt)
        self._formats.update(new)

    def state_format(self, p: torch.Tensor) -> str:
        """The state format set for parameter ``p``: ``set_state_formats``', else the
        optimizer's ``states`` (before ``stored_format``'s rule for small tensors)."""
        for q, fmt in zip(self._params(), self.state_formats()):
            if q is p:
                return fmt
        raise ValueError(f"a tensor of shape {tuple(p.shape)} is not a parameter of this "
                         "optimizer")

    def state_formats(self) -> list[str]:
        """Each parameter's state format (``state_format``), in param-group order."""
        return [self._formats.get(i, self.states) for i in range(len(self._params()))]

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _own_format(self, p) -> str:
        """This step's declared format of ``p`` (set by ``step``)."""
        return self._fmt.get(id(p), self.states)

    @torch.no_grad()
    def _recode(self, p, old: str, new: str) -> None:
        """Re-encode the existing states of ``p`` from format ``old`` into ``new``."""
        if _is_dtensor(p):
            raise NotImplementedError(
                "changing the state format of a sharded parameter that has states: set "
                "the formats before the first step (or before sharding)")
        state, shape = self.state[p], tuple(p.shape)
        was, will = stored_format(old, shape), stored_format(new, shape)
        if was == will:
            return
        for name, signed in self._STATES:
            if not self._has(state, name):
                continue
            value = self._read_state(state, name, p, signed, None, was).clone()
            for k in (name, f"{name}.q", f"{name}.s"):
                state.pop(k, None)
            self._write_state(state, name, value, signed, None, will)

    # --- the step ------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One update of every parameter with a gradient (see the module docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)
        grad_scale = getattr(self, "grad_scale", None)
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
        self._index = {id(q): i for i, q in
                       enumerate(q for g in self.param_groups for q in g["params"])}
        self._fmt = {id(q): f for q, f in zip(self._params(), self.state_formats())}
        for group in self.param_groups:
            done = (self._fused_step(group, found_inf, grad_scale)
                    if group.get("fused") else set())
            for p in group["params"]:
                g = None if id(p) in done else self._grad(p)
                if g is None:
                    continue
                if _is_dtensor(g):
                    g = g.to_local()
                self._update(p, g, group, self.state[p], skip)
        for count in self._sr_steps.values():  # a skipped step draws the same bits again
            count.add_(1 if skip is None else (~skip).to(count.dtype))
        return loss

    def _fused_step(self, group, found_inf, grad_scale) -> set[int]:
        """``fused=True``: the fp32 parameters with fp32 states go through torch's own
        fused kernel (the subclass's ``_FUSED``), as ``torch.optim`` with
        ``fused=True`` would step them; returns their ids. The rest, and every
        quantized state, take the per-tensor path."""
        return set()

    def _grad(self, p: torch.Tensor) -> torch.Tensor | None:
        if self.grad_buffers is not None and id(p) in self.grad_buffers:
            return self.grad_buffers[id(p)]
        return p.grad

    def _update(self, p, g, group, state, skip) -> None:
        """Decode, run ``_math`` (the subclass's torch-exact update) on fp32 values,
        encode and commit. ``g`` is the (local) fp32 gradient."""
        if _is_dtensor(p):
            self._update_shard(p, g, group, state, skip)
        else:
            self._update_tensor(p, p.shape, g, group, state, skip)

    def _update_shard(self, p, g, group, state, skip) -> None:
        """A DTensor parameter: the update of its local shard, with each new state
        wrapped as a DTensor sharded like ``p`` (rows with its rows)."""
        own = self._own_format(p)
        if own != "fp32" and any(pl.is_shard() and pl.dim != 0 for pl in p.placements):
            raise NotImplementedError(
                f"states={own!r} for a parameter sharded as {p.placements}: block "
                "states are cut along rows, so only dim-0 shards (FSDP2's default) hold "
                "whole blocks. Shard on dim 0, or use states='fp32'.")
        local = {k: v.to_local() if _is_dtensor(v) else v for k, v in state.items()}
        offset = _shard_offset(p) if self.write == "stochastic" else 0
        self._update_tensor(p.data.to_local(), p.shape, g, group, local, skip,
                            offset=offset, key=id(p))
        for k, v in local.items():
            if k not in state:
                state[k] = v if v.ndim == 0 else _shard_like(v, p)

    def _update_tensor(self, p, shape, g, group, state, skip, offset: int = 0,
                       key: int | None = None) -> None:
        """The update of the plain tensor ``p`` (a parameter, or a shard of one whose
        whole shape is ``shape`` and whose first element is element ``offset`` of the
        whole; ``key``: the parameter's id, for its stochastic-rounding stream).

        The step runs over pieces of rows (``chunk_rows``), so its scratch (decoded
        states, fp32 weights and gradients, hashes) is bounded by ``CHUNK`` elements,
        not by the tensor. Every op is elementwise or per row (blocks lie along rows,
        the random bits are keyed by the element's index in the whole tensor), so the
        result equals the whole tensor's update bit for bit (torch's own, with fp32
        states and weights: tests/test_optim.py checks both on odd shapes). The step
        that creates the states runs in pieces too: each piece sees none (the first
        update's rule) and its new states fill their rows of whole-size ones."""
        fmt = self._weight_format(p)
        key = id(p) if key is None else key
        sfmt = stored_format(self._fmt.get(key, self.states), shape)
        if not state:
            self._init_state(p, state, fmt)
        step = state.get("step")
        if step is not None:
            new_step = step + 1 if skip is None else step + (~skip).float()
        else:
            new_step = None
        rows = p.shape[0] if p.ndim else 1
        per = chunk_rows(tuple(p.shape))
        if per >= rows:
            self._update_piece(p, g, group, state, skip, new_step, fmt, sfmt, offset, key)
        else:
            self._update_rows(p, g, group, state, skip, new_step, fmt, sfmt, offset, key,
                              rows, per)
        if new_step is not None:
            state["step"].copy_(new_step)

    def _update_rows(self, p, g, group, state, skip, new_step, fmt, sfmt, offset, key,
                     rows: int, per: int) -> None:
        """``_update_piece`` over pieces of ``per`` rows. A state that a piece creates
        (the first step's) is allocated whole once and takes each piece's rows; later
        pieces still see it as absent."""
        cols = math.prod(p.shape[1:])
        before = set(state)
        # 0-d states (flags) are read by every piece as they were before the step
        flags = {k: v for k, v in state.items()
                 if isinstance(v, torch.Tensor) and v.ndim == 0 and k != "step"}
        piece: dict = {}
        for r0 in range(0, rows, per):
            r1 = min(rows, r0 + per)
            piece = {k: (v[r0:r1] if isinstance(v, torch.Tensor) and v.ndim
                         and v.shape[0] == rows else v)
                     for k, v in state.items() if k in before}
            piece.update({k: v.clone() for k, v in flags.items()})
            self._update_piece(p.data[r0:r1], g[r0:r1], group, piece, skip, new_step,
                               fmt, sfmt, offset + r0 * cols, key)
            for k, v in piece.items():  # in creation order, as one piece would add them
                if k in before:
                    continue
                if not (isinstance(v, torch.Tensor) and v.ndim and v.shape[0] == r1 - r0):
                    state[k] = v  # not one per row: the last piece's
                    continue
                if k not in state:
                    state[k] = v.new_empty((rows, *v.shape[1:]))
                state[k][r0:r1].copy_(v)
        for k, v in flags.items():
            v.copy_(piece[k])

    def _creates(self, group: dict) -> tuple[str, ...]:
        """The states this optimizer keeps for a parameter of ``group`` once it has
        stepped (all of ``_STATES`` unless a subclass says otherwise)."""
        return tuple(n for n, _ in self._STATES)

    def _update_piece(self, p, g, group, state, skip, new_step, fmt, sfmt, offset,
                      key) -> None:
        """Decode, update and encode the rows ``p`` (a view of the parameter, ``state``
        the same rows of its states), writing the results into them. ``g``: those rows
        of the gradient as stored; unscaled and upcast here, piece by piece."""
        scale = self._grad_scale
        if scale is not None:
            g = g / scale
        if g.dtype != torch.float32:
            g = g.float()
        w = self._read_weight(p, state, fmt, skip)
        values = {n: self._read_state(state, n, p, signed, skip, sfmt)
                  for n, signed in self._STATES if self._has(state, n)}
        new_values = self._math(w, g, values, group, state, new_step, skip)
        for (n, signed) in self._STATES:
            if n in new_values:
                self._write_state(state, n, new_values[n], signed, skip, sfmt)
        self._write_weight(p, w, state, fmt, skip, offset, key)

    def _math(self, w, g, values, group, state, step, skip) -> dict:
        raise NotImplementedError

    # --- weights -------------------------------------------------------------------

    def _weight_format(self, p: torch.Tensor) -> str:
        """``fp32`` for fp32 weights (updated in place), else the 16-bit format."""
        if p.dtype == torch.float32:
            return self.emulated_format or "fp32"
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(p.dtype, "other")

    def _init_state(self, p, state, fmt) -> None:
        """Empty state, plus the write rule's buffer and the step count."""
        if fmt == "other":
            raise TypeError(f"mixprec.optim updates fp32, bf16 and fp16 parameters, not "
                            f"{p.dtype}")
        if fmt != "fp32" and self.write == "kahan":
            state["kahan_comp"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if fmt != "fp32" and self.write == "remainder":
            if fmt != "bf16":
                raise ValueError("write='remainder' keeps bf16 weights' low 16 bits; "
                                 f"this parameter is {fmt}. Use write='kahan' or "
                                 "'stochastic' for fp16 weights.")
            state["remainder"] = torch.zeros(p.shape, dtype=torch.int16, device=p.device)

    def init_remainders(self, params: list, fp32_values: list) -> None:
        """Start ``write="remainder"`` from exact fp32 values: each bf16 parameter (or
        emulated one) becomes the rounding ``split_remainder`` gives, and its remainder
        the low bits, so weight + remainder equal the fp32 value bit for bit."""
        for p, v in zip(params, fp32_values, strict=True):
            shard = _is_dtensor(p)  # FSDP2: the local rows, states sharded like p
            target = p.data.to_local() if shard else p.data
            v = v.detach().to_local() if _is_dtensor(v) else v.detach()
            w, rem = split_remainder(v.float().contiguous())
            local: dict = {}
            self._init_state(target, local, "bf16")
            local["remainder"].copy_(rem)
            for k, t in local.items():
                self.state[p][k] = _shard_like(t, p) if shard and t.ndim else t
            target.copy_(w if target.dtype == torch.bfloat16 else w.float())

    def _read_weight(self, p, state, fmt, skip) -> torch.Tensor:
        if fmt == "fp32":
            return p.data if skip is None else p.data.clone()
        if self.write == "remainder":
            return join_remainder(p.data.to(torch.bfloat16), state["remainder"])
        w = p.data.float()
        if self.write == "kahan":
            w = w - state["kahan_comp"].float()
        return w if w is not p.data else w.clone()

    def _write_weight(self, p, w, state, fmt, skip, offset: int = 0,
                      key: int | None = None) -> None:
        if fmt == "fp32":
            if skip is not None:
                p.data.copy_(torch.where(skip, p.data, w))
            return
        half = _HALF[fmt]
        writes = {}
        if self.write == "remainder":
            new, writes["remainder"] = split_remainder(w)
        elif self.write == "stochastic":
            k = stream_key(self.seed, self._index.get(id(p) if key is None else key, 0),
                           self._sr_step(p.device))
            bits = counter_bits(w.shape, k, offset, 16 if half == torch.bfloat16 else 24)
            new = stochastic_round(w, half, bits=bits)
        else:
            new = w.to(half)
            if self.write == "kahan":
                writes["kahan_comp"] = (new.float() - w).to(half)
        for name, value in writes.items():
            _commit(state[name], value.to(state[name].dtype), skip)
        _commit(p.data, new.to(p.dtype), skip)

    @torch.no_grad()
    def stored_value(self, p: torch.Tensor) -> torch.Tensor:
        """The fp32 value this optimizer holds for ``p``: the weight, less its Kahan
        compensation, or joined with its remainder (a copy)."""
        state = self.state.get(p, {})
        if "remainder" in state:
            return join_remainder(p.detach().to(torch.bfloat16), state["remainder"])
        if "kahan_comp" in state:
            return p.detach().float() - state["kahan_comp"].float()
        return p.detach().float().clone()

    def _sr_step(self, device: torch.device) -> torch.Tensor:
        """The applied-step counter on ``device`` (created at 0)."""
        count = self._sr_steps.get(device)
        if count is None:
            count = self._sr_steps[device] = torch.full((), self._sr_start,
                                                        dtype=torch.int64, device=device)
        return count

    # --- states --------------------------------------------------------------------

    @staticmethod
    def _has(state: dict, name: str) -> bool:
        return name in state or f"{name}.q" in state

    def _read_state(self, state, name, p, signed, skip, fmt) -> torch.Tensor:
        if fmt == "fp32":
            v = state[name]
            return v if skip is None else v.clone()
        stored = {k: state[f"{name}.{k}"] for k in ("q", "s") if f"{name}.{k}" in state}
        return decode(stored, fmt, p, signed)

    def _write_state(self, state, name, value, signed, skip, fmt) -> None:
        if fmt == "fp32":
            if name not in state:
                state[name] = value if skip is None else torch.where(
                    skip, torch.zeros_like(value), value)
            elif skip is not None or state[name] is not value:
                _commit(state[name], value, skip)
            return
        for k, v in encode(value, fmt, signed).items():
            key = f"{name}.{k}"
            if key not in state:
                state[key] = v if skip is None else torch.where(skip, torch.zeros_like(v), v)
            else:
                _commit(state[key], v, skip)

    # --- checkpoints ---------------------------------------------------------------

    @torch.no_grad()
    def materialize_states(self) -> None:
        """Create every state a step creates, as torch does before a
        ``torch.distributed.checkpoint`` load (which fills existing entries only), also
        where some exist already (``write="remainder"``'s, made at construction): one
        step at learning rate 0 on zero gradients. Weights stay bit-identical (every
        write rule keeps a value it can represent); the loaded states then replace the
        placeholders."""
        params = [p for g in self.param_groups for p in g["params"]]
        grads, lrs, buffers = [p.grad for p in params], [g["lr"] for g in
                                                         self.param_groups], self.grad_buffers
        counters = {d: c.clone() for d, c in self._sr_steps.items()}
        self.grad_buffers = None
        try:
            for g in self.param_groups:
                g["lr"] = 0.0
            for p in params:
                p.grad = torch.zeros_like(p)
            self.step()
        finally:
            for p, gr in zip(params, grads):
                p.grad = gr
            for g, lr in zip(self.param_groups, lrs):
                g["lr"] = lr
            self.grad_buffers = buffers
            for d, c in counters.items():
                self._sr_steps[d].copy_(c)

    def extra_state(self) -> dict:
        """What torch's state dict does not hold: the settings and the stochastic-
        rounding stream's state (the seed and the applied-step counter: the same on
        every rank, at any world size). ``torch.distributed.checkpoint`` drops it from
        ``state_dict()``, so reshardable checkpoints carry it beside."""
        # a counter is created at its first stochastic write; before it (a checkpoint
        # loaded and saved again), the restored count is the state
        counts = ({str(d): c.clone() for d, c in self._sr_steps.items()}
                  or {"start": torch.tensor(self._sr_start, dtype=torch.int64)})
        extra = {"states": self.states, "write": self.write, "seed": self.seed,
                 "layout": LAYOUT, "sr_steps": counts}
        formats = self.state_formats()
        if any(f != self.states for f in formats):  # set_state_formats': each one's
            extra["formats"] = formats
        return extra

    def check_extra_state(self, extra: dict, reshardable: bool = False) -> None:
        """Refuse, before anything is loaded, a checkpoint this optimizer cannot read:
        other ``states`` / ``write`` settings, another state format for a parameter
        (``set_state_formats``), or (in a ``reshardable`` directory, whose entries load
        in place) block states in another storage layout."""
        if (extra["states"], extra["write"]) != (self.states, self.write):
            raise ValueError(
                f"optimizer state saved with states={extra['states']!r}, "
                f"write={extra['write']!r}; this optimizer has states={self.states!r}, "
                f"write={self.write!r}: build it with the saved settings")
        mine = self.state_formats()
        saved = list(extra.get("formats") or [extra["states"]] * len(mine))
        if len(saved) == len(mine) and saved != mine:
            i = next(i for i, (a, b) in enumerate(zip(saved, mine)) if a != b)
            shape = tuple(self._params()[i].shape)
            raise ValueError(
                f"optimizer state saved with {saved[i]} states for parameter {i} (shape "
                f"{shape}); this optimizer keeps {mine[i]} states for it: set the "
                "formats the checkpoint was written with (set_state_formats, or the same "
                "recipe with its states: rules) before loading")
        layout = int(extra.get("layout", 1))
        block = sorted({f for f in mine if f in ("fp8", "int8")})
        if reshardable and layout != LAYOUT and block:
            raise ValueError(
                f"this reshardable checkpoint holds {'/'.join(block)} optimizer states in "
                f"storage layout {layout} (mixprec 0.2); this version reads layout "
                f"{LAYOUT} in place. Load it once with mixprec 0.2 and save it with "
                "save(path, full=True): this version converts full checkpoints")

    def load_extra_state(self, extra: dict) -> None:
        """Restore ``extra_state()``'s output (the settings must match)."""
        self.check_extra_state(extra)
        self.seed = int(extra.get("seed", self.seed))
        # the count, not the device that saved it: a cuda:0 checkpoint resumes on a CPU
        # or on cuda:1 with the same bits (every device's counter is the same count)
        counts = [int(c) for c in extra.get("sr_steps", {}).values()]
        if counts:
            self._sr_start = max(counts)
            for c in self._sr_steps.values():
                c.fill_(self._sr_start)

    def _check_stored_formats(self, sd: dict) -> None:
        """Each parameter's saved states are in the form this optimizer stores them:
        coded (``name.q``, ``name.s``) where its format codes them, plain fp32 where it
        keeps fp32 (torch's own optimizers write plain fp32 states for all)."""
        names = {n for n, _ in self._STATES}
        ids = [i for g in sd["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p, own in zip(ids, params, self.state_formats()):
            saved = sd["state"].get(i, {})
            want = stored_format(own, tuple(p.shape))
            plain = [k for k in saved if k in names]
            coded = [k for k in saved if k.split(".")[0] in names and "." in k]
            if want != "fp32" and plain:
                raise ValueError(
                    f"this state dict holds fp32 states (e.g. {plain[0]!r} of a parameter "
                    f"of shape {tuple(p.shape)}, as torch's optimizers write), this "
                    f"optimizer stores states={own!r} for it: build it with "
                    "states='fp32' to load it, or load a checkpoint that "
                    f"{type(self).__name__}(states={own!r}) wrote")
            if want == "fp32" and coded:
                raise ValueError(
                    f"this state dict holds coded states ({coded[0]!r}) of a parameter "
                    f"this optimizer (states={own!r} for it) keeps in fp32: build it with "
                    "the states the checkpoint was written with")

    def state_dict(self) -> dict:
        """torch's state dict plus ``extra_state()`` (under ``"mixprec"``)."""
        sd = super().state_dict()
        sd["mixprec"] = self.extra_state()
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loading, with each state tensor kept in its stored dtype (torch
        would cast int8 codes and fp32 scales to the parameter's dtype), and the
        stochastic-rounding counter restored. A state of other formats is refused."""
        sd = dict(state_dict)
        extra = sd.pop("mixprec", None)
        if extra is not None:
            self.check_extra_state(extra)  # raises, naming both settings
        self._check_stored_formats(sd)
        super().load_state_dict(sd)
        ids = [i for g in sd["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params):
            for k, v in sd["state"].get(i, {}).items():
                if isinstance(v, torch.Tensor) and k != "step":
                    self.state[p][k] = v.to(device=p.device).clone()
        if extra is not None and int(extra.get("layout", 1)) != LAYOUT:
            self._convert_layout1()
        if extra is not None:
            self.load_extra_state(extra)

    def _convert_layout1(self) -> None:
        """Re-encode block states that mixprec 0.2 stored (layout 1) in this version's
        maps and blocks, once, with a warning (the decoded values move by at most one
        step of the new grid)."""
        import warnings

        converted, formats = 0, set()
        for p, own in zip(self._params(), self.state_formats()):
            state = self.state.get(p, {})
            fmt = stored_format(own, tuple(p.shape))
            for name, signed in self._STATES:
                if fmt in ("fp32", "bf16") or f"{name}.q" not in state:
                    continue
                if _is_dtensor(p):
                    raise NotImplementedError(
                        "converting mixprec 0.2 block states of a sharded parameter: load "
                        "the checkpoint unsharded (or with mixprec 0.2, then save it "
                        "full) before sharding")
                old = {k: state.pop(f"{name}.{k}") for k in ("q", "s")}
                value = decode_layout1(old, fmt, p, signed)
                for k, v in encode(value, fmt, signed).items():
                    state[f"{name}.{k}"] = v
                converted += 1
                formats.add(fmt)
        if converted:
            warnings.warn(
                f"optimizer checkpoint from mixprec 0.2: {converted} "
                f"{'/'.join(sorted(formats))} state(s) "
                "re-encoded in this version's storage (finer maps, unpadded blocks); "
                "save again to keep the new form", stacklevel=3)


#: elements of a tensor one piece of the step decodes and updates at a time: its
#: scratch (a few fp32 and int64 temporaries per element) stays near 8 MiB
CHUNK = 1 << 17


def chunk_rows(shape: tuple[int, ...]) -> int:
    """Rows of a tensor of ``shape`` per piece of the step: at most ``CHUNK``
    elements, or one row where a row is wider."""
    rows = shape[0] if shape else 1
    cols = math.prod(shape[1:]) if shape else 1
    if cols == 0 or rows == 0:
        return max(rows, 1)
    return max(1, CHUNK // cols)


def _is_dtensor(t) -> bool:
    """Whether ``t`` is a DTensor (without importing DTensor's module: if it was never
    imported, there is none)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def _shard_offset(p) -> int:
    """Element index, in the whole tensor, of the first element of this rank's shard of
    DTensor ``p`` (dim-0 shards, torch.chunk's split as FSDP2 and DTensor cut them)."""
    (pl,) = p.placements if len(p.placements) == 1 else (None,)
    if pl is None or not pl.is_shard():
        if pl is None:
            raise NotImplementedError(
                f"a parameter on a {p.device_mesh.ndim}-D mesh ({p.placements}): "
                "mixprec.optim's stochastic writes key their bits by the element's index "
                "on a 1-D mesh (FSDP2); use write='kahan' or 'remainder' here")
        return 0
    if pl.dim != 0:
        raise NotImplementedError(f"a parameter sharded as {p.placements}: stochastic "
                                  "writes need dim-0 shards (FSDP2's default)")
    rows, world = p.shape[0], p.device_mesh.size()
    chunk = -(-rows // world) if rows else 0
    first = min(p.device_mesh.get_coordinate()[0] * chunk, rows)
    return first * math.prod(p.shape[1:])


def _shard_like(local: torch.Tensor, p) -> torch.Tensor:
    """``local``, this rank's rows of a state of ``p``, as a DTensor placed like ``p``
    whose global dim 0 is ``p``'s (FSDP2's shards may be uneven)."""
    from torch.distributed.tensor import DTensor

    shape = (p.shape[0], *local.shape[1:])
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                              shape=shape, stride=stride)


def _commit(dst: torch.Tensor, new: torch.Tensor, skip) -> None:
    """``dst <- new``, or under a device skip flag, ``dst`` unchanged where it is set."""
    dst.copy_(new if skip is None else torch.where(skip, dst, new))
