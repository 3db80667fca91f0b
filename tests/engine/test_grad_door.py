"""The parameter state's one door in and one view out, the step's two passes over the
gradients, and the one writer of the step counters."""

from __future__ import annotations

import sys
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from helpers import dist_workers as w
from helpers.ranks import spawn
from mixprec import MixedPrecision
from mixprec.engine.step import Counters

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _window(engine, accum: int, seed: int = 1) -> None:
    x, y = w.make_data(1, seed=seed)[0]
    for xm, ym in zip(x.chunk(accum), y.chunk(accum)):
        with engine.autocast():
            loss = F.cross_entropy(engine.model(xm), ym)
        engine.backward(loss)


@pytest.mark.parametrize("recipe,accum,callers", [
    ("bf16-master", 2, {"accumulate"}),                       # autograd's .grad harvest
    ("bf16-master,grad_accum=kahan", 3, {"accumulate"}),      # compensations too
    ("bf16-master,wgrad=fp32", 2, {"add_fp32_grad"}),         # the sink during backward
])
def test_every_buffer_write_of_a_window_goes_through_the_door(recipe, accum, callers):
    model = w.make_mlp()
    engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), recipe,
                            grad_accum_steps=accum)
    state = engine.param_state
    start = w.DoorSpy.writes(state)
    with w.ValueSpy(state) as values, w.DoorSpy() as spy:
        _window(engine, accum)
    assert callers <= set(spy.calls), spy.calls
    assert set(spy.calls) <= {"accumulate", "add_fp32_grad"}
    assert values.outside == 0 and values.inside > 0
    if not engine.emulating:
        # under the emulation's dispatch mode torch's in-place foreach ops leave the
        # version counters as they were (the values above are the check there)
        assert spy.inside == w.DoorSpy.writes(state) - start > 0



def test_ddp_hook_and_fsdp_shards_write_through_the_door():
    for r in spawn(w.door_writers):
        ddp = r[("ddp", "bf16-master")]
        # the hook folds the last micro-batch into the buffers' sums in fp32 on its way
        # to the reduction (no write) and puts the reduced sums back through the door
        # (``done``); what it settled is not harvested again
        assert ddp["calls"]["done"] >= 1 and "ddp_comm_hook" not in ddp["calls"], ddp
        assert set(ddp["calls"]) <= {"accumulate", "done"}, ddp
        wgrad = r[("ddp", "bf16-master,wgrad=fp32")]
        assert wgrad["calls"]["add_fp32_grad"] >= 3, wgrad   # 3 Linears' weights
        assert "accumulate" not in wgrad["calls"] and wgrad["calls"]["done"] >= 1, wgrad
        fsdp = r[("fsdp", "fp32,grad_accum=kahan")]
        # FSDP keeps the window's unsharded sum itself: one harvest of the shards
        assert not fsdp["direct"] and fsdp["calls"] == {"accumulate": 1}, fsdp
        for case in r.values():
            assert case["values_outside"] == 0 and case["values_inside"] > 0, case
            if not case["emulating"]:  # see the window test above
                assert case["inside"] == case["writes"] > 0, case


def test_torch_optimizers_read_the_view_as_grad_without_a_copy():
    model = w.make_mlp()
    engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            "bf16-master")
    _window(engine, 1)
    engine.param_state.hand_to_optimizer()
    state = engine.param_state
    assert all(q.grad is g for q, g in zip(state.opt_params, state.grads))
    assert all(g.dtype == torch.float32 for g in state.grads)


class GradReads(TorchDispatchMode):
    """Each gradient's non-view ops (a view reads no element) while ``on``."""

    def __init__(self, grads: list[torch.Tensor]) -> None:
        super().__init__()
        self.ptrs = {g.untyped_storage().data_ptr() for g in grads}
        self.ops: dict[int, list] = defaultdict(list)
        self.on = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.on and not func.is_view:
            touched = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                       if isinstance(t, torch.Tensor)} & self.ptrs
            for ptr in touched:
                self.ops[ptr].append(func)
        return func(*args, **kwargs)


@pytest.mark.parametrize("recipe,max_norm,passes", [
    ("fp16-master", 1.0, 2),    # norm, then g * clip_coef / scale
    ("fp16-master", None, 2),   # norm, then g / scale
    ("bf16-master", 1e-3, 2),   # norm, then g * clip_coef (clips)
    ("bf16-master", None, 1),   # norm only: nothing to unscale or clip
])
def test_unfused_step_passes_over_the_gradients_twice(recipe, max_norm, passes):
    torch.manual_seed(0)
    model = w.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # no found_inf: the unfused step
    engine = MixedPrecision(model, opt, recipe, max_grad_norm=max_norm)
    _window(engine, 1)
    grads = engine.param_state.gradients()
    mode = GradReads(grads)
    plain_step = opt.step

    def step(*args, **kwargs):
        mode.on = False  # the optimizer's own reads are not the step's passes
        return plain_step(*args, **kwargs)

    opt.step = step
    with mode:
        result = engine.step()
    assert not bool(result.skipped)
    assert len(mode.ops) == len(grads)
    assert {len(ops) for ops in mode.ops.values()} == {passes}, dict(mode.ops)


@pytest.mark.parametrize("recipe", ["fp16-master", "bf16-master"])
def test_one_pass_unscale_and_clip_equals_torch_unscale_then_clip(recipe):
    """The step's one multiply gives the bits of GradScaler's unscale followed by
    torch's ``clip_grad_norm_`` (a power-of-2 scale)."""
    torch.manual_seed(0)
    model = w.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = MixedPrecision(model, opt, recipe, max_grad_norm=1e-3)
    _window(engine, 1)
    state = engine.param_state
    scale = engine.scaler.scale.clone()
    ref = [g.clone() for g in state.gradients()]
    seen = []
    plain_step = opt.step
    opt.step = lambda *a, **k: (seen.extend(g.clone() for g in state.gradients()),
                                plain_step(*a, **k))[1]
    engine.step()
    holders = [torch.zeros_like(g, requires_grad=True) for g in ref]
    for h, g in zip(holders, ref):
        h.grad = g.mul_(torch.reciprocal(scale))  # GradScaler's unscale_
    torch.nn.utils.clip_grad_norm_(holders, 1e-3, foreach=True)
    assert len(seen) == len(ref)
    for got, want in zip(seen, ref):
        assert torch.equal(got, want)


def test_only_counters_write_the_counters(monkeypatch, tmp_path):
    writers = set()
    plain = object.__setattr__

    def spy(self, name, value):
        writers.add(sys._getframe(1).f_code.co_qualname)
        plain(self, name, value)

    model = w.make_mlp()
    engine = MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16",
                            grad_accum_steps=2, max_grad_norm=1.0)
    monkeypatch.setattr(Counters, "__setattr__", spy)
    _window(engine, 2)
    engine.step()
    _window(engine, 1)
    engine.zero_grad()
    engine.save(tmp_path / "c.pt")
    engine.load(tmp_path / "c.pt")
    assert engine.steps == 1
    assert writers and all(q.startswith("Counters.") for q in writers), writers
