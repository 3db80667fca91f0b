"""Where the parameter state keeps the accumulated gradients: one interface, two storages.

``ParamState`` (``mixprec.engine.param_state``) owns the gradients in every recipe; how it stores
them is one of two strategies behind the same methods:

- ``BufferGrads`` (``"buffer"``): accumulation buffers in the recipe's ``grads`` dtype,
  one per optimizer parameter (with a Kahan compensation each under
  ``grad_accum=kahan``). Every write goes through ``ParamState.receive``; autograd's
  ``.grad`` on the working parameters is harvested and dropped after each backward.
- ``DirectGrads`` (``"direct"``): no buffers. The optimizer parameters' own ``.grad``,
  written by autograd, DDP's reducer or FSDP's reduce-scatter, is the accumulator
  (fp32 parameters with fp32 gradients and plain accumulation: ``bf16``, ``fp16``,
  ``fp32``, the fp8 family, where the parameter itself is what the optimizer steps).

Each strategy answers the same moments: the harvest after a backward (``accumulate``),
the accumulation's marker (``sentinel``), stray gradients (``drop_stray``), the view out
(``grads``), the hand-over to the optimizer, clearing (``zero``), DDP's bucket and a
whole reduction outside DDP (``bucket``, ``reduce``), and the record of partial-sum
gradients' sums (``record_sums``). The rest of the engine (the step, the comm hook, the
engine's ``zero_grad``) calls ``ParamState``, which calls these: no other module of the
step writes ``.grad`` or the buffers (the optimizers read ``.grad``, as torch's do).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["GradStorage", "BufferGrads", "DirectGrads", "local_shard", "placed_like"]

#: what a reduction hands back: the tensor DDP writes into its bucket, from the mean
Finish = Callable[[torch.Tensor], torch.Tensor]


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view that writes through), or ``t`` itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def placed_like(grad: torch.Tensor, like: torch.Tensor, stats: Any = None) -> torch.Tensor:
    """``grad`` placed as ``like`` (its parameter or buffer): a partial-sum DTensor
    gradient, which a replicated parameter gets where it met sharded activations
    (sequence parallelism's norms), is summed across its mesh (an all-reduce by
    DTensor, per partial mesh dim, each recorded in ``stats``, a ``CommStats``, where
    given). A replicated gradient of a sharded parameter (transformers' vocab-parallel
    embedding) is cut to this rank's shard, with no collective. Any other gradient is
    returned as it is."""
    placements = getattr(grad, "placements", ())
    if not any(pl.is_partial() for pl in placements):
        want = tuple(getattr(like, "placements", ()))
        if len(want) != len(placements) or tuple(placements) == want:
            return grad  # placed alike, or not on one mesh: as it is
        return grad.redistribute(grad.device_mesh, want)
    if stats is not None:
        _record_sum(grad, like, stats)
    return grad.redistribute(grad.device_mesh, like.placements)


def _record_sum(grad: torch.Tensor, like: torch.Tensor, stats) -> None:
    """Record in ``stats`` the collective per partial mesh dim that places ``grad`` as
    ``like``: an all-reduce where ``like`` is replicated, else a reduce-scatter."""
    for pl, want in zip(getattr(grad, "placements", ()), like.placements):
        if pl.is_partial():
            op = "all_reduce" if want.is_replicate() else "reduce_scatter"
            stats.record(grad.to_local(), op=op, what="grads")


def _note_added_sum(p: torch.Tensor, stats, grad: torch.Tensor) -> None:
    """A DTensor parameter's gradient hook (``direct``): a partial-sum gradient that
    autograd adds into an existing ``.grad`` is summed by DTensor there; recorded."""
    if p.grad is not None:
        _record_sum(grad, p, stats)


class GradStorage:
    """The interface: where the gradients of ``opt_params`` (aligned with ``working``)
    add up, and every move in and out of that place. ``state`` arguments are the
    owning ``ParamState``: writes into buffers go through its door (``receive``)."""

    #: ``"buffer"`` or ``"direct"``
    kind = ""

    def __init__(self, working: list[nn.Parameter], opt_params: list[nn.Parameter]) -> None:
        self.working, self.opt_params = working, opt_params
        #: the accumulation buffers and their Kahan compensations (empty when direct)
        self.buffers: list[torch.Tensor] = []
        self.compensations: list[torch.Tensor] = []
        #: where partial-sum gradients' sums are recorded (``record_sums``)
        self.comm_stats = None
        #: the optimizers read ``grads`` themselves (``ParamState.lend_grads``)
        self.lent = False

    def grads(self) -> tuple[torch.Tensor | None, ...]:
        """Each optimizer parameter's accumulated gradient (None: it got none)."""
        raise NotImplementedError

    def accumulate(self, state: Any) -> None:
        """After each backward: the fresh gradients join the accumulation."""
        raise NotImplementedError

    def sentinel(self) -> tuple | None:
        """``(parameter or None, accumulator, its version)`` to tell a later clear."""
        raise NotImplementedError

    def drop_stray(self, fresh: bool) -> None:
        """Drop ``.grad`` another backward left on the working parameters."""
        for p in self.working:
            if p.grad is not None:
                p.grad = None

    def add(self, idx: list[int], grads: list[torch.Tensor], replace: bool) -> None:
        """The door's body (``ParamState.receive``)."""
        raise RuntimeError(
            f"{self.kind!r} gradient storage has no buffers to receive {len(idx)} "
            "gradient(s): autograd's .grad is the accumulator there")

    def takes_fp32(self, i: int | None) -> bool:
        """Whether parameter ``i`` (None: not a trained one) has an fp32 buffer."""
        return False

    def hand_to_optimizer(self) -> None:
        """Put the gradients where torch's optimizers read them (``.grad``)."""

    def zero(self) -> None:
        """Clear the accumulated gradients (after a step, or ``zero_grad``)."""
        raise NotImplementedError

    def bucket(self, state: Any, bucket: Any) -> tuple[torch.Tensor, Finish]:
        """DDP's bucket: ``(what this rank sends, done)``, ``done(mean)`` putting the
        reduced mean in place and returning what DDP writes into the bucket."""
        raise NotImplementedError

    def reduce(self, state: Any, mean: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Every accumulated gradient, flattened into one tensor, through ``mean``
        (this rank's sums in, the mean over ranks out), and put back."""
        raise NotImplementedError

    def record_sums(self, stats: Any) -> None:
        """Record partial-sum gradients' sums in ``stats`` as they enter."""
        self.comm_stats = stats


class DirectGrads(GradStorage):
    """``.grad`` is the accumulator (see the module docstring): autograd makes it
    afresh each window and ``zero`` frees it."""

    kind = "direct"

    def __init__(self, working: list[nn.Parameter], opt_params: list[nn.Parameter],
                 dtensors: list[nn.Parameter]) -> None:
        super().__init__(working, opt_params)
        self._dtensors = dtensors

    def grads(self) -> tuple[torch.Tensor | None, ...]:
        """Each optimizer parameter's ``.grad``."""
        return tuple(q.grad for q in self.opt_params)

    def accumulate(self, state: Any) -> None:
        """Sequence parallelism's partial-sum gradients summed across their mesh."""
        for p in self._dtensors:
            if p.grad is not None:
                p.grad = placed_like(p.grad, p, self.comm_stats)

    def sentinel(self) -> tuple | None:
        """The first ``.grad`` (cleared to None by ``optimizer.zero_grad()``)."""
        p = next((p for p in self.opt_params if p.grad is not None), None)
        return None if p is None else (p, p.grad, p.grad._version)

    def drop_stray(self, fresh: bool) -> None:
        """Only a ``fresh`` window can tell: ``.grad`` is the accumulator."""
        if fresh:
            super().drop_stray(fresh)

    def zero(self) -> None:
        """Each ``.grad`` set to None (torch's ``zero_grad(set_to_none=True)``)."""
        for q in self.opt_params:
            q.grad = None

    def bucket(self, state: Any, bucket: Any) -> tuple[torch.Tensor, Finish]:
        """DDP's flat bucket (the ``.grad`` are its views); DDP writes the mean back."""

        def done(reduced: torch.Tensor) -> torch.Tensor:
            return reduced.to(bucket.buffer().dtype)

        return bucket.buffer(), done

    def reduce(self, state: Any, mean: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """The ``.grad`` reduced in place, a parameter without one as zeros (as DDP
        does)."""
        for p in self.working:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [local_shard(p.grad) for p in self.working]  # DTensors: the local shards
        out = mean(torch.cat([g.flatten() for g in grads]))
        torch._foreach_copy_(grads, [r.view_as(g) for r, g in
                                     zip(out.split([g.numel() for g in grads]), grads)])

    def record_sums(self, stats: Any) -> None:
        """Autograd adds a later micro-batch's partial sum into ``.grad`` itself
        (DTensor sums it there): a hook on each DTensor parameter records those."""
        super().record_sums(stats)
        if stats is not None:
            for p in self._dtensors:
                p.register_hook(functools.partial(_note_added_sum, p, stats))


class BufferGrads(GradStorage):
    """Accumulation buffers in ``dtype`` (see the module docstring). Where a buffer's
    dtype equals its optimizer parameter's and there is a master (``has_master``), the
    buffer *is* that parameter's ``.grad``, so the optimizer reads it with no copy."""

    kind = "buffer"

    def __init__(self, working: list[nn.Parameter], opt_params: list[nn.Parameter],
                 dtype: torch.dtype, has_master: bool, kahan: bool) -> None:
        super().__init__(working, opt_params)
        for q in opt_params:
            b = torch.zeros_like(q, dtype=dtype, memory_format=torch.preserve_format)
            if has_master and b.dtype == q.dtype:
                q.grad = b  # the optimizer reads the buffer directly
            self.buffers.append(b)
        if kahan:
            self.compensations = [torch.zeros_like(b) for b in self.buffers]
        self.kahan = kahan
        #: True where the buffer already is the optimizer parameter's .grad
        self._same = [q.grad is b for b, q in zip(self.buffers, opt_params)]
        #: parameters whose buffer holds this backward's reduced sum already (DDP's
        #: hook): ``accumulate`` drops their ``.grad`` instead of adding it
        self.settled: set[int] = set()

    def grads(self) -> tuple[torch.Tensor | None, ...]:
        """The buffers."""
        return tuple(self.buffers)

    def accumulate(self, state: Any) -> None:
        """The working params' fresh ``.grad`` through the door into the buffers, then
        dropped. Parameters the DDP hook settled give theirs up unread."""
        settled, self.settled = self.settled, set()
        idx = [i for i, p in enumerate(self.working)
               if p.grad is not None and i not in settled]
        if idx:
            state.receive(idx, [self.working[i].grad for i in idx])
        for p in self.working:
            if p.grad is not None:
                p.grad = None

    def sentinel(self) -> tuple | None:
        """The first buffer (zeroed in place by a clear)."""
        return (None, self.buffers[0], self.buffers[0]._version)

    def add(self, idx: list[int], grads: list[torch.Tensor], replace: bool) -> None:
        """Add ``grads`` into the buffers ``idx`` in their dtype, Kahan-compensated
        under ``grad_accum=kahan``; ``replace``: the buffers become ``grads``."""
        # FSDP's shards: their local tensors (DTensor has no rule for _foreach_copy_)
        bufs = [local_shard(self.buffers[i]) for i in idx]
        grads = [local_shard(placed_like(g, self.buffers[i], self.comm_stats))
                 for g, i in zip(grads, idx)]
        if replace:
            torch._foreach_copy_(bufs, grads)
            if self.kahan:
                torch._foreach_zero_([local_shard(self.compensations[i]) for i in idx])
            self.settled.update(idx)
        elif self.kahan:
            # Kahan: y = g - c; t = s + y; c = (t - s) - y; s = t   (all in buffer dtype)
            comps = [local_shard(self.compensations[i]) for i in idx]
            y = torch._foreach_sub([g.to(b.dtype) for g, b in zip(grads, bufs)], comps)
            t = torch._foreach_add(bufs, y)
            diff = torch._foreach_sub(t, bufs)
            torch._foreach_sub_(diff, y)
            torch._foreach_copy_(comps, diff)
            torch._foreach_copy_(bufs, t)
        else:
            torch._foreach_add_(bufs, grads)

    def takes_fp32(self, i: int | None) -> bool:
        """Whether parameter ``i`` is a trained one with an fp32 buffer."""
        return i is not None and self.buffers[i].dtype == torch.float32

    def hand_to_optimizer(self) -> None:
        """The buffers as ``.grad``, or copies where their dtype differs (none once
        lent). Where a buffer *is* the master's ``.grad`` it is re-attached if something
        dropped it: the user's ``optimizer.zero_grad()`` sets the masters' ``.grad`` to
        None, and the optimizer would then silently skip every parameter."""
        for q, b, same in zip(self.opt_params, self.buffers, self._same):
            if not same:
                if not self.lent:
                    q.grad = b.to(q.dtype)
            elif q.grad is not b:
                q.grad = b

    def zero(self) -> None:
        """The buffers and compensations zeroed in place; ``.grad`` copies dropped."""
        self.settled = set()
        torch._foreach_zero_([local_shard(b) for b in self.buffers])
        if self.compensations:
            torch._foreach_zero_([local_shard(c) for c in self.compensations])
        for q, same in zip(self.opt_params, self._same):
            if not same:
                q.grad = None

    def bucket(self, state: Any, bucket: Any) -> tuple[torch.Tensor, Finish]:
        """The last micro-batch joins the rank's buffers in fp32 (no rounding to the
        buffers' dtype before the reduction); the mean goes back through the door and
        DDP's bucket is left as it is (``accumulate`` drops these ``.grad`` unread)."""
        params = bucket.parameters()
        bufs = [self.buffers[state.index[id(p)]] for p in params]
        send = torch.cat([(b.float() + g.float()).flatten()
                          for b, g in zip(bufs, bucket.gradients())])

        def done(reduced: torch.Tensor) -> torch.Tensor:
            parts = reduced.split([b.numel() for b in bufs])
            state.receive(params, [r.view_as(b) for r, b in zip(parts, bufs)], replace=True)
            return bucket.buffer()

        return send, done

    def reduce(self, state: Any, mean: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """The buffers' mean back through the door; the working ``.grad`` are empty,
        so the harvest after it only closes the reduction's account."""
        bufs = [local_shard(b) for b in self.buffers]  # DTensors: the local shards
        out = mean(torch.cat([b.flatten() for b in bufs]))
        parts = [r.view_as(b) for r, b in zip(out.split([b.numel() for b in bufs]), bufs)]
        state.receive(list(range(len(bufs))), parts, replace=True)
        state.accumulate()
