"""The parameter state on its own (``mixprec.engine.param_state``), without an engine: casting,
masters, buffers, accumulation, refresh, and the one rule for what the optimizer
updates."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from mixprec.engine.param_state import PIECE, ParamState, updated_dtype, updated_format
from mixprec.memory import high_water
from mixprec.recipe import Recipe


def _params(*shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]


@pytest.mark.parametrize("recipe, emulate, sharded, fmt, dtype", [
    ("fp32", False, False, "fp32", torch.float32),
    ("bf16", False, False, "fp32", torch.float32),          # autocast: params stay fp32
    ("bf16-master", False, False, "fp32", torch.float32),
    ("fp16-master", False, False, "fp32", torch.float32),
    ("bf16,params=bf16", False, False, "bf16", torch.bfloat16),
    ("bf16,params=bf16", True, False, "bf16", torch.float32),  # bf16 values in fp32
    ("bf16,params=bf16", False, True, "fp32", torch.float32),  # FSDP's fp32 shards
    ("fp16,params=fp16,master=none,loss_scale=dynamic", False, False, "fp16",
     torch.float16),
])
def test_what_the_optimizer_updates_is_one_rule(recipe, emulate, sharded, fmt, dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 weights without masters warn
        r = Recipe.coerce(recipe)
    assert updated_format(r, sharded) == fmt
    assert updated_dtype(r, emulate, sharded) == dtype
    state = ParamState(_params((4, 3)), r, emulate=emulate, sharded=sharded)
    assert state.updated_format == fmt
    assert all(q.dtype == dtype for q in state.opt_params)


def test_masters_are_exact_copies_and_the_working_copy_their_rounding():
    params = _params((8, 5), (5,))
    before = [p.detach().clone() for p in params]
    state = ParamState(params, Recipe.coerce("bf16-master"), names=["w", "b"])
    assert state.names == ["w", "b"] and state.has_master
    for m, w, b in zip(state.masters, state.working, before):
        assert m.dtype == torch.float32 and torch.equal(m, b)  # bit for bit
        assert w.dtype == torch.bfloat16 and torch.equal(w, b.to(torch.bfloat16))
    # fp32 buffers, which are the masters' .grad: the optimizer reads them with no copy
    for m, buf in zip(state.masters, state.buffers):
        assert buf.dtype == torch.float32 and m.grad is buf


def test_micro_batch_gradients_add_up_in_fp32_buffers():
    params = _params((64,))
    state = ParamState(params, Recipe.coerce("bf16-master"))
    w = state.working[0]
    want = torch.zeros(64, dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    for _ in range(16):
        grad = (torch.randn(64, generator=g) * 1e-3).to(torch.bfloat16)
        w.grad = grad
        want += grad.double()
        state.accumulate()
        assert w.grad is None  # moved into the buffer
    # 16 bf16 values sum in fp32 with an error far below one bf16 ulp of the sum
    got = state.gradients()[0].double()
    assert torch.allclose(got, want, rtol=2**-20, atol=0)
    assert (got.float() != want.float().to(torch.bfloat16).float()).any()  # not bf16


def test_kahan_buffers_stay_at_one_rounding_where_plain_fp32_drifts():
    n, size = 2048, 256
    g = torch.Generator().manual_seed(2)
    terms = (torch.rand(n, size, generator=g) * 1e-3).to(torch.bfloat16)
    exact = terms.double().sum(0)
    errors = {}
    for accum in ("plain", "kahan"):
        state = ParamState(_params((size,)), Recipe.coerce(f"bf16-master,grad_accum={accum}"))
        for t in terms:
            state.working[0].grad = t.clone()
            state.accumulate()
        errors[accum] = ((state.gradients()[0].double() - exact).abs() / exact).max().item()
    # compensated: within one fp32 rounding of the exact sum; plain: many roundings
    assert errors["kahan"] <= 2**-24 and errors["plain"] > 2**-23  # 5.8e-8, 2.2e-7
    assert len(ParamState(_params((3,)), Recipe.coerce(
        "bf16-master,grad_accum=kahan")).compensations) == 1


def test_refresh_is_idempotent_and_foreign_writes_are_seen():
    state = ParamState(_params((6,)), Recipe.coerce("bf16-master"))
    with torch.no_grad():
        state.masters[0].add_(1e-3)
    state.refresh_working()
    first = state.working[0].detach().clone()
    state.refresh_working()  # a skipped step refreshes from unchanged masters
    assert torch.equal(state.working[0], first)
    assert state.changed_working() == []
    with torch.no_grad():
        state.working[0].mul_(2)  # e.g. model.load_state_dict behind the engine
    assert state.changed_working() == [state.working[0]]


def test_direct_mode_has_no_buffers_and_an_aligned_view_with_gaps():
    params = _params((3,), (2,))
    state = ParamState(params, Recipe.coerce("fp32"))
    assert state.direct and state.buffers == [] and state.opt_params is state.working
    params[1].grad = torch.ones(2)
    assert state.aligned_gradients() == [None, params[1].grad]
    assert state.gradients() == [params[1].grad]


def test_sharded_state_is_fp32_without_masters_whatever_the_recipe():
    params = _params((4,))
    state = ParamState(params, Recipe.coerce("bf16-master"), sharded=True)
    assert not state.has_master and state.working[0].dtype == torch.float32
    assert state.recipe.grads == "fp32" and state.updated_format == "fp32"


def test_emulated_working_copy_holds_format_values_in_fp32():
    params = _params((32,))
    raw = params[0].detach().clone()
    state = ParamState(params, Recipe.coerce("bf16,params=bf16,emulate=true"), emulate=True)
    w = state.working[0]
    assert w.dtype == torch.float32 and state.round_to == "bf16"
    assert torch.equal(w, raw.to(torch.bfloat16).float())
    assert state.wants_fp32_grad(w) is False  # direct fp32 .grad: no buffer to route to


def test_refresh_rounds_the_emulated_working_copy_in_pieces():
    """Under emulation without masters the refresh rounds the fp32 tensors to bf16 in
    place, a piece at a time: the values a whole-tensor rounding gives, holding at most
    one piece's bf16 copy (2 MiB) rather than the tensor's (5 MiB here)."""
    params = _params((PIECE * 5 // 8, 4), (3, 5))
    state = ParamState(params, Recipe.coerce("bf16-lean,emulate=true"), emulate=True)
    with torch.no_grad():
        for p in params:
            p.add_(torch.rand(p.shape) * 1e-3)  # an update, off the bf16 grid
    want = [p.detach().to(torch.bfloat16).float() for p in params]
    assert high_water(state.refresh_working) <= 2 * PIECE + 4096
    assert all(torch.equal(p, w) for p, w in zip(params, want))


def test_bad_inputs_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="already torch.bfloat16.*fp32 model"):
        ParamState([nn.Parameter(torch.ones(2, dtype=torch.bfloat16))],
                   Recipe.coerce("bf16-master"))
    with pytest.raises(ValueError, match="2 names for 1 parameters"):
        ParamState(_params((2,)), Recipe.coerce("fp32"), names=["a", "b"])


def test_stray_gradients_are_dropped_outside_direct_mode():
    state = ParamState(_params((2,)), Recipe.coerce("bf16-master"))
    state.working[0].grad = torch.ones(2, dtype=torch.bfloat16)  # another engine's
    state.drop_stray_grads(fresh=False)
    assert state.working[0].grad is None
