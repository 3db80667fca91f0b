"""The checks on their own (``mixprec.engine.checks``): each refusal names the value and the
fix, and none of them touches the model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers.models import mlp
from mixprec.engine.checks import (
    check_backward,
    check_fp8_filter,
    check_fsdp_units,
    check_model,
    check_optimizers,
    check_parallel_kwargs,
    param_counts,
    takes_found_inf,
)
from mixprec.engine.param_state import ParamState
from mixprec.parallel.layouts import SingleProcess, make_parallel
from mixprec.recipe import Recipe


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_check_model_splits_trainable_and_frozen_and_refuses_what_it_cannot_train():
    m = mlp()
    m[0].bias.requires_grad_(False)
    params, frozen = check_model(m)
    assert len(params) == 5 and frozen == [m[0].bias]
    with pytest.raises(ValueError, match="no parameters that require grad"):
        check_model(nn.Linear(2, 2).requires_grad_(False))
    with pytest.raises(ValueError, match="uninitialized.*Run one forward pass"):
        check_model(nn.LazyLinear(3))
    with pytest.raises(NotImplementedError, match="sparse=True.*sparse=False"):
        check_model(nn.Embedding(5, 3, sparse=True))


def test_check_optimizers_refuses_foreign_parameters_and_closure_optimizers():
    m = mlp()
    before = _snapshot(m)
    params, frozen = check_model(m)
    stranger = nn.Parameter(torch.ones(7, 3))
    opt = torch.optim.SGD([*m.parameters(), stranger], lr=0.1)
    with pytest.raises(ValueError, match=r"not a parameter of the model \(shape \(7, 3\)\)"):
        check_optimizers([opt], params, frozen, Recipe(), None, False)
    with pytest.raises(NotImplementedError, match="LBFGS.step needs a closure"):
        check_optimizers([torch.optim.LBFGS(m.parameters())], params, frozen, Recipe(),
                         None, False)
    check_optimizers([torch.optim.AdamW(m.parameters())], params, frozen,
                     Recipe.coerce("bf16-master"), None, False)
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())


def test_found_inf_and_param_counts_are_read_from_the_optimizer():
    m = mlp()
    assert takes_found_inf(torch.optim.AdamW(m.parameters(), fused=True))
    assert not takes_found_inf(torch.optim.AdamW(m.parameters()))
    opt = torch.optim.SGD([{"params": [m[0].weight]}, {"params": [m[3].weight]}], lr=1)
    assert param_counts([opt, torch.optim.SGD(m.parameters(), lr=1)]) == [2, 6]


def test_parallel_arguments_are_refused_without_their_mode():
    with pytest.raises(ValueError, match="given without parallel; set parallel="):
        check_parallel_kwargs(None, {"find_unused_parameters": True})
    with pytest.raises(ValueError, match=r"\['mp_policy'\]: set by mixprec"):
        check_parallel_kwargs("fsdp", {"mp_policy": None})
    assert check_parallel_kwargs("ddp", {"bucket_cap_mb": 1}) == {"bucket_cap_mb": 1}
    with pytest.raises(ValueError, match="fsdp_units given with parallel=None"):
        check_fsdp_units(None, nn.Linear, mlp())
    with pytest.raises(ValueError, match="no module of these classes"):
        check_fsdp_units("fsdp", nn.Conv2d, mlp())
    assert check_fsdp_units("fsdp", nn.Linear, mlp())(nn.Linear(1, 1))


def test_fp8_filter_needs_an_fp8_recipe_and_a_callable():
    with pytest.raises(ValueError, match="has no fp8 Linears"):
        check_fp8_filter(lambda m, n: True, Recipe.coerce("bf16"), mlp())
    with pytest.raises(TypeError, match="callable"):
        check_fp8_filter("head", Recipe.coerce("fp8"), mlp())


def test_backward_is_refused_for_a_misused_loop():
    state = ParamState(list(mlp().parameters()), Recipe())
    with pytest.raises(ValueError, match="scalar loss"):
        check_backward(torch.ones(3, requires_grad=True), 0, 1, state)
    with pytest.raises(ValueError, match="does not require grad"):
        check_backward(torch.ones(()), 0, 1, state)
    with pytest.raises(RuntimeError, match="2 times since the last update.*=1"):
        check_backward(torch.ones((), requires_grad=True), 1, 1, state)


def test_parallel_modes_are_made_from_their_names():
    single = make_parallel(None, Recipe(), mlp())
    assert isinstance(single, SingleProcess) and single.world_size == 1
    grads = [torch.ones(2)]
    assert single.local(grads) is grads and single.norm_reduce is None
    flag = torch.ones(())
    assert single.agree_max_(flag) is flag and single.gather({"a": 1}) == {"a": 1}
    assert not single.sharded and single.comm_stats is None
    with pytest.raises(ValueError, match="'ddp', 'fsdp', 'tp' or None"):
        make_parallel("zero3", Recipe(), mlp())
    with pytest.raises(ValueError, match="torchrun --nproc-per-node"):
        make_parallel("ddp", Recipe(), mlp())


def test_write_rules_and_states_are_accepted_under_fsdp_with_16_bit_shards():
    """Under FSDP the shards are fp32 masters, except with a write rule (no master),
    where they are the 16-bit weights the rule writes."""
    import mixprec.optim as mo
    from mixprec.engine.checks import check_optimizer_precision
    from mixprec.engine.param_state import updated_format

    m = mlp()
    sr = Recipe.parse("bf16-sr")
    check_optimizer_precision([mo.AdamW(m.parameters(), write="stochastic")], sr, "fsdp")
    lean = Recipe.parse("bf16-master,states=int8")
    check_optimizer_precision([mo.AdamW(m.parameters(), states="int8")], lean, "fsdp")
    assert updated_format(sr, sharded=True) == "bf16"
    assert updated_format(lean, sharded=True) == "fp32"
    assert updated_format(Recipe.parse("bf16,params=bf16"), sharded=True) == "fp32"
