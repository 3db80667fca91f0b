"""Rank functions for the composition matrix's engine cells (tests/parallel/test_matrix.py):
one spawn of a layout trains several recipes in sequence on a tiny model, each 6 AdamW
steps, then resumes from the state after step 3 and trains the last 3 again.

The model (``make_model``) is two colwise/rowwise Linear pairs between a norm and a
head, 128 wide, so that every format's blocks (128 x 128, 32, 16) fit whole on a
tensor-parallel shard. Layouts (``LAYOUTS``): ``ddp`` and ``fsdp`` (the engine's own),
``user-fsdp`` (``fully_shard`` on each block and the root, then the engine without
``parallel=``), ``user-fsdp-linear`` (``fully_shard`` on each Linear itself), ``tp``
(torch's ``parallelize_module`` plan), ``tp-ddp`` (the plan, then ``parallel="ddp"``),
``fsdp-tp`` (4 ranks: the plan on the mesh's ``tp`` dim, the engine's FSDP on its ``dp``
dim).
"""

from __future__ import annotations

import datetime
import functools
import gc
import io
import os
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from mixprec import MixedPrecision
from mixprec.modules.linear import Float8Linear

__all__ = ["LAYOUTS", "WIDTH", "make_model", "make_data", "cells", "reference", "saved_state",
           "LR"]

warnings.simplefilter("ignore")

#: the model's width (the hidden Linears are twice as wide)
WIDTH = 128
#: AdamW's learning rate
LR = 1e-2
#: samples in a step's global batch (each data-parallel rank takes its share)
BATCH = 16
#: the layouts this module lays out (tests/helpers/matrix_cells.py's ``engine`` family)
LAYOUTS = ("ddp", "fsdp", "user-fsdp", "user-fsdp-linear", "tp", "tp-ddp", "fsdp-tp")
PLAN = {f"blocks.{i}.{name}": style for i in range(2)
        for name, style in (("up", ColwiseParallel()), ("down", RowwiseParallel()))}


class Pair(nn.Module):
    """A colwise/rowwise Linear pair around a GELU."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Net(nn.Module):
    """A norm, two Linear pairs and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.blocks = nn.ModuleList([Pair(), Pair()])
        self.head = nn.Linear(WIDTH, 16)

    def forward(self, x):
        x = self.norm(x)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def make_data(steps: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, 16, (BATCH,), generator=g))
            for _ in range(steps)]


def _quantized(model) -> list[str]:
    return sorted(n for n, m in model.named_modules() if isinstance(m, Float8Linear))


def _coverage(engine) -> list[tuple[str, str]]:
    """(module, format) of every matmul weight the engine's coverage lists."""
    return sorted((r.name, r.format) for r in engine.coverage.rows)


def _build(layout: str, recipe: str, mesh):
    """The model laid out by ``layout`` and the engine over it."""
    model = make_model()
    kwargs = {}
    if layout in ("ddp", "fsdp"):
        kwargs["parallel"] = layout
    elif layout in ("user-fsdp", "user-fsdp-linear"):
        units = (model.blocks if layout == "user-fsdp" else
                 [m for m in model.modules() if isinstance(m, nn.Linear)])
        for unit in units:
            fully_shard(unit)
        fully_shard(model)
    elif layout in ("tp", "tp-ddp"):
        model = parallelize_module(model, mesh, PLAN)
        kwargs = {"parallel": "ddp"} if layout == "tp-ddp" else {}
    elif layout == "fsdp-tp":
        model = parallelize_module(model, mesh["tp"], PLAN)
        kwargs = {"parallel": "fsdp", "parallel_kwargs": {"mesh": mesh["dp"]}}
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    return MixedPrecision(model, opt, recipe, max_grad_norm=1.0, **kwargs)


def _steps(engine, data, dp_rank: int, dp_size: int, group) -> dict:
    """One step per batch, this rank on its share: the global losses, norms, skips."""
    losses, norms, skipped = [], [], []
    per = BATCH // dp_size
    for x, y in data:
        xs, ys = x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per]
        with engine.autocast():
            loss = F.cross_entropy(engine.model(xs), ys)
        engine.backward(loss)
        result = engine.step()
        seen = loss.detach().float().clone()
        if group is not None:
            dist.all_reduce(seen, group=group)
            seen /= dp_size
        losses.append(float(seen))
        norms.append(float(result.grad_norm))
        skipped.append(bool(result.skipped))
    return {"losses": losses, "norms": norms, "skipped": skipped}


def _dp(layout: str, rank: int, world: int, mesh):
    """(dp rank, dp size, the group the losses are averaged over)."""
    if layout in ("tp", "tp-ddp"):
        return 0, 1, None
    if layout == "fsdp-tp":
        return mesh["dp"].get_local_rank(), mesh["dp"].size(), mesh["dp"].get_group()
    return rank, world, dist.group.WORLD


def saved_state(engine) -> tuple[bytes | str, bool]:
    """``torch.save(engine.state_dict())``'s bytes and True, or the errors it raised on
    the ranks where it did and False (a collective: the ranks go on alike)."""
    try:
        buf = io.BytesIO()
        torch.save(engine.state_dict(), buf)
        state = buf.getvalue()
    except Exception as e:  # noqa: BLE001  the test reads what was raised
        state = f"saving the engine's state: {type(e).__name__}: {e}"
    said = [None] * dist.get_world_size()
    dist.all_gather_object(said, None if isinstance(state, bytes) else state)
    failed = [f"rank {r}: {s}" for r, s in enumerate(said) if s is not None]
    return ("; ".join(failed), False) if failed else (state, True)


def _save_alone(engine) -> bytes:
    buf = io.BytesIO()
    torch.save(engine.state_dict(), buf)
    return buf.getvalue()


def train_resume(build, data, dp_rank: int, dp_size: int, group) -> dict:
    """``build()``'s engine trained on ``data``; then a fresh engine loads the state
    saved after half the steps and trains the rest: its record under ``resumed``."""
    engine = build()
    half = len(data) // 2
    head = _steps(engine, data[:half], dp_rank, dp_size, group)
    state, saved = saved_state(engine) if dist.is_initialized() else (_save_alone(engine), True)
    tail = _steps(engine, data[half:], dp_rank, dp_size, group)
    record = {k: head[k] + tail[k] for k in head}
    record["quantized"] = _quantized(engine.module)
    record["coverage"] = _coverage(engine)
    record["kept"] = sorted({r.reason for r in engine.coverage.rows if r.reason})
    record["parallel"] = engine.parallelism.name
    del engine
    gc.collect()
    if not saved:
        record["resumed"] = {"error": state}
        return record
    again = build()
    again.load_state_dict(torch.load(io.BytesIO(state), weights_only=True))
    record["resumed"] = _steps(again, data[half:], dp_rank, dp_size, group)
    del again
    gc.collect()
    return record


def cells(rank: int, world: int, tmp: str, runs: list[tuple[str, str]],
          steps: int) -> None:
    """Every (layout, recipe) of ``runs`` in turn: ``train_resume``'s record, or the
    error the build or a step raised (``{"error": "Type: message", "trace": ...}``);
    writes ``tmp/matrix_rank<r>.pt`` with (layout, recipe) -> record."""
    torch.set_num_threads(1)
    # a rank whose run raised waits at the barrier while another may wait in a
    # collective: the timeout ends that spawn with an error rather than a hang
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=1200))
    mesh = (init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
            if world == 4 else init_device_mesh("cpu", (world,)))
    out = {}
    for layout, recipe in runs:
        dp_rank, dp_size, group = _dp(layout, rank, world, mesh)
        try:
            out[layout, recipe] = train_resume(functools.partial(_build, layout, recipe, mesh),
                                               make_data(steps), dp_rank, dp_size,
                                               group)
        except Exception as e:  # noqa: BLE001  the test reads what was raised
            out[layout, recipe] = {"error": f"{type(e).__name__}: {e}",
                                   "trace": traceback.format_exc()}
        # saved after each run: a spawn a later run breaks still shows the earlier ones
        torch.save(out, os.path.join(tmp, f"matrix_rank{rank}.pt"))
        gc.collect()
        dist.barrier()
    gc.collect()
    dist.destroy_process_group()


def reference(recipe: str, steps: int) -> dict:
    """One process, the whole batch each step, on one thread (as the ranks run); with
    its own resume (``train_resume``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        def build():
            model = make_model()
            return MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=LR),
                                  recipe, max_grad_norm=1.0)
        return train_resume(build, make_data(steps), 0, 1, None)
    finally:
        torch.set_num_threads(threads)


