"""Checkpoints of a ``LowPrecisionOptimizer``: its state dict, the settings beside it,
and the checks that refuse a checkpoint it cannot read before anything is loaded.

torch's state dict holds the states as stored (codes and scales where a format codes
them); ``extra_state`` adds what torch's does not hold: the settings, each parameter's
state format, the storage layout and the stochastic writes' step counter.
``torch.distributed.checkpoint`` drops that extra from ``state_dict()``, so reshardable
checkpoints carry it beside (``mixprec.checkpoint.resharding``). Checkpoints of an
older storage layout go through ``mixprec.optim.compat``.
"""

from __future__ import annotations

import torch

from mixprec.optim import compat
from mixprec.optim.states import LAYOUT, stored_format

__all__ = ["Checkpoints"]


class Checkpoints:
    """The ``LowPrecisionOptimizer`` part that saves, checks and loads its state."""

    @torch.no_grad()
    def materialize_states(self) -> None:
        """Create every state a step creates, as torch does before a
        ``torch.distributed.checkpoint`` load (which fills existing entries only), also
        where some exist already (``write="remainder"``'s, made at construction): one
        step at learning rate 0 on zero gradients. Weights stay bit-identical (every
        write rule keeps a value it can represent); the loaded states then replace the
        placeholders."""
        params = self._params()
        grads, lrs = [p.grad for p in params], [g["lr"] for g in self.param_groups]
        counters = {d: c.clone() for d, c in self._sr_steps.items()}
        with self._without_engine_grads():
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
        if reshardable:
            compat.check_reshardable_layout(extra, mine)

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
        for i, p, own in zip(ids, self._params(), self.state_formats()):
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
        for i, p in zip(ids, self._params()):
            for k, v in sd["state"].get(i, {}).items():
                if isinstance(v, torch.Tensor) and k != "step":
                    self.state[p][k] = v.to(device=p.device).clone()
        if extra is not None:
            compat.convert_layout1(self, extra)
            self.load_extra_state(extra)
