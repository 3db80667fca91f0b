"""Which state format each parameter of a ``LowPrecisionOptimizer`` takes, and its
states read and written in that format.

The optimizer's ``states`` is every parameter's format unless ``set_state_formats``
gives some another (the engine applies a recipe's ``states:`` rules this way). The
formats are kept by the parameter's position in the param groups: positions survive
the engine re-pointing the groups at fp32 masters or FSDP shards, tensors' ids do not.
A state is stored as ``mixprec.optim.states`` encodes it: an fp32 state under its own
name, a coded one as ``name.q`` (codes) and ``name.s`` (block scales).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mixprec.optim.pieces import commit
from mixprec.optim.sharding import is_dtensor
from mixprec.optim.states import STATE_FORMATS, decode, encode, stored_format

__all__ = ["StateFormats"]


class StateFormats:
    """The ``LowPrecisionOptimizer`` part that assigns and applies state formats."""

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

    def _stored_format_of(self, key: int, shape) -> str:
        """The format the states of the parameter with id ``key`` and whole ``shape``
        are stored in this step."""
        return stored_format(self._fmt.get(key, self.states), shape)

    @torch.no_grad()
    def _recode(self, p, old: str, new: str) -> None:
        """Re-encode the existing states of ``p`` from format ``old`` into ``new``."""
        if is_dtensor(p):
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
                commit(state[name], value, skip)
            return
        for k, v in encode(value, fmt, signed).items():
            key = f"{name}.{k}"
            if key not in state:
                state[key] = v if skip is None else torch.where(skip, torch.zeros_like(v), v)
            else:
                commit(state[key], v, skip)
