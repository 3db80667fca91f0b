"""A pipeline whose stages are tensor-parallel and data-parallel: PP 2 x DP 2 x TP 2 on
eight gloo ranks (a 3-D ``DeviceMesh`` as torchtitan builds it, ``Schedule1F1B``)
trains as one process holding the whole model does, every rank reports the same clip
norm and skips the same step when one rank's gradient turns non-finite."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from helpers.pp3d_workers import pp3d_runs

#: the loss tolerance against one process (the two-stage pipeline tests' bounds)
TOL = {"bf16-master": 0.02, "fp8-current": 0.05}
STEPS, INJECT = 4, 2


def _spawn(recipes: list[str]) -> list[dict]:
    tmp = tempfile.mkdtemp(prefix="mixprec-pp3d-")
    mp.start_processes(pp3d_runs, args=(8, tmp, recipes, STEPS, INJECT), nprocs=8,
                       join=True, start_method="forkserver")  # preloaded: see conftest.py
    return [torch.load(os.path.join(tmp, f"pp3d_rank{r}.pt"), weights_only=False)
            for r in range(8)]


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def _weights_rel(ranks: list[dict], recipe: str, ref: dict) -> float:
    """The largest relative difference of any rank's whole weights from one process's
    (each stage's ranks hold its part; every tp and dp rank the same)."""
    worst = 0.0
    for r in ranks:
        got = r["runs"][recipe]["weights"]
        for k, v in got.items():
            w = ref["weights"][k]
            worst = max(worst, ((v - w).abs().max() / w.abs().max()).item())
    return worst


@pytest.mark.long  # eight interpreters on two cores: minutes
def test_pp_x_dp_x_tp_on_eight_ranks_trains_like_one_process_and_skips_together():
    recipes = ["bf16-master", "fp8-current"]
    ranks = _spawn(recipes)
    figures = {}
    for recipe in recipes:
        ref = ranks[0]["refs"][recipe]
        runs = [r["runs"][recipe] for r in ranks]
        # the mesh: rank = 4 pp + 2 dp + tp
        assert [(x["pp"], x["dp"], x["tp"]) for x in runs] == [
            (p, d, t) for p in range(2) for d in range(2) for t in range(2)]
        # every stage's parameters together are the whole model's
        names = set().union(*(x["weights"] for x in runs))
        assert names == set(ref["weights"])
        # the step at INJECT is skipped on all eight ranks, and by one process too
        want = [k == INJECT for k in range(STEPS)]
        assert ref["skipped"] == want
        for x in runs:
            assert x["skipped"] == want, (recipe, x["skipped"])
            assert x["intact"] is True
            assert x["scales"] == runs[0]["scales"]
            assert x["norms"][:INJECT] == runs[0]["norms"][:INJECT]
        tol = TOL[recipe]
        # the batch's loss: the mean of the last stage's dp ranks' (each tp rank's)
        loss = max(_rel([(a + b) / 2 for a, b in zip(runs[4 + t]["losses"],
                                                      runs[6 + t]["losses"])],
                        ref["losses"]) for t in range(2))
        fin = [k for k in range(STEPS) if k != INJECT]
        norm = max(_rel([x["norms"][k] for k in fin], [ref["norms"][k] for k in fin])
                   for x in runs)
        assert max(ref["norms"][k] for k in fin) > 0.1  # the clip acted
        weights = _weights_rel(ranks, recipe, ref)
        figures[recipe] = {"loss": loss, "norm": norm, "weights": weights}
        assert loss <= tol, figures
        assert norm <= tol, figures
        assert weights <= 5 * tol, figures
    print("pp x dp x tp against one process:", figures)


@pytest.fixture
def one_rank_mesh():
    """A one-rank gloo world and its (pp, dp, tp) mesh of ones."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("pp", "dp", "tp"))
    dist.destroy_process_group()


def test_a_stage_fsdp_sharded_or_on_another_mesh_is_refused_naming_what_runs(
        one_rank_mesh):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from helpers.pp3d_workers import Block
    from mixprec import MixedPrecision

    mesh = one_rank_mesh

    def engine(module, **kw):
        return MixedPrecision(module, torch.optim.SGD(module.parameters(), lr=0.1),
                              "bf16-master", parallel="pp", **kw)

    # a tensor-parallel stage with the pipeline's mesh alone: no mesh['tp'] to check
    tp_stage = parallelize_module(Block(), mesh["tp"], {"up": ColwiseParallel()})
    with pytest.raises(NotImplementedError, match=r"parallel_kwargs=\{'mesh': mesh\}"):
        engine(tp_stage, parallel_kwargs={"mesh": mesh["pp"]})
    # FSDP2 inside a stage: not built, the working layout named
    fsdp_stage = fully_shard(Block(), mesh=mesh["dp"])
    with pytest.raises(NotImplementedError, match="FSDP inside a pipeline stage"):
        engine(fsdp_stage, parallel_kwargs={"mesh": mesh})
    # dims the pipeline does not know, or a group and a mesh at once
    from torch.distributed.device_mesh import init_device_mesh

    odd = init_device_mesh("cpu", (1, 1), mesh_dim_names=("pp", "cp"))
    with pytest.raises(ValueError, match=r"'cp'|\('pp', 'cp'\)"):
        engine(Block(), parallel_kwargs={"mesh": odd})
    with pytest.raises(ValueError, match="both group and mesh"):
        engine(Block(), parallel_kwargs={"mesh": mesh, "group": mesh["pp"].get_group()})
    # the whole mesh of ones trains the tensor-parallel stage (a plan over one rank)
    e = engine(parallelize_module(Block(), mesh["tp"], {"up": ColwiseParallel()}),
               parallel_kwargs={"mesh": mesh})
    assert e.parallelism.mesh.tp is None and e.parallelism.mesh.tp_mesh is not None
