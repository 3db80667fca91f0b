"""Optimizer checkpoints written by mixprec 0.2.0 (tests/data/optim_0_2.pt, made by
tests/data/optim_0_2.py with that version) load and resume in this one."""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch

import mixprec.optim as mo
from helpers.paths import DATA
from mixprec.optim.compat import decode_layout1
from mixprec.optim.states import LAYOUT, decode


def _fixture():
    spec = importlib.util.spec_from_file_location("optim_0_2", DATA / "optim_0_2.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, torch.load(DATA / "optim_0_2.pt", weights_only=True)


def _resume(name):
    mod, saved = _fixture()
    states, write, dtype = mod.CASES[name]
    case = saved[name]
    params = [torch.nn.Parameter(p.clone()) for p in case["params"]]
    opt = mo.AdamW(params, lr=1e-2, weight_decay=0.1, states=states, write=write, seed=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict(case["optim"])
    for step in range(3, 5):
        for p, g in zip(params, mod.grads(step)):
            p.grad = g.to(dtype)
        opt.step()
    return params, case, opt, [str(w.message) for w in caught]


def test_stochastic_writes_resume_a_0_2_checkpoint_with_the_same_bits():
    """The rounding stream (seed, parameter index, applied-step count, element index)
    is unchanged: the two steps after the checkpoint land on 0.2's bf16 weights bit for
    bit, and nothing warns."""
    params, case, _, caught = _resume("sr")
    assert not caught
    assert all(torch.equal(p, q) for p, q in zip(params, case["after"]))


def test_the_same_resume_fails_when_the_stream_moves():
    """Control: one more applied step in the counter (a stream that restarted or
    drifted) gives other bf16 weights."""
    mod, saved = _fixture()
    case = dict(saved["sr"])
    optim = dict(case["optim"])
    optim["mixprec"] = {**optim["mixprec"], "sr_steps": {"cpu": torch.tensor(4)}}
    params = [torch.nn.Parameter(p.clone()) for p in case["params"]]
    opt = mo.AdamW(params, lr=1e-2, weight_decay=0.1, states="fp32", write="stochastic",
                   seed=5)
    opt.load_state_dict(optim)
    for step in range(3, 5):
        for p, g in zip(params, mod.grads(step)):
            p.grad = g.to(torch.bfloat16)
        opt.step()
    assert not torch.equal(params[0], case["after"][0])


@pytest.mark.parametrize("name", ["lean", "fp8"])
def test_block_states_of_0_2_are_reencoded_once_with_a_warning(name):
    """0.2's padded, linear codes are read as 0.2 wrote them and re-encoded in this
    version's maps: the states move by at most a grid step, and the resumed weights
    stay within a small fraction of the update of 0.2's."""
    mod, saved = _fixture()
    states, _, dtype = mod.CASES[name]
    params, case, opt, caught = _resume(name)
    assert len(caught) == 1 and "mixprec 0.2" in caught[0] and "re-encoded" in caught[0]
    old = case["optim"]["state"]
    for i, p0 in enumerate(case["params"][:2]):  # the two block-coded parameters
        for n, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            was = decode_layout1({k: old[i][f"{n}.{k}"] for k in "qs"}, states, p0, signed)
            assert old[i][f"{n}.q"].ndim == 3  # the fixture really is layout 1
            fresh = mo.AdamW([torch.nn.Parameter(p0.clone())], states=states,
                             write=mod.CASES[name][1])
            with pytest.warns(UserWarning, match="mixprec 0.2"):
                fresh.load_state_dict(case["optim"] | {"state": {0: old[i]}, "param_groups": [
                    {**case["optim"]["param_groups"][0], "params": [0]}]})
            now = decode({k: fresh.state[fresh.param_groups[0]["params"][0]][f"{n}.{k}"]
                          for k in "qs"}, states, p0, signed)
            tol = 0.07 if states == "fp8" else 0.05
            big = was.abs() > 0.1 * was.abs().max()  # where a grid step is under 5%
            assert ((now - was).abs() <= tol * was.abs())[big].all(), (name, n)
    for p, q, p0 in zip(params, case["after"], case["params"]):
        moved = (q.float() - p0.float()).norm()
        assert (p.float() - q.float()).norm() <= 0.1 * moved
    sd = opt.state_dict()  # saved again: the current layout, no warning on the next load
    assert sd["mixprec"]["layout"] == LAYOUT
    again = mo.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-2,
                     weight_decay=0.1, states=states, write=mod.CASES[name][1], seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again.load_state_dict(sd)


def test_a_reshardable_0_2_checkpoint_of_block_states_is_refused_naming_the_layout():
    _, saved = _fixture()
    extra = saved["lean"]["optim"]["mixprec"]
    opt = mo.AdamW([torch.nn.Parameter(torch.ones(64, 64))], states="int8",
                   write="stochastic")
    opt.check_extra_state(extra)  # a full checkpoint converts
    with pytest.raises(ValueError, match=r"layout 1 \(mixprec 0.2\).*save\(path, full=True\)"):
        opt.check_extra_state(extra, reshardable=True)
