"""The parameter state: working copy, fp32 masters and gradient accumulation buffers.

``ParamState`` owns lists that line up index by index (its public, aligned view):

- ``names``: each trained parameter's name in the model (checkpoints key by them);
- ``working``: the model's parameters, as the forward pass uses them (bf16/fp16 for
  ``-master`` recipes; each tied parameter appears once, so it keeps one master);
- ``opt_params``: what the optimizer updates: fp32 masters for ``master=fp32``, else
  the working parameters themselves;
- ``buffers``: where gradients add up across micro-batches, in the recipe's ``grads``
  dtype (4096 additions of 1e-7 in fp16 stall near 2.4e-4; in fp32 they
  reach 4.096e-4). Where the buffer's dtype equals the optimizer parameter's, the
  buffer *is* that parameter's ``.grad``, so the optimizer reads it with no copy.

With ``grad_accum=kahan`` each buffer carries a compensation term (Kahan summation).
Plain fp32 accumulation of n equal terms has a relative error that grows like n·2^-24,
7e-6 for 4096 terms. Compensated, it stays at one rounding, ~1e-8. It costs one more
buffer per parameter, and is worth it only for very long accumulations.

**One door in.** Every writer adds to the buffers through ``receive``, which knows
the buffer's dtype and the Kahan compensation: the harvest of autograd's ``.grad`` after
each backward (``accumulate``, FSDP's sharded gradients included), the ``wgrad=fp32``
sink during backward (``add_fp32_grad``: the fp32 weight gradients of low-precision
working parameters skip ``.grad``, so no bf16 rounding happens between the GEMM and the
buffer), and DDP's comm hook, which replaces a bucket's sums with their all-reduced
mean (``replace=True``; ``accumulate`` then leaves those parameters' ``.grad`` out).

**One view out.** ``grads``: the accumulated gradient of each optimizer parameter,
aligned with ``opt_params``. The step checks, unscales and clips it in place (it is the
true gradient from then on), torch's optimizers read it as ``.grad``
(``hand_to_optimizer``: the buffer itself where the dtypes agree), ``mixprec.optim``
reads it as a mapping (``lend_grads``), and the frameworks' clip calls reach it through
the engine's ``clip_grad_norm_``.

When autograd can accumulate in place (fp32 params, fp32 grads, plain accumulation),
there are no buffers. ``.grad`` is the fp32 accumulator, written by autograd, DDP's
reducer or FSDP's reduce-scatter, and ``grads`` reads it.

``updated_format`` / ``updated_dtype`` are the one rule for what the optimizer updates;
the checks, the memory planner and the diagnostics ask them.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from mixprec.engine.emulate import round_
from mixprec.recipe import Recipe

__all__ = ["ParamState", "updated_format", "updated_dtype", "grads_in_place", "pieces"]


def updated_format(recipe: Recipe, sharded: bool = False) -> str:
    """The format of the values the optimizer updates: ``"fp32"`` with fp32 masters and
    under FSDP (its fp32 shards are the masters), else the recipe's working format. A
    write rule (``write=stochastic|kahan|remainder``: no master) under FSDP updates
    16-bit shards."""
    if recipe.master == "fp32" or (sharded and recipe.write == "nearest"):
        return "fp32"
    return recipe.params


def updated_dtype(recipe: Recipe, emulate: bool = False,
                  sharded: bool = False) -> torch.dtype:
    """The dtype of the tensors the optimizer updates: ``updated_format``'s, except under
    emulation, where a low-precision format is stored in fp32 tensors."""
    fmt = updated_format(recipe, sharded)
    return torch.float32 if emulate or fmt == "fp32" else recipe.param_dtype


#: elements of a tensor rounded at a time by ``refresh_working`` under emulation
PIECE = 1 << 20


def pieces(t: torch.Tensor, n: int = PIECE) -> list[torch.Tensor]:
    """Views of ``t`` of at most ``n`` elements each that cover it, for in-place ops
    whose scratch should stay that small (``t`` itself where it is small, not
    contiguous, or not a plain tensor: an FSDP shard's DTensor)."""
    if t.numel() <= n or type(t.data) is not torch.Tensor or not t.is_contiguous():
        return [t]
    return list(t.detach().view(-1).split(n))


def grads_in_place(recipe: Recipe, emulate: bool = False) -> bool:
    """Whether autograd accumulates the gradients in ``.grad`` itself, with no
    accumulation buffers: no master, plain accumulation, and working parameters stored
    in the ``grads`` dtype (fp32 tensors under emulation). Such gradients are made
    afresh each backward and freed by ``zero_grad``."""
    stored = torch.float32 if emulate else recipe.param_dtype
    return (recipe.master != "fp32" and recipe.grad_accum != "kahan"
            and stored == recipe.grad_dtype)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view that writes through), or ``t`` itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _placed_like(grad: torch.Tensor, like: torch.Tensor, stats=None) -> torch.Tensor:
    """``grad`` placed as ``like`` (its parameter or buffer): a partial-sum DTensor
    gradient, which a replicated parameter gets where it met sharded activations
    (sequence parallelism's norms), is summed across its mesh (an all-reduce by
    DTensor, per partial mesh dim, each recorded in ``stats``, a ``CommStats``, where
    given). Any other gradient is returned as it is."""
    placements = getattr(grad, "placements", ())
    if not any(pl.is_partial() for pl in placements):
        return grad
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
    """A DTensor parameter's gradient hook (``direct`` mode): a partial-sum gradient that
    autograd adds into an existing ``.grad`` is summed by DTensor there; recorded."""
    if p.grad is not None:
        _record_sum(grad, p, stats)


def _cast_(p: nn.Parameter, dtype: torch.dtype) -> None:
    """Store ``p`` in ``dtype``, the same object. A DTensor (a tensor-parallel shard)
    swaps its contents: assigning its ``.data`` relabels the dtype but leaves the local
    tensor as it was."""
    if hasattr(p, "to_local"):
        torch.utils.swap_tensors(p, nn.Parameter(p.detach().to(dtype),
                                                 requires_grad=p.requires_grad))
    else:
        p.data = p.data.to(dtype)


class ParamState:
    """Master copies, accumulation buffers and the moves between them.

    ``sharded``: the parameters are FSDP's shards. They are fp32 and are the masters;
    the working dtype and the gradients are then fp32 here (FSDP casts on gather and
    on reduce-scatter), whatever the recipe's ``params``, ``master`` and ``grads`` say.
    Except under a write rule (``stochastic``, ``kahan``, ``remainder``), which has no
    master: the shards are the 16-bit weights (bf16 tensors, which FSDP was given,
    or bf16 values in fp32 tensors under emulation), updated by the rule, with fp32
    gradient buffers.

    ``announce_grads``: a reducer must see each parameter's gradient arrive (DDP's), so
    ``add_fp32_grad`` hands autograd a zero where it kept the gradient itself."""

    def __init__(self, params: list[nn.Parameter], recipe: Recipe,
                 emulate: bool = False, names: list[str] | None = None,
                 sharded: bool = False, announce_grads: bool = False) -> None:
        if names is not None and len(names) != len(params):
            raise ValueError(f"{len(names)} names for {len(params)} parameters")
        if sharded and recipe.write == "nearest":
            recipe = recipe.replace(params="fp32", master="none", grads="fp32")
        elif sharded:  # a write rule: the 16-bit shards are the weights, no master
            recipe = recipe.replace(grads="fp32")
        self.recipe = recipe
        self.names = list(names) if names is not None else [f"param {i}"
                                                            for i in range(len(params))]
        #: under emulation: the format the working copy's fp32 tensors hold
        self.round_to = recipe.params if emulate and recipe.params != "fp32" else None
        #: the format of the values the optimizer updates (``updated_format``)
        self.updated_format = updated_format(recipe)
        self.working = params
        self.has_master = recipe.master == "fp32"
        pdt, gdt = recipe.param_dtype, recipe.grad_dtype
        if emulate:
            pdt = torch.float32  # gradient buffers stay real: adds are cheap everywhere
        if self.has_master:
            self.check_masterable(params, recipe)
            self.masters = [nn.Parameter(p.detach().clone(), requires_grad=True)
                            for p in params]
        else:
            self.masters = None
        with torch.no_grad():
            for p in params:
                if p.dtype != pdt:
                    _cast_(p, pdt)
        if self.round_to is not None:
            round_(params, self.round_to)
        self.opt_params = self.masters if self.has_master else self.working
        self.index = {id(p): i for i, p in enumerate(params)}
        #: the working parameters that are DTensors (tensor parallelism, FSDP)
        self._dtensors = [p for p in params if hasattr(p, "to_local")]
        #: where the sums of partial-sum gradients are recorded (``record_sums``)
        self.comm_stats = None
        self.kahan = recipe.grad_accum == "kahan"
        self.announce_grads = announce_grads
        #: the optimizers read ``grads`` themselves (``lend_grads``): 16-bit weights then
        #: get no 16-bit copy of their gradient in ``.grad``
        self._lent = False
        #: parameters whose buffer holds this backward's reduced sum already (DDP's
        #: hook): ``accumulate`` drops their ``.grad`` instead of adding it
        self._settled: set[int] = set()
        # every trained parameter was cast to ``pdt`` above
        self.direct = grads_in_place(recipe, emulate)
        self.buffers: list[torch.Tensor] = []
        self.compensations: list[torch.Tensor] = []
        if not self.direct:
            for q in self.opt_params:
                b = torch.zeros_like(q, dtype=gdt, memory_format=torch.preserve_format)
                if self.has_master and b.dtype == q.dtype:
                    q.grad = b  # the optimizer reads the buffer directly
                self.buffers.append(b)
            if self.kahan:
                self.compensations = [torch.zeros_like(b) for b in self.buffers]
        # True where the buffer already is the optimizer parameter's .grad
        self._same = [q.grad is b for b, q in zip(self.buffers, self.opt_params)]
        self._sentinel = None
        self.mark_working()

    @staticmethod
    def check_masterable(params: list[nn.Parameter], recipe: Recipe) -> None:
        """Raise unless fp32 masters can be built from ``params`` (they must be fp32)."""
        if recipe.master != "fp32":
            return
        half = [p for p in params if p.dtype != torch.float32]
        if half:
            raise ValueError(
                f"recipe {str(recipe)!r} builds fp32 master weights from the model's "
                f"weights, but {len(half)} parameter(s) are already {half[0].dtype}: "
                "their low bits are gone. Create MixedPrecision on the fp32 model "
                "(before model.half() / .to(torch.bfloat16)), or load fp32 weights."
            )

    def record_sums(self, stats) -> None:
        """Record each partial-sum gradient's sum across the mesh in ``stats`` (a
        ``CommStats``) as it enters. In ``direct`` mode autograd adds a later
        micro-batch's partial sum into ``.grad`` itself (DTensor sums it there): a hook
        on each DTensor parameter records those."""
        self.comm_stats = stats
        if stats is not None and self.direct:
            for p in self._dtensors:
                p.register_hook(functools.partial(_note_added_sum, p, stats))

    # --- after each backward ------------------------------------------------------

    def accumulate(self) -> None:
        """After each backward: the working params' fresh ``.grad`` through the door
        into the buffers (no-op when direct). Parameters the DDP hook settled give
        theirs up unread: their buffers hold the reduced sum already."""
        if self.direct:
            for p in self._dtensors:  # sequence parallelism's partial sums, summed
                if p.grad is not None:
                    p.grad = _placed_like(p.grad, p, self.comm_stats)
            return
        settled, self._settled = self._settled, set()
        idx = [i for i, p in enumerate(self.working)
               if p.grad is not None and i not in settled]
        if idx:
            self.receive(idx, [self.working[i].grad for i in idx])
        for p in self.working:
            if p.grad is not None:
                p.grad = None

    def mark_accumulated(self) -> None:
        """After a micro-batch: remember one accumulator (the first ``.grad`` in
        ``direct`` mode, else the first buffer) and its version counter."""
        if self.direct:
            p = next((p for p in self.opt_params if p.grad is not None), None)
            self._sentinel = None if p is None else (p, p.grad, p.grad._version)
        else:
            self._sentinel = (None, self.buffers[0], self.buffers[0]._version)

    def accumulation_cleared(self) -> bool:
        """Whether something outside the engine cleared the accumulated gradients since
        ``mark_accumulated`` (``optimizer.zero_grad()`` between micro-batches: to None
        in ``direct`` mode, or in place)."""
        if self._sentinel is None:
            return False
        p, acc, version = self._sentinel
        return (p is not None and p.grad is not acc) or acc._version != version

    def drop_stray_grads(self, fresh: bool) -> None:
        """Drop gradients that another backward left on the working parameters (a GAN's
        generator loss reaches the discriminator's weights): they were not scaled by
        this engine and are not its to accumulate. Outside ``direct`` mode the working
        ``.grad`` is always empty between backwards, so anything there is stray; in
        ``direct`` mode ``.grad`` is the accumulator, so only a ``fresh`` accumulation
        (the first micro-batch) can tell."""
        if self.direct and not fresh:
            return
        for p in self.working:
            if p.grad is not None:
                p.grad = None

    # --- the one door in ----------------------------------------------------------

    def receive(self, where: list[int] | list[torch.Tensor], grads: list[torch.Tensor],
                *, replace: bool = False) -> None:
        """The way in for every gradient writer (outside ``direct`` mode, where the
        ``.grad`` autograd writes is the accumulator): add ``grads`` into the buffers
        of ``where`` (indices, or the working parameters themselves), in the buffer's
        dtype, Kahan-compensated under ``grad_accum=kahan``. ``replace``: the buffers
        become ``grads`` (a reduction's result, which already holds them), and their
        compensation is reset; ``accumulate`` then leaves those parameters' ``.grad``
        out of this backward."""
        idx = [i if isinstance(i, int) else self.index[id(i)] for i in where]
        # FSDP's shards: their local tensors (DTensor has no rule for _foreach_copy_)
        bufs = [_local(self.buffers[i]) for i in idx]
        grads = [_local(_placed_like(g, self.buffers[i], self.comm_stats))
                 for g, i in zip(grads, idx)]
        if replace:
            torch._foreach_copy_(bufs, grads)
            if self.kahan:
                torch._foreach_zero_([_local(self.compensations[i]) for i in idx])
            self._settled.update(idx)
        elif self.kahan:
            # Kahan: y = g - c; t = s + y; c = (t - s) - y; s = t   (all in buffer dtype)
            comps = [_local(self.compensations[i]) for i in idx]
            y = torch._foreach_sub([g.to(b.dtype) for g, b in zip(grads, bufs)], comps)
            t = torch._foreach_add(bufs, y)
            diff = torch._foreach_sub(t, bufs)
            torch._foreach_sub_(diff, y)
            torch._foreach_copy_(comps, diff)
            torch._foreach_copy_(bufs, t)
        else:
            torch._foreach_add_(bufs, grads)

    # --- the sink for wgrad=fp32 (mixprec.engine.wgrad), during backward -------------------

    def wants_fp32_grad(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is a low-precision working parameter with an fp32 buffer
        (under emulation low-precision parameters are fp32 tensors: ``round_to``)."""
        low = p.dtype != torch.float32 or self.round_to is not None
        return (not self.direct and low and id(p) in self.index
                and self.buffers[self.index[id(p)]].dtype == torch.float32)

    def add_fp32_grad(self, p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor | None:
        """Add an fp32 gradient of working parameter ``p`` straight into its buffer.

        Returns what autograd should accumulate into ``p.grad``: nothing, or under DDP
        (``announce_grads``) a zero, so its reducer sees the parameter become ready; its
        comm hook then reduces the buffer, which already holds this gradient."""
        self.receive([p], [grad])
        if self.announce_grads:
            return torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape)
        return None

    # --- at the optimizer step ----------------------------------------------------

    @property
    def grads(self) -> tuple[torch.Tensor | None, ...]:
        """The one view out: the accumulated gradient of each optimizer parameter,
        index by index with ``opt_params``, ``working`` and ``names`` (None for one that
        got no gradient). Scaled by the loss scale until the step's unscale pass, the
        true gradient after it. Read it; write only through ``receive``."""
        if self.direct:
            return tuple(q.grad for q in self.opt_params)
        return tuple(self.buffers)

    def gradients(self) -> list[torch.Tensor]:
        """``grads`` without the Nones: what the step checks, unscales and clips."""
        return [g for g in self.grads if g is not None]

    def aligned_gradients(self) -> list[torch.Tensor | None]:
        """``grads`` as a list."""
        return list(self.grads)

    def lend_grads(self) -> dict[int, torch.Tensor]:
        """``grads`` as a mapping ``id(optimizer parameter) -> gradient``, for
        optimizers that read it in place of ``.grad`` (``mixprec.optim``): from then on
        ``hand_to_optimizer`` puts no 16-bit copy of an fp32 buffer in ``.grad``."""
        self._lent = True
        return {id(q): g for q, g in zip(self.opt_params, self.grads) if g is not None}

    def hand_to_optimizer(self) -> None:
        """Give the optimizer its grads: the buffers, or copies where their dtype differs.

        Where a buffer *is* the master's ``.grad`` it is re-attached if something
        dropped it: the user's ``optimizer.zero_grad()`` sets the masters' ``.grad`` to
        None, and the optimizer would then silently skip every parameter."""
        if self.direct:
            return
        for q, b, same in zip(self.opt_params, self.buffers, self._same):
            if not same:
                if not self._lent:
                    q.grad = b.to(q.dtype)
            elif q.grad is not b:
                q.grad = b

    @torch.no_grad()
    def refresh_working(self) -> None:
        """Working copy <- masters (round to nearest into bf16/fp16). Idempotent, so a
        skipped step (masters unchanged) leaves the working copy bit-identical.

        Under emulation without masters (``params=bf16``), the optimizer updated the fp32
        tensors themselves: they are rounded to the format, as a real bf16 weight stores
        its update (to nearest), so updates below half an ulp vanish as they do there."""
        if self.has_master:  # DTensor shards (TP, FSDP): through their local tensors
            torch._foreach_copy_([_local(p) for p in self.working],
                                 [_local(m) for m in self.masters])
        if self.round_to is not None:  # in pieces: no whole-tensor 16-bit copy
            round_([q for p in self.working for q in pieces(p)], self.round_to)
        if self.has_master:
            self.mark_working()

    def mark_working(self) -> None:
        """Remember the working copy's version counters (torch bumps them on every
        in-place write), so ``changed_working`` can tell writes made elsewhere."""
        self._versions = [p._version for p in self.working] if self.has_master else []

    def changed_working(self) -> list[torch.Tensor]:
        """Working parameters written in place since ``mark_working`` by someone else
        (``model.load_state_dict``, an in-place op under ``torch.no_grad``). Under
        master weights such a write would be overwritten by the next refresh."""
        if not self.has_master:
            return []
        return [p for p, v in zip(self.working, self._versions) if p._version != v]

    def zero(self) -> None:
        """Clear the accumulated gradients after an optimizer step."""
        self._settled = set()
        if self.direct:
            for q in self.opt_params:
                q.grad = None
            return
        torch._foreach_zero_([_local(b) for b in self.buffers])
        if self.compensations:
            torch._foreach_zero_([_local(c) for c in self.compensations])
        for q, same in zip(self.opt_params, self._same):
            if not same:
                q.grad = None
