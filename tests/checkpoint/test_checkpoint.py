"""The checkpoint room on its own (``mixprec.checkpoint.core``): atomic files, readable
errors, and the checks that run before a state is loaded."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers.models import mlp
from helpers.speeds import set_speeds
from mixprec import MixedPrecision
from mixprec.checkpoint.core import (
    CheckpointError,
    check_engine_state,
    fp32_weights,
    load_checkpoint,
    save_atomic,
)
from mixprec.engine.param_state import ParamState
from mixprec.recipe import Recipe


class _Unpicklable:
    def __reduce__(self):
        raise RuntimeError("disk full")  # fails halfway through torch.save


def test_a_failed_write_leaves_the_previous_file_whole(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_atomic({"step": 1, "w": torch.arange(4.0)}, path)
    with pytest.raises(RuntimeError, match="disk full"):
        save_atomic({"step": 2, "w": torch.zeros(4), "bad": _Unpicklable()}, path)
    got = load_checkpoint(path)
    assert got["step"] == 1 and torch.equal(got["w"], torch.arange(4.0))


def test_missing_and_torn_files_are_checkpoint_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "none.pt")
    path = tmp_path / "torn.pt"
    save_atomic({"w": torch.randn(1000)}, path)
    path.write_bytes(path.read_bytes()[:300])
    with pytest.raises(CheckpointError, match="unreadable.*Nothing was changed"):
        load_checkpoint(path)


def _state(model, opt, recipe="bf16", **over):
    return {"recipe": Recipe.coerce(recipe), "emulating": False, "world_size": 1,
            "parallel": None, "layout": "full", "model": model.state_dict(),
            "optimizers": [opt.state_dict()], **over}


def test_every_mismatch_is_named_before_anything_loads():
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    r = Recipe.coerce("bf16")

    def check(state, parallel=None, world=1, optimizers=(opt,)):
        check_engine_state(state, r, False, world, parallel, list(optimizers), m)

    check(_state(m, opt))  # the same run: fine
    with pytest.raises(ValueError, match="saved with recipe 'bf16-master'.*runs 'bf16'"):
        check(_state(m, opt, "bf16-master"))
    with pytest.warns(UserWarning, match="emulation on.*emulate=auto resolves to off"):
        check(_state(m, opt, emulating=True))  # auto here: resumes, saying so
    with pytest.raises(ValueError, match="emulation on but this recipe pins emulate=false"):
        check_engine_state(_state(m, opt, emulating=True), Recipe.coerce("bf16,emulate=false"),
                           False, 1, None, [opt], m)
    with pytest.raises(ValueError, match="FSDP shards of 2 rank.*full=True"):
        check(_state(m, opt, world_size=2, layout="sharded"))
    with pytest.raises(ValueError, match="1 optimizer\\(s\\), this engine has 2"):
        check(_state(m, opt), optimizers=(opt, opt))
    other = torch.optim.SGD([{"params": list(m.parameters())[:2]},
                             {"params": list(m.parameters())[2:]}], lr=0.1)
    with pytest.raises(ValueError, match="param groups of \\[2, 4\\].*has \\[6\\]"):
        check(_state(m, other))
    with pytest.raises(ValueError, match="does not match this model"):
        check(_state(mlp(hidden=8), opt))


def test_fp32_weights_take_the_masters_and_drop_fp8_state():
    m = nn.Linear(4, 3)
    want = {k: v.clone() for k, v in m.state_dict().items()}
    state = ParamState(list(m.parameters()), Recipe.coerce("bf16-master"))
    assert m.weight.dtype == torch.bfloat16
    got = fp32_weights(m, state)
    assert got.keys() == want.keys()
    assert all(got[k].dtype == torch.float32 and torch.equal(got[k], want[k]) for k in want)


def test_fp32_weights_leave_out_the_fp8_scaling_buffers():
    from mixprec.engine.convert import convert

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    convert(m, Recipe.coerce("fp8"), filter=lambda mod, fqn: True)
    fp8_keys = {k for k in m.state_dict() if "fp8_" in k}
    assert fp8_keys  # amax histories and scales exist in the model's state
    got = fp32_weights(m, ParamState(list(m.parameters()), Recipe.coerce("fp8")))
    assert set(got) == set(m.state_dict()) - fp8_keys
    fresh = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    fresh.load_state_dict(got, strict=True)  # loads into a plain fp32 model


@pytest.mark.parametrize("recipe", ["bf16-master", "fp16-master", "fp8", "bf16",
                                    "bf16-master,emulate=true"])
def test_load_fp32_state_dict_takes_an_export_into_masters_and_working_copy(recipe):
    """An export loads into a fresh engine: its masters equal the exporting engine's bit
    for bit and its working copy is their rounding, as after an update (the next step
    runs: the engine wrote it). A wrong key or shape raises before anything changes."""
    import warnings

    def build():
        torch.manual_seed(1)
        m = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, 8))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return m, MixedPrecision(m, torch.optim.AdamW(m.parameters(), lr=1e-2), recipe)

    def train(m, e, n):
        g = torch.Generator().manual_seed(2)
        for _ in range(n):
            with e.autocast():
                loss = m(torch.randn(16, 32, generator=g)).float().pow(2).mean()
            e.backward(loss)
            e.step()

    m, e = build()
    train(m, e, 3)
    want = e.export_state_dict()
    m2, e2 = build()
    before = {k: v.clone() for k, v in e2.export_state_dict().items()}
    bad = {**want, "0.weight": want["0.weight"][:, :4]}
    with pytest.raises(ValueError, match="does not match this model.*nothing was loaded"):
        e2.load_fp32_state_dict(bad)
    with pytest.raises(ValueError, match="does not match"):
        e2.load_fp32_state_dict({k: v for k, v in want.items() if k != "2.bias"})
    assert all(torch.equal(before[k], v) for k, v in e2.export_state_dict().items())
    e2.load_fp32_state_dict(want)
    got = e2.export_state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())
    assert all(torch.equal(a, b) for a, b in zip(e2.param_state.working,
                                                 e.param_state.working))
    train(m2, e2, 1)
    assert e2.steps == 1


def test_a_run_saved_under_emulation_resumes_where_auto_resolves_to_real_kernels(
        monkeypatch, tmp_path):
    """Saved with ``emulate=true`` (an AVX2 laptop's choice), resumed with
    ``emulate=auto`` on a device whose bf16 kernels measure fast (monkeypatched): the
    weights, masters and optimizer state load as saved, one warning says what changes,
    and training goes on."""
    import warnings

    from mixprec import MixedPrecision

    def build(recipe):
        torch.manual_seed(0)
        m = mlp()
        return m, MixedPrecision(m, torch.optim.AdamW(m.parameters(), lr=1e-2), recipe)

    def steps(m, engine, n):
        torch.manual_seed(1)
        for _ in range(n):
            with engine.autocast():
                loss = m(torch.randn(8, m[0].in_features)).float().square().mean()
            engine.backward(loss)
            engine.step()
            engine.zero_grad()

    m, engine = build("bf16-master,emulate=true")
    steps(m, engine, 2)
    engine.save(tmp_path / "ck.pt")
    saved = {k_: v.clone() for k_, v in m.state_dict().items()}
    set_speeds(monkeypatch, bf16=1.0)  # fast bf16 here
    m2, engine2 = build("bf16-master")
    assert not engine2.emulating
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine2.load(tmp_path / "ck.pt")
    msgs = [str(w.message) for w in caught]
    assert len(msgs) == 1 and "trained with emulation on" in msgs[0], msgs
    assert all(torch.equal(v.float(), saved[k_].float()) for k_, v in m2.state_dict().items())
    steps(m2, engine2, 2)
    assert all(torch.isfinite(p).all() for p in m2.parameters())
    m3, engine3 = build("bf16-master,emulate=false")  # pinned the other way: refused
    with pytest.raises(ValueError, match="pins emulate=false"):
        engine3.load(tmp_path / "ck.pt")


def test_a_checkpoint_of_another_model_is_blamed_on_the_model_not_the_optimizer():
    """Another parameter count also means other param groups: the model is named."""
    small = mlp(hidden=32)
    big = nn.Sequential(*mlp(hidden=32), nn.Linear(4, 4))
    state = MixedPrecision(small, torch.optim.AdamW(small.parameters()), "bf16-master"
                           ).state_dict()
    e = MixedPrecision(big, torch.optim.AdamW(big.parameters()), "bf16-master")
    with pytest.raises(ValueError, match=r"checkpoint's model does not match this model"
                                         r".*'4\.bias', '4\.weight'"):
        e.load_state_dict(state)
