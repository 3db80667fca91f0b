"""torch's fused, foreach and default optimizers, and ``mixprec.optim.adamw_for``'s,
over DTensor parameters: torch's tensor-parallel plans (DTensor shards beside plain
norms and head), FSDP, and FSDP x TP (DTensors on two meshes) train as one process
does under bf16-master, fp8-current and mxfp8 (gloo ranks spawned by the tests)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from helpers import optim_dtensor_workers as w
from helpers.ranks import max_rel as _max_rel
from helpers.ranks import spawn_tp as spawn
from mixprec.engine import checks
from mixprec.optim.kinds import (
    as_kind,
    fuses_over_dtensors,
    kind_of,
    kinds_of,
    splits_by_kind,
    step_by_kind,
    unfuse_over_dtensors,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

STEPS = 3
RECIPES = ["bf16-master", "fp8-current", "mxfp8"]
HOWS = ["adamw_for", "default", "default-cuda", "foreach", "fused-adam", "fused-sgd"]
#: the distance from one process the existing tests allow: bf16-master 2e-2 (TP),
#: the fp8 formats 5e-2 (TP as the recipes come, FSDP x TP's resumes)
TOL = {"bf16-master": 2e-2, "fp8-current": 5e-2, "mxfp8": 5e-2}
#: the data-parallel ranks of each layout (the reference accumulates their shares)
DP = {"tp": 1, "fsdp": 2, "fsdp_tp": 2}
#: the fast pass: every optimizer under TP, the recipes rotated; under FSDP (where the
#: engine fuses nothing itself, and fused Adam runs adamw_for's kernel) one of each path
FAST = {"tp": [(RECIPES[i % 3], h) for i, h in enumerate(HOWS)],
        "fsdp": [("fp8-current", "adamw_for"), ("mxfp8", "default"),
                 ("bf16-master", "foreach"), ("fp8-current", "fused-sgd")]}


def _check(got: dict, ref: dict, recipe: str, how: str) -> None:
    # the steps moved the weights well beyond the bound: a run that skipped them fails
    assert _max_rel(ref["init"], ref["params"]) > 2 * TOL[recipe]
    err = _max_rel(got["params"], ref["params"])
    assert err <= TOL[recipe], (recipe, how, err)
    assert got["norms"] == pytest.approx(ref["norms"], rel=TOL[recipe]), (recipe, how)
    assert got["skipped"] == ref["skipped"]
    assert "DTensor" in got["kinds"]


@pytest.fixture(scope="module")
def fast():
    combos = sorted({c for cs in FAST.values() for c in cs})
    return spawn(w.run, ["tp", "fsdp"], combos, STEPS, 1, name="optdt")


@pytest.mark.parametrize("layout,recipe,how",
                         [(lay, r, h) for lay, cs in FAST.items() for r, h in cs])
def test_fused_foreach_and_default_optimizers_train_dtensors_like_one_process(
        fast, layout, recipe, how):
    """Two ranks under torch's TP plan (the GPT block's Linears DTensor shards, its
    norms and head plain tensors) or FSDP, with an inf in rank 1's gradient at the
    second step: every rank skips that step and ends within the distributed tolerance
    of one process running the same optimizer. torch's fused AdamW (``adamw_for``'s)
    crashed here before (``aten._fused_adamw_ got mixed torch.Tensor and DTensor``), as
    did its foreach one; ``default-cuda`` is the engine fusing torch's default AdamW,
    as it does on CUDA, and ends fused. torch has no DTensor rule for fused SGD's
    kernel: that optimizer steps unfused, with one warning."""
    ref = w.reference(how, recipe, STEPS, inf_step=1, dp=DP[layout])
    assert ref["skipped"] == [False, True, False]
    for rank in fast:
        got = rank[layout, recipe, how]
        _check(got, ref, recipe, how)
        # fused where DTensor has a rule for the kernel (Adam, AdamW); the engine fuses
        # a default optimizer outside FSDP only; fused SGD steps unfused, said once
        fused = how in ("adamw_for", "fused-adam") or (how == "default-cuda"
                                                       and layout == "tp")
        assert got["fused"] == fused, how
        assert len(got["unfused"]) == (how == "fused-sgd"), got["unfused"]
    assert fast[0][layout, recipe, how]["norms"] == fast[1][layout, recipe, how]["norms"]


@pytest.mark.long  # three spawns, 2 and 4 ranks: minutes on two cores
@pytest.mark.parametrize("layout,world", [("tp", 2), ("fsdp", 2), ("fsdp_tp", 4)])
def test_every_optimizer_and_recipe_trains_dtensors_like_one_process(layout, world):
    """The whole matrix: each layout (FSDP x TP on a 2 x 2 mesh) x bf16-master,
    fp8-current, mxfp8 x ``adamw_for`` and torch's AdamW (default, engine-fused,
    foreach), Adam and SGD fused, within the tolerances above of one process."""
    combos = list(itertools.product(RECIPES, HOWS))
    ranks = spawn(w.run, [layout], combos, STEPS, 1, world=world, name="optdt")
    for recipe, how in combos:
        ref = w.reference(how, recipe, STEPS, inf_step=1, dp=DP[layout])
        for rank in ranks:
            _check(rank[layout, recipe, how], ref, recipe, how)


def test_step_by_kind_hands_each_kind_its_own_found_inf(tmp_path, monkeypatch):
    """Parameters of two kinds (a DTensor on a one-rank mesh, a plain tensor): the
    optimizer steps once per kind, each call seeing only that kind's parameters and a
    ``found_inf`` of the same kind; the groups are restored; the update equals
    torch's fused AdamW on plain copies, a skipped step included. Fused SGD over a
    DTensor steps unfused (below)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        _two_kinds()
        _sgd_over_dtensors(monkeypatch)
    finally:
        dist.destroy_process_group()


def _sgd_over_dtensors(monkeypatch) -> None:
    """torch has a DTensor rule for fused Adam/AdamW's kernel, none for fused SGD's
    (DTensor's own registry, read independently here): an ``SGD(fused=True)`` over a
    DTensor is switched to its unfused step with one warning, and on CUDA the engine
    leaves a default SGD over DTensors unfused, a default AdamW fused."""
    from torch.distributed.tensor import DTensor as DT

    mesh = init_device_mesh("cpu", (1,))
    registry = DT._op_dispatcher.sharding_propagator.op_single_dim_strategy_funcs
    assert torch.ops.aten._fused_adamw_.default in registry
    assert torch.ops.aten._fused_sgd_.default not in registry
    p = torch.nn.Parameter(DT.from_local(torch.ones(3), mesh, run_check=False))
    sgd, adamw = torch.optim.SGD([p], lr=0.1, fused=True), torch.optim.AdamW([p], fused=True)
    assert not fuses_over_dtensors(sgd) and fuses_over_dtensors(adamw)
    with pytest.warns(UserWarning, match="no DTensor rule for aten._fused_sgd_") as said:
        assert unfuse_over_dtensors([adamw, sgd]) == [1]
    assert len(said) == 1 and sgd.param_groups[0]["fused"] is False
    assert not checks.takes_found_inf(sgd) and checks.takes_found_inf(adamw)
    defaults = [torch.optim.SGD([p], lr=0.1), torch.optim.AdamW([p])]
    monkeypatch.setattr(checks, "param_device_types", lambda opt: {"cuda"})
    assert checks.fuse_default_optimizers(defaults) == [1]


def _two_kinds() -> None:
    mesh = init_device_mesh("cpu", (1,))
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 3, generator=g), torch.randn(5, generator=g)
    dt = torch.nn.Parameter(DTensor.from_local(a.clone(), mesh, run_check=False))
    pl = torch.nn.Parameter(b.clone())
    ref = [torch.nn.Parameter(a.clone()), torch.nn.Parameter(b.clone())]
    opt = torch.optim.AdamW([dt, pl], lr=0.1, fused=True)
    ref_opt = torch.optim.AdamW(ref, lr=0.1, fused=True)
    assert kinds_of(opt) == [mesh, None] and splits_by_kind(opt) and kind_of(dt) == mesh
    assert type(as_kind(torch.ones(()), None)) is torch.Tensor
    seen = []
    opt.register_step_pre_hook(lambda o, *_: seen.append(
        ([type(p).__name__ for p in o.param_groups[0]["params"]],
         type(o.found_inf).__name__, type(o.grad_scale).__name__)))
    for found in (0.0, 1.0, 0.0):
        gr = [torch.randn(4, 3, generator=g), torch.randn(5, generator=g)]
        dt.grad = DTensor.from_local(gr[0].clone(), mesh, run_check=False)
        pl.grad, ref[0].grad, ref[1].grad = gr[1].clone(), gr[0].clone(), gr[1].clone()
        step_by_kind(opt, torch.tensor(found), torch.tensor(2.0))
        ref_opt.found_inf, ref_opt.grad_scale = torch.tensor(found), torch.tensor(2.0)
        ref_opt.step()
    assert seen[:2] == [(["DTensor"], "DTensor", "DTensor"), (["Parameter"], "Tensor", "Tensor")]
    assert [x is y for x, y in zip(opt.param_groups[0]["params"], [dt, pl])] == [True, True]
    assert not hasattr(opt, "found_inf")
    assert torch.equal(dt.to_local(), ref[0].detach())
    assert torch.equal(pl.detach(), ref[1].detach())
    assert float(opt.state[pl]["step"]) == 2.0  # the skipped step did not count
