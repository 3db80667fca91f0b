"""The collectives under data-parallel mixed precision: DDP's comm hook, FSDP2's policy
and sharding, and the agreements every rank must reach. Built on torch.distributed;
``mixprec.parallel.layouts`` drives it and ``mixprec.parallel.distributed`` is the user's
entry point.

**DDP.** A communication hook reduces gradients in the recipe's ``comm`` dtype. Before
a 16-bit all-reduce it divides by the world size: if every rank's value is within the
format's range (|g| <= max), then so is the mean, so the reduction cannot overflow where
the inputs did not. Summing first can overflow with as few as two ranks. For recipes
whose gradients live in buffers (``-master``, ``grad_accum=kahan``), the hook adds the
last micro-batch's gradient to the rank's buffers in fp32 on its way to the reduction
(no rounding to the buffers' dtype first) and puts the reduced sums back into them
through the parameter state's one door (``receive``).
Nothing goes back through a bf16 ``.grad``.
Micro-batches before the last one run under ``no_sync()``, their forwards included (DDP
decides in the forward whether the backward reduces), so one reduction serves the whole
accumulation. A window that ends early, after a forward under ``no_sync()``, is reduced
by ``reduce_grads_``, in the same dtype and with the same pre-division. Both count the
bytes each rank sends (``CommStats``).

**FSDP2** (``fully_shard``): a ``MixedPrecisionPolicy`` from the recipe
(``param_dtype`` = the recipe's working dtype, ``reduce_dtype`` = ``comm``). FSDP's fp32
sharded parameters are the masters and the optimizer states are sharded (ZeRO-3). The
loss scaler checks the local shards, and the global gradient norm is reduced across ranks.

**Agreement.** ``found_inf`` is all-reduced (MAX) before the skip decision, so every
rank skips together. The clipping norm is global. fp8 amaxes are all-reduced (MAX)
before the scales move, so every rank uses the same scales.

**Tensor parallelism** (torch's ``parallelize_module``): DTensor does the forward's
and backward's collectives. The engine's own are the gradient norm's: each gradient's
local sum of squares is all-reduced over the mesh dims it is sharded on, replicated
ones counted once (``sum_over_shards_``), each call counted in ``CommStats``.

**Teardown.** The engine, once dropped, frees its model and the DDP reducer (the hook's
state holds the engine's ParamState, not the engine: a reference from the reducer back to
the engine was a cycle Python's collector cannot see). ``destroy_process_group()``
leaves a group alive while something still holds it. DDP holds it twice: from Python
(``process_group``) and from its C++ reducer. Were the reducer the last holder, its
destructor would destroy the group while holding the GIL, joining gloo's worker threads,
and a worker still freeing a tensor's Python object needs the GIL: a hang, seen now and
then in this project's tests. ``wrap_ddp`` moves ``process_group`` to the end of the DDP
module's ``__dict__`` (CPython frees an object's attributes in order), so the Python
reference goes last and the group is destroyed with the GIL released.

**Exit.** The hook's reduction finishes in a Python callback (``Future.then``), which a
gloo (or NCCL) thread runs and then drops, taking the GIL to do so, after DDP's wait
has already returned. A main thread that reached interpreter finalization first (the
last backward, a step and a print are a few milliseconds; a loaded host can keep that
thread off the CPU longer) made the thread's GIL request end the thread in the middle of
a C++ destructor: "terminate called without an active exception", SIGABRT, now and then
at the end of a two-rank run. The callbacks are counted while a thread holds them
(``_Handed``), and an ``atexit`` handler, registered with the first hook, waits (GIL
released, at most ``EXIT_WAIT_S``) until none is left, before finalization begins.
"""

from __future__ import annotations

import atexit
import math
import time
import weakref

import torch
import torch.distributed as dist
from torch import nn

from mixprec.parallel.comm_stats import CommStats

__all__ = ["CommStats", "require_process_group", "ddp_comm_hook", "fsdp_policy",
           "all_reduce_max_", "broadcast_module_", "wrap_ddp", "shard_fsdp", "agree_amax_",
           "gather_full", "broadcast_object", "sixteen_bit_shards", "shard_like",
           "spread_of", "sum_over_shards_", "reduce_grads_"]


def require_process_group(parallel: str) -> None:
    """Raise with the fix unless ``parallel`` is ddp/fsdp/tp/pp and a process group is up."""
    if parallel not in ("ddp", "fsdp", "tp", "pp"):
        raise ValueError(f"parallel={parallel!r}; valid: 'pp', 'ddp', 'fsdp', 'tp' or None")
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"parallel={parallel!r} needs an initialised process group: launch with "
            "`torchrun --nproc-per-node N ...` and call "
            "torch.distributed.init_process_group('gloo' on CPU, 'nccl' on GPU) first")


def broadcast_module_(model: nn.Module, src: int = 0) -> None:
    """Make every rank start from rank ``src``'s parameters and buffers. DTensors (a
    tensor-parallel plan's shards) are left as ``distribute_tensor`` placed them."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if not isinstance(t, DTensor):
                dist.broadcast(t.data, src)


def broadcast_object(obj, src: int = 0):
    """Rank ``src``'s ``obj`` (any picklable value) on every rank; the others pass
    anything, None say. A collective."""
    box = [obj]
    dist.broadcast_object_list(box, src)
    return box[0]


def all_reduce_max_(t: torch.Tensor) -> torch.Tensor:
    """In place: the elementwise max of ``t`` over all ranks (skip flags, amaxes)."""
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


class _HookState:
    """What the comm hook needs. It holds the engine's ParamState, not the engine: DDP's
    C++ reducer keeps this object, and a reference from there back to the engine (which
    holds the DDP module) is a cycle Python's collector cannot see, so the engine, its
    model, masters and optimizer state were never freed (and gloo's threads outlived
    ``destroy_process_group``, which could abort the process at exit)."""

    def __init__(self, param_state, comm_dtype: torch.dtype, stats: CommStats) -> None:
        self.param_state = param_state
        self.comm_dtype = comm_dtype
        self.stats = stats
        self.world = dist.get_world_size()


def ddp_comm_hook(state: _HookState, bucket):
    """All-reduce a DDP bucket in the comm dtype (see the module docstring). What the
    rank sends and where the mean goes are the parameter state's (``bucket_reduction``)."""
    send, finish = state.param_state.bucket_reduction(bucket)
    send = send.to(state.comm_dtype)
    send.div_(state.world)  # pre-divide: the mean cannot overflow where the inputs did not
    state.stats.record(send)
    fut = dist.all_reduce(send, async_op=True).get_future()

    def done(f):
        return finish(f.value()[0])

    return fut.then(_HANDED.track(done))


class _Handed:
    """The Python callbacks handed to the process group's threads that a thread still
    holds (weakly: each leaves the set when its thread drops it), and the exit wait on
    them (the module doc's Exit)."""

    def __init__(self) -> None:
        self.live: weakref.WeakSet = weakref.WeakSet()
        self.registered = False

    def track(self, fn):
        """``fn``, counted until it is freed; the first call registers the exit wait."""
        if not self.registered:
            atexit.register(self.wait)
            self.registered = True
        self.live.add(fn)
        return fn

    def wait(self, timeout: float | None = None) -> int:
        """Sleep (the GIL free for the threads) until every tracked callback is dropped
        or ``timeout`` s pass (default ``EXIT_WAIT_S``); the callbacks still held."""
        end = time.monotonic() + (EXIT_WAIT_S if timeout is None else timeout)
        while len(self.live) and time.monotonic() < end:
            time.sleep(0.001)
        return len(self.live)


#: the longest the exit waits for the threads to drop the hook's callbacks (a callback
#: whose collective never completes, a peer gone, is not waited for longer)
EXIT_WAIT_S = 10.0

_HANDED = _Handed()


# DDP checks the hook's return annotation as an object (postponed annotations are strings)
ddp_comm_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]


def reduce_grads_(param_state, comm_dtype: torch.dtype, stats: CommStats,
                  group=None) -> None:
    """All-reduce this rank's accumulated gradients outside DDP's reducer, as the hook
    does (comm dtype, pre-divided), and let the parameter state put the mean back
    (``ParamState.reduce``): for a window that ended earlier than its forward
    expected, or over a pipeline stage's data-parallel ``group`` (default: the
    world; DTensor gradients send their local shards)."""
    world = dist.get_world_size(group)

    def mean(flat: torch.Tensor) -> torch.Tensor:
        send = flat.to(comm_dtype)
        send.div_(world)
        stats.record(send)
        dist.all_reduce(send, group=group)
        return send

    param_state.reduce(mean)


def wrap_ddp(param_state, model: nn.Module, recipe, **ddp_kwargs):
    """DDP around ``model`` with mixprec's comm hook over the engine's ParamState
    ``param_state``; returns (ddp module, CommStats). ``ddp_kwargs`` go to
    ``DistributedDataParallel`` (``find_unused_parameters``...)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    # buffers are broadcast from rank 0 by DDP's default; broadcast_buffers is passed on
    # only when given (torch 2.13 deprecates the argument)
    ddp = DDP(model, **ddp_kwargs, gradient_as_bucket_view=True)
    stats = CommStats()
    ddp.register_comm_hook(_HookState(param_state, recipe.comm_dtype, stats), ddp_comm_hook)
    # last in DDP's __dict__, so released after the reducer (module doc: Teardown)
    ddp.__dict__["process_group"] = ddp.__dict__.pop("process_group")
    return ddp, stats


def shard_fsdp(model: nn.Module, recipe, optimizers, units=None, emulate: bool = False,
               **fsdp_kwargs) -> nn.Module:
    """``fully_shard`` with the recipe's policy, on each module ``units`` selects (by
    default each element of every ``ModuleList``: a transformer's blocks), innermost
    first, and then on the root; the optimizers, built over the
    unsharded model, are re-pointed at the shards (matched by parameter name). State they
    already hold (Adagrad builds it in ``__init__``; or earlier plain steps) is sharded
    like its parameter, from rank 0's copy, as rank 0's weights are the ones kept.
    Under emulation the weights are gathered in fp32 (``fsdp_policy``).

    The shards are fp32 (the masters) except under a write rule (``write=stochastic``,
    ``kahan`` or ``remainder``: no master) on real 16-bit kernels. There the trained
    weights are cast to the recipe's ``params`` dtype before sharding, so each rank
    stores 16-bit shards, FSDP gathers them as they are, and the reduce-scatter (in
    ``comm``) hands back gradients in that dtype, which the parameter state adds into
    fp32 buffers."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    if sixteen_bit_shards(recipe, emulate):
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad and p.dtype != recipe.param_dtype:
                    p.data = p.data.to(recipe.param_dtype)
    before = dict(model.named_parameters())
    policy = fsdp_policy(recipe, emulate)
    # each unit's full weights exist only while it runs; the root unit takes the rest.
    # Default: each element of a ModuleList (a transformer's blocks).
    if units is None:
        chosen = [b for m in model.modules() if isinstance(m, nn.ModuleList) for b in m]
    else:
        chosen = [m for m in model.modules() if m is not model and units(m)]
    # innermost first: fully_shard on a module whose children are units already
    for m in reversed(chosen):
        if any(p.requires_grad for p in m.parameters()):
            fully_shard(m, mp_policy=policy, **fsdp_kwargs)
    fully_shard(model, mp_policy=policy, **fsdp_kwargs)
    after = dict(model.named_parameters())
    new_of = {id(p): after[name] for name, p in before.items()}
    for o in optimizers:
        for p in [p for g in o.param_groups for p in g["params"] if p in o.state]:
            new = new_of[id(p)]
            o.state[new] = {
                k: (distribute_tensor(v, new.device_mesh, new.placements)
                    if isinstance(v, torch.Tensor) and v.shape == p.shape else v)
                for k, v in o.state.pop(p).items()}
        for g in o.param_groups:
            g["params"] = [new_of.get(id(p), p) for p in g["params"]]
    return model


def sixteen_bit_shards(recipe, emulate: bool) -> bool:
    """Whether FSDP's shards are stored in the recipe's 16-bit ``params`` dtype: under a
    write rule with real 16-bit kernels (emulation keeps 16-bit values in fp32)."""
    return (recipe.optim.write != "nearest" and not emulate
            and recipe.param_dtype != torch.float32)


def shard_like(full: torch.Tensor, param) -> torch.Tensor:
    """``full`` (a whole tensor of ``param``'s shape, the same on every rank) placed as
    the DTensor ``param`` is (a collective), or ``full`` itself for a plain parameter."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(param, DTensor):
        return full
    return distribute_tensor(full, param.device_mesh, param.placements)


def spread_of(t: torch.Tensor):
    """How ``t`` lies across ranks: ``(mesh, dims)`` with the mesh dims a DTensor is
    sharded (or partial) on, or None for a plain tensor or one replicated everywhere
    (every rank holds all of it)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return None
    dims = tuple(i for i, p in enumerate(t.placements) if not p.is_replicate())
    return (t.device_mesh, dims) if dims else None


def sum_over_shards_(squares: list[torch.Tensor], spreads: list,
                     stats: CommStats | None = None) -> torch.Tensor:
    """The whole model's Σ g², equal on every rank, from per-tensor local sums of squares
    and each tensor's ``spread_of``: the sums of tensors spread alike are added, then
    all-reduced (SUM) over each mesh dim they are sharded on; replicated tensors are
    counted once. Every rank issues the same collectives in the same order (``stats``
    records each)."""
    groups: dict = {}
    for sq, spread in zip(squares, spreads):
        key = None if spread is None else (id(spread[0]), spread[1])
        groups.setdefault(key, (spread, []))[1].append(sq)
    total = None
    for spread, sqs in groups.values():
        part = torch.stack(sqs).sum()
        if spread is not None:
            mesh, dims = spread
            for d in dims:
                if stats is not None:
                    stats.record(part)
                dist.all_reduce(part, group=mesh.get_group(d))
        total = part if total is None else total + part
    return total


def agree_amax_(fp8_modules, max_=None) -> None:
    """This step's fp8 amaxes become the max over ranks (one all-reduce, ``max_``: over
    the world by default, ``all_reduce_max_`` looked up at the call; none where no
    module's scaling keeps a history)."""
    mods = [m for m in fp8_modules if m.quantizer.has_history]
    if not mods:
        return
    cur = torch.stack([m.fp8_amax_history[:, 0] for m in mods])
    (max_ or all_reduce_max_)(cur)
    for m, row in zip(mods, cur):
        m.fp8_amax_history[:, 0] = row


def fsdp_policy(recipe, emulate: bool = False):
    """``MixedPrecisionPolicy`` for a recipe: working dtype for params, comm for grads.

    Under emulation the gathered weights stay fp32 (the fp32 shards' values): autocast's
    casts round them where a matmul takes them, as the real bf16 weights would be; other
    uses (a norm's weight) see the fp32 value, not its bf16 rounding."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    param_dtype = recipe.param_dtype if recipe.precision.master == "fp32" and not emulate else None
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=recipe.comm_dtype)


def gather_full(obj):
    """``obj`` (nested dicts / lists / tuples) with every DTensor replaced by its full
    tensor. A collective: every rank must call it, on the same structure."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        if obj.dtype.itemsize < 4 and obj.dtype != torch.uint8:
            # fp8, bf16, int16 (mixprec.optim's states and 16-bit shards): gloo has no
            # such dtypes, so each element travels as its bytes, a new last dim, which
            # leaves the sharded dims (and uneven shards) as they are
            size = obj.dtype.itemsize
            local = obj.to_local().unsqueeze(-1).view(torch.uint8)
            shape = (*obj.shape, size)
            stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
            raw = DTensor.from_local(local, obj.device_mesh, obj.placements,
                                     run_check=False, shape=shape, stride=stride)
            return raw.full_tensor().view(obj.dtype).squeeze(-1)
        return obj.full_tensor()
    if isinstance(obj, dict):
        return {k: gather_full(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(gather_full(v) for v in obj)
    return obj
