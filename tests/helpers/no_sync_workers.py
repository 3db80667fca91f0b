"""Rank functions for tests/engine/test_no_sync_parallel.py: every read of a tensor's value on
the host (``item``, ``bool``, ``float``, ``int``, ``tolist``) counted, with where it
came from, while the quantized Linears cast on tensor-parallel shards and FSDP2
gathers their weights as codes (gloo ranks, spawned by the tests)."""

from __future__ import annotations

import contextlib
import math
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from helpers.host_reads import MIXPREC, reads_replaced
from helpers.optim_dtensor_workers import _cuda_fusing, make_opt
from helpers.tp_fp8_workers import PLAN, SeqMLP, make_data, make_model, sp_plan
from helpers.tp_workers import _init, _save
from mixprec import MixedPrecision

warnings.simplefilter("ignore")


def counted_reads(found: list):
    """Each value read appended to ``found`` as ``(name, file:line)`` of its caller."""
    def wrap(name, original):
        def f(self, *a, **k):
            code = sys._getframe(1)
            found.append((name, f"{code.f_code.co_filename}:{code.f_lineno}"))
            return original(self, *a, **k)
        return f

    return reads_replaced(wrap)


def _engine(layout: str, recipe: str, how: str, world: int):
    """``tp``: the GPT block under torch's plan; ``sp``: a sequence-parallel norm
    before a colwise Linear whose input is gathered as its fp8 codes
    (``QuantizedColwiseParallel``); ``fsdp``: the block under FSDP2."""
    mesh = init_device_mesh("cpu", (world,))
    model = make_model()
    kw = {}
    if layout == "tp":
        model = parallelize_module(model, mesh, PLAN)
    elif layout == "sp":
        torch.manual_seed(0)
        model = parallelize_module(SeqMLP(), mesh, sp_plan(True))
    else:
        kw = {"parallel": "fsdp"}
    opt = make_opt(how, recipe, model.parameters())
    with _cuda_fusing(how):
        return MixedPrecision(model, opt, recipe, max_grad_norm=1.0, **kw)


def run(rank, world, tmp, runs, steps):
    """For each ``(layout, recipe, how)`` of ``runs`` (``how``: the optimizer,
    ``optim_dtensor_workers.make_opt``'s): one step outside the count (lazy
    state), then ``steps`` steps (the second skipped: an inf in rank 1's last
    gradient) whose forward, backward and step are counted. Saves the reads made from
    mixprec's code and from elsewhere, and the skips."""
    _init(rank, world, tmp)
    out = {}
    for layout, recipe, how in runs:
        engine = _engine(layout, recipe, how, world)
        data = make_data(steps + 1)
        skipped, found = [], []
        for i, (x, y) in enumerate(data):
            counting = counted_reads(found) if i > 0 else contextlib.nullcontext()
            if layout == "sp":  # this rank's half of every sequence
                x = x.chunk(world, 1)[rank]
            with counting:
                with engine.autocast():
                    loss = F.cross_entropy(engine.model(x), y)
                engine.backward(loss)
                if i == 2 and rank == 1:
                    g = engine.param_state.gradients()[-1]
                    (g.to_local() if isinstance(g, DTensor) else g).view(-1)[0] = math.inf
                r = engine.step()
            skipped.append(r.skipped)
        out[layout, recipe, how] = {
            "mixprec": [f for f in found if MIXPREC in f[1]],
            "other": [f for f in found if MIXPREC not in f[1]],
            "skipped": [bool(s) for s in skipped],
            "totals": engine.comm_stats.totals(),
        }
        del engine
    _save(tmp, "nosync", rank, out)
    dist.destroy_process_group()
