"""Measure the bytes that exist for a model and its engine, by storage (``mixprec.memory``
explains the accounting)."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from mixprec.engine.facade import MixedPrecision
from mixprec.engine.wgrad import WEIGHT_CAST_TAG
from mixprec.memory.breakdown import ITEMS, Breakdown
from mixprec.modules.linear import fp8_modules, scaling_buffers

__all__ = ["measure", "high_water", "quiet_profiler"]

#: what torch's profiler (kineto) writes to stderr at every start and stop, from C++
_CHATTER = b"USDT:"


def _chatter(line: bytes) -> bool:
    """A line the profiler wrote about itself: kineto's start/stop, or a C++ warning
    about what it could not record (a block allocated before it started)."""
    return line.startswith(_CHATTER) or (line.startswith(b"[W") and b"profil" in line)


@contextlib.contextmanager
def quiet_profiler() -> Iterator[None]:
    """Hold file descriptor 2 (stderr, where kineto writes from C++ whatever
    ``sys.stderr`` is) in a temporary file while the profiler runs, then write back
    every line but the profiler's own (``_chatter``: kineto's ``USDT: ...
    profiler_start/stop``, which no setting silences, two for every step measured)."""
    try:
        saved = os.dup(2)
    except OSError:  # no stderr at all
        yield
        return
    with contextlib.suppress(AttributeError, OSError, ValueError):
        sys.stderr.flush()
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(AttributeError, OSError, ValueError):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [line for line in tmp.read().splitlines(keepends=True)
                    if not _chatter(line)]
            if kept:
                os.write(2, b"".join(kept))

_CPU_DEVICE = torch.autograd.DeviceType.CPU


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    """A tensor's storage (pointer, bytes); a DTensor's is its local shard's."""
    st = getattr(t, "_local_tensor", t).untyped_storage()
    return st.data_ptr(), st.nbytes()


class _Ledger:
    """Bytes by item, each storage counted once. The ledger holds every storage it has
    counted until it is dropped: a temporary counted early (a gradient view, a buffer
    made on access) freed before the forward would otherwise hand its address to a
    later weight cast, which the pointer check would then skip. A storage freed in place
    (FSDP2 resizes a gathered weight's storage to 0 bytes after its forward) gives its
    address away even so: a pointer counts as seen only while the storage counted there
    still holds it."""

    def __init__(self) -> None:
        self.seen: dict[int, torch.UntypedStorage] = {}
        self.items: dict[str, float] = {}

    def add(self, item: str, tensors: Iterable[torch.Tensor | None]) -> None:
        for t in tensors:
            if t is None or not isinstance(t, torch.Tensor):
                continue
            ptr, nbytes = _storage_key(t)
            if ptr == 0 and nbytes == 0 or _live(self.seen.get(ptr), ptr):
                continue
            self.seen[ptr] = getattr(t, "_local_tensor", t).untyped_storage()
            self.items[item] = self.items.get(item, 0.0) + nbytes


def _live(storage: torch.UntypedStorage | None, ptr: int) -> bool:
    """Whether ``storage`` still holds its bytes at ``ptr``."""
    return storage is not None and storage.nbytes() > 0 and storage.data_ptr() == ptr


def measure(model: nn.Module,
            engine_or_optimizer: MixedPrecision | torch.optim.Optimizer | None,
            sample_batch: torch.Tensor | tuple[Any, ...] | dict | None = None, *,
            loss_fn: Callable | None = None, peak: bool = False) -> Breakdown:
    """Exact bytes held for ``model`` and its engine (or plain optimizer), by storage.

    With ``sample_batch`` it also runs one forward pass, inside the engine's precision
    context when given an engine, and counts what autograd saves for backward. The
    tensors are deduplicated by storage and split into ``activations`` and
    ``weight_casts`` (bf16/fp8 copies of weights made by autocast or fp8 casts).
    ``sample_batch`` is a tensor, a tuple of model inputs or a dict of keyword inputs
    (a Hugging Face batch). Buffers such as BatchNorm
    statistics and fp8 amax histories are restored afterwards, so measuring changes
    nothing. On CUDA the breakdown also notes ``torch.cuda.max_memory_allocated``.
    Optimizer states exist only after the first ``step()``: measure after one.

    ``peak=True`` also measures the high-water mark of one whole training step on
    ``sample_batch`` (forward in the engine's precision context, ``loss_fn(output)``
    or the output itself as the loss, backward, optimizer step, zero_grad), as
    ``Breakdown.peak``: the bytes held before the step plus the most the step's
    allocations rose above them. On a CPU the allocations are read from
    ``torch.profiler`` (``profile_memory=True``: every tensor the step allocates and
    frees, kernels' own scratch included), on CUDA from ``max_memory_allocated``. The
    step is undone afterwards: the engine's (or model's and optimizer's) state is
    restored from a copy taken before it, so measuring trains nothing.
    """
    engine = engine_or_optimizer if hasattr(engine_or_optimizer, "param_state") else None
    optimizers = (engine.optimizers if engine is not None else
                  [engine_or_optimizer] if engine_or_optimizer is not None else [])
    led = _Ledger()
    params = list({id(p): p for p in model.parameters()}.values())
    led.add("params", params)
    fp8_bufs = [b for m in fp8_modules(model).values() for b in scaling_buffers(m).values()]
    led.add("fp8", fp8_bufs)
    led.add("buffers", model.buffers())
    if engine is not None and engine.param_state.has_master:
        led.add("master", engine.param_state.masters)
    grads = [p.grad for p in params]
    if engine is not None:
        grads += engine.param_state.buffers + engine.param_state.compensations
        grads += [q.grad for q in engine.param_state.opt_params]
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
    high = None
    if peak:
        if sample_batch is None or not optimizers:
            raise ValueError("measure(..., peak=True) runs one training step: pass the "
                             "engine (or optimizer) and a sample_batch")
        steady = sum(v for k, v in items.items() if k not in ("activations", "weight_casts"))
        high = steady + _step_high_water(model, engine, optimizers, sample_batch, loss_fn)
        notes.append("peak: one training step's high-water mark, measured "
                     + ("by torch.profiler" if dev.type == "cpu" else
                        "by max_memory_allocated"))
    return Breakdown(items, recipe, tuple(notes), peak=high)


def _step_high_water(model, engine, optimizers, batch, loss_fn) -> float:
    """The most bytes one training step allocates above what is held when it starts
    (see ``measure``); the step is undone afterwards."""
    import copy

    if engine is not None:
        saved = copy.deepcopy(engine.state_dict())
    else:
        saved = (copy.deepcopy(model.state_dict()),
                 [copy.deepcopy(o.state_dict()) for o in optimizers])

    def step() -> None:
        ctx = engine.autocast() if engine is not None else contextlib.nullcontext()
        with ctx:
            out = _call(model, batch)
            loss = loss_fn(out) if loss_fn is not None else out
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("measure(..., peak=True): the model's output is not a scalar "
                             "loss; pass loss_fn=lambda out: ... to make one")
        if engine is not None:
            engine.backward(loss)
            engine.step()
            engine.zero_grad()
        else:
            loss.backward()
            for o in optimizers:
                o.step()
                o.zero_grad()

    params = list(model.parameters())
    dev = params[0].device if params else torch.device("cpu")
    try:
        return float(high_water(step, dev))
    finally:
        if engine is not None:
            engine.load_state_dict(saved)
        else:
            model.load_state_dict(saved[0])
            for o, sd in zip(optimizers, saved[1]):
                o.load_state_dict(sd)


def high_water(fn: Callable[[], None], device: torch.device | str = "cpu") -> int:
    """The most bytes ``fn`` holds at once above what was allocated when it started:
    ``max_memory_allocated`` on CUDA, torch.profiler's allocator events on a CPU."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        fn()
        torch.cuda.synchronize(dev)
        return int(torch.cuda.max_memory_allocated(dev) - base)
    return _cpu_high_water(fn)


def _cpu_high_water(fn: Callable[[], None]) -> int:
    """The running sum of the CPU allocator's allocations and frees during ``fn``, at
    its highest (torch.profiler's memory events, in time order)."""
    from torch.profiler import ProfilerActivity, profile

    with quiet_profiler(), profile(activities=[ProfilerActivity.CPU],
                                   profile_memory=True) as prof:
        fn()
    results = getattr(prof.profiler, "kineto_results", None)
    if results is None:
        raise NotImplementedError("this torch's profiler gives no memory events: "
                                  "measure(..., peak=True) needs torch.profiler's "
                                  "profile_memory on the CPU")
    events = sorted((e.start_ns(), e.nbytes()) for e in results.events()
                    if e.name() == "[memory]" and e.device_type() == _CPU_DEVICE)
    live = high = 0
    for _, n in events:
        live += n
        high = max(high, live)
    return high


def _call(model: nn.Module, batch):
    """The model on a sample batch: a dict as keyword inputs (Hugging Face), a tuple or
    list as positional ones, a tensor as the one input."""
    if isinstance(batch, dict):
        return model(**batch)
    return model(*batch) if isinstance(batch, (tuple, list)) else model(batch)


_VIEW_NODES = ("TBackward", "ViewBackward", "TransposeBackward", "PermuteBackward",
               "UnsafeViewBackward", "ExpandBackward", "ReshapeAliasBackward")


def _is_weight_cast(t: torch.Tensor, param_ids: set[int], shapes: set) -> bool:
    if getattr(t, WEIGHT_CAST_TAG, False):  # cast inside mixprec.engine.wgrad's Linear
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
        # a parameter of the model, or the whole weight FSDP2 gathered from its shards
        return var is not None and (id(var) in param_ids or isinstance(var, nn.Parameter))
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    return fn is None and t.dtype in fp8 and (tuple(t.shape), t.dtype) in shapes


def _measure_forward(model, engine, batch, loss_fn, led: _Ledger, params) -> None:
    param_ids = {id(p) for p in params}
    # fp8 weight copies have the weight's shape, or its transpose (a GPT-2 Conv1D's
    # (in, out) weight is cast as (out, in))
    shapes = {(shape, dt) for p in params for shape in (tuple(p.shape), tuple(p.shape)[::-1])
              for dt in (torch.float8_e4m3fn, torch.float8_e5m2)}
    saved: list[tuple[str, torch.Tensor]] = []

    def state_ptrs() -> set[int]:
        # read as each tensor is saved, not before the forward: FSDP2 frees and gathers
        # weights during it, and a cast may be made at an address a freed weight had
        out = set()
        for t in [*model.parameters(), *model.buffers()]:
            try:
                st = getattr(t, "_local_tensor", t).untyped_storage()
                if st.nbytes():  # a freed weight's storage holds no address
                    out.add(st.data_ptr())
            except RuntimeError:  # a wrapper subclass (a weight gathered as fp8) has none
                continue
        return out

    def pack(t):
        if isinstance(t, torch.Tensor) and _storage_key(t)[0] not in state_ptrs():
            kind = "weight_casts" if _is_weight_cast(t, param_ids, shapes) else "activations"
            saved.append((kind, t))
        return t

    snapshot = {k: v.clone() for k, v in model.state_dict(keep_vars=False).items()
                if k in dict(model.named_buffers())}
    ctx = engine.autocast() if engine is not None else torch.autocast("cpu", enabled=False)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
            out = _call(model, batch)
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
