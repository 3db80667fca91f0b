"""Exact resume through ``engine.save`` / ``engine.load``: the random streams come back,
a checkpoint loaded and saved again resumes like the original, and a failed write
leaves the previous checkpoint and no temp file."""

from __future__ import annotations

import errno
import random
import resource
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mixprec import MixedPrecision
from mixprec.optim import adamw_for

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _dropout_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 48), nn.GELU(), nn.Dropout(0.1), nn.Linear(48, 48),
                         nn.LayerNorm(48), nn.Dropout(0.2), nn.Linear(48, 4))


def _batches(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
            for _ in range(n)]


def _engine(recipe: str, seed: int = 0):
    model = _dropout_model(seed)
    over = ",growth_interval=2" if "fp16" in recipe else ""
    opt = adamw_for(recipe, model.parameters(), lr=3e-3)
    return model, MixedPrecision(model, opt, recipe + over, max_grad_norm=1.0)


def _run(model, engine, batches) -> list[float]:
    out = []
    model.train()
    for x, y in batches:
        with engine.autocast():
            loss = F.cross_entropy(model(x), y)
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


def _scramble() -> None:
    """What a new process would have: every global stream somewhere else."""
    torch.manual_seed(12345)
    random.seed(12345)
    np.random.seed(12345)


def _same_state(a: MixedPrecision, b: MixedPrecision) -> bool:
    return (all(torch.equal(p, q) for p, q in zip(a.master_params, b.master_params))
            and all(torch.equal(p, q) for p, q in zip(a.module.state_dict().values(),
                                                      b.module.state_dict().values())))


@pytest.mark.paths
@pytest.mark.parametrize("recipe", [
    "bf16-master", pytest.param("fp16-master", marks=pytest.mark.long)])
def test_dropout_resumes_bit_for_bit(recipe, tmp_path):
    data = _batches(15, seed=1)
    model, a = _engine(recipe)
    _run(model, a, data[:5])
    a.save(tmp_path / "ckpt.pt", step=5)
    after_save = (random.random(), float(np.random.rand()))
    tail_a = _run(model, a, data[5:])

    _scramble()  # as in a new process
    b_model, b = _engine(recipe, seed=3)
    assert b.load(tmp_path / "ckpt.pt") == {"step": 5}
    assert (random.random(), float(np.random.rand())) == after_save
    assert _run(b_model, b, data[5:]) == tail_a
    assert _same_state(a, b)

    # without the streams, dropout draws other masks: the check above is not vacuous
    _scramble()
    c_model, c = _engine(recipe, seed=3)
    c.load(tmp_path / "ckpt.pt", rng_state=False)
    assert _run(c_model, c, data[5:]) != tail_a


def test_a_checkpoint_without_streams_loads_with_one_warning(tmp_path):
    model, e = _engine("bf16-master")
    _run(model, e, _batches(2, 0))
    e.save(tmp_path / "ckpt.pt", step=2)
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    del state["rng"]  # as mixprec wrote it before the streams were saved
    torch.save(state, tmp_path / "old.pt")
    model2, e2 = _engine("bf16-master", seed=1)
    with warnings.catch_warnings(record=True) as log:
        warnings.simplefilter("always")
        assert e2.load(tmp_path / "old.pt") == {"step": 2}
        e.save(tmp_path / "off.pt", rng_state=False)  # turned off: loads silently
        e2.load(tmp_path / "off.pt")
    said = [str(w.message) for w in log if "random streams" in str(w.message)]
    assert len(said) == 1 and "holds no random streams" in said[0], said
    assert _same_state(e, e2)


# load -> save -> load -> N steps, against the uninterrupted run, for each family of
# recipes: 16-bit with and without masters, loss scaling, the write rules (stochastic
# rounding's counter, Kahan's compensation, remainders, the lean chunks), coded states,
# and the fp8/fp4 scalings (delayed scaling's amax history among them)
FAMILIES = ["fp32", "bf16", "bf16-master", "fp16-master", "bf16-sr", "bf16-kahan",
            "bf16-remainder", "bf16-lean", "bf16-master,states=int8",
            "bf16-master,states=fp8", "bf16-master,states=int4", "fp8", "fp8-current",
            "fp8-rowwise", "fp8-block", "mxfp8", "nvfp4"]
#: in CI's long pass only: the scalings that keep no state (``fp8``, delayed scaling's
#: history, stands for the Linear formats here)
LONG_FAMILIES = {"fp8-current", "fp8-rowwise", "fp8-block", "mxfp8", "nvfp4"}


def _linear_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)  # Linears whose dims every fp8/fp4 scaling takes
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Dropout(0.1),
                         nn.Linear(128, 64), nn.LayerNorm(64), nn.Linear(64, 128))


@pytest.mark.paths
@pytest.mark.parametrize("recipe", [pytest.param(f, marks=pytest.mark.long)
                                    if f in LONG_FAMILIES else f for f in FAMILIES])
def test_load_then_save_resumes_like_the_original(recipe, tmp_path):
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(32, 64, generator=g), torch.randint(0, 128, (32,), generator=g))
            for _ in range(7)]

    def build(seed):
        m = _linear_model(seed)
        opt = adamw_for(recipe, m.named_parameters(), lr=1e-2)
        over = ",growth_interval=2" if "fp16" in recipe else ""
        return m, MixedPrecision(m, opt, recipe + over)

    m, a = build(0)
    run = _run
    run(m, a, data[:3])
    a.save(tmp_path / "one.pt", step=3)
    want = run(m, a, data[3:])

    _scramble()
    m1, b = build(1)
    assert b.load(tmp_path / "one.pt") == {"step": 3}
    b.save(tmp_path / "two.pt", step=3)  # loaded and saved again before any step
    _scramble()
    m2, c = build(2)
    assert c.load(tmp_path / "two.pt") == {"step": 3}
    got = run(m2, c, data[3:])
    assert got == want
    assert _same_state(a, c)
    for oa, oc in zip(a.optimizers, c.optimizers):
        sa, sc = oa.state_dict()["state"], oc.state_dict()["state"]
        for i in sa:
            for k, v in sa[i].items():
                assert torch.equal(torch.as_tensor(v), torch.as_tensor(sc[i][k])), (i, k)


# --- a write that fails ------------------------------------------------------------------

def _trained(tmp_path):
    model, e = _engine("bf16-master")
    _run(model, e, _batches(2, 0))
    e.save(tmp_path / "ckpt.pt", step=2)
    return model, e, (tmp_path / "ckpt.pt").read_bytes()


def test_a_write_cut_short_by_a_file_size_limit_leaves_no_temp_file(tmp_path):
    model, e, before = _trained(tmp_path)
    _run(model, e, _batches(1, 1))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (len(before) // 2, hard))
    try:
        with pytest.raises(OSError) as info:
            e.save(tmp_path / "ckpt.pt", step=3)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert info.value.errno == errno.EFBIG
    msg = str(info.value)
    assert str(tmp_path / "ckpt.pt") in msg and "larger than this process may write" in msg
    assert "previous checkpoint, if any, is intact" in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]
    assert (tmp_path / "ckpt.pt").read_bytes() == before


@pytest.mark.parametrize("code,cause", [(errno.ENOSPC, "the disk is full"),
                                        (errno.EACCES, "no permission")])
def test_a_failed_write_names_the_path_and_the_cause(tmp_path, monkeypatch, code, cause):
    model, e, before = _trained(tmp_path)
    real_save = torch.save

    def failing(obj, f, *args, **kwargs):
        real_save({"half": torch.zeros(10_000)}, f)  # some bytes reach the temp file
        raise OSError(code, "os says no")

    monkeypatch.setattr(torch, "save", failing)
    with pytest.raises(OSError, match=f"ckpt.pt.*{cause}") as info:
        e.save(tmp_path / "ckpt.pt", step=3)
    assert info.value.errno == code
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]
    assert (tmp_path / "ckpt.pt").read_bytes() == before


def test_an_interrupted_write_leaves_no_temp_file(tmp_path, monkeypatch):
    model, e, before = _trained(tmp_path)

    def interrupted(obj, f, *args, **kwargs):
        f.write(b"x" * 1000)
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        e.save(tmp_path / "ckpt.pt", step=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]
    assert (tmp_path / "ckpt.pt").read_bytes() == before
