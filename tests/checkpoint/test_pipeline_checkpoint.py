"""Pipeline checkpoints through ``torch.distributed.checkpoint``: stages keyed by their
names in the whole model (``stage_module``) save into one directory that stages at
another pipeline degree, or one process holding the whole model, resume from; the
resumed runs beside the runs that never stopped."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from helpers.pp_ckpt_workers import CUT, pp4_runs, pp_ckpt_runs
from mixprec import MixedPrecision
from mixprec.checkpoint.pipeline import stage_module

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

#: the loss tolerance of a pipeline against one process (tests/parallel/test_pipeline.py)
TOL = {"bf16-master": 0.02, "fp8-current": 0.05}


def _model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(),
                         nn.Linear(32, 4))


def _train(model, engine, steps: int, seed: int = 1) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    data = [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
            for _ in range(6)]
    losses = []
    for x, y in data[steps:] if steps < 0 else data[:steps]:
        with engine.autocast():
            loss = F.cross_entropy(model(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_stage_module_keeps_the_whole_models_names():
    whole = _model(0)
    stage = stage_module(whole, ["0", "1"])
    assert list(stage.state_dict()) == ["2.weight", "2.bias", "4.weight", "4.bias"]
    assert list(whole.state_dict())[0] == "0.weight"  # a copy: the model is whole
    x = torch.randn(3, 32)
    torch.testing.assert_close(stage(x), whole[4](whole[3](whole[2](x))), rtol=0, atol=0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.body, self.head = nn.Linear(4, 4), nn.ModuleDict(
                {"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)}), nn.Linear(4, 2)

    net = stage_module(Net(), ["head", "body.a"], copy=False)
    assert net.head is None and list(net.body) == ["b"]
    assert [k for k in net.state_dict() if k.endswith("weight")] == ["embed.weight",
                                                                     "body.b.weight"]
    with pytest.raises(ValueError, match="'body.c' is not a submodule"):
        stage_module(net, ["body.c"])


def test_one_process_directory_resumes_bit_for_bit_and_refuses_uncovered_models():
    """``save(dir, reshardable=True)`` in one process: a fresh engine of other weights
    resumes it as the run that never stopped (bf16-master: masters, AdamW's states and
    the bf16 working copy exact); a model with entries the directory lacks, or without
    some it holds, is refused naming them, unchanged."""
    model = _model(0)
    engine = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                            "bf16-master")
    straight = _train(model, engine, 6)
    want = engine.fp32_state_dict()

    model = _model(0)
    engine = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                            "bf16-master")
    _train(model, engine, 3)
    path = os.path.join(tempfile.mkdtemp(), "ckpt")
    engine.save(path, reshardable=True, step=3)
    assert sorted(os.listdir(os.path.dirname(path))) == ["ckpt"]  # no .partial, no .old
    fresh = _model(7)
    again = MixedPrecision(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2),
                           "bf16-master")
    assert again.load(path) == {"step": 3} and again.steps == 3
    assert _train(fresh, again, -3) == straight[3:]
    got = again.fp32_state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())

    head_only = stage_module(_model(7), ["0", "1", "2", "3"])
    e = MixedPrecision(head_only, torch.optim.AdamW(head_only.parameters(), lr=1e-2),
                       "bf16-master")
    with pytest.raises(ValueError, match=r"belong to no stage here: \['0.bias', '0.weight', "
                                         r"'2.bias', '2.weight'\].*Nothing was loaded"):
        e.load(path)
    longer = nn.Sequential(*_model(7), nn.Linear(4, 4))
    e = MixedPrecision(longer, torch.optim.AdamW(longer.parameters(), lr=1e-2),
                       "bf16-master")
    before = [t.clone() for t in e.fp32_state_dict().values()]
    with pytest.raises(ValueError, match=r"in none of the 1 saved stage\(s\): "
                                         r"\['5.weight', '5.bias'\]"):
        e.load(path)
    assert all(torch.equal(a, b) for a, b in zip(before, e.fp32_state_dict().values()))
    with pytest.raises(ValueError, match="saved with recipe 'bf16-master'"):
        m = _model(7)
        MixedPrecision(m, torch.optim.AdamW(m.parameters()), "fp32").load(path)


def test_a_failed_or_cut_short_save_leaves_the_previous_directory(tmp_path, monkeypatch):
    """A write that fails leaves the previous directory whole (it still resumes); a
    crash between the swap's renames leaves it at ``PATH.old``, which ``load`` reads."""
    import torch.distributed.checkpoint as dcp

    model = _model(0)
    engine = MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                            "bf16-master")
    _train(model, engine, 2)
    path = tmp_path / "ckpt"
    engine.save(path, reshardable=True, step=2)
    want = {k: v.clone() for k, v in engine.fp32_state_dict().items()}
    _train(model, engine, 1)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcp, "save", full_disk)
    with pytest.raises(OSError):
        engine.save(path, reshardable=True, step=3)
    monkeypatch.undo()
    for cut_short in (False, True):
        if cut_short:  # the previous directory moved aside, the new one not yet in place
            os.replace(path, tmp_path / "ckpt.old")
        fresh = _model(7)
        again = MixedPrecision(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2),
                               "bf16-master")
        assert again.load(path) == {"step": 2}
        got = again.fp32_state_dict()
        assert all(torch.equal(got[k], v) for k, v in want.items())


def _spawn(recipe: str) -> list[dict]:
    tmp = tempfile.mkdtemp(prefix="mixprec-ppckpt-")
    mp.start_processes(pp_ckpt_runs, args=(2, tmp, recipe), nprocs=2, join=True,
                       start_method="forkserver")  # preloaded: see conftest.py
    return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False)
            for r in range(2)]


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _close(a: dict, b: dict, tol: float) -> bool:
    return a.keys() == b.keys() and all(
        ((a[k] - b[k]).abs().max() / b[k].abs().max()).item() <= tol for k in a)


@pytest.mark.long  # one spawn of two ranks, eight trainings: 45-65 s on two loaded cores
@pytest.mark.parametrize("recipe", ["bf16-master", "fp8-current"])
def test_stages_resume_at_another_pipeline_degree(recipe):
    r0, r1 = _spawn(recipe)
    tol = TOL[recipe]
    assert r0["listing"] == ["pp2", "store"]  # the swap left no .partial, no .old
    straight = r1["pp2_losses"]  # the last stage's
    weights = {**r0["pp2_weights"], **r1["pp2_weights"]}
    # two stages -> two stages: every tensor read back exactly, the rest of the run
    # the run that never stopped, bit for bit
    for r in (r0, r1):
        assert _equal(r["pp2_saved"], r["pp2_loaded"])
        assert r["pp2_extra"] == {"step": CUT} and r["pp2_steps"] == CUT
    assert r1["pp2_resumed"] == straight[CUT:]
    assert _equal({**r0["pp2_resumed_weights"], **r1["pp2_resumed_weights"]}, weights)
    # two stages -> one process holding the whole model: the union of the stages'
    # entries, exactly; the rest of the run as the pipeline's, within its tolerance
    saved = {k: v for r in (r0, r1) for k, v in r["pp2_saved"].items() if k != "scale"}
    loaded = {k: v for k, v in r0["pp1_loaded"].items() if k != "scale"}
    assert _equal(saved, loaded)
    assert r0["pp1_extra"] == {"step": CUT}
    assert _rel(r0["pp1_resumed"], straight[CUT:]) <= tol
    assert _rel(r0["pp1_resumed"], r0["one_losses"][CUT:]) <= tol
    assert _close(r0["pp1_resumed_weights"], weights, 5 * tol)
    # one process -> two stages: each stage's entries, exactly; the rest of the run as
    # one process's and the pipeline's, within the tolerance
    both = {k: v for r in (r0, r1) for k, v in r["from_pp1_loaded"].items() if k != "scale"}
    assert _equal(both, {k: v for k, v in r0["pp1_saved"].items() if k != "scale"})
    assert _rel(r1["from_pp1_resumed"], r0["one_losses"][CUT:]) <= tol
    assert _rel(r1["from_pp1_resumed"], straight[CUT:]) <= tol
    assert _close({**r0["from_pp1_weights"], **r1["from_pp1_weights"]}, r0["one_weights"],
                  5 * tol)
    # stages that renumber the blocks: the save is refused (nothing written), the load
    # names what does not fit, on every stage, and changes nothing
    for r in (r0, r1):
        assert "held by two pipeline ranks (e.g. '0.0.weight'" in r["bad_save"]
        assert "stage_module" in r["bad_save"] and r["no_bad_dir"]
        assert "stage on rank 1: 3 entries of another shape, e.g. '0.0.weight': saved " \
               "(32, 16), here (32, 32)" in r["bad_load"]
        assert "Nothing was loaded" in r["bad_load"] and r["bad_unchanged"]


@pytest.mark.long  # two spawns, of four ranks and of two: ~2 min on two loaded cores
def test_four_stages_resume_as_two_and_as_two_interleaved():
    tmp = tempfile.mkdtemp(prefix="mixprec-pp4-")
    got = {}
    for world in (4, 2):
        mp.start_processes(pp4_runs, args=(world, tmp, "bf16-master"), nprocs=world,
                           join=True, start_method="forkserver")
        got[world] = [torch.load(os.path.join(tmp, f"pp{world}_rank{r}.pt"),
                                 weights_only=False) for r in range(world)]
    saved = {k: v for r in got[4] for k, v in r["saved"].items() if k != "scale"}
    loaded = {k: v for r in got[2] for k, v in r["loaded"].items() if k != "scale"}
    assert _equal(saved, loaded)  # each of two stages read its two blocks' entries
    straight = got[4][3]["losses"]
    assert _rel(got[2][1]["losses"], straight[CUT:]) <= TOL["bf16-master"]
    assert _close({k: v for r in got[2] for k, v in r["weights"].items()},
                  {k: v for r in got[4] for k, v in r["weights"].items()},
                  5 * TOL["bf16-master"])
    # the same four stages two per rank (interleaved): the same entries, exactly; the
    # rest of the run as the four ranks' (the norm's sum over two ranks, not four)
    loaded = {k: v for r in got[2] for k, v in r["iv_loaded"].items() if k != "scale"}
    assert _equal(saved, loaded)
    assert _rel(got[2][1]["iv_losses"], straight[CUT:]) <= TOL["bf16-master"]
    assert _close({k: v for r in got[2] for k, v in r["iv_weights"].items()},
                  {k: v for r in got[4] for k, v in r["weights"].items()},
                  5 * TOL["bf16-master"])
    # their save, under the whole model's names, read by one process exactly
    saved = {k: v for r in got[2] for k, v in r["iv_saved"].items() if k != "scale"}
    assert _equal(saved, {k: v for k, v in got[2][0]["iv_one_loaded"].items()
                          if k != "scale"})
